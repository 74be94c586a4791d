"""What every driver does, whoever runs it (:class:`_DriverCore`): its command socket,
counters file, doorbells and conductor; the commands into the conductor and its answers out; the
conductor's duty cycle, its heartbeat and its pacing (:class:`ConductorPacing`).  Its two
runners are a driver process's trio shell (:mod:`slipstream.daemon.shell`) and an embedded
driver in invoker mode (:mod:`slipstream.daemon.embedded`)."""

from __future__ import annotations

import collections
import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import attrs
import zmq

from slipstream.client import control
from slipstream.client.channel import MAX_URI_LENGTH, Channel, parse_channel
from slipstream.client.counters import CountersFile, SystemCounter
from slipstream.client.errors import ChannelError
from slipstream.daemon.agents.thread import open_doorbell
from slipstream.daemon.conductor.conductor import DriverConductor, Outgoing
from slipstream.daemon.conductor.image_logs import LogMaking
from slipstream.daemon.conductor.network import NetworkConductor
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.directory import DriverDirectory
from slipstream.daemon.media import names
from slipstream.daemon.media.names import NameCache, NameResolver, ResolveNames
from slipstream.daemon.media.udp import UdpTransports

log = logging.getLogger("slipstream.driver")

ACTIVE_CYCLE_S = 0.001
IDLE_PARK_MAX_S = 1.0


class ConductorPacing:
    """When the conductor's next cycle is due without news: :data:`ACTIVE_CYCLE_S` after a
    cycle that did work, then twice as long after each idle cycle in a row, up to
    :data:`IDLE_PARK_MAX_S` (its own deadline, a command or an agent's event comes sooner).
    The daemon's trio loop and an embedded driver pace their conductor alike."""

    __slots__ = ("idle_cycles",)

    def __init__(self) -> None:
        self.idle_cycles = 0

    def delay_s(self, work: int) -> float:
        """The delay after a cycle that did ``work``, s."""
        if work:
            self.idle_cycles = 0
            return ACTIVE_CYCLE_S
        self.idle_cycles += 1
        return min(ACTIVE_CYCLE_S * (1 << min(self.idle_cycles, 10)), IDLE_PARK_MAX_S)


#: How many later commands of one client may wait behind its command that waits for names;
#: past that a command is refused (the client library waits for each answer: only a client
#: that does not comes near it).
HELD_COMMANDS_MAX = 1024


@attrs.frozen(eq=False)
class _AwaitingNames:
    """A command whose channel names ``hosts`` with no fresh answer: handled once the
    resolver answers, refused at ``deadline_s`` (monotonic) if it has not."""

    key: bytes
    message: dict[str, Any]
    channel: Channel
    hosts: tuple[str, ...]
    deadline_s: float


