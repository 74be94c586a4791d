"""The conductor's network half: UDP publications, subscriptions, images and endpoints.

The :class:`~slipstream.daemon.conductor.conductor.DriverConductor` hands every ``aeron:udp``
command here.  This object creates what the network agents need (logs, position counters, the
sans-I/O :class:`NetworkPublication` and :class:`PublicationImage` objects, endpoint transports)
on the conductor's thread and hands them to the :class:`Sender` and :class:`Receiver` agents with
commands; the agents answer with events (a SETUP asks for an image, an image or publication is
done, an endpoint was removed).  A resource is freed only on the event that says the agent no
longer uses it, so the network thread never touches an unmapped log.  As in Aeron
(DriverConductor / Sender / Receiver): the threads share no mutable object except through
these queues, and position counters.

Names in a channel become IP literals here, once, when the channel is added (:func:`_resolved`;
the driver shell resolved them in a thread first, :mod:`slipstream.daemon.media.names`); the
protocol core only ever sees IP literals.  Sockets are opened by the injected
:class:`NetworkTransports` (real UDP sockets in the driver, a virtual network in the
simulator), so this module does no I/O of its own beyond creating log files.

Units: times in ns, sizes in bytes.
"""

from __future__ import annotations

import enum
import logging
import random
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import attrs

from slipstream.client import control
from slipstream.client.channel import Channel
from slipstream.client.counters import (
    BACK_PRESSURE_TYPES,
    CountersFile,
    CountersFullError,
    CounterType,
    SystemCounter,
)
from slipstream.client.errors import ChannelError
from slipstream.client.logbuffer import LogBuffer, term_count
from slipstream.daemon.agents.receiver import ReceiveEndpoint, Receiver, ReceiveTransport
from slipstream.daemon.agents.sender import (
    PublicationDone,
    PublicationRejected,
    SendEndpoint,
    Sender,
    SendTransport,
)
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
    destination_of,
    endpoint_key,
)
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.flow.registry import congestion_control_for, flow_control_for
from slipstream.daemon.media import names
from slipstream.daemon.media.receive_channel import (
    ImageDone,
    ImageRejected,
    ImageRequested,
    ImageUnavailable,
    ReceiveChannel,
)
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
from slipstream.daemon.streams.publication import NetworkPublication, SenderPositions

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


