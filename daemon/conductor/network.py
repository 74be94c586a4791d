"""The conductor's network half: UDP publications, subscriptions, images, spies and endpoints.

The :class:`~slipstream.daemon.conductor.conductor.DriverConductor` hands every ``aeron:udp``
command here.  This object creates what the network agents need (logs, position counters, the
sans-I/O :class:`NetworkPublication` and :class:`PublicationImage` objects, endpoint transports)
on the conductor's thread and hands them to the :class:`Sender` and :class:`Receiver` agents with
commands; the agents answer with events (a SETUP asks for an image, an image or publication is
done, an endpoint was removed).  A resource is freed only on the event that says the agent no
longer uses it, so the network thread never touches an unmapped log.  As in Aeron
(DriverConductor / Sender / Receiver): the threads share no mutable object except through
these queues, and position counters (and each publication's spy hold, a position cell this
thread lowers while it links a spy: docs/PROTOCOL.md §3.7).

Names in a channel become IP literals here, once, when the channel is added (:func:`_resolved`;
the driver shell resolved them in a thread first, :mod:`slipstream.daemon.media.names`); the
protocol core only ever sees IP literals.  Sockets are opened, and the host's interface
addresses listed (for ``interface=`` as a subnet), by the injected :class:`NetworkTransports`
(real UDP sockets and ``getifaddrs`` in the driver, a virtual network and the simulated host's
address in the simulator), so this module does no I/O of its own beyond creating log files.

Units: times in ns, sizes in bytes.
"""

from __future__ import annotations

import enum
import functools
import ipaddress
import logging
import random
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from slipstream.client import control
from slipstream.client._native import lib as native
from slipstream.client.channel import Channel, keys_given
from slipstream.client.counters import (
    BACK_PRESSURE_TYPES,
    CountersFile,
    CountersFullError,
    CounterType,
    SystemCounter,
)
from slipstream.client.errors import ChannelError
from slipstream.client.layout import NO_DEADLINE
from slipstream.client.logbuffer import LogBuffer, term_count
from slipstream.daemon._network import lib as network
from slipstream.daemon.agents.commands import ReceiverProxy, RemovedDestination, SenderProxy
from slipstream.daemon.agents.receiver import ReceiveEndpoint, Receiver, ReceiveTransport
from slipstream.daemon.agents.sender import SendEndpoint, Sender, SendTransport
from slipstream.daemon.conductor import messages
from slipstream.daemon.conductor.resources import (
    LogBudget,
    ResourceError,
    StreamInterest,
    create_log,
    discard_log,
    log_start,
)
from slipstream.daemon.conductor.sharing import (
    check_same_control,
    check_same_log,
    check_same_receive_params,
    check_same_watermarks,
    check_session_free,
    destination_of,
    endpoint_key,
)
from slipstream.daemon.conductor.untethered import UntetheredStream, check_untethered
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.flow.registry import congestion_control_for, flow_control_for
from slipstream.daemon.media import interfaces, names
from slipstream.daemon.media.destinations import (
    ALL_DESTINATIONS,
    ControlMode,
    DestinationTable,
    ip_version_of,
)
from slipstream.daemon.media.events import (
    EndpointRemoved,
    ImageDone,
    ImageRejected,
    ImageRequested,
    ImageUnavailable,
    NetworkEvent,
    PublicationDone,
    PublicationRejected,
    ReceiveDestinationFailed,
    ResponseSetupArrived,
    SpiesReleased,
    SpyLinked,
    SpyUnlinked,
)
from slipstream.daemon.media.interfaces import InterfaceAddress
from slipstream.daemon.media.receive_channel import ReceiveChannel
from slipstream.daemon.media.send_channel import SendChannel
from slipstream.daemon.pressure.episodes import (
    BackPressureEpisodes,
    EpisodeEvent,
    LogReadings,
    watermarks_of,
)
from slipstream.daemon.protocol.params import PublicationParams, SubscriptionParams
from slipstream.daemon.protocol.types import Address
from slipstream.daemon.reports.loss_report import FILE as LOSS_REPORT_FILE
from slipstream.daemon.reports.loss_report import LossReport
from slipstream.daemon.streams.image import ImagePositions, PublicationImage
from slipstream.daemon.streams.publication import (
    NetworkPublication,
    PublicationStatus,
    SenderPositions,
)
from slipstream.daemon.streams.tether import Tether, TetherablePosition

log = logging.getLogger("slipstream.driver")

Outgoing = list[tuple[bytes, dict[str, Any]]]
#: Agent events handled per conductor duty cycle; the rest wait for the next (at once).
MAX_EVENTS_PER_CYCLE = 64


class NetworkTransports(Protocol):
    """Opens the transports of channel endpoints (may raise OSError, e.g. a port in use)."""

    def open_send(self, channel: Channel, destination: Address) -> SendTransport:
        """A transport sending to ``destination`` (the endpoint, or the multicast data group)
        and receiving the control frames that come back."""
        ...

    def open_receive(self, channel: Channel, bind: Address) -> ReceiveTransport:
        """A transport receiving at ``bind`` (the endpoint, or the multicast data group)."""
        ...

    def open_multi_destination_receive(self, channel: Channel) -> ReceiveTransport:
        """A multi-destination subscription's endpoint (``control-mode=manual``): no socket of
        its own; each destination is a transport of :meth:`open_receive`, which the receiver's
        thread hands it (``add_destination``, ``remove_destination``).  The driver's and the
        simulator's are one class (:mod:`slipstream.daemon.media.receive_destinations`)."""
        ...

    def local_addresses(self) -> Sequence[InterfaceAddress]:
        """This host's interface addresses, which ``interface=ADDRESS/PREFIX`` chooses among
        (:mod:`slipstream.daemon.media.interfaces`); may raise OSError.  Called on the
        conductor's thread as such a channel is added."""
        ...


