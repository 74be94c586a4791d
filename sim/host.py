"""Simulated hosts: a thin adapter between the virtual network and the real protocol core.

A host owns what one machine's driver and applications would own, and nothing else:

* :class:`PublisherHost`: a real log buffer, the C appender (``ss_offer``) appending
  numbered messages as fast as the publisher limit allows (or at a set rate), and a
  :class:`~slipstream.daemon.network_publication.NetworkPublication` behind a
  :class:`~slipstream.daemon.network_publication.SendChannel`;
* :class:`SubscriberHost`: a :class:`~slipstream.daemon.receiver.ReceiveChannel` whose image
  logs are real log buffers, and one real client
  :class:`~slipstream.client.subscription.Image` reader per image, whose position cell is
  registered with the image (``add_subscriber_position``).

The adapter only moves bytes and time: arriving datagrams go to ``on_datagram(data, source,
now)``; after every batch of inputs at an instant (and at the core's deadlines) the host runs a
*service pass*: application work (offer / poll), then ``datagrams_to_send(now)`` whose output
goes onto the network, until ``next_deadline_ns()`` lies in the future, where a timer is armed.

A crash drops the host off the network and discards its protocol objects and logs; a restart
builds fresh ones (new session id / receiver id, new logs), as a restarted driver would.

Message format (``size`` bytes, >= 12): ``publisher_id:u32 seq:u32`` at the start, ``seq:u32``
again in the last 4 bytes (to catch torn or misplaced data), zeros between.
"""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Final

from slipstream.client._native import ffi, lib
from slipstream.client.channel import Channel, parse_channel
from slipstream.client.frames import Setup
from slipstream.client.logbuffer import LogBuffer, new_appender
from slipstream.client.subscription import Image
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.flow_control import flow_control_for
from slipstream.daemon.network_publication import NetworkPublication, SendChannel
from slipstream.daemon.protocol_types import (
    NO_DEADLINE,
    Address,
    Datagram,
    ImageAvailable,
    ImageUnavailable,
    LocalCounters,
)
from slipstream.daemon.receiver import ReceiveChannel
from slipstream.sim.events import PHASE_SERVICE, Timer
from slipstream.sim.scenario import MULTICAST_GROUP, UNICAST_PORT

if TYPE_CHECKING:
    from slipstream.sim.runner import Simulation

MESSAGE_HEADER: Final = struct.Struct("<II")  # publisher id, sequence number
MESSAGE_TRAILER: Final = struct.Struct("<I")  # the sequence number again, in the last 4 bytes
SEND_PORT_BASE: Final = 50000  # the publisher's ephemeral source port: base + incarnation
#: DATA datagrams per ``datagrams_to_send`` call.  The driver sends 2 per duty cycle and cycles
#: again at once; at one virtual instant a bigger batch is the same thing with fewer calls.
SEND_BATCH: Final = 64
#: Messages per subscriber poll (the client's fragment limit).
POLL_LIMIT: Final = 4096
#: Service passes at one virtual instant before the host is declared stuck (a core bug:
#: ``next_deadline_ns() <= now`` forever).
MAX_PASSES_AT_ONE_INSTANT: Final = 100_000

_OFFER_BACK_PRESSURED = -2
_OFFER_NOT_CONNECTED = -1
_OFFER_ADMIN_ACTION = -3


class SimulationStuck(RuntimeError):
    """A host kept asking to be serviced at the same virtual instant (a livelock)."""


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

    def on_message(self, data: memoryview, _header: object) -> None:
        """The subscriber's fragment handler (one call per whole message)."""
        pid, seq = MESSAGE_HEADER.unpack_from(data)
        if seq >= self._capacity or MESSAGE_TRAILER.unpack_from(data, len(data) - 4)[0] != seq:
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
        self.delivered_bytes += len(data)
        if seq < self.highest[pid]:
            self.out_of_order += 1
            if seq < self.first_seq[pid]:
                self.first_seq[pid] = seq
        else:
            self.highest[pid] = seq

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


