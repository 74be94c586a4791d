"""Simulated hosts: the driver's own network stack on a virtual network, and the applications.

Each host incarnation runs a :class:`SimDriver`: the real
:class:`~slipstream.daemon.conductor.conductor.DriverConductor` (client commands, logs, counters,
image creation) with the real :class:`~slipstream.daemon.agents.sender.Sender` and
:class:`~slipstream.daemon.agents.receiver.Receiver` agents, in a directory of its own with a real
counters file; only the transports are virtual (:mod:`slipstream.sim.transport`).  Every
simulator run therefore tests the driver's code, and there is one place for each rule.

The applications talk to their driver as a client does (the control commands, the log and
counter files it names):

* :class:`PublisherHost`: one publication; the C appender (``ss_offer``) appends numbered
  messages as fast as the publisher limit allows (or at a set rate);
* :class:`SubscriberHost`: one subscription; one client
  :class:`~slipstream.client.image.Image` reader per image, on its ``sub-pos`` counter.

A *service pass* of a host runs the applications, then the driver's duty cycles (sender,
receiver, conductor) until they report no work, and arms a timer at the earliest deadline.
Arriving datagrams queue at the transports and schedule a pass at the same instant.

A crash drops the host off the network and discards its driver (directory, logs, counters);
a restart builds a fresh one (new session id, receiver id and logs), as a restarted driver
would.

Message format (``size`` bytes, >= 12): ``publisher_id:u32 seq:u32`` at the start, ``seq:u32``
again in the last 4 bytes (to catch torn or misplaced data), zeros between.
"""

from __future__ import annotations

import math
import random
import shutil
import struct
from pathlib import Path
from typing import Any, Final, Protocol

from slipstream.client import control
from slipstream.client._native import ffi, lib
from slipstream.client.counters import CountersFile, SystemCounter
from slipstream.client.image import Image
from slipstream.client.layout import NO_DEADLINE, PARTITION_COUNT
from slipstream.client.logbuffer import LogBuffer, new_appender
from slipstream.client.publication import ADMIN_ACTION, BACK_PRESSURED, NOT_CONNECTED
from slipstream.daemon.conductor.conductor import DriverConductor
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.protocol.types import Address
from slipstream.daemon.streams.publication import NetworkPublication
from slipstream.sim.events import PHASE_SERVICE, EventLoop, Timer
from slipstream.sim.network import Network
from slipstream.sim.scenario import Scenario, host_ip
from slipstream.sim.transport import VirtualTransports


class World(Protocol):
    """What the hosts use of the simulation they run in
    (:class:`~slipstream.sim.runner.Simulation`, which makes them): its event loop, network,
    scenario and seed, the driver settings, the directory the drivers' directories are made
    in, and the publishing host."""

    loop: EventLoop
    network: Network
    scenario: Scenario
    seed: int
    settings: DriverSettings
    directory: Path
    publisher: PublisherHost


MESSAGE_HEADER: Final = struct.Struct("<II")  # publisher id, sequence number
MESSAGE_TRAILER: Final = struct.Struct("<I")  # the sequence number again, in the last 4 bytes
_unpack_header = MESSAGE_HEADER.unpack_from  # bound once: they run once per message delivered
_unpack_trailer = MESSAGE_TRAILER.unpack_from
#: Messages per subscriber poll (the client's fragment limit).
POLL_LIMIT: Final = 4096
#: Duty cycles in one service pass before it yields to other hosts at the same instant.
MAX_CYCLES_PER_PASS: Final = 64
#: Service passes at one virtual instant before the host is declared stuck (a core bug:
#: ``next_deadline_ns() <= now`` forever).
MAX_PASSES_AT_ONE_INSTANT: Final = 100_000
#: Counter slots of a simulated driver (a few streams each).
SIM_COUNTERS_CAPACITY: Final = 256
_APP_KEY: Final = b"simulated-application"




class CommandRefusedError(RuntimeError):
    """The simulated driver refused an application's command (a scenario's channel it does
    not take, full counters): ``answer`` is its ERROR reply (None: no answer)."""

    def __init__(self, message: dict[str, Any], answer: dict[str, Any] | None) -> None:
        self.command = message
        self.answer = answer
        detail = answer.get("message", answer) if answer is not None else "no answer"
        super().__init__(f"the simulated driver refused {message.get('type')} of "
                         f"{message.get('channel', '')!r}: {detail}")