class _DriverCore:
    """What every driver does between its command socket, its conductor and its counters,
    whoever runs it: the trio shell of a driver process (:class:`_DriverShell`) or an embedded
    driver in invoker mode (:class:`EmbeddedDriver`).  Its methods run on the conductor's
    thread; host names are resolved by :attr:`resolver`'s threads
    (:mod:`slipstream.daemon.media.names`), whose answers :meth:`_take_names` takes."""

    def __init__(self, settings: DriverSettings) -> None:
        self.settings = settings
        self.driver_directory = DriverDirectory(settings.directory, settings.client_gid)
        self._told_clients = False
        self.doorbells: list[Any] = []
        self._opened: list[str] = []  # what _open made so far: _close closes just that
        self._exporter: Any = None  # the metrics server (metrics_address), while it serves

    def _start_metrics(self) -> None:
        """Serve the counters at ``metrics_address`` (if set) from a thread of its own."""
        endpoint = self.settings.metrics_endpoint
        if endpoint is not None:
            from slipstream.daemon.ops.metrics import metrics_url, start_exporter

            self._exporter, _ = start_exporter(self.driver_directory.path, *endpoint)
            log.info("metrics at %s", metrics_url(self._exporter))

    def _stop_metrics(self) -> None:
        if self._exporter is not None:
            self._exporter.shutdown()
            self._exporter.server_close()
            self._exporter = None

    def _open(self, *, wake_network: Callable[[], object],
              wake_conductor: Callable[[], object], image_logs: LogMaking) -> NetworkConductor:
        """The command socket (not bound yet), the counters file, the doorbells and the
        conductor over UDP transports (``image_logs``: where it makes images' logs); returns
        the conductor's network side."""
        self.context = zmq.Context()
        self._opened.append("context")
        self.sock = sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # Only processes of the driver's own user may talk to it (SO_PEERCRED): the 0700
        # directory keeps others out too, but not root, nor a directory someone opened up.
        sock.setsockopt(zmq.IPC_FILTER_UID, os.geteuid())
        directory = self.driver_directory
        if directory.group is not None:
            # And the members of client_group: libzmq admits a peer whose gid is the group's
            # or whom the group database lists as a member.
            sock.setsockopt(zmq.IPC_FILTER_GID, directory.group)
        shared_mode = directory.file_mode(clients_write=True)
        self.counters = counters = CountersFile.create(
            directory.path / control.COUNTERS_FILE, self.settings.counters_capacity, shared_mode)
        self._opened.append("counters")
        for name in (control.SENDER_DOORBELL, control.RECEIVER_DOORBELL):
            self.doorbells.append(open_doorbell(str(directory.path / name), shared_mode))
        #: The resolver's answers (the conductor thread's), and the resolver, which wakes the
        #: conductor's thread when it answered.
        self.name_cache = NameCache()
        self.resolver = NameResolver(wake_conductor)
        self._requests = itertools.count(1)
        self._awaiting_names: dict[int, _AwaitingNames] = {}  # by ResolveNames.request
        #: The later commands of each client that has a command waiting for names, in the
        #: order they came: a client's commands take effect in its order (a remove sent
        #: right after its add finds the add done).
        self._held: dict[bytes, collections.deque[dict[str, Any]]] = {}
        self._resolving_again: dict[int, str] = {}  # the host, by ResolveNames.request
        self.conductor = DriverConductor(
            self.settings, self.driver_directory.path, counters,
            transports=UdpTransports(self.settings, counters),
            wake_network=wake_network, wake_conductor=wake_conductor, image_logs=image_logs,
            name_cache=self.name_cache)
        self._opened.append("conductor")
        assert self.conductor.network is not None
        return self.conductor.network

    def _close(self) -> None:
        """What :meth:`_open` made (all of it, or as far as it came): the conductor's
        resources, the sockets, the counters."""
        opened = self._opened
        self.resolver.close()
        for doorbell in self.doorbells:
            doorbell.close()
        self.doorbells = []
        if "conductor" in opened:
            self.conductor.close(time.monotonic_ns())
        if "context" in opened:
            # The shutdown events are queued: give them a moment to reach the clients.
            self.sock.close(200 if self._told_clients else 0)
            self.context.term()
        if "counters" in opened:
            self.counters.close()
        opened.clear()

    def _bind_commands(self) -> None:
        """Bind the command socket, with the mode of every file clients write in the directory
        (zmq makes it with the process's umask, and an adopted directory may be 0755)."""
        self.sock.bind(control.conductor_endpoint(self.driver_directory.path))
        os.chmod(self.driver_directory.path / control.CONDUCTOR_SOCKET,
                 self.driver_directory.file_mode(clients_write=True))

    def _send(self, out: Outgoing) -> None:
        for key, message in out:
            try:
                self.sock.send_multipart([key, control.encode(message)], zmq.NOBLOCK)
            except zmq.ZMQError as e:  # the client is gone; its liveness timeout cleans up
                log.debug("dropping %s for a vanished client: %s", message.get("type"), e)

    def _process_commands(self) -> int:
        """Handle every waiting command; returns how many.  zmq's FD is edge-triggered and any
        send can consume the edge of a command that arrived meanwhile, so this runs after every
        send too.  Once the clients were told the driver goes it takes none; commands it
        handled are news for the conductor (:meth:`_commands_handled`)."""
        if self._told_clients:  # stopping: a task resumed after _stop_now (or close) takes none
            return 0
        sock = self.sock
        handled = 0
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart(zmq.NOBLOCK)
            handled += 1
            if len(frames) != 2:
                self.counters.add(SystemCounter.ERRORS)
                continue
            key, frame = frames
            try:
                message = control.decode(frame)
            except ValueError as e:
                log.warning("a malformed control message from a client: %s", e)
                self._send(self.conductor.on_malformed(key, e))
                continue
            held = self._held.get(key)
            if held is None:
                self._take_command(key, message)
            elif len(held) < HELD_COMMANDS_MAX:
                held.append(message)
            else:
                self._send(self.conductor.on_unresolved(
                    key, message, f"more than {HELD_COMMANDS_MAX} commands wait behind one "
                    "that waits for the names of its channel", code=control.ERR_RESOURCE))
        if handled:
            self._commands_handled()
        return handled

    def _take_command(self, key: bytes, message: dict[str, Any]) -> None:
        """Handle a client's command now, or, when its channel names a host with no fresh
        answer, once the resolver answered; the client's later commands wait behind it."""
        channel = _channel_of(message)
        if channel is not None:
            hosts = self.name_cache.unresolved(channel, time.monotonic())
            if hosts:
                self._await_names(key, message, channel, hosts)
                self._held[key] = collections.deque()
                return
        self._handle_command(key, message)

    def _release_held(self, key: bytes, unanswered: frozenset[str] = frozenset()) -> None:
        """A client's command that waited for names was handled or refused: its later
        commands are taken in order, until one of them waits for names in turn.  One naming a
        host in ``unanswered`` (the resolver just failed to answer for it in time) is refused
        at once rather than waiting as long again."""
        held = self._held.pop(key, None)
        while held:
            message = held.popleft()
            channel = _channel_of(message) if unanswered else None
            if channel is not None:
                hosts = unanswered.intersection(
                    self.name_cache.unresolved(channel, time.monotonic()))
                if hosts:
                    self._send(self.conductor.on_unresolved(
                        key, message, f"{channel}: the resolver did not answer for "
                        f"{', '.join(sorted(hosts))} within {names.PREFETCH_TIMEOUT_S:g} s"))
                    continue
            self._take_command(key, message)
            if key in self._held:
                self._held[key].extend(held)
                return

    def _commands_handled(self) -> None:
        """Commands were handled, here or after a send of the conductor's cycle: resources
        changed, so the conductor's cycle looks at once (each runner wakes it its own way: see
        the subclasses)."""
        raise NotImplementedError

    def _await_names(self, key: bytes, message: dict[str, Any], channel: Channel,
                     hosts: list[str]) -> None:
        """A command whose channel names ``hosts`` with no fresh answer: the resolver is
        asked for them, and the command waits (:meth:`_take_names`) while other clients'
        commands are served (this client's wait behind it: :meth:`_release_held`)."""
        request = next(self._requests)
        deadline_s = time.monotonic() + names.PREFETCH_TIMEOUT_S
        self._awaiting_names[request] = _AwaitingNames(key, message, channel, tuple(hosts),
                                                       deadline_s)
        self.resolver.submit(ResolveNames(request, tuple(hosts)))
        self._names_deadline(deadline_s)

    def _names_deadline(self, deadline_s: float) -> None:
        """A command waits for names until ``deadline_s`` (monotonic): the runner makes sure
        :meth:`_take_names` runs by then (see the subclasses)."""

    def _resolve_again(self, hosts: list[str]) -> None:
        """Host names of channels whose peers went silent (:meth:`DriverConductor.names_due`):
        the resolver is asked for each on its own (a slow one delays no other's answer), and
        :meth:`_take_names` hands the answers to :meth:`DriverConductor.on_names_resolved`."""
        for host in hosts:
            request = next(self._requests)
            self._resolving_again[request] = host
            self.resolver.submit(ResolveNames(request, (host,), again=True))

    def _take_names(self) -> int:
        """The resolver's answers: each command waiting for its names is handled now, each
        name resolved again goes to the conductor; a command whose names did not come within
        :data:`~slipstream.daemon.media.names.PREFETCH_TIMEOUT_S` is refused, naming them.
        Returns how many of these it handled."""
        if self._told_clients:
            return 0
        work = 0
        now_s = time.monotonic()
        for resolved in self.resolver.answered():
            work += 1
            host = self._resolving_again.pop(resolved.request, None)
            if host is not None:
                self.name_cache.store(resolved.answers, now_s, remember_failures=False)
                self.conductor.on_names_resolved(
                    [host], {name: answer.address for name, answer in resolved.answers.items()})
                continue
            # Kept even when its command was refused meanwhile: the next one finds it.
            self.name_cache.store(resolved.answers, now_s)
            waiting = self._awaiting_names.pop(resolved.request, None)
            if waiting is not None:
                self._handle_command(waiting.key, waiting.message)
                self._release_held(waiting.key)
        for request, waiting in list(self._awaiting_names.items()):
            if now_s >= waiting.deadline_s:
                del self._awaiting_names[request]
                work += 1
                self._send(self.conductor.on_unresolved(
                    waiting.key, waiting.message,
                    f"{waiting.channel}: the resolver did not answer for "
                    f"{', '.join(waiting.hosts)} within {names.PREFETCH_TIMEOUT_S:g} s"))
                self._release_held(waiting.key, frozenset(waiting.hosts))
        if work:
            self._commands_handled()
            self._process_commands()  # the sends may have taken the socket's edge
        return work

    def _handle_command(self, key: bytes, message: dict[str, Any]) -> None:
        started = time.monotonic_ns()
        out = self.conductor.on_command(key, message, started)
        # A command is conductor work as a duty cycle is (creating a log takes tens of ms):
        # the max cycle time shows it, before the client hears the answer.
        self._record_cycle_time(time.monotonic_ns() - started)
        self._send(out)

    def _record_cycle_time(self, cycle_ns: int) -> None:
        counters = self.counters
        if cycle_ns > counters.get(SystemCounter.CONDUCTOR_MAX_CYCLE_TIME_NS):
            counters.set(SystemCounter.CONDUCTOR_MAX_CYCLE_TIME_NS, cycle_ns)
        timeout_ns = self.settings.driver_timeout
        if cycle_ns > timeout_ns // 4:
            # The heartbeat's promise (four beats within driver_timeout) is broken: say so
            # where an operator looks, not only in a counter.
            log.warning("a conductor cycle took %.1f s, past driver_timeout / 4 (%.1f s); "
                        "clients deem the driver gone after driver_timeout (%.1f s) without "
                        "a heartbeat", cycle_ns / 1e9, timeout_ns / 4e9, timeout_ns / 1e9)

    def _conductor_cycle(self, started: int) -> int:
        """The conductor's duty cycle at ``started`` (monotonic ns), its messages sent, the
        heartbeat clients watch; returns the work done."""
        work, out = self.conductor.do_work(started)
        if out:
            self._send(out)
            self._process_commands()
        hosts = self.conductor.names_due(started)
        if hosts:
            self._resolve_again(hosts)
        self.counters.beat(time.time_ns())
        self.counters.add(SystemCounter.CONDUCTOR_CYCLES)
        return work


def _channel_of(message: dict[str, Any]) -> Channel | None:
    """The channel an ADD or destination command names, parsed (None for any other message,
    or one that does not parse: the conductor answers that)."""
    if message.get("type") not in (control.ADD_PUBLICATION, control.ADD_EXCLUSIVE_PUBLICATION,
                                   control.ADD_SUBSCRIPTION, control.ADD_DESTINATION,
                                   control.REMOVE_DESTINATION, control.ADD_RCV_DESTINATION,
                                   control.REMOVE_RCV_DESTINATION):
        return None
    uri = message.get("channel")
    if not isinstance(uri, str) or len(uri) > MAX_URI_LENGTH:
        return None
    try:
        return parse_channel(uri)
    except ChannelError:
        return None