class SimHost:
    """One machine: address, up/down, service passes and timers.  Subclasses add roles."""

    def __init__(self, sim: Simulation, index: int) -> None:
        self.sim = sim
        self.index = index
        self.ip = f"10.0.0.{index}"
        self.up = False
        self.incarnation = 0
        self.counters = LocalCounters()  # across incarnations, for the report
        self.source: Address = (self.ip, 0)
        self._timer: Timer | None = None
        self._service_scheduled = False
        self._last_service_ns = -1
        self._passes_at_instant = 0
        self._directory: Path | None = None
        self._logs: list[LogBuffer] = []

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Boot (or reboot) with fresh protocol state."""
        if self.up:
            return
        self.incarnation += 1
        self.up = True
        self._directory = self.sim.directory / f"host{self.index}-{self.incarnation}"
        self._directory.mkdir()
        self.sim.network.set_up(self.ip, True)
        self._start()
        self.wake()

    def crash(self) -> None:
        """Lose everything: off the network, protocol objects and logs gone."""
        if not self.up:
            return
        self.up = False
        self.sim.network.set_up(self.ip, False)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._stop()
        self.close_logs()

    def close_logs(self) -> None:
        for log in self._logs:
            path = log.path
            log.close()
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._logs = []

    def _new_log(self, name: str, **kwargs: int) -> LogBuffer:
        assert self._directory is not None
        log = LogBuffer.create(self._directory / f"{name}.logbuffer", **kwargs)
        self._logs.append(log)
        return log

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
        send = self.sim.network.send
        source = self.source
        deadline = now
        for _ in range(64):
            for datagram in self._work(now):
                send(source, datagram.address, datagram.data)
            deadline = self._deadline(now)
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

    # -- role hooks ---------------------------------------------------------------------------
    def _start(self) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError

    def _work(self, now_ns: int) -> list[Datagram]:
        raise NotImplementedError

    def _deadline(self, now_ns: int) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        state = "up" if self.up else "down"
        return f"<{type(self).__name__} {self.ip} {state} incarnation={self.incarnation}>"


class PublisherHost(SimHost):
    """Host 1: one publication, one publisher appending numbered messages."""

    def __init__(self, sim: Simulation, index: int) -> None:
        super().__init__(sim, index)
        self.publication: NetworkPublication | None = None
        self.send_channel: SendChannel | None = None
        self.log: LogBuffer | None = None
        self.channel: Channel = parse_channel(sim.scenario.channel_uri(index))
        self.settings: DriverSettings = sim.settings
        #: ``(publisher id, first seq, end seq)`` per incarnation: what each one appended.
        self.ranges: list[list[int]] = []
        self.blocked = 0  # offers refused (back pressure / not connected)
        self._limit = ffi.new("int64_t *")
        self._appender = None
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

    def _start(self) -> None:
        sim = self.sim
        rng = self.rng("publication")
        channel = self.channel
        term_length = channel.term_length or self.settings.term_buffer_length
        session_id = rng.randint(1001, 2**31 - 1)
        log = self.log = self._new_log(
            "publication", term_length=term_length,
            initial_term_id=rng.randint(-2**31, 2**31 - 1), session_id=session_id,
            stream_id=sim.scenario.stream_id, mtu=channel.mtu or self.settings.mtu_length,
            correlation_id=self.incarnation,
            term_window_length=self.settings.term_window_length(term_length))
        self.source = (self.ip, SEND_PORT_BASE + self.incarnation)
        group = channel.control_group
        if group is not None:
            destination: Address = MULTICAST_GROUP
            control: Address | None = (group.host, group.port or MULTICAST_GROUP[1])
        else:
            destination = (sim.host_ip(2), UNICAST_PORT)
            control = None
        now = sim.loop.now_ns
        self.publication = NetworkPublication(
            log=log, channel=channel, settings=self.settings, publisher_limit=self._limit,
            flow_control=flow_control_for(channel, self.settings), counters=self.counters,
            now_ns=now, destination=destination)
        self.send_channel = SendChannel(counters=self.counters)
        self.send_channel.add_publication(self.publication)
        sim.network.bind(self.source, self._on_datagram)
        if control is not None:
            sim.network.join(control, self.ip, self._on_datagram)
        self._appender = new_appender(log, self._limit)
        self.ranges.append([self.incarnation, self.next_seq, self.next_seq])
        self._blocked_at_limit = None
        self._start_ns = now

    def _stop(self) -> None:
        net = self.sim.network
        net.unbind(self.source)
        if self.sim.scenario.is_multicast:
            for group in list(net._groups):
                net.leave(group, self.ip)
        self.publication = None
        self.send_channel = None
        self._appender = None
        self.log = None
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None

    def _on_datagram(self, data: bytes, source: Address, now_ns: int) -> None:
        if self.send_channel is not None:
            self.send_channel.on_datagram(data, source, now_ns)
            self.wake()

    # -- the publisher application ----------------------------------------------------------
    def _allowed_end(self, now_ns: int) -> int:
        """Sequence number the publisher may reach by ``now_ns`` (publish_rate)."""
        total = self.sim.scenario.messages
        rate = self.sim.scenario.publish_rate
        if rate <= 0:
            return total
        first = self.ranges[-1][1]
        return min(total, first + 1 + int((now_ns - self._start_ns) * rate / 1e9))

    def _offer(self, now_ns: int) -> None:
        rng_range = self.ranges[-1]
        end = self._allowed_end(now_ns)
        seq = rng_range[2]
        if seq >= end:
            return
        limit = self._limit[0]
        if self._blocked_at_limit is not None and self._blocked_at_limit == limit:
            return
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
            elif result == _OFFER_ADMIN_ACTION:
                continue
            elif result in (_OFFER_BACK_PRESSURED, _OFFER_NOT_CONNECTED):
                self.blocked += 1
                self._blocked_at_limit = limit
                break
            else:
                raise RuntimeError(f"offer failed with {result} at seq {seq}")
        rng_range[2] = seq
        if seq < self.sim.scenario.messages and seq >= end and self._rate_timer is None:
            rate = self.sim.scenario.publish_rate
            first = rng_range[1]
            due = self._start_ns + int((seq - first) * 1e9 / rate)
            self._rate_timer = self.sim.loop.call_at(max(due, now_ns + 1), self._on_rate_timer)

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

    def _work(self, now_ns: int) -> list[Datagram]:
        publication = self.publication
        assert publication is not None
        self._offer(now_ns)
        return publication.datagrams_to_send(now_ns, SEND_BATCH)

    def _deadline(self, now_ns: int) -> int:
        publication = self.publication
        assert publication is not None
        deadline = publication.next_deadline_ns()
        if (self._blocked_at_limit is not None and self._limit[0] != self._blocked_at_limit
                and self.next_seq < self._allowed_end(now_ns)):
            return now_ns  # credit arrived: offer again
        return deadline


class SubscriberHost(SimHost):
    """Hosts 2..N: one subscription, one reader per image, statistics of what arrived."""

    def __init__(self, sim: Simulation, index: int) -> None:
        super().__init__(sim, index)
        self.stats = SubscriberStats(sim.scenario.messages)
        self.channel: Channel = parse_channel(sim.scenario.channel_uri(index))
        self.receive_channel: ReceiveChannel | None = None
        #: session id -> (protocol image, client reader, position cell)
        self.readers: dict[int, tuple[object, Image, object]] = {}
        self.images_seen = 0
        self.images_lost = 0  # ImageUnavailable events
        self.unavailable_at_ns: list[int] = []

    def _start(self) -> None:
        sim = self.sim
        if self.incarnation == 1:
            self.stats.expected_from = sim.publisher.next_seq
        rng = self.rng("receiver")
        port = MULTICAST_GROUP[1] if sim.scenario.is_multicast else UNICAST_PORT
        self.source = (self.ip, port)
        self.receive_channel = ReceiveChannel(
            channel=self.channel, settings=sim.settings, receiver_id=rng.getrandbits(63),
            counters=self.counters, log_factory=self._log_factory, now_ns=sim.loop.now_ns,
            rng=rng)
        self.receive_channel.add_subscription(sim.scenario.stream_id)
        if sim.scenario.is_multicast:
            sim.network.join(MULTICAST_GROUP, self.ip, self._on_datagram)
        else:
            sim.network.bind(self.source, self._on_datagram)

    def _log_factory(self, setup: Setup) -> LogBuffer:
        count = (setup.active_term_id - setup.initial_term_id) & 0xFFFFFFFF
        self.images_seen += 1
        return self._new_log(
            f"image-{setup.session_id}-{self.images_seen}", term_length=setup.term_length,
            initial_term_id=setup.initial_term_id, session_id=setup.session_id,
            stream_id=setup.stream_id, mtu=setup.mtu, correlation_id=self.images_seen,
            initial_term_count=count - (1 << 32) if count >= 1 << 31 else count,
            initial_term_offset=setup.term_offset)

    def _stop(self) -> None:
        net = self.sim.network
        if self.sim.scenario.is_multicast:
            net.leave(MULTICAST_GROUP, self.ip)
        else:
            net.unbind(self.source)
        self.receive_channel = None
        self.readers = {}

    def _on_datagram(self, data: bytes, source: Address, now_ns: int) -> None:
        receive_channel = self.receive_channel
        if receive_channel is not None:
            receive_channel.on_datagram(data, source, now_ns)
            if not self._service_scheduled:
                self.wake()

    def _events(self, now_ns: int) -> None:
        assert self.receive_channel is not None
        for event in self.receive_channel.poll_events():
            image = event.image
            session = image.session_id  # type: ignore[attr-defined]
            if isinstance(event, ImageAvailable):
                join = image.join_position  # type: ignore[attr-defined]
                cell = ffi.new("int64_t *", join)
                reader = Image(image.log, cell, join_position=join)  # type: ignore[attr-defined]
                image.add_subscriber_position(cell)  # type: ignore[attr-defined]
                self.readers[session] = (image, reader, cell)
            elif isinstance(event, ImageUnavailable):
                entry = self.readers.get(session)
                if entry is not None and entry[0] is image:
                    self._drain(entry[1])
                    image.remove_subscriber_position(entry[2])  # type: ignore[attr-defined]
                    del self.readers[session]
                self.images_lost += 1
                self.unavailable_at_ns.append(now_ns)

    def _drain(self, reader: Image) -> None:
        on_message = self.stats.on_message
        for _ in range(1000):
            if not reader.poll(on_message, POLL_LIMIT):
                break

    def _work(self, now_ns: int) -> list[Datagram]:
        receive_channel = self.receive_channel
        assert receive_channel is not None
        self._events(now_ns)
        on_message = self.stats.on_message
        for _image, reader, cell in self.readers.values():
            before = cell[0]
            while True:  # until the reader stops moving (padding moves it without messages)
                reader.poll(on_message, POLL_LIMIT)
                position = cell[0]
                if position == before:
                    break
                before = position
        out = receive_channel.datagrams_to_send(now_ns)
        self._events(now_ns)
        return out

    def _deadline(self, now_ns: int) -> int:
        assert self.receive_channel is not None
        return self.receive_channel.next_deadline_ns()

    def position_of(self, session_id: int) -> int | None:
        """This subscriber's position in the image of ``session_id`` (None: no image)."""
        entry = self.readers.get(session_id)
        return None if entry is None else entry[2][0]
