"""The driver conductor: client commands, resources and timers, with no I/O of its own.

``on_command(client_key, message, now_ns)`` and ``do_work(now_ns)`` return the messages to
send as ``(client_key, message)`` pairs; the trio shell (``shell.py``) moves them over zmq and
calls ``do_work`` on its duty cycle.  Time is always an argument (monotonic ns), so the same
object runs under tests with a fake clock.

Resources per client (as Aeron's DriverConductor): publications (registrations on a shared IPC
log), subscriptions (with one position counter per image), counters it added (ADD_COUNTER).  A
client whose heartbeat counter (or any command) has not moved for ``client_liveness_timeout``
is timed out and its resources are reclaimed, so a killed subscriber stops holding back its
publishers and a killed client's counters are freed.
"""

from __future__ import annotations

import collections
import enum
import functools
import logging
import os
import random
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from slipstream.client import control
from slipstream.client.channel import (
    Channel,
    check_stream_id,
    check_subscription_keys,
    parse_channel,
)
from slipstream.client.counters import (
    CountersFile,
    CountersFullError,
    CounterType,
    SystemCounter,
    capacity_key,
)
from slipstream.client.errors import ChannelError, InvalidArgumentError
from slipstream.client.layout import INT32_MAX, INT32_MIN
from slipstream.daemon.conductor import messages
from slipstream.daemon.conductor.image_logs import LogMaking
from slipstream.daemon.conductor.ipc import IpcPublication, IpcPublicationState
from slipstream.daemon.conductor.messages import ClientMessage, Outgoing
from slipstream.daemon.conductor.network import (
    NetworkConductor,
    NetworkSubscription,
    NetworkTransports,
)
from slipstream.daemon.conductor.resources import (
    LogBudget,
    ResourceError,
    StreamInterest,
    log_start,
    make_room_for_log,
    no_room_for_log,
)
from slipstream.daemon.conductor.sharing import (
    check_same_log,
    check_same_watermarks,
    check_session_free,
)
from slipstream.daemon.conductor.untethered import tether_for
from slipstream.daemon.conductor.watch import WordWatch
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.media.names import NameCache
from slipstream.daemon.pressure.episodes import (
    EPISODE_SAMPLE_INTERVAL_NS,
    watermarks_of,
)
from slipstream.daemon.pressure.governor import (
    SAMPLE_INTERVAL_NS,
    PressureGovernor,
    is_lag_led,
    pressure_of,
)
from slipstream.daemon.protocol.params import PublicationParams

log = logging.getLogger("slipstream.driver")

@attrs.define(eq=False)
class ClientSession:
    """A connected client process."""

    client_id: int
    key: bytes
    pid: int  # for people: logs and the heartbeat counter's label
    process: int  # control.process_token(): which process it is, across pid namespaces
    time_of_last_keepalive_ns: int  # the driver's clock: a command, or the heartbeat moved
    #: CLIENT_HEARTBEAT: the client writes its monotonic ns there, on its own clock (a time
    #: namespace shifts it), so only a change of the value counts, timed by the driver.
    heartbeat_counter_id: int
    publications: dict[int, int] = attrs.Factory(dict)  # registration id -> publication id
    subscriptions: dict[int, Subscription | NetworkSubscription] = attrs.Factory(dict)
    counters: dict[int, int] = attrs.Factory(dict)  # registration id -> counter id (ADD_COUNTER)
    last_heartbeat: int = 0  # the heartbeat counter's value when last looked at


@attrs.define(eq=False)
class Subscription(StreamInterest):
    """A client's IPC subscription: the channel and stream it wants."""

    registration_id: int
    client_id: int
    client_key: bytes
    channel: Channel
    stream_id: int


class DrainPhase(enum.Enum):
    """Where a graceful stop is (:meth:`DriverConductor.begin_drain`)."""

    NONE = "serving"
    FLUSHING = "no new credit; sending and reading what the logs hold"
    ENDING = "end-of-stream sent; waiting for it to go out"