class _EndpointState(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"  # the agent was asked to remove it; a new user may still revive it


@attrs.frozen(eq=False)
class EndpointRemoved:
    """The agent no longer uses the endpoint (sent by the removal command itself)."""

    entry: object
    generation: int


@attrs.define(eq=False)
class _SendEndpointEntry:
    key: tuple[Any, ...]
    endpoint: SendEndpoint
    publications: int = 0
    state: _EndpointState = _EndpointState.OPEN
    generation: int = 0


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


@attrs.define(eq=False)
class NetworkSubscription(StreamInterest):
    """A client's subscription to a UDP channel."""

    registration_id: int
    client_id: int
    client_key: bytes
    channel: Channel
    stream_id: int
    endpoint: _ReceiveEndpointEntry | None = None


@attrs.define(eq=False)
class _ImageLink:
    subscription: NetworkSubscription
    counter_id: int
    cell: object  # cffi int64_t * of the sub-pos counter


@attrs.define(eq=False)
class _ImageEntry:
    registration_id: int
    image: PublicationImage
    log: LogBuffer
    counter_ids: list[int]
    source: Address
    links: list[_ImageLink] = attrs.Factory(list)
    lingering: bool = False


@attrs.define(eq=False)
class _ReceiveEndpointEntry:
    key: tuple[Any, ...]
    endpoint: ReceiveEndpoint
    subscriptions: list[NetworkSubscription] = attrs.Factory(list)
    images: dict[int, _ImageEntry] = attrs.Factory(dict)  # by image (id of the object)
    state: _EndpointState = _EndpointState.OPEN
    generation: int = 0


#: Receiver ids of this driver's closed endpoints kept (a closing embedded driver's drain looks
#: them up): the newest this many, so that endpoint churn does not grow the set.
RECEIVER_IDS_KEPT = 1024
#: EOS heartbeats (100 ms apart) a draining driver sends before it stops waiting for answers.
EOS_HEARTBEATS_TO_END = 3

NetworkEvent = (ImageRequested | ImageUnavailable | ImageDone | ImageRejected | PublicationDone
                | PublicationRejected | EndpointRemoved)


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
        self._wake_network = wake_network
        self._wake_conductor = wake_conductor
        self._events: deque[NetworkEvent] = deque()
        self.loss_report = LossReport(directory / LOSS_REPORT_FILE,
                                      mode=settings.file_mode(clients_write=False))
        self.sender = Sender(
            on_event=self._post,
            max_datagrams_per_send=settings.network_publication_max_messages_per_send,
            status_poll_ratio=settings.send_to_status_poll_ratio)
        self.receiver = Receiver(on_event=self._post)
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

    # -- plumbing -----------------------------------------------------------------------------
    def _post(self, event: NetworkEvent) -> None:
        """An agent's event (any thread): queued for the conductor's next duty cycle."""
        self._events.append(event)
        self._wake_conductor()

    def _submit_send(self, command: Callable[[int], None]) -> None:
        self.sender.submit(command)
        self._wake_network()

    def _submit_receive(self, command: Callable[[int], None]) -> None:
        self.receiver.submit(command)
        self._wake_network()

    @property
    def image_count(self) -> int:
        return sum(len(entry.images) for entry in self._receive_endpoints.values())

    @property
    def has_events(self) -> bool:
        return bool(self._events)

    @property
    def used_session_ids(self) -> set[int]:
        return {entry.publication.session_id for entry in self.publications.values()}

    # -- publications -------------------------------------------------------------------------
    def add_publication(self, client_key: bytes, channel: Channel, stream_id: int,
                        now_ns: int) -> tuple[_PublicationEntry, int]:
        """A publisher of ``stream_id`` on ``channel``: shares the publication of the same
        endpoint, stream and session, or makes one.  Returns it and the registration id of
        this publisher."""
        channel = _resolved(channel)
        destination = destination_of(channel)
        key = (endpoint_key(channel, destination), stream_id, channel.session_id)
        entry = self._shared_publications.get(key)
        if entry is None:
            entry = self._create_publication(key, channel, stream_id, destination, now_ns)
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

    def _create_publication(self, key: tuple[Any, ...], channel: Channel, stream_id: int,
                            destination: Address, now_ns: int) -> _PublicationEntry:
        params = PublicationParams.for_network(channel, self.settings)  # before a socket
        endpoint = self._send_endpoint(key[0], channel, destination)
        try:
            return self._create_publication_on(endpoint, key, channel, params, stream_id,
                                               destination, now_ns)
        except BaseException:
            if endpoint.publications == 0:
                self._close_endpoint(endpoint)  # opened (or revived) for nothing
            raise

    def _create_publication_on(self, endpoint: _SendEndpointEntry, key: tuple[Any, ...],
                               channel: Channel, params: PublicationParams, stream_id: int,
                               destination: Address, now_ns: int) -> _PublicationEntry:
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
        self._shared_publications[key] = entry
        self._submit_send(lambda _now: self.sender.add_publication(endpoint.endpoint, publication))
        log.info("created network publication %d %s stream=%d session=%d term_length=%d",
                 registration_id, channel, stream_id, session_id, term_length)
        return entry

    def _send_endpoint(self, key: tuple[Any, ...], channel: Channel,
                       destination: Address) -> _SendEndpointEntry:
        entry = self._send_endpoints.get(key)
        if entry is not None:
            if entry.state is _EndpointState.CLOSING:  # revive it: the removal is undone
                entry.state = _EndpointState.OPEN
                self._submit_send(lambda _now: self.sender.add_endpoint(entry.endpoint))
            return entry
        try:
            transport = self.transports.open_send(channel, destination)
        except OSError as e:
            raise ResourceError(f"cannot open a send socket for {channel}: "
                                f"{e.strerror or e}") from None
        endpoint = SendEndpoint(SendChannel(counters=self.counters), transport)
        entry = self._send_endpoints[key] = _SendEndpointEntry(key, endpoint)
        self._submit_send(lambda _now: self.sender.add_endpoint(endpoint))
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
        publication = entry.publication
        self._submit_send(lambda now: publication.close(now))

    # -- subscriptions ------------------------------------------------------------------------
    def add_subscription(self, subscription: NetworkSubscription, now_ns: int) -> Outgoing:
        """Receive ``subscription``'s stream at its endpoint; images already there are linked
        at once (the AVAILABLE_IMAGE messages are returned)."""
        channel = subscription.channel = _resolved(subscription.channel)
        SubscriptionParams.resolve(channel, self.settings)  # refused before a socket opens
        bind = destination_of(channel)
        key = endpoint_key(channel, bind)
        entry = self._receive_endpoints.get(key)
        if entry is not None:
            check_same_receive_params(channel, entry.endpoint.channel.channel, self.settings)
        if entry is None:
            try:
                transport = self.transports.open_receive(channel, bind)
            except OSError as e:
                raise ResourceError(f"cannot receive on {bind[0]}:{bind[1]} for {channel}: "
                                    f"{e.strerror or e}") from None
            receive_channel = ReceiveChannel(
                channel=channel, settings=self.settings,
                receiver_id=self._rng.getrandbits(63), counters=self.counters, now_ns=now_ns,
                rng=random.Random(self._rng.getrandbits(64)))
            endpoint = ReceiveEndpoint(receive_channel, transport)
            entry = self._receive_endpoints[key] = _ReceiveEndpointEntry(key, endpoint)
            self._submit_receive(lambda _now: self.receiver.add_endpoint(endpoint))
        elif entry.state is _EndpointState.CLOSING:
            entry.state = _EndpointState.OPEN
            revived = entry.endpoint
            self._submit_receive(lambda _now: self.receiver.add_endpoint(revived))
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
                                          image_entry.image.rcv_pos, submit=True))
        except CountersFullError:
            # All or nothing: a half-added subscription nobody owns would hold its images'
            # slowest position (and the senders) for good.
            self.remove_subscription(subscription.registration_id)
            raise
        return out

    def remove_subscription(self, registration_id: int) -> None:
        """The subscription goes: its positions stop holding images back; an endpoint left
        without subscriptions is removed."""
        subscription = self.subscriptions.pop(registration_id, None)
        if subscription is None or subscription.endpoint is None:
            return
        entry = subscription.endpoint
        for image_entry in entry.images.values():
            for link in [k for k in image_entry.links if k.subscription is subscription]:
                self._unlink(image_entry, link)
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
            if subscription.channel.session_id is None:
                sessions = None
                break
            assert sessions is not None
            sessions.add(subscription.channel.session_id)
        channel = entry.endpoint.channel
        self._submit_receive(lambda _now: channel.set_interest(stream_id, sessions))

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
            receive_channel = event.channel
            self._submit_receive(lambda now: receive_channel.reject_image(event, now, reason))
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
                out.append(self._link(image_entry, subscription, join, submit=False))
            except CountersFullError as e:
                log.error("cannot link subscription %d to %s: %s",
                          subscription.registration_id, _label_of(setup, event.source), e)
        receive_channel = event.channel
        self._submit_receive(lambda _now: receive_channel.add_image(image))
        log.info("image %d of %s: join position %d, %d subscriber(s)", registration_id,
                 _label_of(setup, event.source), join, len(image_entry.links))
        return out

    def _link(self, image_entry: _ImageEntry, subscription: NetworkSubscription,
              position: int, *, submit: bool) -> tuple[bytes, dict[str, Any]]:
        """A sub-pos counter for ``subscription`` on the image, and the AVAILABLE_IMAGE."""
        image = image_entry.image
        counter_id = self.counters.allocate(
            CounterType.SUBSCRIBER_POSITION,
            f"sub-pos: {subscription.channel} stream={image.stream_id} "
            f"session={image.session_id} sub={subscription.registration_id}",
            registration_id=subscription.registration_id, session_id=image.session_id,
            stream_id=image.stream_id, owner_id=subscription.client_id, initial_value=position)
        cell = self.counters.address(counter_id)
        image_entry.links.append(_ImageLink(subscription, counter_id, cell))
        if submit:
            self._submit_receive(lambda _now: image.add_subscriber_position(cell))
        else:
            image.add_subscriber_position(cell)  # not handed to the receiver yet
        return (subscription.client_key, messages.available_image(
            image_registration_id=image_entry.registration_id,
            subscription_registration_id=subscription.registration_id,
            session_id=image.session_id, stream_id=image.stream_id,
            log_file=image_entry.log.path, subscriber_position_counter_id=counter_id,
            join_position=position,
            source_identity=f"{image_entry.source[0]}:{image_entry.source[1]}"))

    def _unlink(self, image_entry: _ImageEntry, link: _ImageLink) -> None:
        image_entry.links.remove(link)
        image, cell = image_entry.image, link.cell
        self._submit_receive(lambda _now: image.remove_subscriber_position(cell))
        self.counters.free(link.counter_id)  # reused after 1 s: a late write is harmless

    def _on_image_unavailable(self, event: ImageUnavailable) -> Outgoing:
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
                stream_id=event.image.stream_id, lost=event.image.left_behind)))
            self._unlink(image_entry, link)
        return out

    def _on_image_done(self, event: ImageDone) -> None:
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
        out: Outgoing = []
        work = 0
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
                    self._on_publication_done(event)
                elif isinstance(event, PublicationRejected):  # once a second a receiver
                    for (host, port), reason in event.rejections:
                        self.counters.add(SystemCounter.ERRORS)
                        log.error("the receiver at %s:%d refused the image of session %d "
                                  "stream %d: %s", host, port, event.publication.session_id,
                                  event.publication.stream_id, reason)
                elif isinstance(event, EndpointRemoved):
                    self._on_endpoint_removed(event)
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
            if (deferring and publication.priority < 0) or publication.c.rate_limit > 0:
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
        self._submit_send(lambda _now: self.sender.set_pressure_step(step))
        self._submit_receive(lambda _now: self.receiver.set_pressure_step(step))

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

    def _on_publication_done(self, event: PublicationDone) -> None:
        entry = next((e for e in self.publications.values()
                      if e.publication is event.publication), None)
        if entry is None:
            return
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

    def _close_endpoint(self, entry: _SendEndpointEntry | _ReceiveEndpointEntry) -> None:
        """Its agent (sender or receiver) drops the endpoint; then :class:`EndpointRemoved`
        closes its socket (unless a new publication or subscription revived it meanwhile)."""
        entry.state = _EndpointState.CLOSING
        entry.generation += 1
        generation = entry.generation

        if isinstance(entry, _SendEndpointEntry):
            send_endpoint = entry.endpoint

            def remove_send(_now: int) -> None:
                self.sender.remove_endpoint(send_endpoint)
                self._post(EndpointRemoved(entry, generation))

            self._submit_send(remove_send)
        else:
            receive_endpoint = entry.endpoint

            def remove_receive(now_ns: int) -> None:
                try:
                    self.receiver.remove_endpoint(receive_endpoint, now_ns)
                finally:  # its socket, logs and counters are freed whatever the farewell did
                    self._post(EndpointRemoved(entry, generation))

            self._submit_receive(remove_receive)

    def _on_endpoint_removed(self, event: EndpointRemoved) -> None:
        entry = event.entry
        if not isinstance(entry, _SendEndpointEntry | _ReceiveEndpointEntry):
            return
        if entry.state is not _EndpointState.CLOSING or entry.generation != event.generation:
            return  # revived since
        entry.endpoint.transport.close()
        if isinstance(entry, _SendEndpointEntry):
            self._send_endpoints.pop(entry.key, None)
            return
        self._receive_endpoints.pop(entry.key, None)
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
            publication = entry.publication
            self._submit_send(lambda _now, p=publication: p.stop_credit())

    def is_flushed(self, *, closing_clients: frozenset[int] | None = None) -> bool:
        """Every publication sent its log and its live receivers acknowledged the end
        (``closing_clients``: an embedded driver closing with these clients of its own
        process: not waiting for this driver's receivers that only they read from)."""
        return all(entry.publication.is_flushed_except(
                       self._closing_receiver_ids(closing_clients, entry.publication))
                   for entry in list(self.publications.values()))

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
        """Close every publication still open: it sends end-of-stream (EOS heartbeats)."""
        for entry in self.publications.values():
            if not entry.closing:
                entry.closing = True
                if self._shared_publications.get(entry.key) is entry:
                    del self._shared_publications[entry.key]
                publication = entry.publication
                self._submit_send(lambda now, p=publication: p.close(now))

    def has_ended_streams(self, *, closing_clients: frozenset[int] | None = None) -> bool:
        """Every publication's receivers answered its end-of-stream (an EOS-flagged status
        message takes a receiver off the list), or it sent ``EOS_HEARTBEATS_TO_END`` EOS
        heartbeats and is still flushed (an offer that passed its limit check as the credit
        stopped is acknowledged too; receivers that do not answer EOS, as Aeron 1.15's, then
        miss it only if all of them are lost), or it is gone."""
        def ended(publication: NetworkPublication) -> bool:
            ignored = self._closing_receiver_ids(closing_clients, publication)
            return not publication.has_receivers_except(ignored) or (
                publication.eos_heartbeats_sent >= EOS_HEARTBEATS_TO_END
                and publication.is_flushed_except(ignored))

        return all(ended(entry.publication) for entry in list(self.publications.values()))

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
            for counter_id in entry.counter_ids:
                self.counters.free(counter_id)
            discard_log(entry.log, self.budget)
        self.publications.clear()
        self._shared_publications.clear()
        for send_entry in self._send_endpoints.values():
            send_entry.endpoint.transport.close()
        self._send_endpoints.clear()
        for receive_entry in self._receive_endpoints.values():
            receive_entry.endpoint.transport.close()
            for image_entry in receive_entry.images.values():
                self._free_image(image_entry)
        self._receive_endpoints.clear()
        self.subscriptions.clear()
        self.loss_report.close()


def _resolved(channel: Channel) -> Channel:
    """The channel with the names in its endpoint and interface replaced by IP literals, as
    the channel is added (:mod:`slipstream.daemon.media.names`: the shell resolved them off the
    loop): nothing downstream resolves again, inside the duty cycle."""
    for part, host in names.names_of(channel):
        address = names.lookup(channel, part, host)
        hostport = getattr(channel, part)
        channel = attrs.evolve(channel, **{part: attrs.evolve(hostport, host=address)})
    return channel


def _label_of(setup: Any, source: Address) -> str:
    return (f"session {setup.session_id} stream {setup.stream_id} from "
            f"{source[0]}:{source[1]}")