class _EndpointState(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"  # the agent was asked to remove it; a new user may still revive it


@attrs.define(eq=False)
class _SendEndpointEntry:
    key: tuple[Any, ...]
    endpoint: SendEndpoint
    publications: int = 0
    state: _EndpointState = _EndpointState.OPEN
    generation: int = 0
    #: A multi-destination-cast endpoint's mdc-destinations counter.
    destinations_counter_id: int | None = None
    #: control-mode=manual: its destinations as the conductor added them (the sender's
    #: table follows by command; only the conductor changes a manual table).
    manual_destinations: dict[Address, str] = attrs.Factory(dict)


@attrs.define(eq=False)
class _PublicationEntry:
    """A network publication as the conductor tracks it (the object itself is the sender's)."""

    registration_id: int
    key: tuple[Any, ...]
    channel: Channel
    publication: NetworkPublication
    endpoint: _SendEndpointEntry
    log: LogBuffer
    counter_ids: list[int]
    publisher_limit_id: int
    episodes: BackPressureEpisodes
    drops_counter_id: int
    readings: LogReadings  # what the episodes are sampled from
    publisher_refs: int = 0
    closing: bool = False
    #: Spy subscriptions reading its log (Aeron's spy links), and how many of them the sender
    #: has not taken yet (the publication's spy hold stays at their join positions until then).
    spies: list[TetherablePosition[NetworkSubscription]] = attrs.Factory(list)
    spy_joins_pending: int = 0
    #: Untethered spies left behind, resting until they rejoin (their tethers RESTING).
    resting_spies: list[TetherablePosition[NetworkSubscription]] = attrs.Factory(list)
    #: Spies that want it but found the counters full as it was made: linked on the
    #: conductor's timer once there is room (:meth:`NetworkConductor.check_spies`).
    missed_spies: list[NetworkSubscription] = attrs.Factory(list)
    #: A response publication's request image, while that sends RSP_SETUP (until this
    #: publication is connected: :meth:`NetworkConductor._check_response_connections`).
    response_image: PublicationImage | None = None


@attrs.define(eq=False)
class NetworkSubscription(StreamInterest):
    """A client's subscription to a UDP channel."""

    registration_id: int
    client_id: int
    client_key: bytes
    channel: Channel
    stream_id: int
    endpoint: _ReceiveEndpointEntry | None = None
    #: A spy's (``aeron-spy:``): the key of the send endpoint whose publications it reads.
    spied_key: tuple[Any, ...] | None = None
    #: A response subscription's (``control-mode=response``): the session of the response
    #: publication its server made for it, as an RSP_SETUP named it; it takes no session
    #: before that (Aeron's response subscription waits outside the receiver until then).
    response_session_id: int | None = None

    def wants(self, session_id: int, stream_id: int) -> bool:
        if self.channel.is_response:
            return stream_id == self.stream_id and session_id == self.response_session_id
        return super().wants(session_id, stream_id)




@attrs.define(eq=False)
class _ImageEntry:
    registration_id: int
    image: PublicationImage
    log: LogBuffer
    counter_ids: list[int]
    source: Address
    links: list[TetherablePosition[NetworkSubscription]] = attrs.Factory(list)
    lingering: bool = False
    #: Untethered subscriptions left behind, resting until they rejoin (their tethers
    #: RESTING).
    resting: list[TetherablePosition[NetworkSubscription]] = attrs.Factory(list)


@attrs.define(eq=False)
class _ReceiveEndpointEntry:
    key: tuple[Any, ...]
    endpoint: ReceiveEndpoint
    subscriptions: list[NetworkSubscription] = attrs.Factory(list)
    images: dict[int, _ImageEntry] = attrs.Factory(dict)  # by image (id of the object)
    state: _EndpointState = _EndpointState.OPEN
    generation: int = 0
    #: A multi-destination subscription's (control-mode=manual): its destinations, by
    #: address, with each one's slot in its images' paths, and its mds-destinations counter.
    destinations: dict[Address, int] = attrs.Factory(dict)
    destinations_counter_id: int | None = None
    #: Each destination's socket (its transport) and the channel it was opened for.
    sockets: dict[Address, tuple[Any, Channel]] = attrs.Factory(dict)
    #: Destinations removed whose socket the receiver's thread may not have closed yet: an
    #: add of the same address takes the socket back rather than find its port in use.
    removing: dict[Address, RemovedDestination] = attrs.Factory(dict)


#: Receiver ids of this driver's closed endpoints kept (a closing embedded driver's drain looks
#: them up): the newest this many, so that endpoint churn does not grow the set.
RECEIVER_IDS_KEPT = 1024
#: EOS heartbeats (100 ms apart) a draining driver sends before it stops waiting for answers.
EOS_HEARTBEATS_TO_END = 3

class NetworkConductor:
    """Owns the driver's network resources.  Single-threaded: the conductor's thread calls it;
    the agents it creates run on the network thread (see the module docstring)."""

    def __init__(self, *, settings: DriverSettings, directory: Path, counters: CountersFile,
                 transports: NetworkTransports, budget: LogBudget, rng: random.Random,
                 new_id: Callable[[], int], new_session_id: Callable[[], int],
                 wake_network: Callable[[], None] = lambda: None,
                 wake_conductor: Callable[[], None] = lambda: None) -> None:
        self.settings = settings
        self.directory = directory
        self.counters = counters
        self.transports = transports
        self.budget = budget
        self._rng = rng
        self._new_id = new_id
        self._new_session_id = new_session_id
        self._wake_conductor = wake_conductor
        self._events: deque[NetworkEvent] = deque()
        self.loss_report = LossReport(directory / LOSS_REPORT_FILE,
                                      mode=settings.file_mode(clients_write=False))
        self.sender = Sender(
            on_event=self._post,
            max_datagrams_per_send=settings.network_publication_max_messages_per_send,
            status_poll_ratio=settings.send_to_status_poll_ratio)
        self.receiver = Receiver(on_event=self._post)
        #: The conductor's only way to ask the agents for work (their command queues).
        self.sender_proxy = SenderProxy(self.sender.enqueue, wake_network)
        self.receiver_proxy = ReceiverProxy(self.receiver.enqueue, wake_network)
        self._send_endpoints: dict[tuple[Any, ...], _SendEndpointEntry] = {}
        self._receive_endpoints: dict[tuple[Any, ...], _ReceiveEndpointEntry] = {}
        #: Receiver ids of this driver's receive endpoints that closed (random 63-bit: no
        #: other driver's): their status messages may still count at a publication.  An
        #: ordered set, the newest RECEIVER_IDS_KEPT kept; open endpoints' are in
        #: _receive_endpoints.
        self._closed_receiver_ids: dict[int, None] = {}
        self.publications: dict[int, _PublicationEntry] = {}
        self._shared_publications: dict[tuple[Any, ...], _PublicationEntry] = {}
        self.subscriptions: dict[int, NetworkSubscription] = {}
        #: Spy subscriptions (``aeron-spy:``), by registration id; they have no endpoint.
        self.spies: dict[int, NetworkSubscription] = {}
        #: Messages to clients made outside a command's answer (the images of spies linked to
        #: a new publication), sent on the next duty cycle.
        self._spy_out: Outgoing = []
        #: Sub-pos counters of unlinked spies the sender has not dropped yet (SpyUnlinked).
        self._spy_counters_unlinking: set[int] = set()
        #: Response publications whose request images send RSP_SETUP for them, until they are
        #: connected or closed (_check_response_connections).
        self._answering: list[_PublicationEntry] = []

    # -- plumbing -----------------------------------------------------------------------------
    def _post(self, event: NetworkEvent) -> None:
        """An agent's event (any thread): queued for the conductor's next duty cycle."""
        self._events.append(event)
        self._wake_conductor()

    @property
    def image_count(self) -> int:
        return sum(len(entry.images) for entry in self._receive_endpoints.values())

    @property
    def has_events(self) -> bool:
        return bool(self._events) or bool(self._spy_out)

    @property
    def used_session_ids(self) -> set[int]:
        return {entry.publication.session_id for entry in self.publications.values()}

    # -- publications -------------------------------------------------------------------------
    def add_publication(self, client_key: bytes, channel: Channel, stream_id: int,
                        now_ns: int, *, exclusive: bool = False) -> tuple[_PublicationEntry, int]:
        """A publisher of ``stream_id`` on ``channel``: shares the publication of the same
        endpoint, stream and session, or makes one; an ``exclusive`` one always makes a
        publication of its own (its own session and log, which nobody joins).  Returns it and
        the registration id of this publisher."""
        channel = _resolved(channel, self.transports.local_addresses)
        destination = destination_of(channel)
        request_image = self._check_response_keys(channel)
        # Publications with another response-correlation-id share nothing (Aeron's
        # findPublication): each answers, or asks on behalf of, its own.
        key = (endpoint_key(channel, destination), stream_id, channel.session_id,
               channel.response_correlation_id)
        entry = None if exclusive else self._shared_publications.get(key)
        if entry is None:
            check_session_free(channel, (e.publication.session_id
                                         for e in self.publications.values()
                                         if e.key[:2] == key[:2] and not e.closing), stream_id)
            entry = self._create_publication(key, channel, stream_id, destination, now_ns,
                                             shared=not exclusive)
            if request_image is not None:
                self._start_response_setup(entry, request_image)
        else:
            check_same_log(channel, entry.log, entry.publication.session_id, stream_id)
            check_same_watermarks(channel, entry.episodes, stream_id)
            check_same_control(channel, entry.channel, self.settings, stream_id)
            if channel.priority is not None and channel.priority != entry.publication.priority:
                raise ChannelError(str(channel), "priority",
                                   f"{channel.priority} differs from the existing "
                                   f"publication's {entry.publication.priority} on stream "
                                   f"{stream_id}")
        entry.publisher_refs += 1
        return entry, self._new_id()

    # -- response channels (docs/PROTOCOL.md §7.6) -------------------------------------------
    def _check_response_keys(self, channel: Channel) -> _ImageEntry | None:
        """A publication's response keys, checked before anything is made (Aeron's
        validateResponseSubscription and findResponsePublicationImage): a response
        publication (``control-mode=response``) names its control address and a request
        image of this driver that asked for responses, and gets that image; a request
        publication (``response-correlation-id=`` alone) names a response subscription of
        this driver.  ChannelError names the key at fault."""
        correlation_id = channel.response_correlation_id
        if not channel.is_response:
            if correlation_id is not None and not any(
                    s.registration_id == correlation_id and s.channel.is_response
                    for s in self.subscriptions.values()):
                raise ChannelError(
                    str(channel), "response-correlation-id",
                    f"{correlation_id} is not the registration id of a response subscription "
                    f"(control-mode=response) of this driver: add that subscription first "
                    f"and give its registration_id")
            return None
        if channel.control is None or not channel.control.port:
            raise ChannelError(str(channel), "control",
                               "a response publication is bound to its response control "
                               "address, where its client's response subscription sends its "
                               "status messages: name it with a port (control=HOST:PORT)")
        if correlation_id is None:
            raise ChannelError(str(channel), "response-correlation-id",
                               "a response publication answers one request image: give that "
                               "image's correlation_id (control-mode=response was given "
                               "without it)")
        image_entry = next((e for endpoint in self._receive_endpoints.values()
                            for e in endpoint.images.values()
                            if e.registration_id == correlation_id), None)
        if image_entry is None or image_entry.lingering:
            raise ChannelError(str(channel), "response-correlation-id",
                               f"{correlation_id} names no image of this driver (it has gone, "
                               f"its client with it, or never was): answer an image while it "
                               f"is available")
        if not image_entry.image.wants_response:
            what = _label_of(image_entry.image, image_entry.source)
            raise ChannelError(str(channel), "response-correlation-id",
                               f"image {correlation_id} ({what}) did not ask for responses: "
                               f"its publication has no response-correlation-id")
        return image_entry

    def _start_response_setup(self, entry: _PublicationEntry, image_entry: _ImageEntry) -> None:
        """The request image tells its client's driver the new response publication's session
        (RSP_SETUP) until that publication is connected."""
        image, session_id = image_entry.image, entry.publication.session_id
        entry.response_image = image
        self._answering.append(entry)
        self.receiver_proxy.on_set_response_session(image, session_id)

    def _check_response_connections(self) -> None:
        """A response publication connected (its log says so): its request image stops
        sending RSP_SETUP (Aeron's responseConnected); so does one whose publication closes."""
        if not self._answering:
            return
        for entry in [e for e in self._answering if e.log.is_connected or e.closing]:
            self._answering.remove(entry)
            image, entry.response_image = entry.response_image, None
            if image is not None:
                self.receiver_proxy.on_set_response_session(image, None)

    def _on_response_setup(self, event: ResponseSetupArrived) -> None:
        """An RSP_SETUP reached a request publication: its response subscription takes the
        session it names, and its endpoint asks that session's publication for SETUP (Aeron's
        DriverConductor.responseSetup).  The server repeats it until its response publication
        is connected: a repeat changes nothing.  Another session replaces the one taken only
        while the subscription has no image of that (the server closed that response
        publication and made another; Aeron's keeps the first session for good)."""
        subscription = self.subscriptions.get(event.response_correlation_id)
        if (subscription is None or not subscription.channel.is_response
                or subscription.endpoint is None
                or subscription.response_session_id == event.response_session_id):
            return
        if subscription.response_session_id is not None and any(
                link.subscription is subscription and not image_entry.lingering
                for image_entry in subscription.endpoint.images.values()
                for link in image_entry.links):
            return  # its response stream is live: a stray or late RSP_SETUP
        subscription.response_session_id = event.response_session_id
        self._sync_interest(subscription.endpoint, subscription.stream_id)
        log.info("response subscription %d takes session %d of stream %d",
                 subscription.registration_id, event.response_session_id,
                 subscription.stream_id)

    def _create_publication(self, key: tuple[Any, ...], channel: Channel, stream_id: int,
                            destination: Address, now_ns: int, *,
                            shared: bool = True) -> _PublicationEntry:
        """A new publication on its endpoint; ``shared``: the one later publishers of its
        key join (not an exclusive one's)."""
        params = PublicationParams.for_network(channel, self.settings)  # before a socket
        endpoint = self._send_endpoint(key[0], channel, destination)
        try:
            return self._create_publication_on(endpoint, key, channel, params, stream_id,
                                               destination, now_ns, shared=shared)
        except BaseException:
            if endpoint.publications == 0:
                self._close_endpoint(endpoint)  # opened (or revived) for nothing
            raise

    def _create_publication_on(self, endpoint: _SendEndpointEntry, key: tuple[Any, ...],
                               channel: Channel, params: PublicationParams, stream_id: int,
                               destination: Address, now_ns: int, *,
                               shared: bool = True) -> _PublicationEntry:
        settings = self.settings
        term_length = params.term_length
        registration_id = self._new_id()
        session_id = (params.session_id if params.session_id is not None
                      else self._new_session_id())
        path = self.directory / control.PUBLICATIONS_DIR / f"{registration_id}.logbuffer"
        log_buffer = create_log(
            path, self.budget, f"stream {stream_id} on {channel}",
            term_length=term_length, session_id=session_id, stream_id=stream_id,
            mtu=params.mtu, correlation_id=registration_id,
            term_window_length=params.term_window_length, group=params.group,
            linger_timeout_ns=params.linger_timeout_ns, sparse=params.sparse,
            mode=settings.file_mode(clients_write=True), **log_start(params, self._rng))
        label = f"{channel} stream={stream_id} session={session_id}"
        try:
            flow_control = flow_control_for(params)
            kinds = [(CounterType.PUBLISHER_LIMIT, "pub-lmt"),
                     (CounterType.SENDER_POSITION, "snd-pos"),
                     (CounterType.SENDER_LIMIT, "snd-lmt")]
            if params.rate_control is not None:
                kinds.append((CounterType.SENDER_RATE_LIMIT, "snd-rate"))
            if flow_control.tracks_receivers:
                kinds.append((CounterType.FC_RECEIVERS, "fc-receivers"))
            kinds.extend(BACK_PRESSURE_TYPES)
            counter_ids = self._allocate_counters(kinds, label, registration_id, session_id,
                                                  stream_id)
        except CountersFullError:
            discard_log(log_buffer, self.budget)
            raise
        cells = {kind: self.counters.address(counter_id)
                 for (kind, _), counter_id in zip(kinds, counter_ids, strict=True)}
        positions = SenderPositions(
            cells[CounterType.PUBLISHER_LIMIT], cells[CounterType.SENDER_POSITION],
            cells[CounterType.SENDER_LIMIT], cells.get(CounterType.SENDER_RATE_LIMIT),
            cells.get(CounterType.FC_RECEIVERS))
        publication = NetworkPublication(
            log=log_buffer, params=params, settings=settings, positions=positions,
            flow_control=flow_control, counters=self.counters,
            now_ns=now_ns, destination=destination)
        episodes = BackPressureEpisodes(
            params.term_window_length, *watermarks_of(channel, settings),
            {kind: cells[kind] for kind, _ in BACK_PRESSURE_TYPES})
        entry = _PublicationEntry(registration_id, key, channel, publication, endpoint,
                                  log_buffer, counter_ids, counter_ids[0], episodes,
                                  counter_ids[kinds.index((CounterType.PUBLISHER_DROPS,
                                                           "pub-drops"))],
                                  LogReadings(log_buffer, cells[CounterType.PUBLISHER_LIMIT]))
        endpoint.publications += 1
        self.publications[registration_id] = entry
        if shared:
            self._shared_publications[key] = entry
        self.sender_proxy.on_add_publication(endpoint.endpoint, publication)
        # After the publication: the sender runs the commands in order.
        self._spy_out.extend(self._link_spies(entry, now_ns))
        log.info("created %s network publication %d %s stream=%d session=%d term_length=%d",
                 "shared" if shared else "exclusive", registration_id, channel, stream_id,
                 session_id, term_length)
        return entry

    def _send_endpoint(self, key: tuple[Any, ...], channel: Channel,
                       destination: Address) -> _SendEndpointEntry:
        entry = self._send_endpoints.get(key)
        if entry is not None:
            if entry.state is _EndpointState.CLOSING:  # revive it: the removal is undone
                entry.state = _EndpointState.OPEN
                self.sender_proxy.on_add_endpoint(entry.endpoint)
            return entry
        counter_id = destinations = None
        if destination == ALL_DESTINATIONS and not channel.is_response:
            counter_id = self.counters.allocate(CounterType.MDC_DESTINATIONS,
                                                f"mdc-destinations: {channel}")
            destinations = DestinationTable(ControlMode(channel.control_mode),
                                            ip_version=ip_version_of(channel),
                                            count_cell=self.counters.address(counter_id))
        try:
            transport = self.transports.open_send(channel, destination)
        except OSError as e:
            if counter_id is not None:
                self.counters.free(counter_id)
            raise ResourceError(f"cannot open a send socket for {channel}: "
                                f"{e.strerror or e}") from None
        endpoint = SendEndpoint(
            SendChannel(counters=self.counters, destinations=destinations,
                        response_ip_version=(ip_version_of(channel) if channel.is_response
                                             else None)),
            transport)
        entry = self._send_endpoints[key] = _SendEndpointEntry(key, endpoint,
                                                               destinations_counter_id=counter_id)
        self.sender_proxy.on_add_endpoint(endpoint)
        return entry

    def release_publication(self, registration_id: int, now_ns: int) -> None:
        """One publisher left; the last one closes the publication (it drains, then lingers,
        then :class:`PublicationDone` frees it)."""
        entry = self.publications.get(registration_id)
        if entry is None or entry.closing:
            return
        entry.publisher_refs -= 1
        if entry.publisher_refs > 0:
            return
        entry.closing = True
        if self._shared_publications.get(entry.key) is entry:
            del self._shared_publications[entry.key]
        self._drop_spies_left_behind(entry)
        publication = entry.publication
        self.sender_proxy.on_close_publication(publication)

    # -- multi-destination-cast -----------------------------------------------------------------
    def add_destination(self, publication_id: int, destination: Channel, now_ns: int) -> None:
        """Publication ``publication_id``'s endpoint sends to ``destination``
        (``aeron:udp?endpoint=HOST:PORT``) too; ChannelError names what it refuses."""
        endpoint, address, uri = self._manual_destination(publication_id, destination)
        if address in endpoint.manual_destinations:
            raise ChannelError(uri, "endpoint",
                               f"{address[0]}:{address[1]} is a destination of "
                               f"{self.publications[publication_id].channel} already")
        endpoint.manual_destinations[address] = uri
        channel = endpoint.endpoint.channel
        assert channel.destinations is not None
        self.sender_proxy.on_add_destination(channel, address)
        log.info("added destination %s:%d to %s", address[0], address[1], endpoint.key)

    def remove_destination(self, publication_id: int, destination: Channel) -> None:
        """Publication ``publication_id``'s endpoint no longer sends to ``destination``;
        ChannelError when it was not one."""
        endpoint, address, uri = self._manual_destination(publication_id, destination)
        if endpoint.manual_destinations.pop(address, None) is None:
            raise ChannelError(uri, "endpoint",
                               f"{address[0]}:{address[1]} is not a destination of this "
                               f"channel: nothing to remove")
        channel = endpoint.endpoint.channel
        assert channel.destinations is not None
        self.sender_proxy.on_remove_destination(channel, address)
        log.info("removed destination %s:%d from %s", address[0], address[1], endpoint.key)

    def _manual_destination(self, publication_id: int,
                            destination: Channel) -> tuple[_SendEndpointEntry, Address, str]:
        """The endpoint of a control-mode=manual publication and the address of a destination
        URI (one key: endpoint=, an IP or a name the shell resolved)."""
        entry = self.publications[publication_id]
        uri = str(destination)
        if entry.channel.control_mode != ControlMode.MANUAL.value:
            raise ChannelError(str(entry.channel), "control-mode",
                               "destinations are added to and removed from a "
                               "control-mode=manual publication only (a dynamic one learns "
                               "them from its receivers' status messages)")
        if not destination.is_udp or destination.is_spy:
            raise ChannelError(uri, "aeron:udp", "a destination is aeron:udp?endpoint=HOST:PORT")
        extra = keys_given(destination) - {"endpoint", "alias"}
        if extra:
            raise ChannelError(uri, sorted(extra)[0],
                               "a destination takes endpoint= only; the other keys belong "
                               "to the publication's channel")
        destination = _resolved(destination, self.transports.local_addresses)
        address = destination_of(destination, sending=False)
        ip = ipaddress.ip_address(address[0])
        socket_version = ip_version_of(entry.channel)
        if ip.version != socket_version:
            raise ChannelError(uri, "endpoint",
                               f"an IPv{ip.version} destination for a send socket of IPv"
                               f"{socket_version} (its control= or interface=)")
        if ip.is_multicast:
            raise ChannelError(uri, "endpoint",
                               "a multicast group is not a destination: its receivers send "
                               "their status messages to its control group, which this "
                               "endpoint does not join (publish on the group's channel)")
        return entry.endpoint, address, uri

    # -- multi-destination subscriptions --------------------------------------------------------
    def add_receive_destination(self, registration_id: int, destination: Channel) -> None:
        """Subscription ``registration_id``'s endpoint (``control-mode=manual``) receives on
        ``destination`` too (``aeron:udp?endpoint=HOST:PORT``, or a multicast group with
        ``interface=``): its socket is opened here (with the subscription's socket options),
        or taken back from a removal of the same destination that has not closed it yet,
        then the receiver's thread reads it into the endpoint's images.  ChannelError names
        what it refuses; ResourceError when the socket cannot be opened (the port in use)."""
        entry, address, uri, resolved = self._receive_destination(registration_id, destination)
        if address in entry.destinations:
            raise ChannelError(uri, "endpoint",
                               f"{address[0]}:{address[1]} is a destination of "
                               f"{entry.endpoint.channel.channel} already")
        taken = set(entry.destinations.values())
        free = [i for i in range(network.SS_RECEIVE_DESTINATIONS_MAX) if i not in taken]
        if not free:
            raise ChannelError(uri, "endpoint",
                               f"a multi-destination subscription has at most "
                               f"{network.SS_RECEIVE_DESTINATIONS_MAX} destinations")
        versions = {ipaddress.ip_address(a[0]).version for a in entry.destinations}
        version = ipaddress.ip_address(address[0]).version
        if versions and version not in versions:
            raise ChannelError(uri, "endpoint",
                               f"an IPv{version} destination beside IPv{versions.pop()} ones: "
                               f"one subscription's destinations share an IP version")
        # Removed just before and not closed yet: the same socket again (its port is bound).
        removed = entry.removing.pop(address, None)
        transport = (removed.reclaim() if removed is not None and removed.channel == resolved
                     else None)
        if transport is None:
            try:
                transport = self.transports.open_receive(resolved, address)
            except OSError as e:
                raise ResourceError(f"cannot receive on {address[0]}:{address[1]} for {uri}: "
                                    f"{e.strerror or e}") from None
        index = free[0]
        entry.destinations[address] = index
        entry.sockets[address] = (transport, resolved)
        group = resolved.control_group
        control = (group.host, group.port or address[1]) if group is not None else None
        self.receiver_proxy.on_add_destination(entry.endpoint, index, transport, control,
                                               address, self._destinations_cell(entry),
                                               len(entry.destinations))
        log.info("added receive destination %s:%d to %s", address[0], address[1], entry.key)

    def remove_receive_destination(self, registration_id: int, destination: Channel) -> None:
        """Subscription ``registration_id``'s endpoint no longer receives on ``destination``:
        the receiver's thread detaches and closes its socket, and its images' paths through
        it end (their status messages and NAKs stop going that way); an add of the same
        destination before then takes the socket back.  ChannelError when it was not a
        destination."""
        entry, address, uri, _ = self._receive_destination(registration_id, destination)
        index = entry.destinations.pop(address, None)
        if index is None:
            raise ChannelError(uri, "endpoint",
                               f"{address[0]}:{address[1]} is not a destination of this "
                               f"subscription's channel: nothing to remove")
        transport, opened_for = entry.sockets.pop(address)
        for gone in [a for a, r in entry.removing.items() if r.closed]:
            del entry.removing[gone]
        removed = entry.removing[address] = RemovedDestination(transport, opened_for)
        self.receiver_proxy.on_remove_destination(entry.endpoint, index, removed,
                                                  self._destinations_cell(entry),
                                                  len(entry.destinations))
        log.info("removed receive destination %s:%d from %s", address[0], address[1],
                 entry.key)

    def _destinations_cell(self, entry: _ReceiveEndpointEntry):
        """The mds-destinations counter's cell (cffi ``int64_t *``), or None."""
        counter_id = entry.destinations_counter_id
        return self.counters.address(counter_id) if counter_id is not None else None

    def _receive_destination(self, registration_id: int, destination: Channel
                             ) -> tuple[_ReceiveEndpointEntry, Address, str, Channel]:
        """The endpoint of a control-mode=manual subscription, the address a destination URI
        binds (names resolved), the URI, and the resolved destination channel."""
        subscription = self.subscriptions.get(registration_id)
        uri = str(destination)
        if subscription is None or subscription.endpoint is None:
            raise ChannelError(uri, "aeron:udp",
                               f"subscription {registration_id} is not a network "
                               f"subscription: destinations belong to aeron:udp "
                               f"subscriptions of control-mode=manual")
        if subscription.channel.control_mode != ControlMode.MANUAL.value:
            raise ChannelError(str(subscription.channel), "control-mode",
                               "destinations are added to and removed from a "
                               "control-mode=manual subscription only")
        if not destination.is_udp or destination.is_spy:
            raise ChannelError(uri, "aeron:udp",
                               "a destination is aeron:udp?endpoint=HOST:PORT (a multicast "
                               "group with interface=)")
        extra = keys_given(destination) - {"endpoint", "interface", "alias"}
        if extra:
            raise ChannelError(uri, sorted(extra)[0],
                               "a receive destination takes endpoint= (and interface= for a "
                               "multicast group) only; the other keys belong to the "
                               "subscription's channel")
        # Its socket takes the subscription's socket options (so-rcvbuf=, so-sndbuf=, ttl=),
        # which a destination URI cannot name.
        channel = subscription.channel
        resolved = attrs.evolve(_resolved(destination, self.transports.local_addresses),
                                so_rcvbuf=channel.so_rcvbuf, so_sndbuf=channel.so_sndbuf,
                                ttl=channel.ttl)
        address = destination_of(resolved, sending=False)
        if resolved.interface is not None and not ipaddress.ip_address(address[0]).is_multicast:
            raise ChannelError(uri, "interface",
                               "interface= chooses a multicast destination's interface; a "
                               "unicast destination binds its endpoint=")
        return subscription.endpoint, address, uri, resolved

    # -- spies --------------------------------------------------------------------------------
    def _add_spy(self, spy: NetworkSubscription, now_ns: int) -> Outgoing:
        """An ``aeron-spy:`` subscription: it reads every publication of this driver on its
        channel's send endpoint (address and interface) whose stream, and session if it names
        one, it wants, those present and those made later (Aeron's onAddSpySubscription and
        linkSpies); the AVAILABLE_IMAGE messages of those present are returned.  A closing
        publication takes no new spy."""
        channel = spy.channel = _resolved(spy.channel, self.transports.local_addresses)
        spy.spied_key = endpoint_key(channel, destination_of(channel))
        self.spies[spy.registration_id] = spy
        out: Outgoing = []
        try:
            for entry in list(self.publications.values()):
                if _spies_on(spy, entry):
                    out.append(self._link_spy(entry, spy, now_ns))
        except CountersFullError:
            # All or nothing, as add_subscription: a spy nobody owns would hold its
            # publications back for good.
            self.remove_subscription(spy.registration_id)
            raise
        return out

    def _link_spies(self, entry: _PublicationEntry, now_ns: int) -> Outgoing:
        """A new publication: every spy that wants it reads it (Aeron's linkSpies); one the
        counters have no room for is logged and linked later, on the timer, once there is
        room (:meth:`check_spies`)."""
        out: Outgoing = []
        for spy in list(self.spies.values()):
            if _spies_on(spy, entry):
                try:
                    out.append(self._link_spy(entry, spy, now_ns))
                except CountersFullError as e:
                    self.counters.add(SystemCounter.ERRORS)
                    log.error("cannot link spy subscription %d to publication %d yet (tried "
                              "again on the timer): %s", spy.registration_id,
                              entry.registration_id, e)
                    entry.missed_spies.append(spy)
        return out

    def _link_spy(self, entry: _PublicationEntry, spy: NetworkSubscription,
                  now_ns: int) -> tuple[bytes, dict[str, Any]]:
        """A sub-pos counter for ``spy`` at the publication's sender position (Aeron's
        linkSpy: a spy joins where the network is), handed to the sender, and the
        AVAILABLE_IMAGE of it: the publication's own log, under the publication's
        registration id."""
        publication = entry.publication
        join = self._hold_for_spy(entry)
        try:
            counter_id = self.counters.allocate(
                CounterType.SUBSCRIBER_POSITION,
                f"sub-pos: {spy.channel} stream={publication.stream_id} "
                f"session={publication.session_id} sub={spy.registration_id}",
                registration_id=spy.registration_id, session_id=publication.session_id,
                stream_id=publication.stream_id, owner_id=spy.client_id, initial_value=join)
        except CountersFullError:
            self._on_spy_linked(entry)  # no link after all: its hold goes
            raise
        cell = self.counters.address(counter_id)
        entry.spies.append(TetherablePosition(spy, counter_id, cell, self._tether(spy, now_ns)))
        self.sender_proxy.on_add_spy(publication, cell, entry.registration_id)
        return (spy.client_key, messages.available_image(
            image_registration_id=entry.registration_id,
            subscription_registration_id=spy.registration_id,
            session_id=publication.session_id, stream_id=publication.stream_id,
            log_file=entry.log.path, subscriber_position_counter_id=counter_id,
            join_position=join, source_identity=SPY_SOURCE_IDENTITY))

    def _hold_for_spy(self, entry: _PublicationEntry) -> int:
        """A spy's join position: the publication's sender position, which its log keeps
        until the sender has taken the spy (:class:`SpyLinked`).  The publication's spy hold
        is lowered to it with a full fence, then the sender position read again: cleaning
        stays a term behind what the C half read, so unless the sender went a term further
        meanwhile nothing from the join position on was cleaned, and from the hold on nothing
        will be (network.h, ``spy_hold``).  Otherwise it tries again from there."""
        publication = entry.publication
        hold = publication.spy_hold
        term_length = entry.log.term_length
        entry.spy_joins_pending += 1
        while True:
            join = publication.sender_position
            held = native.ss_load_acquire_i64(hold)
            native.ss_cas_i64(hold, held, min(held, join))  # only this thread writes it
            if publication.sender_position <= join + term_length:
                return join

    def _on_spy_linked(self, entry: _PublicationEntry) -> None:
        """A spy link is no longer pending: once none is, the hold goes."""
        entry.spy_joins_pending -= 1
        if entry.spy_joins_pending == 0:
            native.ss_store_release_i64(entry.publication.spy_hold, NO_DEADLINE)

    def _unlink_spy(self, entry: _PublicationEntry,
                    link: TetherablePosition[NetworkSubscription], *,
                    tell: bool = False) -> Outgoing:
        """The spy of ``link`` stops reading ``entry``'s publication: its position holds
        nothing back from the sender's next command on; with ``tell``, its client hears that
        the image is gone (UNAVAILABLE_IMAGE).  Its counter is freed once the sender has
        dropped it (:class:`SpyUnlinked`), so the sender never reads a counter reused."""
        entry.spies.remove(link)
        publication, cell, counter_id = entry.publication, link.cell, link.counter_id
        self._spy_counters_unlinking.add(counter_id)
        self.sender_proxy.on_remove_spy(publication, cell, counter_id)
        if not tell:
            return []
        return [(link.subscription.client_key, messages.unavailable_image(
            image_registration_id=entry.registration_id,
            subscription_registration_id=link.subscription.registration_id,
            stream_id=publication.stream_id))]

    def _drop_spies_left_behind(self, entry: _PublicationEntry) -> None:
        """``entry`` starts closing (before its close command goes to the sender): its
        untethered spies left behind stop holding it at once (their clients were told as they
        were left), and its resting ones will not rejoin it (a closing publication takes no
        spy).  The timer leaves a closing publication alone, so a lingering spy kept would
        hold its DRAINING for good."""
        for link in [k for k in entry.spies if k.lingering]:
            self._unlink_spy(entry, link)
        entry.resting_spies.clear()

    def _on_spies_released(self, publication: NetworkPublication) -> Outgoing:
        """A closed publication's spies read it all (:class:`SpiesReleased`), or it is done:
        their images end."""
        entry = next((e for e in self.publications.values() if e.publication is publication),
                     None)
        if entry is None:
            return []
        out: Outgoing = []
        for link in list(entry.spies):  # a lingering one's client was told already
            out.extend(self._unlink_spy(entry, link, tell=not link.lingering))
        entry.resting_spies.clear()
        return out

    def check_spies(self, now_ns: int) -> Outgoing:
        """On the conductor's timer: the spies a publication missed as it was made (the
        counters were full) are linked if there is room now, and untethered spies are looked
        at (:meth:`check_untethered_spies`)."""
        out: Outgoing = []
        for entry in self.publications.values():
            for spy in list(entry.missed_spies):
                if entry.closing or self.spies.get(spy.registration_id) is not spy:
                    entry.missed_spies.remove(spy)  # it takes no spy, or the spy went
                    continue
                try:
                    out.append(self._link_spy(entry, spy, now_ns))
                except CountersFullError:
                    continue  # logged once, as it was missed
                entry.missed_spies.remove(spy)
        out.extend(self.check_untethered_spies(now_ns))
        out.extend(self.check_untethered_images(now_ns))
        return out

    def _tether(self, subscription: NetworkSubscription, now_ns: int) -> Tether | None:
        """An untethered subscription's tether as it links (ACTIVE from ``now_ns``), None for
        a tethered one."""
        channel = subscription.channel
        return Tether.of(channel, self.settings, now_ns) if channel.tether is False else None

    def check_untethered_images(self, now_ns: int) -> Outgoing:
        """Aeron's untethered subscriptions of network images (``tether=false``;
        PublicationImage.checkUntetheredSubscriptions; :mod:`.untethered`), on the conductor's
        timer.  An image's head is its fastest subscriber, its window the receiver window
        congestion control gives it now (a sample of what the receiver sets): one
        left behind loses its image, with the range it skips (from its position to the
        fastest's); it rejoins where the image's slowest subscriber is, with a new image."""
        out: Outgoing = []
        for endpoint in self._receive_endpoints.values():
            for image_entry in endpoint.images.values():
                if not image_entry.lingering and (
                        image_entry.resting
                        or any(link.tether is not None for link in image_entry.links)):
                    out.extend(self._check_untethered_links(image_entry, now_ns))
        return out

    def _check_untethered_links(self, image_entry: _ImageEntry, now_ns: int) -> Outgoing:
        image = image_entry.image
        positions = self._image_positions(image_entry)
        return check_untethered(
            UntetheredStream(f"image {image_entry.registration_id}",
                             image_entry.registration_id, image.stream_id,
                             max((p for _, p in positions), default=image.rcv_pos),
                             image.window, functools.partial(self._unlink, image_entry),
                             functools.partial(self._rejoin_rested, image_entry, now_ns)),
            positions, image_entry.resting, self.counters, now_ns)

    def _image_positions(self, image_entry: _ImageEntry
                         ) -> list[tuple[TetherablePosition[NetworkSubscription], int]]:
        """Each link of the image with its subscriber's position (within the image's
        ``rcv-hwm``)."""
        hwm = image_entry.image.rcv_hwm
        return [(link, network.ss_subscriber_position_bounded(
            self.counters.get(link.counter_id), hwm)) for link in image_entry.links]

    def _rejoin_rested(self, image_entry: _ImageEntry, now_ns: int,
                       subscription: NetworkSubscription) -> tuple[bytes, dict[str, Any]] | None:
        """A resting subscription of ``image_entry`` links again at its join position (Aeron's:
        the slowest subscriber's, at most rcv-pos); None if the subscription went."""
        if self.subscriptions.get(subscription.registration_id) is not subscription:
            return None
        join = min([image_entry.image.rcv_pos,
                    *(p for _, p in self._image_positions(image_entry))])
        return self._link(image_entry, subscription, join, now_ns, submit=True)

    def check_untethered_spies(self, now_ns: int) -> Outgoing:
        """Aeron's untethered spies (``tether=false``; NetworkPublication
        .checkUntetheredSubscriptions; :mod:`.untethered`), on the conductor's timer.  A
        publication's head is ``snd-pos``, its window the term window: a spy left behind loses
        its image, with the range it skips (from its position to snd-pos); it rejoins at
        snd-pos with a new image.  Only while the publication is open."""
        out: Outgoing = []
        for entry in self.publications.values():
            if entry.closing or not (entry.resting_spies
                                     or any(k.tether is not None for k in entry.spies)):
                continue
            publication = entry.publication
            sender_position = publication.sender_position
            out.extend(check_untethered(
                UntetheredStream(f"publication {entry.registration_id} (a spy)",
                                 entry.registration_id, publication.stream_id, sender_position,
                                 publication.term_window_length,
                                 functools.partial(self._unlink_spy, entry),
                                 functools.partial(self._link_spy, entry, now_ns=now_ns)),
                [(link, network.ss_subscriber_position_bounded(
                    self.counters.get(link.counter_id), sender_position))
                 for link in entry.spies if link.tether is not None],
                entry.resting_spies, self.counters, now_ns))
        return out

    # -- subscriptions ------------------------------------------------------------------------
    def add_subscription(self, subscription: NetworkSubscription, now_ns: int) -> Outgoing:
        """Receive ``subscription``'s stream at its endpoint; images already there are linked
        at once (the AVAILABLE_IMAGE messages are returned).  A spy (``aeron-spy:``) reads
        this driver's publications instead (:meth:`_add_spy`)."""
        if subscription.channel.is_spy:
            return self._add_spy(subscription, now_ns)
        channel = subscription.channel = _resolved(subscription.channel,
                                                   self.transports.local_addresses)
        SubscriptionParams.resolve(channel, self.settings)  # refused before a socket opens
        multi_destination = channel.control_mode == ControlMode.MANUAL.value
        if multi_destination and channel.endpoint is not None:
            raise ChannelError(str(channel), "endpoint",
                               "a control-mode=manual subscription receives on the "
                               "destinations it adds (Subscription.add_destination), not on "
                               "an endpoint of its own: leave endpoint= out")
        if multi_destination and channel.control is not None:
            raise ChannelError(str(channel), "control",
                               "a control-mode=manual subscription answers each sender along "
                               "the path its data came by, not at a control address: leave "
                               "control= out")
        bind = ALL_DESTINATIONS if multi_destination else destination_of(channel, sending=False)
        key = endpoint_key(channel, bind)
        entry = self._receive_endpoints.get(key)
        if entry is not None:
            check_same_receive_params(channel, entry.endpoint.channel.channel, self.settings)
            existing = entry.endpoint.channel.channel.control
            if channel.control != existing:
                raise ChannelError(str(channel), "control",
                                   f"{channel.control or 'none'} differs from "
                                   f"{existing or 'none'}, the control address this endpoint "
                                   f"joins (from {entry.endpoint.channel.channel}): subscribe "
                                   f"on another endpoint, or name the same")
        if entry is None:
            counter_id = None
            try:
                if multi_destination:
                    transport = self.transports.open_multi_destination_receive(channel)
                    counter_id = self.counters.allocate(CounterType.MDS_DESTINATIONS,
                                                        f"mds-destinations: {channel}")
                else:
                    transport = self.transports.open_receive(channel, bind)
            except OSError as e:
                raise ResourceError(f"cannot receive on {bind[0]}:{bind[1]} for {channel}: "
                                    f"{e.strerror or e}") from None
            receive_channel = ReceiveChannel(
                channel=channel, settings=self.settings,
                receiver_id=self._rng.getrandbits(63), counters=self.counters, now_ns=now_ns,
                rng=random.Random(self._rng.getrandbits(64)))
            endpoint = ReceiveEndpoint(receive_channel, transport)
            entry = self._receive_endpoints[key] = _ReceiveEndpointEntry(
                key, endpoint, destinations_counter_id=counter_id)
            self.receiver_proxy.on_add_endpoint(endpoint)
        elif entry.state is _EndpointState.CLOSING:
            entry.state = _EndpointState.OPEN
            self.receiver_proxy.on_add_endpoint(entry.endpoint)
        subscription.endpoint = entry
        entry.subscriptions.append(subscription)
        self.subscriptions[subscription.registration_id] = subscription
        self._sync_interest(entry, subscription.stream_id)
        out: Outgoing = []
        try:
            for image_entry in list(entry.images.values()):
                # As Aeron's isAcceptingSubscriptions: an image whose last subscriber left is
                # on its way out (its receiver stopped taking its data); the session gets a
                # new image when its SETUP comes again.
                if (not image_entry.lingering and image_entry.links
                        and subscription.wants(image_entry.image.session_id,
                                               image_entry.image.stream_id)):
                    out.append(self._link(image_entry, subscription,
                                          image_entry.image.rcv_pos, now_ns, submit=True))
        except CountersFullError:
            # All or nothing: a half-added subscription nobody owns would hold its images'
            # slowest position (and the senders) for good.
            self.remove_subscription(subscription.registration_id)
            raise
        return out

    def remove_subscription(self, registration_id: int) -> None:
        """The subscription goes: its positions stop holding images back; an endpoint left
        without subscriptions is removed."""
        spy = self.spies.pop(registration_id, None)
        if spy is not None:
            for entry in self.publications.values():
                for link in [k for k in entry.spies if k.subscription is spy]:
                    self._unlink_spy(entry, link)
                entry.resting_spies = [k for k in entry.resting_spies if k.subscription is not spy]
            return
        subscription = self.subscriptions.pop(registration_id, None)
        if subscription is None or subscription.endpoint is None:
            return
        entry = subscription.endpoint
        for image_entry in entry.images.values():
            for link in [k for k in image_entry.links if k.subscription is subscription]:
                self._unlink(image_entry, link)
            image_entry.resting = [k for k in image_entry.resting
                                   if k.subscription is not subscription]
        entry.subscriptions.remove(subscription)
        self._sync_interest(entry, subscription.stream_id)
        if not entry.subscriptions:
            self._close_endpoint(entry)

    def _sync_interest(self, entry: _ReceiveEndpointEntry, stream_id: int) -> None:
        """Tell the receive channel which sessions of ``stream_id`` its subscriptions want."""
        sessions: set[int] | None = set()
        for subscription in entry.subscriptions:
            if subscription.stream_id != stream_id:
                continue
            if subscription.channel.is_response:
                # No session until an RSP_SETUP names one (_on_response_setup); a response
                # endpoint has response subscriptions only (endpoint_key).
                assert sessions is not None
                if subscription.response_session_id is not None:
                    sessions.add(subscription.response_session_id)
                continue
            if subscription.channel.session_id is None:
                sessions = None
                break
            assert sessions is not None
            sessions.add(subscription.channel.session_id)
        channel = entry.endpoint.channel
        self.receiver_proxy.on_set_interest(
            channel, stream_id, None if sessions is None else frozenset(sessions))

    # -- images -------------------------------------------------------------------------------
    def _on_image_requested(self, event: ImageRequested, now_ns: int) -> Outgoing:
        entry = self._entry_of(event.channel)
        if entry is None or entry.state is not _EndpointState.OPEN:
            return []
        setup = event.setup
        subscribers = [s for s in entry.subscriptions
                       if s.wants(setup.session_id, setup.stream_id)]
        if not subscribers:
            return []
        if any(not e.lingering and e.image.session_id == setup.session_id
               and e.image.stream_id == setup.stream_id for e in entry.images.values()):
            return []  # a repeat of a request already served (the receiver asked again)
        registration_id = self._new_id()
        path = self.directory / control.IMAGES_DIR / f"{registration_id}.logbuffer"
        channel = entry.endpoint.channel.channel
        params = entry.endpoint.channel.params
        # Congestion control's counters start at what the image's will be: none reads a 0.
        strategy = congestion_control_for(params, setup.term_length, setup.mtu, now_ns)
        indicators = zip((counter.label for counter in strategy.counters),
                         strategy.indicator_values(), strict=True)
        what = f"the image of {_label_of(setup, event.source)}"
        try:
            log_buffer = create_log(
                path, self.budget, what,
                term_length=setup.term_length,
                initial_term_id=setup.initial_term_id, session_id=setup.session_id,
                stream_id=setup.stream_id, mtu=setup.mtu, correlation_id=registration_id,
                initial_term_count=term_count(setup.active_term_id, setup.initial_term_id),
                initial_term_offset=setup.term_offset,
                group=params.image_is_group(setup.is_group), sparse=params.sparse,
                mode=self.settings.file_mode(clients_write=True))
            label = (f"{channel} stream={setup.stream_id} session={setup.session_id} "
                     f"source={event.source[0]}:{event.source[1]}")
            try:
                counter_ids = self._allocate_counters(
                    [(CounterType.RECEIVER_HWM, "rcv-hwm"),
                     (CounterType.RECEIVER_POSITION, "rcv-pos"),
                     *((CounterType.PER_IMAGE_INDICATOR, name, value)
                       for name, value in indicators)],
                    label, registration_id, setup.session_id, setup.stream_id)
            except CountersFullError:
                discard_log(log_buffer, self.budget)
                raise
        except (ResourceError, OSError) as e:
            reason = str(e) if isinstance(e, ResourceError) else (e.strerror or str(e))
            self.counters.add(SystemCounter.ERRORS)  # as every error-log entry
            # The budget's refusal names the image already.
            log.error("cannot create %s", reason if reason.startswith(what)
                      else f"{what}: {reason}")
            self.receiver_proxy.on_reject_image(event, reason)
            return []
        hwm, position, *indicator_cells = (self.counters.address(i) for i in counter_ids)
        positions = ImagePositions(hwm, position, tuple(indicator_cells))
        loss_entry = self.loss_report.add(setup.session_id, setup.stream_id,
                                          f"{channel} source={event.source[0]}:"
                                          f"{event.source[1]}")
        image = event.channel.new_image(event, log_buffer, positions, now_ns, loss_entry)
        image_entry = _ImageEntry(registration_id, image, log_buffer, counter_ids, event.source)
        entry.images[id(image)] = image_entry
        join = image.join_position
        out = []
        for subscription in subscribers:
            try:
                out.append(self._link(image_entry, subscription, join, now_ns, submit=False))
            except CountersFullError as e:
                log.error("cannot link subscription %d to %s: %s",
                          subscription.registration_id, _label_of(setup, event.source), e)
        self.receiver_proxy.on_add_publication_image(event.channel, image)
        log.info("image %d of %s: join position %d, %d subscriber(s)", registration_id,
                 _label_of(setup, event.source), join, len(image_entry.links))
        return out

    def _link(self, image_entry: _ImageEntry, subscription: NetworkSubscription,
              position: int, now_ns: int, *, submit: bool) -> tuple[bytes, dict[str, Any]]:
        """A sub-pos counter for ``subscription`` on the image (and its tether, untethered,
        from ``now_ns``), and the AVAILABLE_IMAGE."""
        image = image_entry.image
        counter_id = self.counters.allocate(
            CounterType.SUBSCRIBER_POSITION,
            f"sub-pos: {subscription.channel} stream={image.stream_id} "
            f"session={image.session_id} sub={subscription.registration_id}",
            registration_id=subscription.registration_id, session_id=image.session_id,
            stream_id=image.stream_id, owner_id=subscription.client_id, initial_value=position)
        cell = self.counters.address(counter_id)
        image_entry.links.append(TetherablePosition(subscription, counter_id, cell,
                                                    self._tether(subscription, now_ns)))
        if submit:
            self.receiver_proxy.on_add_subscriber(image, cell)
        else:
            image.add_subscriber_position(cell)  # not handed to the receiver yet
        return (subscription.client_key, messages.available_image(
            image_registration_id=image_entry.registration_id,
            subscription_registration_id=subscription.registration_id,
            session_id=image.session_id, stream_id=image.stream_id,
            log_file=image_entry.log.path, subscriber_position_counter_id=counter_id,
            join_position=position,
            source_identity=f"{image_entry.source[0]}:{image_entry.source[1]}"))

    def _unlink(self, image_entry: _ImageEntry,
                link: TetherablePosition[NetworkSubscription]) -> None:
        image_entry.links.remove(link)
        image, cell = image_entry.image, link.cell
        self.receiver_proxy.on_remove_subscriber(image, cell)
        self.counters.free(link.counter_id)  # reused after 1 s: a late write is harmless

    def _forget_response_image(self, image: PublicationImage) -> None:
        """A request image went (unavailable, or done): a response publication made for it
        that is not connected yet is no longer pending (:meth:`_check_response_connections`);
        the image sends no RSP_SETUP past ACTIVE/DRAINING, and the conductor holds it no more."""
        for entry in [e for e in self._answering if e.response_image is image]:
            self._answering.remove(entry)
            entry.response_image = None

    def _on_image_unavailable(self, event: ImageUnavailable) -> Outgoing:
        self._forget_response_image(event.image)
        entry = self._entry_of(event.channel)
        image_entry = entry.images.get(id(event.image)) if entry is not None else None
        if image_entry is None or image_entry.lingering:
            return []
        image_entry.lingering = True
        out: Outgoing = []
        for link in list(image_entry.links):
            out.append((link.subscription.client_key, messages.unavailable_image(
                image_registration_id=image_entry.registration_id,
                subscription_registration_id=link.subscription.registration_id,
                stream_id=event.image.stream_id, lost=event.lost)))
            self._unlink(image_entry, link)
        return out

    def _on_image_done(self, event: ImageDone) -> None:
        self._forget_response_image(event.image)
        entry = self._entry_of(event.channel)
        image_entry = entry.images.pop(id(event.image), None) if entry is not None else None
        if image_entry is not None:
            self._free_image(image_entry)

    def _free_image(self, image_entry: _ImageEntry) -> None:
        for link in image_entry.links:
            self.counters.free(link.counter_id)
        image_entry.links.clear()
        for counter_id in image_entry.counter_ids:
            self.counters.free(counter_id)
        discard_log(image_entry.log, self.budget)

    def image_log(self, registration_id: int) -> LogBuffer | None:
        """The driver's mapping of image ``registration_id``'s log (None once it is gone),
        for a reader in this process: the simulator's subscribers read through it (a second
        mapping of every log would double what a many-host run holds)."""
        for entry in self._receive_endpoints.values():
            for image_entry in entry.images.values():
                if image_entry.registration_id == registration_id:
                    return image_entry.log
        return None

    def _entry_of(self, channel: ReceiveChannel) -> _ReceiveEndpointEntry | None:
        for entry in self._receive_endpoints.values():
            if entry.endpoint.channel is channel:
                return entry
        return None

    # -- duty cycle ---------------------------------------------------------------------------
    def do_work(self, now_ns: int) -> tuple[int, Outgoing]:
        """Handle the agents' events; returns (work done, messages to clients)."""
        out, self._spy_out = self._spy_out, []
        work = len(out)
        self._check_response_connections()
        events = self._events
        # Bounded: a flood of SETUPs must not hold the conductor (and its heartbeat) for long.
        while events and work < MAX_EVENTS_PER_CYCLE:
            event = events.popleft()
            work += 1
            try:
                if isinstance(event, ImageRequested):
                    out.extend(self._on_image_requested(event, now_ns))
                elif isinstance(event, ImageUnavailable):
                    out.extend(self._on_image_unavailable(event))
                elif isinstance(event, ImageDone):
                    self._on_image_done(event)
                elif isinstance(event, ImageRejected):  # at most once a second a session
                    self.counters.add(SystemCounter.ERRORS)  # as every error-log entry
                    log.error("refused the image of %s: %s",
                              _label_of(event.setup, event.source), event.reason)
                elif isinstance(event, PublicationDone):
                    out.extend(self._on_publication_done(event))
                elif isinstance(event, SpiesReleased):
                    out.extend(self._on_spies_released(event.publication))
                elif isinstance(event, SpyLinked):
                    linked = self.publications.get(event.registration_id)
                    if linked is not None:  # else it is done, and its hold gone with it
                        self._on_spy_linked(linked)
                elif isinstance(event, SpyUnlinked):
                    if event.counter_id in self._spy_counters_unlinking:
                        self._spy_counters_unlinking.discard(event.counter_id)
                        self.counters.free(event.counter_id)
                elif isinstance(event, PublicationRejected):  # once a second a receiver
                    for (host, port), reason in event.rejections:
                        self.counters.add(SystemCounter.ERRORS)
                        log.error("the receiver at %s:%d refused the image of session %d "
                                  "stream %d: %s", host, port, event.publication.session_id,
                                  event.publication.stream_id, reason)
                elif isinstance(event, EndpointRemoved):
                    self._on_endpoint_removed(event)
                elif isinstance(event, ReceiveDestinationFailed):
                    failed = self._entry_of(event.channel)
                    if (failed is not None
                            and failed.destinations.get(event.address) == event.index):
                        del failed.destinations[event.address]
                        failed.sockets.pop(event.address, None)
                        cell = self._destinations_cell(failed)
                        if cell is not None:
                            cell[0] = len(failed.destinations)
                elif isinstance(event, ResponseSetupArrived):
                    self._on_response_setup(event)
            except Exception:  # a bug: counted and logged; the conductor serves on
                self.counters.add(SystemCounter.ERRORS)
                log.exception("handling %r failed", event)
        return work, out

    def send_backlog(self, *, deferring: bool) -> float:
        """The governor's send backlog: of each publication, the data its flow control lets it
        send but the sender has not sent, as a share of what flow control lets it send; the
        largest (0 without publications: a sender that keeps up leaves next to nothing).  A
        publication counts only while the sender could send it something (its next frame fits
        in the window: a subscriber that stopped reading leaves a rest shorter than a frame,
        which is no backlog); one whose data waits on purpose does not count: one paced by
        its send-rate limit (``rc=``), and with ``deferring`` one of the lowest band.  (Its
        ``c`` belongs to the sender's thread: words read across threads, a sample's worth.)"""
        backlog = 0.0
        for entry in self.publications.values():
            publication = entry.publication
            if (deferring and publication.priority < 0) or publication.is_rate_limited:
                continue  # waits on purpose: deferred, or paced by its send-rate limit
            if not publication.has_data_ready():
                continue  # e.g. the window's rest is shorter than the next frame: nothing to send
            sender_position = publication.sender_position
            sender_limit = publication.sender_limit
            sendable = min(entry.log.producer_position(), sender_limit)
            if sendable > sender_position:
                backlog = max(backlog, (sendable - sender_position)
                              / (sender_limit - sender_position))
        return backlog

    @property
    def carries_streams(self) -> bool:
        """Whether it has publications or images (what the governor watches; asked after
        every idle duty cycle, so a plain loop)."""
        if self.publications:
            return True
        for entry in self._receive_endpoints.values():
            if entry.images:
                return True
        return False

    def apply_pressure_step(self, step: int) -> None:
        """Hand the governor's step to the agents (on their thread)."""
        self.sender_proxy.on_pressure_step(step)
        self.receiver_proxy.on_pressure_step(step)

    @property
    def has_open_episode(self) -> bool:
        """Whether a publication is in a back-pressure episode."""
        for entry in self.publications.values():
            if entry.episodes.is_open:
                return True
        return False

    def sample_episodes(self, now_ns: int) -> list[tuple[int, EpisodeEvent]]:
        """Each publication's back-pressure episodes that began or ended since the last
        sample, with the publication's registration id."""
        events: list[tuple[int, EpisodeEvent]] = []
        for entry in self.publications.values():
            for event in entry.episodes.sample(
                    now_ns, *entry.readings.read(),
                    window_start=entry.publication.sender_position):
                events.append((entry.registration_id, event))
        return events

    def _on_publication_done(self, event: PublicationDone) -> Outgoing:
        entry = next((e for e in self.publications.values()
                      if e.publication is event.publication), None)
        if entry is None:
            return []
        out = self._on_spies_released(event.publication)  # any left (none once it lingered)
        del self.publications[entry.registration_id]
        if self._shared_publications.get(entry.key) is entry:
            del self._shared_publications[entry.key]
        for counter_id in entry.counter_ids:
            self.counters.free(counter_id)
        discard_log(entry.log, self.budget)
        endpoint_entry = entry.endpoint
        endpoint_entry.publications -= 1
        if endpoint_entry.publications == 0:
            self._close_endpoint(endpoint_entry)
        return out

    def _close_endpoint(self, entry: _SendEndpointEntry | _ReceiveEndpointEntry) -> None:
        """Its agent (sender or receiver) drops the endpoint; then :class:`EndpointRemoved`
        closes its socket (unless a new publication or subscription revived it meanwhile)."""
        entry.state = _EndpointState.CLOSING
        entry.generation += 1
        generation = entry.generation

        if isinstance(entry, _SendEndpointEntry):
            # Its destinations go with it: a publication that revives it starts with none,
            # as on a new endpoint.
            entry.manual_destinations.clear()
            self.sender_proxy.on_remove_endpoint(entry.endpoint, generation)
        else:
            # A multi-destination subscription's destinations go with it, as a send
            # endpoint's: a subscription that revives it starts with none.
            indexes = tuple(entry.destinations.values())
            entry.destinations.clear()
            entry.sockets.clear()
            entry.removing.clear()  # their removals close them (none can take them back)
            self.receiver_proxy.on_remove_endpoint(entry.endpoint, indexes,
                                                   self._destinations_cell(entry), generation)

    def _on_endpoint_removed(self, event: EndpointRemoved) -> None:
        entry: _SendEndpointEntry | _ReceiveEndpointEntry | None
        if isinstance(event.channel, SendChannel):
            entry = next((e for e in self._send_endpoints.values()
                          if e.endpoint.channel is event.channel), None)
        else:
            entry = self._entry_of(event.channel)
        if entry is None:
            return
        if entry.state is not _EndpointState.CLOSING or entry.generation != event.generation:
            return  # revived since
        entry.endpoint.transport.close()
        if isinstance(entry, _SendEndpointEntry):
            self._send_endpoints.pop(entry.key, None)
            if entry.destinations_counter_id is not None:
                self.counters.free(entry.destinations_counter_id)
            return
        self._receive_endpoints.pop(entry.key, None)
        if entry.destinations_counter_id is not None:
            self.counters.free(entry.destinations_counter_id)
        self._closed_receiver_ids[entry.endpoint.channel.receiver_id] = None
        while len(self._closed_receiver_ids) > RECEIVER_IDS_KEPT:
            del self._closed_receiver_ids[next(iter(self._closed_receiver_ids))]
        for image_entry in entry.images.values():
            self._free_image(image_entry)
        entry.images.clear()

    # -- graceful drain (DriverConductor.drain) -----------------------------------------------
    def stop_credit(self) -> None:
        """Every network publication stops granting credit (on the sender's thread, which
        owns pub-lmt)."""
        for entry in self.publications.values():
            self.sender_proxy.on_stop_credit(entry.publication)

    def is_flushed(self, *, closing_clients: frozenset[int] | None = None) -> bool:
        """Every publication sent its log, its live receivers acknowledged the end and its
        spies read it to the end, as IPC subscribers are waited for (``closing_clients``: an
        embedded driver closing with these clients of its own process: not waiting for this
        driver's receivers that only they read from, nor for their spies).  From what the
        sender published (:class:`PublicationStatus`) and the counters only."""
        return all(self._flushed(entry, entry.publication.status,
                                 self._closing_receiver_ids(closing_clients, entry.publication))
                   and self._spies_read_all(entry, closing_clients)
                   for entry in list(self.publications.values()))

    @staticmethod
    def _flushed(entry: _PublicationEntry, status: PublicationStatus,
                 ignored: frozenset[int]) -> bool:
        """:meth:`PublicationStatus.is_flushed_except` of ``entry``'s publication, from
        ``status`` (its last) and its counters."""
        publication = entry.publication
        end = entry.log.producer_position()
        return status.is_flushed_except(
            ignored, end=end, sender_position=publication.sender_position,
            c_acknowledged=publication.c_acknowledged())

    def _spies_read_all(self, entry: _PublicationEntry,
                        closing_clients: frozenset[int] | None) -> bool:
        """Every spy of ``entry`` (but those of ``closing_clients``, and untethered ones left
        behind) has read its log to the producer position."""
        end = entry.log.producer_position()
        return all(self.counters.get(link.counter_id) >= end for link in entry.spies
                   if not link.lingering and (closing_clients is None
                                              or link.subscription.client_id
                                              not in closing_clients))

    def _closing_receiver_ids(self, closing_clients: frozenset[int] | None,
                              publication: NetworkPublication) -> frozenset[int]:
        """This driver's receivers that only ``closing_clients`` read ``publication``'s
        stream from (or nobody now: the endpoint closed), whose acknowledgements a closing
        embedded driver does not wait for; none without ``closing_clients``.  (A receiver
        another process also reads the stream from is waited for, and its acknowledgement
        is the slowest of its subscribers', the closing application's too.)"""
        if closing_clients is None:
            return frozenset()
        session_id, stream_id = publication.session_id, publication.stream_id
        ours = {entry.endpoint.channel.receiver_id
                for entry in self._receive_endpoints.values()
                if not any(s.client_id not in closing_clients and s.wants(session_id, stream_id)
                           for s in entry.subscriptions)}
        return frozenset(ours | self._closed_receiver_ids.keys())

    def end_streams(self) -> None:
        """Close every publication still open: it sends end-of-stream (EOS heartbeats).  No
        publication's linger waits for its spies any more: the flush waited for them (but
        for a closing process's own)."""
        for entry in self.publications.values():
            if not entry.closing:
                entry.closing = True
                if self._shared_publications.get(entry.key) is entry:
                    del self._shared_publications[entry.key]
                self._drop_spies_left_behind(entry)
            self.sender_proxy.on_close_publication(entry.publication, wait_for_spies=False)

    def has_ended_streams(self, *, closing_clients: frozenset[int] | None = None) -> bool:
        """Every publication's receivers answered its end-of-stream (an EOS-flagged status
        message takes a receiver off the list), or it sent ``EOS_HEARTBEATS_TO_END`` EOS
        heartbeats and is still flushed (an offer that passed its limit check as the credit
        stopped is acknowledged too; receivers that do not answer EOS, as Aeron 1.15's, then
        miss it only if all of them are lost), or it is gone."""
        def ended(entry: _PublicationEntry) -> bool:
            ignored = self._closing_receiver_ids(closing_clients, entry.publication)
            status = entry.publication.status
            return not status.has_receivers_except(ignored) or (
                status.eos_heartbeats_sent >= EOS_HEARTBEATS_TO_END
                and self._flushed(entry, status, ignored))

        return all(ended(entry) for entry in list(self.publications.values()))

    # -- helpers ------------------------------------------------------------------------------
    def _allocate_counters(self, kinds: list[tuple[Any, ...]], label: str,
                           registration_id: int, session_id: int, stream_id: int) -> list[int]:
        """One counter of each ``(CounterType, label kind[, initial value])``, or none."""
        allocated: list[int] = []
        try:
            for kind, name, *initial in kinds:
                allocated.append(self.counters.allocate(
                    kind, f"{name}: {label}", registration_id=registration_id,
                    session_id=session_id, stream_id=stream_id,
                    initial_value=initial[0] if initial else 0))
        except CountersFullError:
            for counter_id in allocated:
                self.counters.free(counter_id)
            raise
        return allocated

    def close(self, now_ns: int) -> None:
        """Free everything (the network thread has stopped).  The images first tell their
        senders that this receiver leaves, as a closed subscription's do."""
        try:
            self.receiver.leave(now_ns)
        except Exception:  # the farewell only: what follows frees everything regardless
            log.exception("telling the senders this receiver leaves failed")
        for entry in list(self.publications.values()):
            for counter_id in [*entry.counter_ids, *(link.counter_id for link in entry.spies)]:
                self.counters.free(counter_id)
            discard_log(entry.log, self.budget)
        for counter_id in self._spy_counters_unlinking:  # the sender stopped first
            self.counters.free(counter_id)
        self._spy_counters_unlinking.clear()
        self.publications.clear()
        self.spies.clear()
        self._shared_publications.clear()
        for send_entry in self._send_endpoints.values():
            send_entry.endpoint.transport.close()
            if send_entry.destinations_counter_id is not None:
                self.counters.free(send_entry.destinations_counter_id)
        self._send_endpoints.clear()
        for receive_entry in self._receive_endpoints.values():
            receive_entry.endpoint.transport.close()
            for image_entry in receive_entry.images.values():
                self._free_image(image_entry)
            if receive_entry.destinations_counter_id is not None:
                self.counters.free(receive_entry.destinations_counter_id)
        self._receive_endpoints.clear()
        self.subscriptions.clear()
        self.loss_report.close()


#: The source identity of a spy's image, as Aeron gives it (CommonContext.IPC_CHANNEL): the log
#: is read in place on this host.
SPY_SOURCE_IDENTITY = "aeron:ipc"


def _spies_on(spy: NetworkSubscription, entry: _PublicationEntry) -> bool:
    """Whether ``spy`` reads ``entry``'s publication (Aeron's SpySubscriptionLink.matches): the
    same send endpoint, its stream, and its session if the spy names one; not once closing."""
    return (not entry.closing and spy.spied_key == entry.endpoint.key
            and spy.wants(entry.publication.session_id, entry.publication.stream_id))


def _resolved(channel: Channel,
              local_addresses: Callable[[], Sequence[InterfaceAddress]]) -> Channel:
    """The channel with the names in its endpoint and interface replaced by IP literals, as
    the channel is added (:mod:`slipstream.daemon.media.names`: the shell resolved them off the
    loop, so this looks them up in its cache): nothing downstream resolves again, inside the
    duty cycle.  An interface given as a subnet (``interface=10.1.2.0/24``) becomes the address
    of the local interface in it, chosen among ``local_addresses()`` (the transports':
    :mod:`slipstream.daemon.media.interfaces`), so channels that name one interface either way
    share its endpoints; that lists the host's interfaces here, on the conductor's thread, for
    each such channel.  On a unicast channel a wildcard subnet (``interface=0.0.0.0/0``,
    ``[::]/0``) stays the wildcard, without its prefix, and lists nothing (as Aeron's
    ``UdpChannel.parse``: any local address)."""
    for part, host in names.names_of(channel):
        address = names.lookup(channel, part, host)
        hostport = getattr(channel, part)
        channel = attrs.evolve(channel, **{part: attrs.evolve(hostport, host=address)})
    interface = channel.interface
    if interface is not None and interface.prefix_length is not None:
        ip = interface.ip
        if ip is not None and ip.is_unspecified and not channel.is_multicast:
            local = interface.host
        else:
            subnet = ipaddress.ip_network(f"{interface.host}/{interface.prefix_length}",
                                          strict=False)
            local = interfaces.address_in_subnet(channel, "interface", subnet,
                                                 local_addresses)
        channel = attrs.evolve(channel, interface=attrs.evolve(interface, host=local,
                                                               prefix_length=None))
    return channel


def _label_of(setup: Any, source: Address) -> str:
    return (f"session {setup.session_id} stream {setup.stream_id} from "
            f"{source[0]}:{source[1]}")
