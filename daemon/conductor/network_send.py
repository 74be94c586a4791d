"""The network side's send half: network publications, their send endpoints, a
multi-destination-cast endpoint's destinations (manual ones added by the client; dynamic ones
the sender learns), response publications (docs/CHANNELS.md §7.6), and what the pressure
governor samples of the publications.

Owns what the conductor keeps of each publication (:class:`_PublicationEntry`: its log, its
counters, its back-pressure episodes, its publishers) and of each send endpoint
(:class:`_SendEndpointEntry`), in the dictionaries the facade
(:class:`~slipstream.daemon.conductor.network.NetworkConductor`) hands it.  Runs on the
conductor's thread.  It asks the sender, through the
:class:`~slipstream.daemon.agents.commands.SenderProxy`, to take or drop an endpoint, a
publication and a manual destination, and the receiver, through the
:class:`~slipstream.daemon.agents.commands.ReceiverProxy`, to have a request image send
RSP_SETUP for a response publication; it frees a publication on :class:`PublicationDone` and an
endpoint on :class:`EndpointRemoved`.  A new publication's spies are linked by
:mod:`.network_spies`.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slipstream.client import control
from slipstream.client.channel import Channel, Subnet, keys_given, parse_join
from slipstream.client.counters import (
    BACK_PRESSURE_TYPES,
    CountersFile,
    CountersFullError,
    CounterType,
    SystemCounter,
)
from slipstream.client.errors import ChannelError
from slipstream.client.layout import SEALED_MTU_MAX, SEALED_OVERHEAD
from slipstream.client.logbuffer import LogBuffer
from slipstream.client.publication import PublicationRefusal
from slipstream.daemon.agents.commands import ReceiverProxy, SenderProxy
from slipstream.daemon.agents.endpoints import SendEndpoint
from slipstream.daemon.conductor.image_logs import ImageLogMaker
from slipstream.daemon.conductor.messages import Outgoing
from slipstream.daemon.conductor.network_records import (
    EndpointsByChannel,
    NetworkSubscription,
    NetworkTransports,
    _close_endpoint,
    _EndpointState,
    _ImageEntry,
    _is_removed_by,
    _label_of,
    _NamedDestination,
    _PublicationEntry,
    _ReceiveEndpointEntry,
    _resolved,
    _SendEndpointEntry,
    _start_closing,
)
from slipstream.daemon.conductor.network_spies import SpySubscriptions
from slipstream.daemon.conductor.resources import (
    LogBudget,
    ResourceError,
    create_log,
    discard_log,
    log_start,
)
from slipstream.daemon.conductor.sharing import (
    check_same_control,
    check_same_key,
    check_same_log,
    check_same_watermarks,
    check_session_free,
    destination_of,
    send_endpoint_key,
)
from slipstream.daemon.conductor.watch import WordWatch
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.flow.registry import flow_control_for
from slipstream.daemon.media.destinations import (
    ALL_DESTINATIONS,
    ControlMode,
    DestinationTable,
    ip_version_of,
    random_tokens,
)
from slipstream.daemon.media.events import (
    DestinationsSilent,
    EndpointRemoved,
    PublicationDone,
    PublicationRejected,
    RetargetFailed,
)
from slipstream.daemon.media.names import NameCache, NameWatch
from slipstream.daemon.media.send_channel import SendChannel
from slipstream.daemon.pressure.episodes import (
    BackPressureEpisodes,
    EpisodeEvent,
    LogReadings,
    watermarks_of,
)
from slipstream.daemon.protocol.params import PublicationParams
from slipstream.daemon.protocol.types import Address
from slipstream.daemon.reports.error_log import RemoteTextLimiter, escape_remote_text
from slipstream.daemon.streams.image import PublicationImage
from slipstream.daemon.streams.publication import NetworkPublication, SenderPositions

log = logging.getLogger("slipstream.driver")

#: A publication's publishers are told of its receivers' refusals (PUBLICATION_REFUSED) at
#: most once per this interval: a refused stream's receiver answers each of its SETUPs it
#: refuses, a forger as often as it likes.
REFUSAL_NOTICE_INTERVAL_NS = 1_000_000_000


class SendSide:
    """The network publications and their send endpoints (see the module's docstring)."""

    def __init__(self, *, settings: DriverSettings, directory: Path, counters: CountersFile,
                 transports: NetworkTransports, budget: LogBudget, rng: random.Random,
                 token_rng: random.Random,
                 new_id: Callable[[], int], new_session_id: Callable[[], int],
                 sender_proxy: SenderProxy, receiver_proxy: ReceiverProxy,
                 send_endpoints: dict[tuple[Any, ...], _SendEndpointEntry],
                 publications: dict[int, _PublicationEntry],
                 shared_publications: dict[tuple[Any, ...], _PublicationEntry],
                 answering: list[_PublicationEntry],
                 subscriptions: dict[int, NetworkSubscription],
                 receive_endpoints: dict[tuple[Any, ...], _ReceiveEndpointEntry],
                 spy_subscriptions: SpySubscriptions,
                 names: NameWatch[_SendEndpointEntry | _NamedDestination],
                 name_cache: NameCache,
                 log_maker: ImageLogMaker | None = None) -> None:
        """``log_maker``: where a released publication's log is zeroed for reuse or deleted,
        off this thread in a driver process (:meth:`ImageLogMaker.discard`), and its pool,
        whose kept files new logs take (None: deleted here, none kept).  ``names``: the
        unicast endpoints whose ``endpoint=`` is a host name, and the manual destinations
        added by one, resolved again while their peers are silent
        (:meth:`on_resolution_change` and :meth:`on_destination_moved` apply an answer).
        ``token_rng``: what the dynamic endpoints' validation tokens are drawn from
        (:func:`~slipstream.daemon.media.destinations.random_tokens`)."""
        self.settings = settings
        self.directory = directory
        self.counters = counters
        self.transports = transports
        self.budget = budget
        self._log_maker = log_maker
        self._rng = rng
        self._new_tokens = random_tokens(token_rng)
        self._new_id = new_id
        self._new_session_id = new_session_id
        self.sender_proxy = sender_proxy
        self.receiver_proxy = receiver_proxy
        self._send_endpoints = send_endpoints
        #: The same entries by the SendChannel the sender's events name.
        self._send_by_channel: EndpointsByChannel[_SendEndpointEntry] = EndpointsByChannel()
        self.publications = publications
        self._shared_publications = shared_publications
        self._answering = answering
        #: Read only: a request publication names a response subscription, a response
        #: publication a request image (_check_response_keys).
        self.subscriptions = subscriptions
        self._receive_endpoints = receive_endpoints
        self._spy_subscriptions = spy_subscriptions
        #: The words each publication's episodes are sampled from (:meth:`sample_episodes`),
        #: watched, with each one's slots; and the publications in an open episode, sampled
        #: every cycle.  The others are sampled only when a word moved: the same inputs
        #: again would answer nothing.
        self._episode_watch = WordWatch()
        self._episode_slots: dict[int, list[int]] = {}
        self._episodes_open: set[_PublicationEntry] = set()
        #: The publications the governor's next send backlog looks at (:meth:`send_backlog`):
        #: those whose watched words moved since its last look (the episodes' watch), and
        #: those with data not yet sent then.  Any other has none: its log's end and snd-pos
        #: are as they were, with nothing between them.
        self._backlog_due: set[_PublicationEntry] = set()
        #: The publications the last :meth:`send_backlog` looked at.
        self.backlog_streams_visited = 0
        #: How many publications use each session id.
        self.session_ids: collections.Counter[int] = collections.Counter()
        #: How much of the text receivers send (ERR reasons) reaches the log.
        self._remote_text = RemoteTextLimiter()
        #: Each publication's entry, by the publication object (its id): the sender's events
        #: name the object.
        self._entries: dict[int, _PublicationEntry] = {}
        self.names = names
        #: The resolver's answers, which channels' names are replaced with as they are added.
        self.name_cache = name_cache

    # -- publications and their send endpoints ------------------------------------------------
    def add_publication(self, client_key: bytes, channel: Channel, stream_id: int,
                        now_ns: int, *, exclusive: bool = False) -> tuple[_PublicationEntry, int]:
        """A publisher of ``stream_id`` on ``channel``: shares the publication of the same
        endpoint, stream and session, or makes one; an ``exclusive`` one always makes a
        publication of its own (its own session and log, which nobody joins).  Returns it and
        the registration id of this publisher."""
        given = channel.endpoint
        channel = _resolved(channel, self.name_cache, self.transports.local_addresses)
        destination = destination_of(channel)
        #: A unicast endpoint= given as a name: its peer may move (a pod rescheduled).
        name = (given.host if given is not None and given.ip is None
                and destination != ALL_DESTINATIONS and not channel.is_multicast else None)
        request_image = self._check_response_keys(channel)
        # Publications with another response-correlation-id share nothing (Aeron's
        # findPublication): each answers, or asks on behalf of, its own.
        key = (send_endpoint_key(channel, destination), stream_id, channel.session_id,
               channel.response_correlation_id)
        entry = None if exclusive else self._shared_publications.get(key)
        if entry is None:
            check_session_free(channel, (e.publication.session_id
                                         for e in self.publications.values()
                                         if e.key[:2] == key[:2] and not e.closing), stream_id)
            entry = self._create_publication(key, channel, stream_id, destination, now_ns,
                                             shared=not exclusive, name=name)
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

    def _create_publication(self, key: tuple[Any, ...], channel: Channel, stream_id: int,
                            destination: Address, now_ns: int, *, shared: bool = True,
                            name: str | None = None) -> _PublicationEntry:
        """A new publication on its endpoint; ``shared``: the one later publishers of its
        key join (not an exclusive one's); ``name``: the host name ``destination`` was
        resolved from (its endpoint resolves it again when its peer goes silent)."""
        params = PublicationParams.for_network(channel, self.settings)  # before a socket
        if channel.key is not None and params.mtu > SEALED_MTU_MAX:
            # The URI's mtu= is checked as it is parsed; the setting's is checked here.
            raise ChannelError(str(channel), "mtu",
                               f"{params.mtu} (mtu_length) leaves no room for the "
                               f"{SEALED_OVERHEAD} bytes sealing adds to each datagram of an "
                               f"encrypted channel: give mtu= of at most {SEALED_MTU_MAX}")
        endpoint = self._send_endpoint(key[0], channel, destination)
        if name is not None and self.names.address_of(endpoint) is None:
            self.names.watch(endpoint, name, destination[0],
                             lambda: self._in_contact(endpoint), now_ns)
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
        # A dense log's pages are mapped in place on the log worker, not here: the answer
        # and the SETUP need not wait for them.
        behind = self._log_maker is not None and self._log_maker.populates_behind
        log_buffer = create_log(
            path, self.budget, f"stream {stream_id} on {channel}",
            self._log_maker.pool if self._log_maker is not None else None,
            term_length=term_length, session_id=session_id, stream_id=stream_id,
            mtu=params.mtu, correlation_id=registration_id,
            term_window_length=params.term_window_length, group=params.group,
            linger_timeout_ns=params.linger_timeout_ns, sparse=params.sparse,
            # The driver's view of a sparse log is read by the sender (faults that map 16
            # pages each) and cleaned behind it: no pages mapped up front on this thread.
            populate=False if params.sparse else None, behind=behind,
            mode=settings.file_mode(clients_write=True), **log_start(params, self._rng))
        if behind and log_buffer.unpopulated:  # a new sparse log has none to map
            assert self._log_maker is not None
            self._log_maker.populate_behind(log_buffer)
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
            if params.durable is not None:
                kinds.append((CounterType.PUBLISHER_DURABLE, "pub-durable"))
                kinds.append((CounterType.DURABLE_RECEIVERS, "durable-rcv"))
            kinds.extend(BACK_PRESSURE_TYPES)
            counter_ids = self.counters.allocate_all(
                kinds, label, registration_id=registration_id, session_id=session_id,
                stream_id=stream_id)
        except CountersFullError:
            discard_log(log_buffer, self.budget)
            raise
        cells = {kind: self.counters.address(counter_id)
                 for (kind, _), counter_id in zip(kinds, counter_ids, strict=True)}
        positions = SenderPositions(
            cells[CounterType.PUBLISHER_LIMIT], cells[CounterType.SENDER_POSITION],
            cells[CounterType.SENDER_LIMIT], cells.get(CounterType.SENDER_RATE_LIMIT),
            cells.get(CounterType.FC_RECEIVERS), cells.get(CounterType.PUBLISHER_DURABLE),
            cells.get(CounterType.DURABLE_RECEIVERS))
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
                                  LogReadings(log_buffer, cells[CounterType.PUBLISHER_LIMIT]),
                                  durable_counter_ids=_durable_ids(kinds, counter_ids))
        endpoint.publications += 1
        self.publications[registration_id] = entry
        self._entries[id(publication)] = entry
        self.session_ids[publication.session_id] += 1
        self._watch_episode_words(entry)
        if shared:
            self._shared_publications[key] = entry
        self.sender_proxy.on_add_publication(endpoint.endpoint, publication)
        # After the publication: the sender runs the commands in order.
        self._spy_subscriptions.link_spies(entry, now_ns)
        # Debug, as the IPC publication's creation (DriverConductor._create_ipc_publication).
        log.debug("created %s network publication %d %s stream=%d session=%d term_length=%d",
                 "shared" if shared else "exclusive", registration_id, channel, stream_id,
                 session_id, term_length)
        return entry

    def _send_endpoint(self, key: tuple[Any, ...], channel: Channel,
                       destination: Address) -> _SendEndpointEntry:
        entry = self._send_endpoints.get(key)
        join = self._join_of(channel)
        if entry is not None:
            table = entry.endpoint.channel.destinations
            if table is not None and table.mode is ControlMode.DYNAMIC and table.join != join:
                raise ChannelError(str(channel), "join",
                                   "differs from the join= of the other publications of its "
                                   "control address, which share one endpoint and one list "
                                   "of who may join")
            check_same_key(channel, entry.channel.key, entry.channel)
            if entry.state is _EndpointState.CLOSING:  # revive it: the removal is undone
                entry.state = _EndpointState.OPEN
                self.sender_proxy.on_add_endpoint(entry.endpoint)
            return entry
        counter_id = destinations = None
        if destination == ALL_DESTINATIONS and not channel.is_response:
            counter_id = self.counters.allocate(CounterType.MDC_DESTINATIONS,
                                                f"mdc-destinations: {channel}")
            destinations = DestinationTable(
                ControlMode(channel.control_mode), ip_version=ip_version_of(channel),
                count_cell=self.counters.address(counter_id), join=join,
                max_candidates=self.settings.mdc_candidates_max,
                validation_timeout_ns=self.settings.mdc_validation_timeout,
                token_source=self._new_tokens)
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
        entry = self._send_endpoints[key] = _SendEndpointEntry(key, endpoint, channel,
                                                               destinations_counter_id=counter_id)
        self._send_by_channel.add(entry)
        self.sender_proxy.on_add_endpoint(endpoint)
        return entry

    def _join_of(self, channel: Channel) -> tuple[Subnet, ...]:
        """Who may join a dynamic endpoint: the channel's ``join=``, else the ``mdc_join``
        setting's subnets (none: anyone)."""
        if channel.control_mode != ControlMode.DYNAMIC.value:
            return ()
        if channel.join is not None:
            return channel.join
        return parse_join(self.settings.mdc_join) if self.settings.mdc_join else ()

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
        self._spy_subscriptions.drop_spies_left_behind(entry)
        publication = entry.publication
        self.sender_proxy.on_close_publication(publication)

    def on_publication_done(self, event: PublicationDone) -> Outgoing:
        """A publication is done (the sender let it go): its spies' images end, its counters and
        log are freed, and its endpoint closes if it was the last there."""
        entry = self._entries.pop(id(event.publication), None)
        if entry is None:
            return []
        # Any spies left (none once it lingered).
        out = self._spy_subscriptions.on_spies_released(event.publication)
        del self.publications[entry.registration_id]
        self._forget_episode_words(entry)
        self.session_ids[entry.publication.session_id] -= 1
        if not self.session_ids[entry.publication.session_id]:
            del self.session_ids[entry.publication.session_id]
        if self._shared_publications.get(entry.key) is entry:
            del self._shared_publications[entry.key]
        for counter_id in entry.counter_ids:
            self.counters.free(counter_id)
        self._discard(entry.log)
        endpoint_entry = entry.endpoint
        endpoint_entry.publications -= 1
        if endpoint_entry.publications == 0:
            self._close_endpoint(endpoint_entry)
        return out

    def on_publication_rejected(self, event: PublicationRejected,
                                now_ns: int) -> list[tuple[int, PublicationRefusal]]:
        """A receiver refused a publication's image: an error, counted and logged, its
        reason (text the remote host chose) escaped and cut, at most
        REMOTE_LINES_PER_INTERVAL lines per host per REMOTE_INTERVAL_NS; the lines past
        that count REMOTE_TEXT_SUPPRESSED_DROPS.  Returns the refusal its publishers are to
        be told of, with the publication's registration id: the last of the event's, at
        most one per publication per REFUSAL_NOTICE_INTERVAL_NS.  The event's ``unkept``
        refusals (their text was not kept) count as errors and refusals too."""
        last = None
        if event.unkept:
            self.counters.add(SystemCounter.ERRORS, event.unkept)
        for (host, port), reason in event.rejections:
            self.counters.add(SystemCounter.ERRORS)
            text = escape_remote_text(reason)
            last = (f"{host}:{port}", text)
            if not self._remote_text.allow(host, now_ns):
                self.counters.add(SystemCounter.REMOTE_TEXT_SUPPRESSED_DROPS)
                continue
            log.error("the receiver at %s:%d refused the image of session %d "
                      "stream %d: %s", host, port, event.publication.session_id,
                      event.publication.stream_id, text)
        entry = self._entries.get(id(event.publication))
        if entry is None or last is None:
            return []
        entry.refusals += len(event.rejections) + event.unkept
        if now_ns < entry.refusal_told_ns + REFUSAL_NOTICE_INTERVAL_NS:
            return []
        entry.refusal_told_ns = now_ns
        return [(entry.registration_id, PublicationRefusal(*last, now_ns, entry.refusals))]

    def _close_endpoint(self, entry: _SendEndpointEntry) -> None:
        """The sender drops the endpoint; then :class:`EndpointRemoved` closes its socket
        (unless a new publication revived it meanwhile)."""
        generation = _start_closing(entry)
        # Its destinations go with it: a publication that revives it starts with none,
        # as on a new endpoint.
        entry.manual_destinations.clear()
        for named in entry.named_destinations.values():
            self.names.unwatch(named)
        entry.named_destinations.clear()
        entry.silent_destinations = frozenset()
        self.sender_proxy.on_remove_endpoint(entry.endpoint, generation)

    def _in_contact(self, endpoint: _SendEndpointEntry) -> bool:
        """Whether a publication of ``endpoint`` is connected (a status message came within
        ``publication_connection_timeout``: its log's flag, which the sender keeps)."""
        return any(e.log.is_connected for e in self.publications.values()
                   if e.endpoint is endpoint and not e.closing)

    def on_resolution_change(self, endpoint: _SendEndpointEntry, old: str, new: str) -> None:
        """The name of ``endpoint``'s peer resolved to ``new`` (it sent to ``old``): the
        sender connects its socket there (its publications' SETUP, heartbeats and data go
        there from the next duty cycle), the endpoint is found by its new address from now
        on, and RESOLUTION_CHANGES counts it (docs/CHANNELS.md §7.2)."""
        ((_, port), interface), sealing = endpoint.key
        address: Address = (new, port)
        self.sender_proxy.on_resolution_change(endpoint.endpoint, address)
        if old == new:  # the move to it did not take before (on_retarget_failed): again
            log.debug("the send endpoint %s:%d connects to %s again", old, port, new)
            return
        self.counters.add(SystemCounter.RESOLUTION_CHANGES)
        log.info("the peer of send endpoint %s:%d resolved to %s: sending there", old, port,
                 new)
        new_key = ((address, interface), sealing)
        if new_key in self._send_endpoints or endpoint.state is not _EndpointState.OPEN:
            return  # another endpoint sends there already: channels naming it find that one
        del self._send_endpoints[endpoint.key]
        endpoint.key = new_key
        self._send_endpoints[new_key] = endpoint
        for entry in self.publications.values():
            if entry.endpoint is endpoint:
                shared = self._shared_publications.get(entry.key) is entry
                if shared:
                    del self._shared_publications[entry.key]
                entry.key = (new_key, *entry.key[1:])
                if shared:
                    self._shared_publications[entry.key] = entry

    def on_retarget_failed(self, event: RetargetFailed) -> None:
        """The sender could not move the endpoint to ``event.address`` (its socket sends to
        the old peer still; the failure is logged and counted where it happened): its name is
        asked again at the next check, and the answer applied even if it is that address."""
        entry = self._send_by_channel.get(event.channel)
        if entry is not None:
            self.names.retry(entry, event.address[0])

    def check_destinations(self) -> None:
        """Ask the sender which destinations of the manual endpoints with named ones went
        silent (no status message within ``publication_connection_timeout``); its answer
        (:meth:`on_destinations_silent`) is what the next check of the names goes by."""
        for entry in self._send_endpoints.values():
            if entry.named_destinations and entry.state is _EndpointState.OPEN:
                self.sender_proxy.on_check_destinations(
                    entry.endpoint.channel, self.settings.publication_connection_timeout)

    def on_destinations_silent(self, event: DestinationsSilent) -> None:
        entry = self._send_by_channel.get(event.channel)
        if entry is not None:
            entry.silent_destinations = event.addresses

    def on_destination_moved(self, named: _NamedDestination, old: str, new: str) -> None:
        """The name of a manual destination resolved to ``new`` (it was sent to at ``old``):
        the endpoint sends to the new address in its place (the sender's table: removed,
        then added, in one pass), and RESOLUTION_CHANGES counts it (docs/CHANNELS.md §7.4)."""
        endpoint = named.endpoint
        uri = endpoint.manual_destinations.pop(named.address, None)
        if uri is None or endpoint.state is not _EndpointState.OPEN:
            return
        del endpoint.named_destinations[named.address]
        channel = endpoint.endpoint.channel
        self.sender_proxy.on_remove_destination(channel, named.address)
        address: Address = (new, named.address[1])
        self.counters.add(SystemCounter.RESOLUTION_CHANGES)
        if address in endpoint.manual_destinations:
            # Another destination is there already: one from now on, that one's (removing
            # either by its URI removes it).
            self.names.unwatch(named)
            log.info("destination %s of %s resolved to %s, a destination already: one now",
                     uri, endpoint.key, new)
            return
        endpoint.manual_destinations[address] = uri
        self.sender_proxy.on_add_destination(channel, address)
        named.address = address
        endpoint.named_destinations[address] = named
        log.info("destination %s of %s resolved to %s: sending there", uri, endpoint.key, new)

    def on_endpoint_removed(self, event: EndpointRemoved) -> None:
        """The sender dropped a send endpoint: its socket closes and its counter is freed,
        unless a new publication revived it since."""
        entry = self._send_by_channel.get(event.channel)
        if entry is None or not _is_removed_by(entry, event):
            return
        _close_endpoint(entry, self._send_endpoints, self._send_by_channel, self.names,
                        self.counters)

    # -- response channels (docs/CHANNELS.md §7.6) -------------------------------------------
    def _check_response_keys(self, channel: Channel) -> _ImageEntry | None:
        """A publication's response keys, checked before anything is made (Aeron's
        validateResponseSubscription and findResponsePublicationImage): a response
        publication (``control-mode=response``) names its control address and a request
        image of this driver that asked for responses, and gets that image; a request
        publication (``response-correlation-id=`` alone) names a response subscription of
        this driver.  ChannelError names the key at fault."""
        correlation_id = channel.response_correlation_id
        if not channel.is_response:
            if correlation_id is None:
                return None
            responses = next((s for s in self.subscriptions.values()
                              if s.registration_id == correlation_id and s.channel.is_response),
                             None)
            if responses is None:
                raise ChannelError(
                    str(channel), "response-correlation-id",
                    f"{correlation_id} is not the registration id of a response subscription "
                    f"(control-mode=response) of this driver: add that subscription first "
                    f"and give its registration_id")
            _check_response_key(channel, responses.channel.key, "its response subscription",
                                responses.channel)
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
        image_entry, request_channel = next(
            ((e, endpoint.endpoint.channel.channel) for endpoint in self._receive_endpoints.values()
             for e in endpoint.images.values() if e.registration_id == correlation_id),
            (None, None))
        if image_entry is None or request_channel is None or image_entry.lingering:
            raise ChannelError(str(channel), "response-correlation-id",
                               f"{correlation_id} names no image of this driver (it has gone, "
                               f"its client with it, or never was): answer an image while it "
                               f"is available")
        if not image_entry.image.wants_response:
            what = _label_of(image_entry.image, image_entry.source)
            raise ChannelError(str(channel), "response-correlation-id",
                               f"image {correlation_id} ({what}) did not ask for responses: "
                               f"its publication has no response-correlation-id")
        _check_response_key(channel, request_channel.key, "the request stream it answers",
                            request_channel)
        return image_entry

    def _start_response_setup(self, entry: _PublicationEntry, image_entry: _ImageEntry) -> None:
        """The request image tells its client's driver the new response publication's session
        (RSP_SETUP) until that publication is connected."""
        image, session_id = image_entry.image, entry.publication.session_id
        entry.response_image = image
        self._answering.append(entry)
        self.receiver_proxy.on_set_response_session(image, session_id)

    def check_response_connections(self) -> None:
        """A response publication connected (its log says so): its request image stops
        sending RSP_SETUP (Aeron's responseConnected); so does one whose publication closes."""
        if not self._answering:
            return
        for entry in [e for e in self._answering if e.log.is_connected or e.closing]:
            self._answering.remove(entry)
            image, entry.response_image = entry.response_image, None
            if image is not None:
                self.receiver_proxy.on_set_response_session(image, None)

    def forget_response_image(self, image: PublicationImage) -> None:
        """A request image went (unavailable, or done): a response publication made for it
        that is not connected yet is no longer pending (:meth:`check_response_connections`);
        the image sends no RSP_SETUP past ACTIVE/DRAINING, and the conductor holds it no more."""
        for entry in [e for e in self._answering if e.response_image is image]:
            self._answering.remove(entry)
            entry.response_image = None

    # -- multi-destination-cast -----------------------------------------------------------------
    def add_destination(self, publication_id: int, destination: Channel, now_ns: int) -> None:
        """Publication ``publication_id``'s endpoint sends to ``destination``
        (``aeron:udp?endpoint=HOST:PORT``) too; ChannelError names what it refuses."""
        given = destination.endpoint
        endpoint, address, uri = self._manual_destination(publication_id, destination)
        if address in endpoint.manual_destinations:
            raise ChannelError(uri, "endpoint",
                               f"{address[0]}:{address[1]} is a destination of "
                               f"{self.publications[publication_id].channel} already")
        endpoint.manual_destinations[address] = uri
        channel = endpoint.endpoint.channel
        assert channel.destinations is not None
        self.sender_proxy.on_add_destination(channel, address)
        if given is not None and given.ip is None:  # a name: it may move (§7.4)
            named = _NamedDestination(endpoint, address, given.host)
            endpoint.named_destinations[address] = named
            self.names.watch(named, given.host, address[0],
                             lambda: named.address not in endpoint.silent_destinations,
                             now_ns)
        log.info("added destination %s:%d to %s", address[0], address[1], endpoint.key)

    def remove_destination(self, publication_id: int, destination: Channel) -> None:
        """Publication ``publication_id``'s endpoint no longer sends to ``destination``;
        ChannelError when it was not one.  One added by name is found by its name, wherever
        the name took it since."""
        endpoint, address, uri = self._named_destination(publication_id, destination) or \
            self._manual_destination(publication_id, destination)
        if endpoint.manual_destinations.pop(address, None) is None:
            raise ChannelError(uri, "endpoint",
                               f"{address[0]}:{address[1]} is not a destination of this "
                               f"channel: nothing to remove")
        named = endpoint.named_destinations.pop(address, None)
        if named is not None:
            self.names.unwatch(named)
        channel = endpoint.endpoint.channel
        assert channel.destinations is not None
        self.sender_proxy.on_remove_destination(channel, address)
        log.info("removed destination %s:%d from %s", address[0], address[1], endpoint.key)

    def _named_destination(self, publication_id: int, destination: Channel
                           ) -> tuple[_SendEndpointEntry, Address, str] | None:
        """The endpoint and address of the destination added as ``destination``'s
        ``endpoint=NAME:PORT``, if one was (None: look it up by address)."""
        given = destination.endpoint
        entry = self.publications.get(publication_id)
        if given is None or given.ip is not None or entry is None:
            return None
        for named in entry.endpoint.named_destinations.values():
            if named.name == given.host and named.address[1] == given.port:
                return entry.endpoint, named.address, str(destination)
        return None

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
        destination = _resolved(destination, self.name_cache,
                                self.transports.local_addresses)
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

    # -- what the pressure governor samples ---------------------------------------------------
    def send_backlog(self, *, deferring: bool) -> float:
        """The governor's send backlog: of each publication, the data its flow control lets it
        send but the sender has not sent, as a share of what flow control lets it send; the
        largest (0 without publications: a sender that keeps up leaves next to nothing).  A
        publication counts only while the sender could send it something (its next frame fits
        in the window: a subscriber that stopped reading leaves a rest shorter than a frame,
        which is no backlog); one whose data waits on purpose does not count: one paced by
        its send-rate limit (``rc=``), and with ``deferring`` one of the lowest band.  (Its
        ``c`` belongs to the sender's thread: words read across threads, a sample's worth.)
        It looks at the publications that may have one alone (``_backlog_due``): an idle
        stream costs it nothing."""
        backlog = 0.0
        due, self._backlog_due = self._backlog_due, set()
        self.backlog_streams_visited = len(due)
        for entry in due:
            if entry.registration_id not in self._episode_slots:
                continue  # it went
            publication = entry.publication
            if entry.log.producer_position() <= publication.sender_position:
                continue  # all sent: none until a watched word moves
            self._backlog_due.add(entry)
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
    def has_open_episode(self) -> bool:
        """Whether a publication is in a back-pressure episode."""
        return bool(self._episodes_open)

    @property
    def owed_episode_scan_ns(self) -> int | None:
        """When the scan of the episodes' words that a sample went without is due (ns);
        None when none is owed (:meth:`WordWatch.look`)."""
        return self._episode_watch.owed_scan_ns

    def sample_episodes(self, now_ns: int) -> list[tuple[int, EpisodeEvent]]:
        """Each publication's back-pressure episodes that began or ended since the last
        sample, with the publication's registration id: those in an open episode and those
        whose words moved (or new), in the order they were made."""
        moved = self._episode_watch.look(now_ns)
        self._backlog_due.update(moved)
        due = [entry for entry in self._episodes_open.union(moved)
               if entry.registration_id in self._episode_slots]
        due.sort(key=lambda entry: entry.registration_id)
        events: list[tuple[int, EpisodeEvent]] = []
        for entry in due:
            for event in entry.episodes.sample(
                    now_ns, *entry.readings.read(),
                    window_start=entry.publication.sender_position):
                events.append((entry.registration_id, event))
            if entry.episodes.is_open:
                self._episodes_open.add(entry)
            else:
                self._episodes_open.discard(entry)
        return events

    def _discard(self, log_buffer: LogBuffer) -> None:
        """A released publication's log goes (:meth:`ImageLogMaker.discard`: kept for reuse
        or deleted); its memory counts in the budget until then."""
        if self._log_maker is None:
            discard_log(log_buffer, self.budget)
            return
        length = log_buffer.length
        self._log_maker.discard(log_buffer, lambda: self.budget.release(length))

    def _watch_episode_words(self, entry: _PublicationEntry) -> None:
        """Sample ``entry``'s episodes when a word they are read from moves (and at the next
        sample: it has none yet).  Its snd-pos (the window's start) is the counter the C half
        publishes with the cell ``sender_position`` reads."""
        watch = self._episode_watch
        words = [*entry.readings.words(), entry.publication.positions.sender_position]
        self._episode_slots[entry.registration_id] = [watch.watch(word, entry) for word in words]
        watch.mark(entry)

    def _forget_episode_words(self, entry: _PublicationEntry) -> None:
        for slot in self._episode_slots.pop(entry.registration_id, ()):
            self._episode_watch.forget(slot)
        self._episodes_open.discard(entry)

    # -- closing ------------------------------------------------------------------------------
    def free_publications(self) -> None:
        """Free every publication's counters (its spies' too) and log (the network thread has
        stopped)."""
        for entry in list(self.publications.values()):
            self._forget_episode_words(entry)
            for counter_id in [*entry.counter_ids, *(link.counter_id for link in entry.spies)]:
                self.counters.free(counter_id)
            discard_log(entry.log, self.budget)
        self.publications.clear()
        self._entries.clear()
        self.session_ids.clear()
        self._shared_publications.clear()

    def close_endpoints(self) -> None:
        """Close every send endpoint's socket and free its counter (the network thread has
        stopped)."""
        for send_entry in self._send_endpoints.values():
            self.names.unwatch(send_entry)
            send_entry.endpoint.transport.close()
            if send_entry.destinations_counter_id is not None:
                self.counters.free(send_entry.destinations_counter_id)
        self._send_endpoints.clear()
        self._send_by_channel.clear()


def _durable_ids(kinds: list[tuple[CounterType, str]],
                 counter_ids: list[int]) -> tuple[int, int] | None:
    """(pub-durable, durable-rcv) of a durable= publication's counters, None without."""
    ids = {kind: counter_id for (kind, _), counter_id in zip(kinds, counter_ids, strict=True)}
    if CounterType.PUBLISHER_DURABLE not in ids:
        return None
    return ids[CounterType.PUBLISHER_DURABLE], ids[CounterType.DURABLE_RECEIVERS]


def _check_response_key(channel: Channel, other_key: str | None, other: str,
                        other_channel: Channel) -> None:
    """A request stream and its responses carry the same ``key=`` (or none): the answers to
    an encrypted request are as protected as the request, and a plain request gets no
    encrypted answer it could not have asked for.  ChannelError names ``key``."""
    if channel.key == other_key:
        return
    mine = "none" if channel.key is None else channel.key
    theirs = "plain" if other_key is None else f"encrypted with key {other_key}"
    raise ChannelError(str(channel), "key",
                       f"{mine} differs from {other}'s ({theirs}, {other_channel}): a request "
                       f"and its responses carry the same key=, so that the answers to an "
                       f"encrypted request are encrypted too")
