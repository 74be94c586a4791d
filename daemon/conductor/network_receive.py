"""The network side's receive half: network subscriptions, their receive endpoints, a
multi-destination subscription's destinations (``control-mode=manual``: a socket each), and
the images of the streams they receive, with each image's subscriber positions.

Owns what the conductor keeps of each receive endpoint (:class:`_ReceiveEndpointEntry`: its
subscriptions, images and destinations), image (:class:`_ImageEntry`: its log, counters and
links) and subscription (:class:`NetworkSubscription`), in the dictionaries the facade
(:class:`~slipstream.daemon.conductor.network.NetworkConductor`) hands it.  Runs on the
conductor's thread.  It asks the receiver, through the
:class:`~slipstream.daemon.agents.commands.ReceiverProxy`, to take or drop an endpoint, a
destination, an image and a subscriber's position, and which sessions each endpoint's
subscriptions want; the receiver asks it for an image (:class:`ImageRequested`), and tells it
when an image is unavailable or done, an endpoint removed and a destination failed.  Spies
(``aeron-spy:``) are :mod:`.network_spies`'; response subscriptions take their session here, as
an RSP_SETUP names it.
"""

from __future__ import annotations

import ipaddress
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from slipstream.client import control
from slipstream.client.channel import Channel, keys_given
from slipstream.client.counters import CountersFile, CountersFullError, CounterType, SystemCounter
from slipstream.client.errors import ChannelError
from slipstream.client.logbuffer import LogBuffer, compute_log_length, term_count
from slipstream.client.notices import SourceNotices
from slipstream.daemon._network import lib as network
from slipstream.daemon.agents.commands import ReceiverProxy, RemovedDestination
from slipstream.daemon.agents.endpoints import ReceiveEndpoint
from slipstream.daemon.conductor import messages
from slipstream.daemon.conductor.image_logs import ImageLogMaker, LogJob, LogMaking
from slipstream.daemon.conductor.messages import ClientMessage, Outgoing
from slipstream.daemon.conductor.network_records import (
    EndpointsByChannel,
    NetworkSubscription,
    NetworkTransports,
    _allocate_subscriber_position,
    _close_endpoint,
    _EndpointState,
    _ImageEntry,
    _is_removed_by,
    _label_of,
    _ReceiveEndpointEntry,
    _resolved,
    _start_closing,
)
from slipstream.daemon.conductor.resources import (
    LogBudget,
    ResourceError,
    discard_log,
    no_room_for_log,
)
from slipstream.daemon.conductor.sharing import (
    check_same_key,
    check_same_receive_params,
    destination_of,
    endpoint_key,
)
from slipstream.daemon.conductor.untethered import tether_for
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.flow.registry import congestion_control_for
from slipstream.daemon.media.destinations import ALL_DESTINATIONS, ControlMode
from slipstream.daemon.media.events import (
    EndpointRemoved,
    ImageDone,
    ImageMaker,
    ImageRejected,
    ImageRequested,
    ImageUnavailable,
    ReceiveDestinationFailed,
    ResponseSetupArrived,
)
from slipstream.daemon.media.names import NameCache, NameWatch
from slipstream.daemon.media.receive_channel import ReceiveChannel
from slipstream.daemon.protocol.params import SubscriptionParams
from slipstream.daemon.protocol.types import Address
from slipstream.daemon.reports.loss_report import LossReport
from slipstream.daemon.streams.image import ImagePositions
from slipstream.daemon.streams.tether import TetherablePosition

log = logging.getLogger("slipstream.driver")

#: Receiver ids of this driver's closed endpoints kept (a closing embedded driver's drain looks
#: them up): the newest this many, so that endpoint churn does not grow the set.
RECEIVER_IDS_KEPT = 1024
#: How often the images of a source at image_source_max_images are looked at for those data
#: came to since (ns): a flood's refusals cost a count, a peer's next SETUP finds the room.
HEARD_CHECK_INTERVAL_NS = 100_000_000