class DriverConductor:
    """Owns every resource of the driver.  Single-threaded: call it from one task only."""

    def __init__(self, settings: DriverSettings, directory: Path, counters: CountersFile,
                 *, rng: random.Random | None = None,
                 transports: NetworkTransports | None = None,
                 wake_network: Callable[[], None] = lambda: None,
                 wake_conductor: Callable[[], None] = lambda: None,
                 image_logs: LogMaking = LogMaking.INLINE,
                 name_cache: NameCache | None = None) -> None:
        """``transports`` opens UDP endpoints (None: this conductor carries IPC only);
        ``wake_network`` and ``wake_conductor`` are called (from any thread) when the network
        agents or the conductor have new work; ``image_logs``: where images' logs are made
        (a driver process: a worker thread; an embedded driver: one a cycle; the simulator:
        at once); ``name_cache``: the driver's resolver's answers, which channels' host names
        are replaced with as they are added (None: an empty one: IP literals only); ``rng``:
        the source of every random choice of the driver (None: the system's CSPRNG; the
        simulator's is seeded, so that a seeded run repeats), and itself of the secrets a
        forger must not guess (the network side draws its other choices from one seeded
        from it)."""
        self.settings = settings
        self.directory = directory
        self.counters = counters
        self._rng = rng or random.SystemRandom()
        self._next_id = self._rng.randrange(1, 1 << 40)
        self.clients: dict[int, ClientSession] = {}
        self._clients_by_key: dict[bytes, ClientSession] = {}
        self.ipc_publications: dict[int, IpcPublication] = {}  # by registration id
        self._ipc_by_stream: dict[int, IpcPublication] = {}
        #: The words each IPC publication's pass reads, watched (:class:`WordWatch`), and the
        #: publications a pass found unsettled (``IpcPublication.is_settled``): a duty cycle
        #: passes over these and those whose words changed, not over every one.
        #: Its scans are spaced (:meth:`WordWatch.look`): cycles between (commands, marks)
        #: pass over the unsettled and the marked publications.
        self._ipc_watch = WordWatch()
        self._ipc_unsettled: set[IpcPublication] = set()
        #: Indexes by stream id, so that no command looks at every stream: the IPC
        #: publications (by registration id, as made), and the IPC subscriptions.
        self._ipc_of_stream: dict[int, dict[int, IpcPublication]] = {}
        self._ipc_subscriptions_of_stream: dict[int, dict[int, Subscription]] = {}
        #: How many IPC publications use each session id (:meth:`_new_session_id`).
        self._ipc_session_ids: collections.Counter[int] = collections.Counter()
        self.budget = LogBudget(settings.log_buffer_memory_limit)
        self.network: NetworkConductor | None = None
        if transports is not None:
            self.network = NetworkConductor(
                settings=settings, directory=directory, counters=counters,
                transports=transports, budget=self.budget,
                rng=random.Random(self._rng.getrandbits(64)), token_rng=self._rng,
                new_id=self._new_id, new_session_id=self._new_session_id,
                wake_network=wake_network, wake_conductor=wake_conductor,
                image_logs=image_logs, name_cache=name_cache)
        #: The capacities a user can reach besides counters_capacity, each a CAPACITY
        #: counter by its setting (its key the setting's value), whose use the timer's cycles
        #: keep current (:meth:`_report_capacities`), for `slipstream stat` and the metrics.
        self._capacity_ids = {
            setting: counters.allocate(CounterType.CAPACITY, setting,
                                       key=capacity_key(getattr(settings, setting)))
            for setting in self._capacity_uses()}
        self._next_timer_ns = 0
        self._last_cycle_ns = 0
        self.drain_phase = DrainPhase.NONE
        #: The pressure governor (docs/BACKPRESSURE.md) over the network streams;
        #: ``network_lag_ns`` is the network threads' duty-cycle lag (the latest of their
        #: smoothed timer lateness), which the shell keeps current.  The conductor's own
        #: lateness is not the data path's: the C loops move the data while the conductor
        #: waits for the GIL.
        self.governor = PressureGovernor()
        self.network_lag_ns = 0.0
        self._next_governor_ns = 0
        self._governor_busy = (0, 0)  # NETWORK_BUSY_NS and the time, at the last sample

    def status_line(self) -> str:
        """What the driver serves, in a line (systemd's STATUS=)."""
        publications = len(self.ipc_publications)
        images = 0
        if self.network is not None:
            publications += len(self.network.publications)
            images = self.network.image_count
        subscriptions = sum(len(c.subscriptions) for c in self.clients.values())
        return (f"{len(self.clients)} clients, {publications} publications, "
                f"{subscriptions} subscriptions, {images} network images")

    # -- ids ---------------------------------------------------------------------------------
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _new_session_id(self) -> int:
        low = self.settings.publication_reserved_session_id_low
        high = self.settings.publication_reserved_session_id_high
        network = self.network
        ipc_ids = self._ipc_session_ids
        network_ids = network.used_session_ids if network is not None else ipc_ids
        in_use = len(self.ipc_publications) + (len(network.publications)
                                                if network is not None else 0)
        # Drawn from the ids outside the reserved range (the settings leave at least one):
        # [INT32_MIN, low) then (high, INT32_MAX], counted as one run of `free` ids.
        below = low - INT32_MIN
        free = below + INT32_MAX - high

        def nth_free(n: int) -> int:
            return INT32_MIN + n if n < below else high + 1 + (n - below)

        start = self._rng.randrange(free)
        # A few random draws find a free id at once unless nearly all are taken; then a walk
        # from the last draw visits at most len(used) + 1 ids.
        for _ in range(8):
            session_id = nth_free(start)
            if session_id not in ipc_ids and session_id not in network_ids:
                return session_id
            start = self._rng.randrange(free)
        for step in range(min(free, in_use + 1)):
            session_id = nth_free((start + step) % free)
            if session_id not in ipc_ids and session_id not in network_ids:
                return session_id
        raise ResourceError(
            f"no session id is free: all {free} outside the reserved range "
            f"publication_reserved_session_id_low..high ({low}..{high}) are in use; narrow "
            f"the range or give the publication session-id=")

    # -- commands ----------------------------------------------------------------------------
    def on_command(self, key: bytes, message: dict[str, Any], now_ns: int) -> Outgoing:
        """Handle one client command; returns the answers and events to send."""
        kind = message["type"]
        correlation_id = message.get("correlation_id", 0)
        if isinstance(correlation_id, bool) or not isinstance(correlation_id, int):
            correlation_id = 0
        if kind == control.CONNECT and message.get("version") != control.PROTOCOL_VERSION:
            # Before the fields: an older client's CONNECT may lack one of this version's.
            return [(key, messages.error(
                correlation_id, control.ERR_UNSUPPORTED,
                f"client protocol version {str(message.get('version'))[:32]} is not "
                f"{control.PROTOCOL_VERSION}: upgrade the client or driver"))]
        try:
            control.check_command(message)
        except InvalidArgumentError as e:
            self.counters.add(SystemCounter.ERRORS)
            log.warning("refused a malformed %.64s command: %s", kind, e)
            code = control.ERR_UNSUPPORTED if e.field == "type" else control.ERR_INVALID_ARGUMENT
            return [(key, messages.error(correlation_id, code,
                                         f"malformed {kind[:64]} command: {e}"))]
        out = self._dispatch(kind, key, message, correlation_id, now_ns)
        if out and out[0][0] == key and out[0][1].get("type") in (control.PUBLICATION_READY,
                                                                   control.SUBSCRIPTION_READY):
            # The client reads these before it returns: its call ends with its images.
            out[0][1]["images_following"] = sum(
                1 for to, event in out[1:]
                if to == key and event.get("type") == control.AVAILABLE_IMAGE)
        return out

    def _dispatch(self, kind: str, key: bytes, message: dict[str, Any], correlation_id: int,
                  now_ns: int) -> Outgoing:
        try:
            if kind == control.CONNECT:
                return self._on_connect(key, message, now_ns)
            client = self._clients_by_key.get(key)
            if client is None:
                return [(key, messages.error(correlation_id, control.ERR_UNKNOWN_CLIENT,
                                             "unknown client: connect first (or it timed out)"))]
            client.time_of_last_keepalive_ns = now_ns
            if (self.drain_phase is not DrainPhase.NONE
                    and kind in (control.ADD_PUBLICATION, control.ADD_EXCLUSIVE_PUBLICATION,
                                 control.ADD_SUBSCRIPTION)):
                return [(key, messages.error(correlation_id, control.ERR_GENERIC,
                                             "the driver is stopping (draining): no new streams"))]
            if kind in (control.ADD_PUBLICATION, control.ADD_EXCLUSIVE_PUBLICATION):
                return self._on_add_publication(
                    client, message, now_ns, exclusive=kind == control.ADD_EXCLUSIVE_PUBLICATION)
            if kind == control.REMOVE_PUBLICATION:
                return self._on_remove_publication(client, message, now_ns)
            if kind == control.ADD_SUBSCRIPTION:
                return self._on_add_subscription(client, message, now_ns)
            if kind == control.REMOVE_SUBSCRIPTION:
                return self._on_remove_subscription(client, message)
            if kind == control.ADD_COUNTER:
                return self._on_add_counter(client, message)
            if kind == control.REMOVE_COUNTER:
                return self._on_remove_counter(client, message)
            if kind == control.CLOSE_CLIENT:
                self._remove_client(client, now_ns)
                return [(key, messages.operation_success(correlation_id))]
            if kind in (control.ADD_DESTINATION, control.REMOVE_DESTINATION):
                return self._on_destination(client, message, now_ns,
                                            add=kind == control.ADD_DESTINATION)
            if kind in (control.ADD_RCV_DESTINATION, control.REMOVE_RCV_DESTINATION):
                return self._on_receive_destination(client, message,
                                                    add=kind == control.ADD_RCV_DESTINATION)
            raise AssertionError(f"check_command let {kind!r} through")
        except ChannelError as e:
            refusal = messages.error(correlation_id, control.ERR_INVALID_CHANNEL, str(e))
            refusal.update(uri=e.uri, part=e.part, problem=e.problem)
            return [(key, refusal)]
        except (ResourceError, OSError) as e:
            self.counters.add(SystemCounter.ERRORS)
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            log.error("%s failed: %s", kind, reason)
            return [(key, messages.error(correlation_id, control.ERR_RESOURCE, reason))]
        except Exception as e:  # a bug: answered and counted; the conductor serves on
            self.counters.add(SystemCounter.ERRORS)
            log.exception("%s failed on %r", kind, message)
            return [(key, messages.error(correlation_id, control.ERR_GENERIC,
                                         f"the driver failed on {kind}: {e!r}"))]

    def on_unresolved(self, key: bytes, message: dict[str, Any], reason: str, *,
                      code: str = control.ERR_INVALID_CHANNEL) -> Outgoing:
        """A command refused before it was handled: its channel names a host the resolver did
        not answer for in time, or (``code``) too many commands wait behind one that does."""
        self.counters.add(SystemCounter.ERRORS)
        correlation_id = message.get("correlation_id", 0)
        if isinstance(correlation_id, bool) or not isinstance(correlation_id, int):
            return []
        return [(key, messages.error(correlation_id, code, reason))]

    def on_malformed(self, key: bytes, error: ValueError) -> Outgoing:
        """A frame that is not a command: counted; answered when it names a correlation id
        (a JSON object whose type or values are wrong), else dropped."""
        self.counters.add(SystemCounter.ERRORS)
        correlation_id = getattr(error, "correlation_id", None)
        if correlation_id is None:
            return []
        return [(key, messages.error(correlation_id, control.ERR_INVALID_ARGUMENT,
                                     f"malformed command: {error}"))]

    def _on_connect(self, key: bytes, message: dict[str, Any], now_ns: int) -> Outgoing:
        existing = self._clients_by_key.get(key)
        if existing is not None:
            # One client per connection: a second CONNECT would leave the first one's counter
            # and resources to the liveness timeout (a loop of them exhausts the counters).
            return [(key, messages.error(
                message.get("correlation_id", 0), control.ERR_INVALID_ARGUMENT,
                f"type: this connection is client {existing.client_id} already; CONNECT once "
                f"per connection"))]
        client_id = self._new_id()
        pid = message["pid"]
        heartbeat_id = self.counters.allocate(
            CounterType.CLIENT_HEARTBEAT, f"client-heartbeat: {client_id} pid={pid}",
            registration_id=client_id, owner_id=client_id, initial_value=now_ns)
        client = ClientSession(client_id, key, pid, message["process"], now_ns, heartbeat_id,
                               last_heartbeat=now_ns)  # the counter's initial value
        self.clients[client.client_id] = client
        self._clients_by_key[key] = client
        return [(key, {
            "type": control.CONNECTED,
            "correlation_id": message.get("correlation_id", 0),
            "client_id": client.client_id,
            "counters_file": str(self.directory / control.COUNTERS_FILE),
            "client_liveness_timeout_ns": self.settings.client_liveness_timeout,
            "keepalive_interval_ns": self.settings.client_keepalive_interval,
            "heartbeat_counter_id": heartbeat_id,
            "driver_timeout_ns": self.settings.driver_timeout,
            "driver_pid": os.getpid(),
        })]

    def _on_add_publication(self, client: ClientSession, message: dict[str, Any],
                            now_ns: int, *, exclusive: bool = False) -> Outgoing:
        """A publisher: it joins the stream's shared publication, or makes it; an
        ``exclusive`` one (ADD_EXCLUSIVE_PUBLICATION, Aeron's addExclusivePublication) always
        makes a publication and log of its own, with its own session, that nobody joins."""
        correlation_id = message["correlation_id"]
        channel = _carried(parse_channel(message["channel"]), subscription=False)
        stream_id = message["stream_id"]
        check_stream_id(channel, stream_id)
        if not channel.is_ipc:
            return self._on_add_network_publication(client, correlation_id, channel, stream_id,
                                                    now_ns, exclusive=exclusive)
        publication = None if exclusive else self._ipc_by_stream.get(stream_id)
        out: Outgoing = []
        if publication is not None and publication.state is IpcPublicationState.ACTIVE:
            check_same_log(channel, publication.log, publication.session_id, stream_id)
            check_same_watermarks(channel, publication.episodes, stream_id)
        else:
            check_session_free(channel, (p.session_id for p in self._active_ipc(stream_id)),
                               stream_id)
            publication = self._create_ipc_publication(channel, stream_id, now_ns,
                                                       shared=not exclusive)
            try:
                out.extend(self._link_subscriptions(publication))
            except OSError:  # counters full: no half-linked publication stays behind
                self._close_publication(publication)
                raise
        publication.publisher_refs += 1
        registration_id = self._new_id()
        client.publications[registration_id] = publication.registration_id
        out.insert(0, (client.key, messages.publication_ready(
            correlation_id=correlation_id, registration_id=registration_id,
            original_registration_id=publication.registration_id, log_file=publication.log.path,
            session_id=publication.session_id, stream_id=stream_id,
            publisher_limit_counter_id=publication.publisher_limit_id,
            drops_counter_id=publication.drops_counter_id)))
        return out

    def _on_add_network_publication(self, client: ClientSession, correlation_id: int,
                                    channel: Channel, stream_id: int, now_ns: int, *,
                                    exclusive: bool = False) -> Outgoing:
        if self.network is None or not channel.is_udp or channel.is_spy:
            return [(client.key, _unsupported(correlation_id, channel, publication=True))]
        entry, registration_id = self.network.add_publication(client.key, channel, stream_id,
                                                              now_ns, exclusive=exclusive)
        client.publications[registration_id] = entry.registration_id
        return [(client.key, messages.publication_ready(
            correlation_id=correlation_id, registration_id=registration_id,
            original_registration_id=entry.registration_id, log_file=entry.log.path,
            session_id=entry.publication.session_id, stream_id=stream_id,
            publisher_limit_counter_id=entry.publisher_limit_id,
            drops_counter_id=entry.drops_counter_id,
            durable_counter_ids=entry.durable_counter_ids))]

    def _active_ipc(self, stream_id: int) -> list[IpcPublication]:
        """The ACTIVE IPC publications of ``stream_id``: its shared one, and its exclusive
        ones (the ones a new subscription reads)."""
        return [p for p in self._ipc_of_stream.get(stream_id, {}).values()
                if p.state is IpcPublicationState.ACTIVE]

    def _create_ipc_publication(self, channel: Channel, stream_id: int, now_ns: int, *,
                                shared: bool = True) -> IpcPublication:
        """A new IPC publication and log; ``shared``: the one later publishers of the stream
        join (not an exclusive one's)."""
        settings = self.settings
        params = PublicationParams.for_ipc(channel, settings)
        term_length = params.term_length
        registration_id = self._new_id()
        session_id = (params.session_id if params.session_id is not None
                      else self._new_session_id())
        path = self.directory / control.PUBLICATIONS_DIR / f"{registration_id}.logbuffer"
        reserved = self.budget.reserve(term_length, f"stream {stream_id} on aeron:ipc")
        try:
            # The budget counts this log already: what the others may take is the rest.
            make_room_for_log(path, reserved, self.budget.pool,
                              logs_length=self.budget.used - reserved)
            publication = IpcPublication.create(
                path=str(path),
                registration_id=registration_id, stream_id=stream_id, session_id=session_id,
                channel="aeron:ipc", counters=self.counters, term_length=term_length,
                mtu=params.mtu, term_window_length=params.term_window_length,
                unblock_timeout_ns=settings.publication_unblock_timeout,
                linger_timeout_ns=params.linger_timeout_ns,
                now_ns=now_ns, **log_start(params, self._rng), sparse=params.sparse,
                watermarks=watermarks_of(channel, settings),
                mode=settings.file_mode(clients_write=True))
        except CountersFullError:
            self.budget.release(reserved)
            raise
        except OSError as e:
            self.budget.release(reserved)
            raise no_room_for_log(path, stream_id, term_length, e) from None
        self.ipc_publications[registration_id] = publication
        self._ipc_of_stream.setdefault(stream_id, {})[registration_id] = publication
        self._ipc_session_ids[session_id] += 1
        publication.watch_words(self._ipc_watch)
        if shared:
            self._ipc_by_stream[stream_id] = publication
        # Debug, as each stream's creation: a host adding thousands of streams would log
        # thousands of lines, and the conductor's add would pay for each one.
        log.debug("created %s IPC publication %d stream=%d session=%d term_length=%d",
                 "shared" if shared else "exclusive", registration_id, stream_id, session_id,
                 term_length)
        return publication

    def _on_remove_publication(self, client: ClientSession, message: dict[str, Any],
                               now_ns: int) -> Outgoing:
        correlation_id = message["correlation_id"]
        registration_id = message["registration_id"]
        publication_id = client.publications.pop(registration_id, None)
        if publication_id is None:
            return [(client.key, messages.error(correlation_id, control.ERR_UNKNOWN_PUBLICATION,
                                                f"unknown publication {registration_id}"))]
        self._release_publication(publication_id, now_ns)
        return [(client.key, messages.operation_success(correlation_id))]

    def _on_destination(self, client: ClientSession, message: dict[str, Any], now_ns: int, *,
                        add: bool) -> Outgoing:
        """ADD_DESTINATION / REMOVE_DESTINATION: a destination of the send endpoint of one of
        the client's publications (control-mode=manual multi-destination-cast)."""
        correlation_id = message["correlation_id"]
        registration_id = message["registration_id"]
        publication_id = client.publications.get(registration_id)
        if publication_id is None:
            return [(client.key, messages.error(correlation_id, control.ERR_UNKNOWN_PUBLICATION,
                                                f"unknown publication {registration_id}"))]
        destination = parse_channel(message["channel"])
        if self.network is None or publication_id in self.ipc_publications:
            return [(client.key, messages.error(
                correlation_id, control.ERR_INVALID_ARGUMENT,
                f"publication {registration_id} is aeron:ipc: destinations belong to "
                f"aeron:udp publications of control-mode=manual"))]
        if add:
            self.network.add_destination(publication_id, destination, now_ns)
        else:
            self.network.remove_destination(publication_id, destination)
        return [(client.key, messages.operation_success(correlation_id))]

    def _on_receive_destination(self, client: ClientSession, message: dict[str, Any], *,
                                add: bool) -> Outgoing:
        """ADD_RCV_DESTINATION / REMOVE_RCV_DESTINATION: a destination of the receive
        endpoint of one of the client's subscriptions (a control-mode=manual
        multi-destination subscription)."""
        correlation_id = message["correlation_id"]
        registration_id = message["registration_id"]
        subscription = client.subscriptions.get(registration_id)
        if subscription is None:
            return [(client.key, messages.error(correlation_id, control.ERR_UNKNOWN_SUBSCRIPTION,
                                                f"unknown subscription {registration_id}"))]
        destination = parse_channel(message["channel"])
        if self.network is None or not isinstance(subscription, NetworkSubscription):
            return [(client.key, messages.error(
                correlation_id, control.ERR_INVALID_ARGUMENT,
                f"subscription {registration_id} is aeron:ipc: destinations belong to "
                f"aeron:udp subscriptions of control-mode=manual"))]
        if add:
            self.network.add_receive_destination(registration_id, destination)
        else:
            self.network.remove_receive_destination(registration_id, destination)
        return [(client.key, messages.operation_success(correlation_id))]

    def _release_publication(self, publication_id: int, now_ns: int) -> None:
        publication = self.ipc_publications.get(publication_id)
        if publication is None:
            if self.network is not None:
                self.network.release_publication(publication_id, now_ns)
            return
        publication.publisher_refs -= 1
        if publication.publisher_refs <= 0 and publication.state is IpcPublicationState.ACTIVE:
            publication.start_draining()
            if self._ipc_by_stream.get(publication.stream_id) is publication:
                del self._ipc_by_stream[publication.stream_id]

    def _on_add_subscription(self, client: ClientSession, message: dict[str, Any],
                             now_ns: int) -> Outgoing:
        correlation_id = message["correlation_id"]
        channel = _carried(parse_channel(message["channel"]), subscription=True)
        stream_id = message["stream_id"]
        check_stream_id(channel, stream_id)
        if not channel.is_ipc:
            if self.network is None or not channel.is_udp:
                return [(client.key, _unsupported(correlation_id, channel))]
            # A spy (aeron-spy:) reads this driver's publications of the channel instead.
            network_subscription = NetworkSubscription(self._new_id(), client.client_id,
                                                       client.key, channel, stream_id)
            images = self.network.add_subscription(network_subscription, now_ns)
            client.subscriptions[network_subscription.registration_id] = network_subscription
            return [(client.key, messages.subscription_ready(
                correlation_id, network_subscription.registration_id)), *images]
        subscription = Subscription(self._new_id(), client.client_id, client.key, channel,
                                    stream_id)
        out: Outgoing = [(client.key, messages.subscription_ready(
            correlation_id, subscription.registration_id))]
        # The stream's shared publication and its exclusive ones: an image of each.
        attached: list[IpcPublication] = []
        try:
            for publication in self._active_ipc(stream_id):
                if subscription.wants(publication.session_id, stream_id):
                    out.append(self._attach(publication, subscription, client))
                    attached.append(publication)
        except OSError:  # counters full: not kept, and no image of it stays behind
            for publication in attached:
                publication.remove_subscriber(subscription.registration_id)
            raise
        client.subscriptions[subscription.registration_id] = subscription
        self._ipc_subscriptions_of_stream.setdefault(stream_id, {})[
            subscription.registration_id] = subscription
        return out

    def _link_subscriptions(self, publication: IpcPublication) -> Outgoing:
        """A new publication: every matching subscription gets an image of it, client by
        client as they connected, each client's as it subscribed."""
        out: Outgoing = []
        subscriptions = sorted(
            self._ipc_subscriptions_of_stream.get(publication.stream_id, {}).values(),
            key=lambda s: (s.client_id, s.registration_id))
        for subscription in subscriptions:
            client = self.clients[subscription.client_id]
            if subscription.wants(publication.session_id, publication.stream_id):
                out.append(self._attach(publication, subscription, client))
        return out

    def _attach(self, publication: IpcPublication, subscription: Subscription,
                client: ClientSession) -> ClientMessage:
        channel = subscription.channel
        subscriber = publication.add_subscriber(
            subscription,
            f"aeron:ipc stream={publication.stream_id} session={publication.session_id} "
            f"sub={subscription.registration_id}",
            tether=tether_for(channel, self.settings, self._last_cycle_ns))
        # Credit and is_connected now, not at the next duty cycle: an offer made as soon as
        # add_subscription (or add_publication) returns finds them (it got NOT_CONNECTED).
        publication.update_limits(self._last_cycle_ns)
        return (client.key, messages.available_image(
            image_registration_id=publication.registration_id,
            subscription_registration_id=subscription.registration_id,
            session_id=publication.session_id, stream_id=publication.stream_id,
            log_file=publication.log.path,
            subscriber_position_counter_id=subscriber.counter_id,
            join_position=self.counters.get(subscriber.counter_id),
            source_identity="aeron:ipc", channel_key=None))

    def _on_add_counter(self, client: ClientSession, message: dict[str, Any]) -> Outgoing:
        """A counter the client owns (Aeron's on_add_counter): allocated here, with a new
        registration id and the client as its owner, freed by REMOVE_COUNTER or with the
        client.  Its fields were checked (type id not the driver's, label and key within
        the record: :func:`control.check_command`); a full file is ERR_RESOURCE."""
        registration_id = self._new_id()
        counter_id = self.counters.allocate(
            message["type_id"], message["label"], registration_id=registration_id,
            owner_id=client.client_id, key=bytes.fromhex(message["key"]))
        client.counters[registration_id] = counter_id
        return [(client.key, messages.counter_ready(message["correlation_id"], registration_id,
                                                    counter_id))]

    def _on_remove_counter(self, client: ClientSession, message: dict[str, Any]) -> Outgoing:
        correlation_id = message["correlation_id"]
        registration_id = message["registration_id"]
        counter_id = client.counters.pop(registration_id, None)
        if counter_id is None:  # only the client's own: another's registration is unknown here
            return [(client.key, messages.error(correlation_id, control.ERR_UNKNOWN_COUNTER,
                                                f"unknown counter {registration_id}"))]
        self.counters.free(counter_id)
        return [(client.key, messages.operation_success(correlation_id))]

    def _on_remove_subscription(self, client: ClientSession, message: dict[str, Any]) -> Outgoing:
        correlation_id = message["correlation_id"]
        registration_id = message["registration_id"]
        subscription = client.subscriptions.pop(registration_id, None)
        if subscription is None:
            return [(client.key, messages.error(correlation_id, control.ERR_UNKNOWN_SUBSCRIPTION,
                                                f"unknown subscription {registration_id}"))]
        self._detach(subscription)
        return [(client.key, messages.operation_success(correlation_id))]

    def _detach(self, subscription: Subscription | NetworkSubscription) -> None:
        if isinstance(subscription, NetworkSubscription):
            assert self.network is not None
            self.network.remove_subscription(subscription.registration_id)
            return
        of_stream = self._ipc_subscriptions_of_stream[subscription.stream_id]
        del of_stream[subscription.registration_id]
        if not of_stream:
            del self._ipc_subscriptions_of_stream[subscription.stream_id]
        for publication in list(self._ipc_of_stream.get(subscription.stream_id, {}).values()):
            publication.remove_subscriber(subscription.registration_id)

    def _remove_client(self, client: ClientSession, now_ns: int) -> None:
        for publication_id in client.publications.values():
            self._release_publication(publication_id, now_ns)
        client.publications.clear()
        for subscription in client.subscriptions.values():
            self._detach(subscription)
        client.subscriptions.clear()
        for counter_id in client.counters.values():
            self.counters.free(counter_id)
        client.counters.clear()
        self.clients.pop(client.client_id, None)
        self._clients_by_key.pop(client.key, None)
        self.counters.free(client.heartbeat_counter_id)

    # -- duty cycle --------------------------------------------------------------------------
    def do_work(self, now_ns: int) -> tuple[int, Outgoing]:
        """One duty cycle: limits, cleaning, unblocking and (every timer interval) liveness."""
        work = 0
        out: Outgoing = []
        self._last_cycle_ns = now_ns
        for publication in self._ipc_due(now_ns):
            produced = len(out)
            limit = self.counters.get(publication.publisher_limit_id)
            # Sampled against the limit the publishers had since the last cycle: right after
            # the limit moves, the depth would dip by what the subscribers read in a cycle
            # though the publishers never stopped pressing.
            for event in publication.sample_episodes(now_ns):
                out.extend(self._to_publishers(
                    publication.registration_id,
                    functools.partial(messages.back_pressure_episode, event=event)))
            passed = publication.update_limits(now_ns)
            work += passed
            # Only while publishers write (as Aeron's): a log that drains, or a driver that
            # drains, owes it in whole to every subscriber, untethered ones too; nothing is
            # held back any more.
            if (publication.state is IpcPublicationState.ACTIVE
                    and self.drain_phase is DrainPhase.NONE
                    and (publication.subscribers or publication.resting)):
                out.extend(self._check_untethered(publication, now_ns))
            if publication.is_drained():
                out.extend(self._close_publication(publication))
                work += 1
            elif (passed == 0 and len(out) == produced and publication.is_settled
                  and self.counters.get(publication.publisher_limit_id) == limit):
                # The next pass would find the same words (the limit it samples too): none
                # until one changes.
                self._ipc_unsettled.discard(publication)
            else:
                self._ipc_unsettled.add(publication)
        if self.network is not None:
            if self.network.has_events:
                network_work, network_out = self.network.do_work(now_ns)
                work += network_work
                out.extend(network_out)
                for publication_id, refusal in self.network.take_refusals():
                    out.extend(self._to_publishers(
                        publication_id,
                        functools.partial(messages.publication_refused, refusal=refusal)))
            if self.network.publications:  # sampling none would still cost a call a cycle
                for publication_id, event in self.network.sample_episodes(now_ns):
                    out.extend(self._to_publishers(
                        publication_id,
                        functools.partial(messages.back_pressure_episode, event=event)))
            # A calm governor samples on the timer's cycles too (one wake-up for both), but
            # never more often than a watched one: a short window reads a blip as busy.
            if now_ns >= self._next_governor_ns or (
                    now_ns >= self._next_timer_ns and self.governor.is_calm
                    and now_ns - self._governor_busy[1] >= SAMPLE_INTERVAL_NS):
                self._govern(now_ns)
        if now_ns >= self._next_timer_ns:
            self._next_timer_ns = now_ns + min(self.settings.timer_interval,
                                               self.settings.client_liveness_timeout // 4 or 1)
            out.extend(self._check_client_liveness(now_ns))
            self._report_capacities()
            if self.network is not None and self.drain_phase is DrainPhase.NONE:
                out.extend(self.network.check_spies(now_ns))
            if self.network is not None:
                self.network.transports.reload_keys(now_ns)
        return work, out

    def _capacity_uses(self) -> dict[str, int]:
        """The use now of each capacity this driver has, by the setting that bounds it."""
        uses = {"log_buffer_memory_limit": self.budget.used}
        if self.network is not None:
            uses.update(self.network.capacity_use())
        return uses

    def _report_capacities(self) -> None:
        """Set each capacity counter to its use now."""
        uses = self._capacity_uses()
        for setting, counter_id in self._capacity_ids.items():
            self.counters.set(counter_id, uses[setting])

    def _ipc_due(self, now_ns: int) -> list[IpcPublication]:
        """The IPC publications this cycle passes over, in the order they were made: every
        one while the driver drains; else those a pass left unsettled, those that marked a
        change of their own, and, when the watch's look is due, those whose watched words
        changed."""
        moved = self._ipc_watch.look(now_ns, scan=self.drain_phase is not DrainPhase.NONE)
        if self.drain_phase is not DrainPhase.NONE:
            return list(self.ipc_publications.values())
        due = [p for p in self._ipc_unsettled.union(moved)
               if p.state is not IpcPublicationState.DONE]
        due.sort(key=lambda p: p.registration_id)
        return due

    def _govern(self, now_ns: int) -> None:
        """One sample of the pressure governor (daemon/pressure/governor.py)."""
        assert self.network is not None
        counters = self.counters
        busy_ns, before_ns = counters.get(SystemCounter.NETWORK_BUSY_NS), self._governor_busy[0]
        elapsed_ns = now_ns - self._governor_busy[1]
        self._governor_busy = (busy_ns, now_ns)
        governor = self.governor
        self._next_governor_ns = now_ns + governor.sample_interval_ns()
        if not self.network.carries_streams and governor.step == 0:
            return
        backlog = self.network.send_backlog(deferring=governor.step >= 3)
        # The share of the time the network threads spent on work (their average).
        threads = 2 if self.settings.threading_mode == "dedicated" else 1
        busy = min(1.0, (busy_ns - before_ns) / (elapsed_ns * threads)) if elapsed_ns > 0 else 0.0
        pressure = pressure_of(backlog, self.network_lag_ns, busy)
        change = governor.sample(pressure)
        self._next_governor_ns = now_ns + governor.sample_interval_ns()
        counters.set(SystemCounter.GOVERNOR_PRESSURE, round(pressure * 1000))
        if not change:
            return
        counters.set(SystemCounter.GOVERNOR_STEP, governor.step)
        if change > 0:
            counters.add(SystemCounter.GOVERNOR_CLIMBS)
            counters.add(_STEP_COUNTERS[governor.step])
            if is_lag_led(backlog, self.network_lag_ns, busy):
                counters.add(SystemCounter.GOVERNOR_LAG_CLIMBS)
        else:
            counters.add(SystemCounter.GOVERNOR_DESCENTS)
        log.info("pressure %.2f (send backlog %.2f, cycle lag %.1f ms, busy %.2f): the governor "
                 "%s to step %d", pressure, backlog, self.network_lag_ns / 1e6, busy,
                 "climbs" if change > 0 else "descends", governor.step)
        self.network.apply_pressure_step(governor.step)

    def _check_untethered(self, publication: IpcPublication, now_ns: int) -> Outgoing:
        """Untethered subscribers left behind lose their image, with the range they skip;
        those done resting rejoin at the newest position (a new image)."""

        def relink(subscription: Subscription) -> ClientMessage | None:
            client = self.clients.get(subscription.client_id)
            if client is None or client.subscriptions.get(
                    subscription.registration_id) is not subscription:
                return None  # it went
            return self._attach(publication, subscription, client)

        return publication.check_untethered(relink, now_ns)

    def _to_publishers(self, publication_id: int,
                       message: Callable[[int], dict[str, Any]]) -> Outgoing:
        """``message(registration_id)`` to every client that publishes through
        ``publication_id``, once per publisher it added (its registration id): an episode's
        start or end, a receiver's refusal."""
        return [(client.key, message(registration_id))
                for client in self.clients.values()
                for registration_id, target in client.publications.items()
                if target == publication_id]

    def _close_publication(self, publication: IpcPublication) -> Iterable[ClientMessage]:
        out = []
        for subscriber in publication.subscribers:
            client = self.clients.get(subscriber.subscription.client_id)
            if client is not None:
                out.append((client.key, messages.unavailable_image(
                    image_registration_id=publication.registration_id,
                    subscription_registration_id=subscriber.subscription.registration_id,
                    stream_id=publication.stream_id)))
        del self.ipc_publications[publication.registration_id]
        self._unindex(publication)
        self._ipc_unsettled.discard(publication)
        if self._ipc_by_stream.get(publication.stream_id) is publication:
            del self._ipc_by_stream[publication.stream_id]
        self.budget.release(publication.log.length)
        publication.close()
        return out

    def _unindex(self, publication: IpcPublication) -> None:
        """``publication`` leaves the indexes by stream and session."""
        of_stream = self._ipc_of_stream[publication.stream_id]
        del of_stream[publication.registration_id]
        if not of_stream:
            del self._ipc_of_stream[publication.stream_id]
        self._ipc_session_ids[publication.session_id] -= 1
        if not self._ipc_session_ids[publication.session_id]:
            del self._ipc_session_ids[publication.session_id]

    def _check_client_liveness(self, now_ns: int) -> Outgoing:
        out: Outgoing = []
        timeout = self.settings.client_liveness_timeout
        for client in list(self.clients.values()):
            heartbeat = self.counters.get(client.heartbeat_counter_id)
            if heartbeat != client.last_heartbeat:
                client.last_heartbeat = heartbeat
                client.time_of_last_keepalive_ns = now_ns
            if now_ns - client.time_of_last_keepalive_ns > timeout:
                log.warning("client %d (pid %d) timed out; reclaiming its resources",
                            client.client_id, client.pid)
                self.counters.add(SystemCounter.CLIENT_TIMEOUTS)
                out.append((client.key, {"type": control.CLIENT_TIMEOUT,
                                         "client_id": client.client_id}))
                self._remove_client(client, now_ns)
        return out

    def names_due(self, now_ns: int) -> list[str]:
        """The host names in channels to resolve again now, off this thread: the runner
        resolves them and hands the answers to :meth:`on_names_resolved`
        (:meth:`NetworkConductor.names_due`)."""
        return [] if self.network is None else self.network.names_due(now_ns)

    def on_names_resolved(self, names: list[str], answers: Mapping[str, str | None]) -> None:
        """The answers for ``names`` (:meth:`names_due`): endpoints move to changed addresses."""
        if self.network is not None:
            self.network.on_names_resolved(names, answers)

    def next_deadline_ns(self) -> int:
        """When the conductor next needs a cycle even if nothing happens (ns, the clock of
        :meth:`do_work`).  Asked after every idle duty cycle: plain loops, no generators."""
        network = self.network
        # A publication cleaning behind or in an open episode is unsettled.
        ipc_publications = (self.ipc_publications.values()
                            if self.drain_phase is not DrainPhase.NONE else self._ipc_unsettled)
        for publication in ipc_publications:
            if publication.cleaner.is_behind:
                return self._last_cycle_ns  # overdue: clean the next chunk after one yield
        if network is not None and network.has_events:
            return self._last_cycle_ns
        deadline = self._next_timer_ns
        # A cycle passed without a scan of the watched words: what moved is found then.
        for owed in (self._ipc_watch.owed_scan_ns,
                     None if network is None else network.owed_episode_scan_ns):
            if owed is not None:
                deadline = min(deadline, owed)
        if network is not None and (network.carries_streams or self.governor.step):
            deadline = min(deadline, self._next_governor_ns)
        if network is not None:
            names_check = network.names.next_check_ns
            if names_check is not None:
                deadline = min(deadline, names_check)
        open_episode = network is not None and network.has_open_episode
        if not open_episode:
            for publication in ipc_publications:
                if publication.episodes.is_open:
                    open_episode = True
                    break
        if open_episode:
            # An open episode ends when the depth falls, which nothing signals: look again.
            return min(deadline, self._last_cycle_ns + EPISODE_SAMPLE_INTERVAL_NS)
        return deadline

    # -- graceful drain (pause credit, never fill a buffer: docs/DRIVER.md §6.2) -------------
    def begin_drain(self, now_ns: int) -> None:
        """Stop granting credit: every offer from now on is back-pressured.  What the logs
        already hold is still sent and read; :meth:`drain` says when that is done."""
        if self.drain_phase is not DrainPhase.NONE:
            return
        self.drain_phase = DrainPhase.FLUSHING
        for publication in self.ipc_publications.values():
            publication.stop_credit()
        if self.network is not None:
            self.network.stop_credit()
        log.info("draining: %s", self.status_line())

    def drain(self, now_ns: int, *, closing_process: int | None = None) -> bool:
        """Advance the drain; True once it is complete.  FLUSHING: until every IPC subscriber
        read its log to the end and every network publication sent its log and its live
        receivers' status messages reached the end.  Then ENDING: end-of-stream (IPC
        subscribers see it at once; network publications close and send EOS heartbeats)
        until every network publication with receivers sent one.  ``closing_process``
        (:func:`control.process_token`): an embedded driver closing inside that process,
        whose subscribers (IPC ones, and this driver's own UDP receivers) are not waited
        for: the application that would read them is the one closing.  Those of other
        processes are."""
        closing = (frozenset(c.client_id for c in self.clients.values()
                             if c.process == closing_process)
                   if closing_process is not None else None)

        def ipc_consumed() -> bool:
            return all(p.is_consumed(except_clients=closing or frozenset())
                       for p in self.ipc_publications.values())

        if self.drain_phase is DrainPhase.FLUSHING:
            if not (ipc_consumed() and (self.network is None
                                        or self.network.is_flushed(closing_clients=closing))):
                return False
            self.drain_phase = DrainPhase.ENDING
            for publication in self.ipc_publications.values():
                if publication.state is IpcPublicationState.ACTIVE:
                    publication.start_draining()
            if self.network is not None:
                self.network.end_streams()
            log.info("drained: every log sent and read; ending the streams")
        if self.drain_phase is DrainPhase.ENDING:
            # Read again: an offer that passed its limit check as the credit stopped may
            # have landed since.
            return ipc_consumed() and (self.network is None
                                       or self.network.has_ended_streams(
                                           closing_clients=closing))
        return False

    def shutdown_events(self) -> Outgoing:
        """What every client is told as the driver goes: its publications are closed and its
        subscriptions' images gone (the client raises DriverNotRunningError from then on)."""
        reason = ("the driver stopped after draining" if self.drain_phase is DrainPhase.ENDING
                  else "the driver stopped")
        return [(client.key, {"type": control.DRIVER_SHUTDOWN, "reason": reason})
                for client in self.clients.values()]

    def close(self, now_ns: int) -> None:
        """Release everything (driver shutdown)."""
        for client in list(self.clients.values()):
            self._remove_client(client, now_ns)
        for publication in list(self.ipc_publications.values()):
            self.budget.release(publication.log.length)
            publication.close()
        self.ipc_publications.clear()
        self._ipc_by_stream.clear()
        self._ipc_of_stream.clear()
        self._ipc_session_ids.clear()
        if self.network is not None:
            self.network.close(now_ns)


# The counter of each step's entries (index: the step).
_STEP_COUNTERS = (None, SystemCounter.GOVERNOR_COALESCING, SystemCounter.GOVERNOR_STATUS_WIDENED,
                  SystemCounter.GOVERNOR_LOWEST_DEFERRED, SystemCounter.GOVERNOR_LOWEST_REFUSED)

# URI parameters this driver parses (they are Aeron's) but does not act on yet: a channel that
# asks for them is refused, naming the part, rather than served without them.  Each predicate
# takes the channel and whether a subscription asks (else a publication), and says itself which
# side it refuses: a key only a subscription acts on is a publication's to ignore (the client
# warned of it).
_NOT_CARRIED_YET: tuple[tuple[str, Callable[[Channel, bool], bool], str], ...] = (
    # rejoin=false: a network image's session (daemon/media/receive_channel.py); IPC and a
    # spy have no sessions that come back over a network.
    ("rejoin", lambda c, subscription: (subscription and c.rejoin is False
                                        and (c.is_ipc or c.is_spy)),
     "rejoin=false on aeron:ipc and spies (a network subscription's: its sessions whose "
     "image went do not come back)"),
    # control-mode=manual on a subscription is a multi-destination subscription
    # (daemon/conductor/network_receive.py, add_receive_destination).
    # Response channels are aeron:udp's here (docs/CHANNELS.md §7.6); Aeron also has them
    # between IPC publications and subscriptions.
    ("control-mode", lambda c, _: c.is_response and c.is_ipc,
     "response channels on aeron:ipc (control-mode=response: slipstream carries them on "
     "aeron:udp)"),
    ("response-correlation-id", lambda c, subscription: (not subscription and c.is_ipc
                                                         and c.response_correlation_id
                                                         is not None),
     "response channels on aeron:ipc (response-correlation-id: slipstream carries them on "
     "aeron:udp)"),
    # On a publication, control= pins its socket's local address (daemon/media/udp.py); on
    # a unicast subscription it is the dynamic multi-destination-cast publication it joins
    # (daemon/media/receive_channel.py).  A spy's control= is its publication's: accepted,
    # not compared (the endpoint decides).
    # (The group is an IP literal: a name in endpoint= is resolved off this loop, later.)
    ("control", lambda c, subscription: (subscription and not c.is_spy and c.control is not None
                                         and c.endpoint is not None and c.endpoint.ip is not None
                                         and c.endpoint.ip.is_multicast),
     "control= on a multicast subscription (its control group is the endpoint's)"),
    ("tags", lambda c, _: c.channel_tag is not None,
     "channel tags (tags=: an endpoint, or a publication's session, found again by its tag)"),
    ("session-id", lambda c, _: c.session_id_tag is not None,
     "session-id=tag:N (the session of the publication tagged N)"),
)


# URI keys a spy (aeron-spy:) parses but does not act on: it has no receive socket, no image log
# of its own and no status messages, and reads the publication's log as that was made.  Asked
# for, they are refused by name, as the keys not carried yet are.  A spy acts on endpoint=,
# interface= (the send endpoint it reads), session-id=, tether= and the untethered timeouts;
# control= is accepted (its publication's), and the publication's only keys (fc=, linger=, ...:
# client/channel.py, PUBLICATION_ONLY_KEYS) are the other side's, which the client warns of.
_NOT_ON_A_SPY: tuple[tuple[str, Callable[[Channel], bool]], ...] = tuple(
    (part, lambda c, field=field: getattr(c, field) is not None)
    for part, field in (("reliable", "reliable"), ("rcv-wnd", "rcv_wnd"), ("cc", "cc"),
                        ("max-term-length", "max_term_length"),
                        ("nak-delay", "nak_delay_ns"), ("gtag", "gtag"), ("group", "group"),
                        ("rejoin", "rejoin"), ("so-rcvbuf", "so_rcvbuf"),
                        ("so-sndbuf", "so_sndbuf"), ("ttl", "ttl"),
                        ("term-length", "term_length"), ("mtu", "mtu"), ("sparse", "sparse")))


def _carried(channel: Channel, *, subscription: bool) -> Channel:
    """``channel``, or ChannelError naming a part this driver does not carry yet on the side
    that asks (``subscription``, else a publication), or that does nothing on a spy."""
    for part, asks, what in _NOT_CARRIED_YET:
        if asks(channel, subscription):
            raise ChannelError(str(channel), part, f"{what}: not supported by this driver yet")
    if subscription:
        check_subscription_keys(channel)
    if channel.is_spy:
        # A response publication sends to its one client only; a spy would read a stream
        # meant for that client alone, and a spy never sends (Aeron has no such spy either).
        for part, asked in (("control-mode", channel.is_response),
                            ("response-correlation-id",
                             channel.response_correlation_id is not None)):
            if asked:
                raise ChannelError(str(channel), part,
                                   "response channels are not spied on (a response "
                                   "publication answers one client; a spy reads, it never "
                                   "asks): leave it out")
        for part, asks_spy in _NOT_ON_A_SPY:
            if asks_spy(channel):
                raise ChannelError(
                    str(channel), part,
                    "does nothing on a spy, which reads its publication's log in place (no "
                    "socket, image log or status messages of its own): leave it out")
    return channel


def _unsupported(correlation_id: int, channel: Channel, *,
                 publication: bool = False) -> dict[str, Any]:
    what = ("a spy (aeron-spy:) only subscribes, to this driver's publications of the "
            "aeron:udp channel it names: publish on that channel" if channel.is_spy and publication
            else "this conductor carries aeron:ipc streams only (no network transports)")
    return messages.error(correlation_id, control.ERR_UNSUPPORTED, f"{channel}: {what}")