class SimulationStuck(RuntimeError):
    """A host kept asking to be serviced at the same virtual instant (a livelock)."""


class SimDriver:
    """One host incarnation's media driver, with its one application client connected.

    ``command(message)`` is the control plane as a client sees it: the answer to a command
    (an ERROR raises), while events for the client (images) go to ``on_message``.
    """

    def __init__(self, host: SimHost, directory: Path, settings: DriverSettings,
                 rng: random.Random, on_message: Any) -> None:
        directory.mkdir()
        (directory / control.PUBLICATIONS_DIR).mkdir()
        (directory / control.IMAGES_DIR).mkdir()
        self.directory = directory
        self.counters = CountersFile.create(directory / control.COUNTERS_FILE,
                                            SIM_COUNTERS_CAPACITY)
        self.transports = VirtualTransports(host)
        self.conductor = DriverConductor(settings, directory, self.counters, rng=rng,
                                         transports=self.transports)
        network = self.conductor.network
        assert network is not None
        self.network = network
        self._on_message = on_message
        self._now_ns = host.sim.loop.now_ns
        self._heartbeat_ns: int | None = None  # what the keepalive cell last got
        self._sender_work = network.sender.do_work
        self._receiver_work = network.receiver.do_work
        self._conductor_work = self.conductor.do_work
        reply = self.command({"type": control.CONNECT, "version": control.PROTOCOL_VERSION,
                              "pid": 0, "process": 0})
        self._heartbeat = self.counters.address(reply["heartbeat_counter_id"])

    def command(self, message: dict[str, Any]) -> dict[str, Any]:
        message.setdefault("correlation_id", 1)
        answer: dict[str, Any] | None = None
        for _key, reply in self.conductor.on_command(_APP_KEY, message, self._now_ns):
            if answer is None and reply.get("correlation_id") == message["correlation_id"] \
                    and reply["type"] not in (control.AVAILABLE_IMAGE,
                                              control.UNAVAILABLE_IMAGE):
                answer = reply
            else:
                self._on_message(reply)
        if answer is None or answer["type"] == control.ERROR:
            raise CommandRefusedError(message, answer)
        return answer

    def do_work(self, now_ns: int) -> int:
        """One duty cycle of each agent and the conductor at ``now_ns`` (virtual ns); returns
        the work done (0: idle)."""
        self._now_ns = now_ns
        if now_ns != self._heartbeat_ns:  # the client's keepalive, once per instant
            self._heartbeat_ns = now_ns
            lib.ss_store_release_i64(self._heartbeat, now_ns)
        work = self._sender_work(now_ns) + self._receiver_work(now_ns)
        conductor_work, out = self._conductor_work(now_ns)
        hosts = self.conductor.names_due(now_ns)
        if hosts:  # simulated hosts never move: a name keeps the address it was added with
            self.conductor.on_names_resolved(hosts, {})
        if out:
            for _key, message in out:
                self._on_message(message)
            work += len(out)
        return work + conductor_work

    def next_deadline_ns(self) -> int:
        return min(self.network.sender.next_deadline_ns(),
                   self.network.receiver.next_deadline_ns(),
                   self.conductor.next_deadline_ns())

    def close(self) -> None:
        """Everything goes: transports, logs, counters, the directory."""
        self.conductor.close(self._now_ns)
        self.counters.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class SubscriberStats:
    """What one subscriber host received, across its incarnations."""

    def __init__(self, messages: int) -> None:
        self._capacity = messages
        self.seen: dict[int, bytearray] = {}  # publisher id -> 1 per sequence number seen
        self.first_seq: dict[int, int] = {}  # publisher id -> lowest sequence number seen
        self.highest: dict[int, int] = {}
        self.delivered = 0
        self.delivered_bytes = 0
        self.duplicates = 0
        self.out_of_order = 0
        self.corrupt = 0
        #: Sequence numbers from here on are expected: the publisher's next one when this
        #: subscriber host first came up (a late joiner does not miss what came before).
        self.expected_from = 0
        #: The longest virtual time between two deliveries (ns), and the last delivery.
        self.longest_gap_ns = 0
        self.last_delivery_ns: int | None = None

    def note_deliveries(self, now_ns: int) -> None:
        """Messages were delivered at ``now_ns``: the gap since the last delivery counts."""
        if self.last_delivery_ns is not None:
            self.longest_gap_ns = max(self.longest_gap_ns, now_ns - self.last_delivery_ns)
        self.last_delivery_ns = now_ns

    def on_message(self, data: memoryview, _header: object) -> None:
        """The subscriber's fragment handler (one call per whole message)."""
        pid, seq = _unpack_header(data)
        length = len(data)
        if seq >= self._capacity or _unpack_trailer(data, length - 4)[0] != seq:
            self.corrupt += 1
            return
        seen = self.seen.get(pid)
        if seen is None:
            seen = self.seen[pid] = bytearray(self._capacity)
            self.first_seq[pid] = seq
            self.highest[pid] = seq
        if seen[seq]:
            self.duplicates += 1
            return
        seen[seq] = 1
        self.delivered += 1
        self.delivered_bytes += length
        if seq < self.highest[pid]:
            self.out_of_order += 1
            if seq < self.first_seq[pid]:
                self.first_seq[pid] = seq
        else:
            self.highest[pid] = seq

    def joined_late(self, publishers: list[tuple[int, int, int]]) -> int:
        """Of :meth:`missing`, the messages before the first one this subscriber got of each
        publisher: it joined the stream after them (a lost SETUP, a crash), it did not lose
        them once joined."""
        late = 0
        for pid, first, end in publishers:
            start = max(first, self.expected_from)
            got_first = self.first_seq.get(pid, end)
            late += max(0, min(got_first, end) - start)
        return late

    def missing(self, publishers: list[tuple[int, int, int]]) -> int:
        """Messages not received of the ``(publisher id, first seq, end seq)`` ranges, from
        :attr:`expected_from` (what was appended once this subscriber host first came up)."""
        missing = 0
        for pid, first, end in publishers:
            start = max(first, self.expected_from)
            if end <= start:
                continue
            seen = self.seen.get(pid)
            missing += (end - start) - (sum(seen[start:end]) if seen is not None else 0)
        return missing