@attrs.define(eq=False)
class _PendingImage:
    """An image whose log is being made (a :class:`LogJob`'s request): the SETUP's event,
    its endpoint, the image's registration id, its key in ``ReceiveSide._pending``, the
    source host it is charged to, and when its sender last asked (ns)."""

    event: ImageRequested
    entry: _ReceiveEndpointEntry
    registration_id: int
    key: tuple[int, int, int]
    host: str
    last_asked_ns: int


class ReceiveSide:
    """The network subscriptions, their receive endpoints and images (see the module's
    docstring)."""

    def __init__(self, *, settings: DriverSettings, directory: Path, counters: CountersFile,
                 transports: NetworkTransports, budget: LogBudget, rng: random.Random,
                 token_rng: random.Random,
                 new_id: Callable[[], int], receiver_proxy: ReceiverProxy,
                 loss_report: LossReport,
                 receive_endpoints: dict[tuple[Any, ...], _ReceiveEndpointEntry],
                 closed_receiver_ids: dict[int, None],
                 subscriptions: dict[int, NetworkSubscription],
                 log_maker: ImageLogMaker | None = None,
                 names: NameWatch[Any] | None = None,
                 name_cache: NameCache | None = None) -> None:
        """``log_maker``: what makes the images' logs and frees them (:mod:`.image_logs`;
        None: one of its own, inline, without a pool).  ``names``: where a dynamic
        multi-destination-cast receiver's ``control=`` name is watched, resolved again while
        no image of its endpoint lives (:meth:`on_control_moved` applies an answer).
        ``name_cache``: the resolver's answers (None: one of its own, empty: IP literals
        only).  ``rng``: the receive side's random choices (NAK delays); ``token_rng``: what
        receiver ids are drawn from: a sender binds a receiver's status messages and ERRs to
        its id, so a forger must not predict the next one from ids it saw on the wire (a
        driver's is the system's CSPRNG)."""
        self.settings = settings
        self.names: NameWatch[Any] = names if names is not None else NameWatch(0)
        self.name_cache = name_cache if name_cache is not None else NameCache()
        self.directory = directory
        self.counters = counters
        self.transports = transports
        self.budget = budget
        self._rng = rng
        self._token_rng = token_rng
        self._new_id = new_id
        self.receiver_proxy = receiver_proxy
        self.loss_report = loss_report
        self._receive_endpoints = receive_endpoints
        #: The same entries by the ReceiveChannel the receiver's events name.
        self._receive_by_channel: EndpointsByChannel[_ReceiveEndpointEntry] = (
            EndpointsByChannel())
        #: Written here as an endpoint is removed, read by the drain (an ordered set).
        self._closed_receiver_ids = closed_receiver_ids
        self.subscriptions = subscriptions
        #: Makes the images' logs (off this thread in a driver process).
        self.log_maker = (log_maker if log_maker is not None
                          else ImageLogMaker(making=LogMaking.INLINE))
        #: The images whose logs are being made, by (id of their ReceiveChannel, session,
        #: stream).
        self._pending: dict[tuple[int, int, int], LogJob] = {}
        #: Each source host's images (being made, live and lingering), their logs' bytes and
        #: how many of those logs are being made.
        self._source_use: dict[str, list[int]] = {}
        #: Each source host's made images that no data or heartbeat has come to yet, by
        #: registration id: with its logs being made, what image_source_max_images bounds (a
        #: host whose streams carry data has shown it is a sender; its memory still counts).
        self._unheard: dict[str, dict[int, _ImageEntry]] = {}
        #: When each source host in ``_unheard`` may have its images looked at again (ns).
        self._heard_checks: dict[str, int] = {}
        #: Refused images are logged once per source host per interval.
        self._refusal_notices = SourceNotices()

    # -- subscriptions ------------------------------------------------------------------------
    def add_subscription(self, subscription: NetworkSubscription, now_ns: int) -> Outgoing:
        """Receive ``subscription``'s stream at its endpoint; images already there are linked
        at once (the AVAILABLE_IMAGE messages are returned).  Not a spy's (``aeron-spy:``):
        :meth:`.SpySubscriptions.add_spy`."""
        given_control = subscription.channel.control
        channel = subscription.channel = _resolved(subscription.channel, self.name_cache,
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
            check_same_key(channel, entry.endpoint.channel.channel.key,
                           entry.endpoint.channel.channel)
            existing = entry.endpoint.channel.channel.control
            moved_to = self.names.address_of(entry)
            if existing is not None and moved_to is not None:  # its name moved: it is there
                existing = attrs.evolve(existing, host=moved_to)
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
                receiver_id=self._token_rng.getrandbits(63), counters=self.counters, now_ns=now_ns,
                rng=random.Random(self._rng.getrandbits(64)))
            endpoint = ReceiveEndpoint(receive_channel, transport)
            entry = self._receive_endpoints[key] = _ReceiveEndpointEntry(
                key, endpoint, destinations_counter_id=counter_id)
            self._receive_by_channel.add(entry)
            self.receiver_proxy.on_add_endpoint(endpoint)
            if (given_control is not None and given_control.ip is None
                    and receive_channel.joins_at_control and channel.control is not None):
                # A name: the publisher it joins may move (docs/CHANNELS.md §7.2).
                watched = entry
                self.names.watch(entry, given_control.host, channel.control.host,
                                 lambda: self._in_contact(watched), now_ns)
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
                    out.append(self.link(image_entry, subscription,
                                         image_entry.image.rcv_pos, now_ns, handed_over=True))
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
                self.unlink(image_entry, link)
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
                # No session until an RSP_SETUP names one (on_response_setup); a response
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

    # -- response subscriptions (docs/CHANNELS.md §7.6) --------------------------------------
    def on_response_setup(self, event: ResponseSetupArrived) -> None:
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
        resolved = attrs.evolve(_resolved(destination, self.name_cache,
                                          self.transports.local_addresses),
                                so_rcvbuf=channel.so_rcvbuf, so_sndbuf=channel.so_sndbuf,
                                ttl=channel.ttl)
        address = destination_of(resolved, sending=False)
        if resolved.interface is not None and not ipaddress.ip_address(address[0]).is_multicast:
            raise ChannelError(uri, "interface",
                               "interface= chooses a multicast destination's interface; a "
                               "unicast destination binds its endpoint=")
        return subscription.endpoint, address, uri, resolved

    def on_destination_failed(self, event: ReceiveDestinationFailed) -> None:
        """The receiver could not read a destination's socket and dropped it: the destination
        is forgotten, unless it was removed (or added again) since."""
        failed = self._entry_of(event.channel)
        if (failed is not None
                and failed.destinations.get(event.address) == event.index):
            del failed.destinations[event.address]
            failed.sockets.pop(event.address, None)
            cell = self._destinations_cell(failed)
            if cell is not None:
                cell[0] = len(failed.destinations)

    # -- images -------------------------------------------------------------------------------
    def on_image_requested(self, event: ImageRequested, now_ns: int) -> Outgoing:
        """A SETUP asks for an image.  Unless the driver's bounds refuse it (the images
        being made, its source's images and their memory, the log budget: counted by cause,
        logged once per source per interval, and the receiver told), its log is made off
        this thread (:mod:`.image_logs`); :meth:`attach_done` makes the image (its counters)
        for the subscriptions that want the session when the log is done, hands it to the
        receiver and returns their AVAILABLE_IMAGE messages (here already, when the logs
        are made inline)."""
        entry = self._entry_of(event.channel)
        if entry is None or entry.state is not _EndpointState.OPEN:
            return []
        setup = event.setup
        if not any(s.wants(setup.session_id, setup.stream_id) for s in entry.subscriptions):
            return []
        if any(not e.lingering and e.image.session_id == setup.session_id
               and e.image.stream_id == setup.stream_id for e in entry.images.values()):
            return []  # a repeat of a request already served (the receiver asked again)
        key = (id(event.channel), setup.session_id, setup.stream_id)
        job = self._pending.get(key)
        if job is not None:  # its log is being made: the sender still asks
            job.request.last_asked_ns = now_ns
            return []
        host = event.source[0]
        length = compute_log_length(setup.term_length)
        refusal = self._bounds_refusal(host, length, now_ns)
        if refusal is not None:
            counter, reason = refusal
            self.counters.add(counter)
            self._refuse(event, reason, now_ns, error=False,
                         lasting=counter is SystemCounter.IMAGE_SOURCE_MEMORY_REFUSED)
            return []
        what = f"the image of {_label_of(setup, event.source)}"
        try:
            self.budget.reserve(setup.term_length, what)
        except ResourceError as e:
            self._refuse(event, str(e), now_ns, error=True)
            return []
        registration_id = self._new_id()
        params = entry.endpoint.channel.params
        job = LogJob(
            self.directory / control.IMAGES_DIR / f"{registration_id}.logbuffer", length,
            {"term_length": setup.term_length, "initial_term_id": setup.initial_term_id,
             "session_id": setup.session_id, "stream_id": setup.stream_id, "mtu": setup.mtu,
             "correlation_id": registration_id,
             "initial_term_count": term_count(setup.active_term_id, setup.initial_term_id),
             "initial_term_offset": setup.term_offset,
             "group": params.image_is_group(setup.is_group), "sparse": params.sparse,
             "mode": self.settings.file_mode(clients_write=True)},
            _PendingImage(event, entry, registration_id, key, host, now_ns),
            logs_length=self.budget.used - length, source=host)
        self._pending[key] = job
        self._source_use.setdefault(host, [0, 0, 0])
        self._charge(host, 1, length, pending=1)
        self.log_maker.submit(job)
        return self.attach_done(now_ns)

    def _bounds_refusal(self, host: str, length: int,
                        now_ns: int) -> tuple[SystemCounter, str] | None:
        """Which bound a new image of ``host`` with a log of ``length`` bytes would pass (its
        counter and the reason), or None."""
        settings = self.settings
        if len(self._pending) >= settings.image_pending_max:
            return (SystemCounter.IMAGE_PENDING_REFUSED,
                    f"{len(self._pending)} image logs are being made, image_pending_max "
                    f"({settings.image_pending_max})")
        _, used, pending = self._source_use.get(host, (0, 0, 0))
        # One address may hold half of the logs being made: a flood from one host leaves
        # room for the others' SETUPs.
        if pending >= max(1, settings.image_pending_max // 2):
            return (SystemCounter.IMAGE_PENDING_REFUSED,
                    f"{host} has {pending} image logs being made, half of image_pending_max "
                    f"({settings.image_pending_max})")
        limit = settings.image_source_max_images
        unheard = self._unheard.get(host)
        if (unheard is not None and pending + len(unheard) >= limit
                and now_ns >= self._heard_checks.get(host, 0)):
            # A flood at the bound is refused on the count alone until the next look.
            self._heard_checks[host] = now_ns + HEARD_CHECK_INTERVAL_NS
            self._forget_heard(host, unheard)
        unproven = pending + len(unheard or ())
        if unproven >= limit:
            return (SystemCounter.IMAGE_SOURCE_IMAGES_REFUSED,
                    f"{host} has {unproven} images here that no data came to yet, "
                    f"image_source_max_images ({limit})")
        if used + length > settings.image_source_memory_limit:
            return (SystemCounter.IMAGE_SOURCE_MEMORY_REFUSED,
                    f"image_source_memory_limit "
                    f"({settings.image_source_memory_limit / 2**20:g} MiB) reached: the logs "
                    f"of {host}'s images would take {(used + length) / 2**20:g} MiB with "
                    f"this one of {length / 2**20:g} MiB")
        return None

    def _forget_heard(self, host: str, unheard: dict[int, _ImageEntry]) -> None:
        """Take the images of ``host`` that data came to since out of ``unheard`` (its
        entry in ``_unheard``): at most image_source_max_images reads, on a SETUP that
        finds the bound reached, at most once per HEARD_CHECK_INTERVAL_NS."""
        for registration_id in [r for r, e in unheard.items() if e.image.has_been_heard]:
            del unheard[registration_id]
        if not unheard:
            del self._unheard[host]
            self._heard_checks.pop(host, None)

    def _charge(self, host: str, images: int, length: int, *, pending: int = 0) -> None:
        """Count (or with negative values, uncount) images, log bytes and logs being made
        of ``host``."""
        use = self._source_use[host]
        use[0] += images
        use[1] += length
        use[2] += pending
        if use[0] <= 0:
            del self._source_use[host]

    def _refuse(self, event: ImageRequested, reason: str, now_ns: int, *, error: bool,
                lasting: bool = True) -> None:
        """The image of ``event`` is not made: the receiver cools the session down (longer
        each time while the cause is ``lasting``; a bound on logs in the making or on unheard
        images passes as they are made or heard) and tells the sender why (an ERR frame),
        and the log says why once per source per interval (an ``error`` as every error-log
        entry is counted; a bound's refusal is counted by its cause instead)."""
        what = f"the image of {_label_of(event.setup, event.source)}"
        labelled = reason.startswith(what)
        # The sender knows its session: the ERR's few bytes go to the cause and its setting.
        answer = reason[len(what):].lstrip(": ") if labelled else reason
        self.receiver_proxy.on_reject_image(event, answer, lasting)
        if error:  # a bound's refusal is counted by its cause, the rest here
            self.counters.add(SystemCounter.IMAGES_REJECTED)
        held = self._refusal_notices.tell(event.source[0], now_ns)
        if held is None:
            return
        text = reason if labelled else f"{what}: {reason}"
        more = f" ({held} more of {event.source[0]} held back since)" if held else ""
        if error:
            self.counters.add(SystemCounter.ERRORS)
            log.error("cannot create %s%s", text, more)
        else:
            log.warning("refused %s%s", text, more)

    def attach_done(self, now_ns: int) -> Outgoing:
        """The image logs deleted since the last call give their memory back, and of those
        made since, each image still wanted is made (its
        counters, linked to the subscriptions that want it) and handed to the receiver, and
        their AVAILABLE_IMAGE messages are returned; a log no longer wanted (its endpoint or
        subscriptions went, another image of its session came, or its source stopped
        asking for image_liveness_timeout) is freed and counted; a log or counters the driver
        could not make refuse the image."""
        for gone in self.log_maker.take_gone():
            gone()
        out: Outgoing = []
        for job in self.log_maker.take_done():
            pending: _PendingImage = job.request
            del self._pending[pending.key]
            self._charge(pending.host, 0, 0, pending=-1)
            result = job.result
            if not isinstance(result, LogBuffer):
                self.budget.release(job.length)
                self._charge(pending.host, -1, -job.length)
                setup = pending.event.setup
                reason = (str(no_room_for_log(job.path, setup.stream_id, setup.term_length,
                                              result))
                          if isinstance(result, OSError) else repr(result))
                self._refuse(pending.event, reason, now_ns, error=True)
                continue
            if not self._still_wanted(pending, now_ns):
                self.counters.add(SystemCounter.IMAGE_LOGS_ABANDONED)
                self._discard(result, pending.host)
                continue
            out.extend(self._attach(pending, result, now_ns))
        return out

    def _still_wanted(self, pending: _PendingImage, now_ns: int) -> bool:
        entry = pending.entry
        setup = pending.event.setup
        if (self._receive_endpoints.get(entry.key) is not entry
                or entry.state is not _EndpointState.OPEN
                or not any(s.wants(setup.session_id, setup.stream_id)
                           for s in entry.subscriptions)):
            return False
        if any(not e.lingering and e.image.session_id == setup.session_id
               and e.image.stream_id == setup.stream_id for e in entry.images.values()):
            return False
        return now_ns - pending.last_asked_ns <= self.settings.image_liveness_timeout

    def _attach(self, pending: _PendingImage, log_buffer: LogBuffer,
                now_ns: int) -> Outgoing:
        """The image over its made ``log_buffer``: its counters, its links, handed to the
        receiver."""
        event, entry, registration_id = pending.event, pending.entry, pending.registration_id
        setup = event.setup
        channel = entry.endpoint.channel.channel
        params = entry.endpoint.channel.params
        # Congestion control's counters start at what the image's will be: none reads a 0.
        strategy = congestion_control_for(params, setup.term_length, setup.mtu, now_ns)
        indicators = zip((counter.label for counter in strategy.counters),
                         strategy.indicator_values(), strict=True)
        label = (f"{channel} stream={setup.stream_id} session={setup.session_id} "
                 f"source={event.source[0]}:{event.source[1]}")
        try:
            counter_ids = self.counters.allocate_all(
                [(CounterType.RECEIVER_HWM, "rcv-hwm"),
                 (CounterType.RECEIVER_POSITION, "rcv-pos"),
                 *((CounterType.PER_IMAGE_INDICATOR, name, value)
                   for name, value in indicators)],
                label, registration_id=registration_id, session_id=setup.session_id,
                stream_id=setup.stream_id)
        except CountersFullError as e:
            self._discard(log_buffer, pending.host)
            self._refuse(event, str(e), now_ns, error=True)
            return []
        hwm, position, *indicator_cells = (self.counters.address(i) for i in counter_ids)
        positions = ImagePositions(hwm, position, tuple(indicator_cells))
        loss_entry = self.loss_report.add(setup.session_id, setup.stream_id,
                                          f"{channel} source={event.source[0]}:"
                                          f"{event.source[1]}")
        image = event.channel.new_image(event, log_buffer, positions, now_ns, loss_entry)
        image_entry = _ImageEntry(registration_id, image, log_buffer, counter_ids, event.source)
        entry.images[id(image)] = image_entry
        self._unheard.setdefault(pending.host, {})[registration_id] = image_entry
        join = image.join_position
        out = []
        for subscription in entry.subscriptions:
            if not subscription.wants(setup.session_id, setup.stream_id):
                continue
            try:
                out.append(self.link(image_entry, subscription, join, now_ns, handed_over=False))
            except CountersFullError as e:
                log.error("cannot link subscription %d to %s: %s",
                          subscription.registration_id, _label_of(setup, event.source), e)
        self.receiver_proxy.on_add_publication_image(entry.endpoint.channel, image)
        # Debug, as a publication's creation: one line per stream at thousands of streams.
        log.debug("image %d of %s: join position %d, %d subscriber(s)", registration_id,
                 _label_of(setup, event.source), join, len(image_entry.links))
        return out

    def link(self, image_entry: _ImageEntry, subscription: NetworkSubscription,
             position: int, now_ns: int, *, handed_over: bool) -> ClientMessage:
        """A sub-pos counter for ``subscription`` on the image (and its tether, untethered,
        from ``now_ns``), and the AVAILABLE_IMAGE.  ``handed_over``: the receiver has the
        image (ask it to add the position); else the image is still this thread's."""
        image = image_entry.image
        counter_id = _allocate_subscriber_position(self.counters, subscription, image.stream_id,
                                                   image.session_id, position)
        cell = self.counters.address(counter_id)
        tether = tether_for(subscription.channel, self.settings, now_ns)
        image_entry.links.append(TetherablePosition(subscription, counter_id, cell, tether))
        if handed_over:
            self.receiver_proxy.on_add_subscriber(image, cell)
        else:
            image.add_subscriber_position(cell)  # not handed to the receiver yet
        return (subscription.client_key, messages.available_image(
            image_registration_id=image_entry.registration_id,
            subscription_registration_id=subscription.registration_id,
            session_id=image.session_id, stream_id=image.stream_id,
            log_file=image_entry.log.path, subscriber_position_counter_id=counter_id,
            join_position=position,
            source_identity=f"{image_entry.source[0]}:{image_entry.source[1]}",
            channel_key=subscription.channel.key))

    def unlink(self, image_entry: _ImageEntry,
               link: TetherablePosition[NetworkSubscription]) -> None:
        """The subscription of ``link`` stops reading the image: the receiver drops its
        position, and its counter is freed."""
        image_entry.links.remove(link)
        image, cell = image_entry.image, link.cell
        self.receiver_proxy.on_remove_subscriber(image, cell)
        self.counters.free(link.counter_id)  # reused after 1 s: a late write is harmless

    def on_image_rejected(self, event: ImageRejected) -> None:
        """The receiver refused a SETUP's image (told once per source per interval): an
        error, counted and logged."""
        self.counters.add(SystemCounter.ERRORS)  # as every error-log entry
        more = (f" ({event.held} more of {event.source[0]} held back since)" if event.held
                else "")
        log.error("refused the image of %s: %s%s",
                  _label_of(event.setup, event.source), event.reason, more)

    def on_image_unavailable(self, event: ImageUnavailable) -> Outgoing:
        """An image is no longer available (its sender went, or its liveness timed out): its
        subscriptions are unlinked and their clients told (UNAVAILABLE_IMAGE); it lingers
        until :class:`ImageDone`."""
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
            self.unlink(image_entry, link)
        return out

    def on_image_done(self, event: ImageDone) -> None:
        """The receiver let an image go: its counters and log are freed."""
        entry = self._entry_of(event.channel)
        image_entry = entry.images.pop(id(event.image), None) if entry is not None else None
        if image_entry is not None:
            self._free_image(image_entry)

    def _free_image(self, image_entry: _ImageEntry) -> None:
        host = image_entry.source[0]
        unheard = self._unheard.get(host)
        if unheard is not None:
            unheard.pop(image_entry.registration_id, None)
            if not unheard:
                del self._unheard[host]
                self._heard_checks.pop(host, None)
        for link in image_entry.links:
            self.counters.free(link.counter_id)
        image_entry.links.clear()
        for counter_id in image_entry.counter_ids:
            self.counters.free(counter_id)
        self._discard(image_entry.log, image_entry.source[0])

    def _discard(self, log_buffer: LogBuffer, host: str) -> None:
        """An image's log goes: unmapped and deleted off this thread
        (:meth:`ImageLogMaker.discard`); its memory counts, in the budget and as ``host``'s,
        until its file is gone."""
        length = log_buffer.length

        def gone() -> None:
            self.budget.release(length)
            self._charge(host, -1, -length)

        self.log_maker.discard(log_buffer, gone)

    def capacity_use(self) -> dict[str, int]:
        """The use now of the receive side's capacities, by the setting that bounds each:
        the image logs being made (``image_pending_max``), and the most of one source host's
        images no data came to yet, those being made included (``image_source_max_images``),
        and of its images' log bytes (``image_source_memory_limit``).  The unheard images
        are counted as of now; the bound itself looks again at most every
        ``HEARD_CHECK_INTERVAL_NS``, so for that long after data came to some it may refuse
        while this reads below its limit.  O(source hosts + their images that no data had
        come to at the last look)."""
        most_unheard = most_bytes = 0
        for host, (_, length, pending) in self._source_use.items():
            unheard = sum(not entry.image.has_been_heard
                          for entry in self._unheard.get(host, {}).values())
            most_unheard = max(most_unheard, pending + unheard)
            most_bytes = max(most_bytes, length)
        return {"image_pending_max": len(self._pending),
                "image_source_max_images": most_unheard,
                "image_source_memory_limit": most_bytes}

    def image_log(self, registration_id: int) -> LogBuffer | None:
        """The driver's mapping of image ``registration_id``'s log (None once it is gone),
        for a reader in this process: the simulator's subscribers read through it (a second
        mapping of every log would double what a many-host run holds)."""
        for entry in self._receive_endpoints.values():
            for image_entry in entry.images.values():
                if image_entry.registration_id == registration_id:
                    return image_entry.log
        return None

    def _entry_of(self, channel: ImageMaker) -> _ReceiveEndpointEntry | None:
        return self._receive_by_channel.get(channel)

    # -- endpoints ----------------------------------------------------------------------------
    def _close_endpoint(self, entry: _ReceiveEndpointEntry) -> None:
        """The receiver drops the endpoint; then :class:`EndpointRemoved` closes its socket
        (unless a new subscription revived it meanwhile)."""
        generation = _start_closing(entry)
        # A multi-destination subscription's destinations go with it, as a send
        # endpoint's: a subscription that revives it starts with none.
        indexes = tuple(entry.destinations.values())
        entry.destinations.clear()
        entry.sockets.clear()
        entry.removing.clear()  # their removals close them (none can take them back)
        self.receiver_proxy.on_remove_endpoint(entry.endpoint, indexes,
                                               self._destinations_cell(entry), generation)

    @staticmethod
    def _in_contact(entry: _ReceiveEndpointEntry) -> bool:
        """Whether an image of ``entry``'s endpoint lives (data came within
        ``image_liveness_timeout``)."""
        return any(not image.lingering for image in entry.images.values())

    def on_control_moved(self, entry: _ReceiveEndpointEntry, old: str, new: str) -> None:
        """A dynamic multi-destination-cast receiver's ``control=`` name resolved to ``new``
        (it joined at ``old``): its endpoint joins there from now on, and RESOLUTION_CHANGES
        counts it."""
        control = entry.endpoint.channel.channel.control
        assert control is not None
        self.receiver_proxy.on_resolution_change(entry.endpoint.channel,
                                                 (new, control.port or 0))
        self.counters.add(SystemCounter.RESOLUTION_CHANGES)
        log.info("the control address %s of receive endpoint %s resolved to %s: joining "
                 "there", old, entry.key, new)

    def on_endpoint_removed(self, event: EndpointRemoved) -> None:
        """The receiver dropped a receive endpoint: its socket closes, its counter and its
        images are freed, and its receiver id is remembered (the drain may meet it), unless a
        new subscription revived it since."""
        entry = self._entry_of(event.channel)
        if entry is None or not _is_removed_by(entry, event):
            return
        _close_endpoint(entry, self._receive_endpoints, self._receive_by_channel, self.names,
                        self.counters)
        self._closed_receiver_ids[entry.endpoint.channel.receiver_id] = None
        while len(self._closed_receiver_ids) > RECEIVER_IDS_KEPT:
            del self._closed_receiver_ids[next(iter(self._closed_receiver_ids))]
        for image_entry in entry.images.values():
            self._free_image(image_entry)
        entry.images.clear()

    def close(self) -> None:
        """Close every receive endpoint's socket and free its images and counter, and forget
        every subscription (the network thread has stopped).  Image logs still being made are
        waited for and freed; those queued are not made (their budget is given back)."""
        for job in self.log_maker.close():
            self._pending.pop(job.request.key, None)
            if isinstance(job.result, LogBuffer):
                discard_log(job.result, self.budget)
            else:
                self.budget.release(job.length)
            self._charge(job.request.host, -1, -job.length, pending=-1)
        for gone in self.log_maker.take_gone():
            gone()
        for receive_entry in self._receive_endpoints.values():
            self.names.unwatch(receive_entry)
            receive_entry.endpoint.transport.close()
            for image_entry in receive_entry.images.values():
                self._free_image(image_entry)
            if receive_entry.destinations_counter_id is not None:
                self.counters.free(receive_entry.destinations_counter_id)
        self._receive_endpoints.clear()
        self._receive_by_channel.clear()
        self.subscriptions.clear()