class _FrameProbe:
    """Whether a reader has something to read: a committed frame (length > 0) at its
    position, the first word its poll looks at (``ss_term_read`` stops at a length <= 0, and
    the poll then returns 0 and moves nothing).  Valid while the log is mapped, as the
    reader itself."""

    __slots__ = ("_bits", "_mask", "_reader", "_term_words", "_words")

    def __init__(self, log: LogBuffer, reader: Image) -> None:
        self._reader = reader
        self._words = ffi.cast("int32_t *", log.address)
        self._term_words = log.term_length >> 2
        self._mask = log.term_length - 1
        self._bits = log.position_bits

    def ready(self) -> bool:
        """A frame starts at the reader's position."""
        position = self._reader.position
        return self._words[((position >> self._bits) % PARTITION_COUNT) * self._term_words
                           + ((position & self._mask) >> 2)] > 0


class SimHost:
    """One machine: address, up/down, a driver, service passes and timers.  Subclasses add the
    application."""

    def __init__(self, sim: World, index: int) -> None:
        self.sim = sim
        self.index = index
        self.ip = host_ip(index)
        self.up = False
        self.incarnation = 0
        self.driver: SimDriver | None = None
        #: System counters summed over the incarnations that ended (see :meth:`counters`).
        self._past_counters: dict[str, int] = {}
        self._timer: Timer | None = None
        self._service_scheduled = False
        self._last_service_ns = -1
        self._passes_at_instant = 0

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Boot (or reboot) with a fresh driver."""
        if self.up:
            return
        self.incarnation += 1
        self.up = True
        self.sim.network.set_up(self.ip, True)
        self.driver = SimDriver(self, self.sim.directory / f"host{self.index}-{self.incarnation}",
                                self.sim.settings, self.rng("driver"), self._on_message)
        self._start()
        self.wake()

    def crash(self) -> None:
        """Lose everything: off the network, the driver and its logs gone."""
        if not self.up:
            return
        self.up = False
        self.sim.network.set_up(self.ip, False)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._stop()
        self.close_driver()

    def close_driver(self) -> None:
        driver = self.driver
        if driver is None:
            return
        for name, value in self._system_counters(driver).items():
            self._past_counters[name] = self._past_counters.get(name, 0) + value
        self.driver = None
        driver.close()

    @staticmethod
    def _system_counters(driver: SimDriver) -> dict[str, int]:
        return {c.name: driver.counters.get(c) for c in SystemCounter if driver.counters.get(c)}

    def counters(self) -> dict[str, int]:
        """This host's system counters (Aeron's), summed over its incarnations."""
        totals = dict(self._past_counters)
        if self.driver is not None:
            for name, value in self._system_counters(self.driver).items():
                totals[name] = totals.get(name, 0) + value
        return dict(sorted(totals.items()))

    def counter(self, counter: SystemCounter) -> int:
        return self.counters().get(counter.name, 0)

    def rng(self, purpose: str) -> random.Random:
        """A generator for this host incarnation, derived from the simulation seed."""
        return random.Random(f"{self.sim.seed}/host{self.index}/{self.incarnation}/{purpose}")

    # -- service ----------------------------------------------------------------------------
    def wake(self) -> None:
        """Schedule a service pass at the current instant, after its other inputs."""
        if not self._service_scheduled and self.up:
            self._service_scheduled = True
            self.sim.loop.call_at(self.sim.loop.now_ns, self._service, PHASE_SERVICE)

    def _on_timer(self) -> None:
        self._timer = None
        self._service_scheduled = True
        self._service()

    def _service(self) -> None:
        self._service_scheduled = False
        if not self.up:
            return
        now = self.sim.loop.now_ns
        if now == self._last_service_ns:
            self._passes_at_instant += 1
            if self._passes_at_instant > MAX_PASSES_AT_ONE_INSTANT:
                raise SimulationStuck(f"host {self.ip} keeps being due at t={now} ns: {self!r}")
        else:
            self._last_service_ns = now
            self._passes_at_instant = 0
        driver = self.driver
        assert driver is not None
        app_work = self._work
        driver_work = driver.do_work
        deadline = now
        for _ in range(MAX_CYCLES_PER_PASS):
            if app_work(now) + driver_work(now):
                deadline = now  # another cycle follows, whatever the deadlines say
                continue
            # Asked only after an idle cycle: after a busy one they decide nothing, and they
            # cost a third of a cycle.
            deadline = min(driver.next_deadline_ns(), self._deadline(now))
            if deadline > now:
                break
        self._arm(deadline)

    def _arm(self, deadline: int) -> None:
        timer = self._timer
        if timer is not None:
            if timer.time_ns == deadline and not timer.cancelled:
                return
            timer.cancel()
            self._timer = None
        if deadline < NO_DEADLINE:
            self._timer = self.sim.loop.call_at(deadline, self._on_timer, PHASE_SERVICE)

    # -- application hooks --------------------------------------------------------------------
    def _start(self) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError

    def _on_message(self, message: dict[str, Any]) -> None:
        """An event from the driver to the application (images)."""

    def _work(self, now_ns: int) -> int:
        raise NotImplementedError

    def _deadline(self, now_ns: int) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        state = "up" if self.up else "down"
        return f"<{type(self).__name__} {self.ip} {state} incarnation={self.incarnation}>"


class PublisherHost(SimHost):
    """Host 1: one publication, one publisher appending numbered messages."""

    def __init__(self, sim: World, index: int) -> None:
        super().__init__(sim, index)
        self.log: LogBuffer | None = None
        self.uri = sim.scenario.channel_uri(index)
        #: ``(publisher id, first seq, end seq)`` per incarnation: what each one appended.
        self.ranges: list[list[int]] = []
        self.blocked = 0  # offers refused (back pressure / not connected)
        self._registration_id = 0
        self._publication_registration_id = 0
        self._limit: Any = None
        self._appender: Any = None
        self._message = bytearray(sim.scenario.size)
        self._message_c = ffi.from_buffer(self._message)
        self._blocked_at_limit: int | None = None
        self._start_ns = 0
        self._rate_timer: Timer | None = None

    @property
    def next_seq(self) -> int:
        return self.ranges[-1][2] if self.ranges else 0

    @property
    def finished(self) -> bool:
        """Every message of the scenario has been appended."""
        return self.next_seq >= self.sim.scenario.messages

    @property
    def publication(self) -> NetworkPublication | None:
        """The driver's sender state of the stream (None while the host is down)."""
        if self.driver is None:
            return None
        entry = self.driver.network.publications.get(self._registration_id)
        return entry.publication if entry is not None else None

    @property
    def source(self) -> Address | None:
        """The address the publication's datagrams come from."""
        if self.driver is None or not self.driver.transports.send_transports:
            return None
        return self.driver.transports.send_transports[0].address

    def _start(self) -> None:
        assert self.driver is not None
        reply = self.driver.command({"type": control.ADD_PUBLICATION, "channel": self.uri,
                                     "stream_id": self.sim.scenario.stream_id})
        self._registration_id = reply["original_registration_id"]
        # This publisher's registration id, as its client has it.
        self._publication_registration_id = reply["registration_id"]
        for destination in self.sim.scenario.destinations(self.index):
            self.destination(control.ADD_DESTINATION, destination)
        self.log = LogBuffer(reply["log_file"])
        self._limit = self.driver.counters.address(reply["publication_limit_counter_id"])
        self._appender = new_appender(self.log, self._limit)
        self.ranges.append([self.incarnation, self.next_seq, self.next_seq])
        self._blocked_at_limit = None
        self._start_ns = self.sim.loop.now_ns

    def destination(self, command: str, uri: str) -> None:
        """``ADD_DESTINATION`` or ``REMOVE_DESTINATION`` of ``uri`` for the publication (a
        ``control-mode=manual`` one), as its application's ``add_destination`` and
        ``remove_destination`` send them; a refusal raises :class:`CommandRefusedError`."""
        assert self.driver is not None, "the publisher host is down"
        self.driver.command({"type": command, "registration_id": self._publication_registration_id,
                             "channel": uri})

    def _stop(self) -> None:
        self._appender = None
        if self.log is not None:
            self.log.close()
            self.log = None
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None

    # -- the publisher application ----------------------------------------------------------
    def _allowed_end(self, now_ns: int) -> int:
        """Sequence number the publisher may reach by ``now_ns`` (publish_rate): one message
        at the incarnation's start, then one every 1e9/rate virtual ns."""
        total = self.sim.scenario.messages
        rate = self.sim.scenario.publish_rate
        if rate <= 0:
            return total
        first = self.ranges[-1][1]
        return min(total, first + 1 + int((now_ns - self._start_ns) * rate / 1e9))

    def _arm_rate_timer(self, seq: int, now_ns: int) -> None:
        """With a publish_rate, wake the publisher when it may offer ``seq``: the first
        virtual ns (after ``now_ns``) at which :meth:`_allowed_end` exceeds ``seq``."""
        rate = self.sim.scenario.publish_rate
        if rate <= 0 or seq >= self.sim.scenario.messages or self._rate_timer is not None:
            return
        due_messages = seq - self.ranges[-1][1]  # messages after the first one at the start
        # Rounded up, and past any float rounding of _allowed_end's product: a timer a
        # nanosecond early finds nothing allowed yet, and the next offer would wait for
        # whatever else wakes the host (a 100 ms heartbeat), then burst.
        after_start = math.ceil(due_messages * 1e9 / rate)
        while int(after_start * rate / 1e9) < due_messages:
            after_start += 1
        self._rate_timer = self.sim.loop.call_at(max(self._start_ns + after_start, now_ns + 1),
                                                 self._on_rate_timer)

    def _work(self, now_ns: int) -> int:
        """Offer what the limit allows; returns the messages appended."""
        rng_range = self.ranges[-1]
        end = self._allowed_end(now_ns)
        seq = first = rng_range[2]
        if seq >= end:
            # Not due yet (a pass for the driver's work): a timer must still say when.
            self._arm_rate_timer(seq, now_ns)
            return 0
        limit = self._limit[0]
        if self._blocked_at_limit is not None and self._blocked_at_limit == limit:
            return 0
        self._blocked_at_limit = None
        message = self._message
        message_c = self._message_c
        appender = self._appender
        size = len(message)
        pid = self.incarnation
        header = MESSAGE_HEADER.pack_into
        trailer = MESSAGE_TRAILER.pack_into
        offer = lib.ss_offer
        while seq < end:
            header(message, 0, pid, seq)
            trailer(message, size - 4, seq)
            result = offer(appender, message_c, size)
            if result > 0:
                seq += 1
            elif result == ADMIN_ACTION:
                continue
            elif result in (BACK_PRESSURED, NOT_CONNECTED):
                self.blocked += 1
                self._blocked_at_limit = limit
                break
            else:
                raise RuntimeError(f"offer failed with {result} at seq {seq}")
        rng_range[2] = seq
        if seq >= end:
            self._arm_rate_timer(seq, now_ns)
        return seq - first

    @property
    def publisher_limit(self) -> int:
        """The pub-lmt cell the appender checks (bytes)."""
        return self._limit[0]

    def offer_once(self) -> int:
        """Offer the next message once, outside the normal flow; the raw ``ss_offer`` result
        (a position, or NOT_CONNECTED / BACK_PRESSURED / ADMIN_ACTION / ...)."""
        seq = self.next_seq
        MESSAGE_HEADER.pack_into(self._message, 0, self.incarnation, seq)
        MESSAGE_TRAILER.pack_into(self._message, len(self._message) - 4, seq)
        result = lib.ss_offer(self._appender, self._message_c, len(self._message))
        if result > 0:
            self.ranges[-1][2] = seq + 1
        return result

    def _on_rate_timer(self) -> None:
        self._rate_timer = None
        self.wake()

    def _deadline(self, now_ns: int) -> int:
        if (self._blocked_at_limit is not None and self._limit[0] != self._blocked_at_limit
                and self.next_seq < self._allowed_end(now_ns)):
            return now_ns  # credit arrived: offer again
        return NO_DEADLINE


class SubscriberHost(SimHost):
    """Hosts 2..N: one subscription, one reader per image, statistics of what arrived.  The
    subscriber reads everything it can, or ``read_rate`` messages per virtual second (the
    scenario's ``[[subscriber]]``), and not at all while paused (a ``pause`` event)."""

    def __init__(self, sim: World, index: int) -> None:
        super().__init__(sim, index)
        self.stats = SubscriberStats(sim.scenario.messages)
        self.uri = sim.scenario.channel_uri(index)
        #: session id -> (image registration id, client reader, position cell)
        self.readers: dict[int, tuple[int, Image, Any]] = {}
        #: session id -> the image's :class:`_FrameProbe` (what the reader would find next).
        self._probes: dict[int, _FrameProbe] = {}
        self.images_seen = 0
        self.images_lost = 0  # UNAVAILABLE_IMAGE events
        self.unavailable_at_ns: list[int] = []
        #: Stream positions (from, to) an image lost because it was left behind.
        self.lost_ranges: list[tuple[int, int]] = []
        #: Per image, by (the host's incarnation, its correlation id): its session, join
        #: position and when it came (virtual s); and per entry of ``lost_ranges``, the image
        #: that went with it, its session and when (sim/report.py's ``rejoins``).
        self.joins: dict[tuple[int, int], tuple[int, int, float]] = {}
        self.left: list[tuple[tuple[int, int], int, float]] = []
        self.read_rate = sim.scenario.read_rate(index)
        self._registration_id = 0
        self._read_start_ns: int | None = None
        self._read_count = 0
        self._rate_bound = False  # the last pass stopped at read_rate, not for lack of data
        self._paused_until_ns = 0

    def pause_until(self, end_ns: int) -> None:
        """The subscriber stops reading until ``end_ns`` (virtual); the driver goes on.  A
        subscriber with a read rate earns no reading for the pause."""
        if self._read_start_ns is not None:
            self._read_start_ns += max(0, end_ns - max(self.sim.loop.now_ns,
                                                       self._paused_until_ns))
        self._paused_until_ns = end_ns
        self.sim.loop.call_at(end_ns, self.wake)

    def _start(self) -> None:
        if self.incarnation == 1:
            self.stats.expected_from = self.sim.publisher.next_seq
        assert self.driver is not None
        reply = self.driver.command({"type": control.ADD_SUBSCRIPTION, "channel": self.uri,
                                     "stream_id": self.sim.scenario.stream_id})
        self._registration_id = reply["registration_id"]
        for destination in self.sim.scenario.destinations(self.index):
            self.destination(control.ADD_RCV_DESTINATION, destination)

    def destination(self, command: str, uri: str) -> None:
        """``ADD_RCV_DESTINATION`` or ``REMOVE_RCV_DESTINATION`` of ``uri`` for the
        subscription (a ``control-mode=manual`` one), as its application's
        ``add_destination`` and ``remove_destination`` send them; a refusal raises
        :class:`CommandRefusedError`."""
        assert self.driver is not None, f"subscriber host {self.ip} is down"
        self.driver.command({"type": command, "registration_id": self._registration_id,
                             "channel": uri})

    def _stop(self) -> None:
        for _registration_id, reader, _cell in self.readers.values():
            reader.close()
        self.readers = {}
        self._probes = {}

    def _on_message(self, message: dict[str, Any]) -> None:
        if message["type"] == control.AVAILABLE_IMAGE:
            assert self.driver is not None
            self.images_seen += 1
            self.joins[self.incarnation, message["correlation_id"]] = (
                message["session_id"], message["join_position"], self.sim.loop.now_ns / 1e9)
            cell = self.driver.counters.address(message["subscriber_position_counter_id"])
            # The driver's own mapping (it outlives the reader: UNAVAILABLE_IMAGE, which
            # closes the reader, comes a linger before the driver lets the log go).
            log = self.driver.network.image_log(message["correlation_id"])
            reader_log = log.borrowed() if log is not None else LogBuffer(message["log_file"])
            reader = Image(reader_log, cell,
                           join_position=message["join_position"],
                           correlation_id=message["correlation_id"])
            self.readers[message["session_id"]] = (message["correlation_id"], reader, cell)
            self._probes[message["session_id"]] = _FrameProbe(reader_log, reader)
        elif message["type"] == control.UNAVAILABLE_IMAGE:
            for session, (registration_id, reader, _cell) in list(self.readers.items()):
                if registration_id == message["correlation_id"]:
                    self._drain(reader)
                    reader.close()
                    del self.readers[session]
                    del self._probes[session]
            self.images_lost += 1
            self.unavailable_at_ns.append(self.sim.loop.now_ns)
            if "lost_from" in message:
                self.lost_ranges.append((message["lost_from"], message["lost_to"]))
                key = (self.incarnation, message["correlation_id"])
                session = self.joins[key][0] if key in self.joins else None
                self.left.append((key, session, self.sim.loop.now_ns / 1e9))

    def _drain(self, reader: Image) -> None:
        on_message = self.stats.on_message
        for _ in range(1000):
            if not reader.poll(on_message, POLL_LIMIT):
                break

    def _read_budget(self, now_ns: int) -> int:
        """Messages the subscriber may read at ``now_ns`` (read_rate), POLL_LIMIT-sized
        passes without one."""
        if now_ns < self._paused_until_ns:
            return 0
        if not self.read_rate:
            return 1 << 62
        if self._read_start_ns is None:
            self._read_start_ns = now_ns
        allowed = int((now_ns - self._read_start_ns) * self.read_rate / 1e9) + 1
        return max(0, allowed - self._read_count)

    def _work(self, now_ns: int) -> int:
        budget = self._read_budget(now_ns)
        self._rate_bound = False
        probes = self._probes
        if budget > 0:
            for probe in probes.values():
                if probe.ready():
                    break
            else:
                return 0  # most cycles: nothing to read, and a poll would move nothing
        stats = self.stats
        on_message = stats.on_message
        delivered = stats.delivered
        moved = 0
        for session, (_registration_id, reader, cell) in self.readers.items():
            ready = probes[session].ready
            before = start = cell[0]
            while budget > 0:  # until the reader stops moving (padding moves it without messages)
                if not ready():
                    break  # the poll would find nothing and move nothing: spare the call
                budget -= reader.poll(on_message, min(POLL_LIMIT, budget))
                position = cell[0]
                if position == before:
                    break
                before = position
            else:
                self._rate_bound = True
            moved += cell[0] != start
        if stats.delivered != delivered:
            self._read_count += stats.delivered - delivered
            stats.note_deliveries(now_ns)
        return moved

    def _deadline(self, now_ns: int) -> int:
        if now_ns < self._paused_until_ns:
            return self._paused_until_ns
        if self._rate_bound and self._read_start_ns is not None:
            # When the next message may be read (the budget above turns positive).
            return max(now_ns + 1, self._read_start_ns + int(
                self._read_count * 1e9 / self.read_rate))
        return NO_DEADLINE

    def position_of(self, session_id: int) -> int | None:
        """This subscriber's position in the image of ``session_id`` (None: no image)."""
        entry = self.readers.get(session_id)
        return None if entry is None else entry[2][0]
