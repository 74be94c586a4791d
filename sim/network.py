"""The virtual network: hosts, per-direction links with faults, partitions, multicast, a trace.

Model (one datagram sent from host A to address D at virtual time t):

1. If A or the destination host is down (crashed), or a partition separates them at t, the
   datagram is dropped (``drop-down`` / ``drop-partition``).
2. Each destination host (one for unicast; every host that joined the group for a multicast
   address in 224.0.0.0/4, the sender excepted) is reached over its own directed link A→B with
   independent faults and random numbers:

   * **bandwidth** (``rate_mbit``, Mbit/s; 0 = unlimited): the link serialises datagrams one
     after the other (``len * 8 / rate`` each); a datagram that would make the queue waiting
     for the wire exceed ``queue_bytes`` is tail-dropped (``drop-queue``, counted);
   * **random loss** ``loss`` (probability per datagram, ``drop-loss``);
   * **bursty loss** (Gilbert-Elliott, ``burst = (p, r)``): before each datagram the link
     moves good→bad with probability p and bad→good with probability r; in the bad state
     every datagram is dropped (``drop-burst``).  Mean burst length 1/r, bad-state share
     p/(p+r);
   * **delay** ``delay_ms`` plus **jitter** uniform in ``[-jitter_ms, +jitter_ms]`` (clamped
     at 0 extra), which may reorder datagrams on its own;
   * **reordering** ``reorder``: with this probability a datagram is held back an extra delay
     uniform in ``(0, reorder_delay_ms]``;
   * **duplication** ``duplicate``: with this probability a second copy is delivered, with its
     own jitter.

   Test code may add *filters* (``Network.filters``) that drop chosen datagrams
   (``drop-filter``), e.g. "the DATA frame at term offset X, the first time".

3. On arrival the datagram is handed to whatever is bound to the destination address on that
   host (``drop-unbound`` if nothing is; ``drop-down`` if the host crashed meanwhile).

Partitions are checked when a datagram is sent: one already in flight when the partition
starts still arrives.  Every outcome is appended to the **trace** (one line per delivery or
drop, with the virtual time in ns, addresses, length and a CRC of the bytes) and folded into a
SHA-256 digest; the same seed gives the same trace byte for byte.

All randomness comes from the ``random.Random`` passed in (the simulation's seed); each link
draws from its own generator seeded from ``(seed, "link", src, dst)``, so adding a link or a
host does not perturb the others.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import math
import random
import zlib
from collections.abc import Callable, Iterable
from typing import Final, TypeAlias

import attrs

from slipstream.sim.events import PHASE_INPUT, EventLoop

Address: TypeAlias = tuple[str, int]
#: ``handler(data, source, now_ns)``: something bound to an address on a host.
Receiver: TypeAlias = Callable[[bytes, Address, int], None]

_MS: Final = 1_000_000
#: Trace lines hashed together into the digest (bounds the memory they wait in).
_DIGEST_BATCH: Final = 1024

DROP_REASONS: Final = ("drop-loss", "drop-burst", "drop-queue", "drop-partition", "drop-down",
                       "drop-unbound", "drop-filter")


def _probability(name: str) -> Callable[[object, attrs.Attribute, float], None]:
    def check(_instance: object, _attribute: attrs.Attribute, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be a probability in [0, 1], not {value}")
    return check


def _non_negative(name: str) -> Callable[[object, attrs.Attribute, float], None]:
    def check(_instance: object, _attribute: attrs.Attribute, value: float) -> None:
        if not 0 <= value < math.inf:  # NaN and infinity too
            raise ValueError(f"{name} must be >= 0 and finite, not {value}")
    return check


def _non_negative_int(name: str) -> Callable[[object, attrs.Attribute, int], None]:
    def check(_instance: object, _attribute: attrs.Attribute, value: int) -> None:
        # A count of bytes: 1.5 would be taken and compared as a float, never refused.
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0 (bytes), not {value!r}")
    return check


def _burst(_instance: object, _attribute: attrs.Attribute,
           value: tuple[float, float] | None) -> None:
    if value is None:
        return
    p, r = value
    if not (0.0 <= p <= 1.0 and 0.0 < r <= 1.0):
        raise ValueError(f"burst loss (p, r) needs 0 <= p <= 1 and 0 < r <= 1, not {value}")


@attrs.frozen
class LinkFaults:
    """Faults of one direction of one link.  Probabilities per datagram; times in ms."""

    loss: float = attrs.field(default=0.0, validator=_probability("loss"))
    #: Gilbert-Elliott (p = P(good→bad), r = P(bad→good)) per datagram; None = off.
    burst: tuple[float, float] | None = attrs.field(default=None, validator=_burst)
    delay_ms: float = attrs.field(default=0.0, validator=_non_negative("delay_ms"))
    jitter_ms: float = attrs.field(default=0.0, validator=_non_negative("jitter_ms"))
    reorder: float = attrs.field(default=0.0, validator=_probability("reorder"))
    reorder_delay_ms: float = attrs.field(default=5.0,
                                          validator=_non_negative("reorder_delay_ms"))
    duplicate: float = attrs.field(default=0.0, validator=_probability("duplicate"))
    #: Bandwidth in Mbit/s; 0 = unlimited.
    rate_mbit: float = attrs.field(default=0.0, validator=_non_negative("rate_mbit"))
    #: Bytes that may wait for the wire when ``rate_mbit`` is set; beyond: tail drop.
    queue_bytes: int = attrs.field(default=1 << 20, validator=_non_negative_int("queue_bytes"))


@attrs.define
class LinkStats:
    """What happened on one link (counts of datagrams)."""

    offered: int = 0
    delivered: int = 0
    lost: int = 0  # random loss
    burst_lost: int = 0  # Gilbert-Elliott bad state
    queue_dropped: int = 0  # bandwidth queue full (tail drop)
    duplicated: int = 0
    reordered: int = 0
    max_queue_bytes: int = 0


class Link:
    """One direction ``src → dst`` with its faults, its random generator and its queue."""

    __slots__ = ("_bad", "_busy_until_ns", "_delay_only_ns", "_faults", "dst", "rng", "src",
                 "stats")

    def __init__(self, src: str, dst: str, faults: LinkFaults, rng: random.Random) -> None:
        self.src = src
        self.dst = dst
        self.faults = faults
        self.rng = rng
        self.stats = LinkStats()
        self._bad = False
        self._busy_until_ns = 0

    @property
    def faults(self) -> LinkFaults:
        return self._faults

    @faults.setter
    def faults(self, faults: LinkFaults) -> None:
        self._faults = faults
        # A link with a delay and no other fault (most of them) decides a datagram's fate
        # with no random number and no queue: transmit takes a shortcut, in ns.
        plain = (faults.rate_mbit <= 0 and faults.burst is None and faults.loss <= 0
                 and faults.duplicate <= 0 and faults.jitter_ms <= 0 and faults.reorder <= 0)
        self._delay_only_ns = int(faults.delay_ms * _MS) if plain else None

    def backlog_bytes(self, now_ns: int) -> int | None:
        """Bytes waiting for the wire at ``now_ns`` (None: the link has no bandwidth limit)."""
        rate = self.faults.rate_mbit
        if rate <= 0:
            return None
        return max(0, int((self._busy_until_ns - now_ns) * rate / 8000))

    @property
    def in_bad_state(self) -> bool:
        """The Gilbert-Elliott chain is in its bad (dropping) state."""
        return self._bad

    def transmit(self, length: int, now_ns: int) -> tuple[str | None, list[int]]:
        """Decide the fate of one datagram of ``length`` bytes sent at ``now_ns``.

        Returns ``(drop_reason, [])`` or ``(None, arrival_times_ns)`` with one time, or two
        when the datagram is duplicated.  Draws the link's random numbers in a fixed order.
        """
        stats = self.stats
        stats.offered += 1
        if self._delay_only_ns is not None:
            stats.delivered += 1
            return None, [now_ns + self._delay_only_ns]
        f = self._faults
        rng = self.rng
        departure = now_ns
        if f.rate_mbit > 0:
            busy = self._busy_until_ns
            start = busy if busy > now_ns else now_ns
            backlog = int((start - now_ns) * f.rate_mbit / 8000)  # bytes waiting for the wire
            if backlog + length > f.queue_bytes:
                stats.queue_dropped += 1
                return "drop-queue", []
            if backlog + length > stats.max_queue_bytes:
                stats.max_queue_bytes = backlog + length
            departure = start + int(length * 8000 / f.rate_mbit)
            self._busy_until_ns = departure
        if f.burst is not None:
            p, r = f.burst
            if self._bad:
                if rng.random() < r:
                    self._bad = False
            elif rng.random() < p:
                self._bad = True
            if self._bad:
                stats.burst_lost += 1
                return "drop-burst", []
        if f.loss > 0 and rng.random() < f.loss:
            stats.lost += 1
            return "drop-loss", []
        copies = 2 if f.duplicate > 0 and rng.random() < f.duplicate else 1
        if copies == 2:
            stats.duplicated += 1
        arrivals = []
        for _ in range(copies):
            delay_ms = f.delay_ms
            if f.jitter_ms > 0:
                delay_ms = max(0.0, delay_ms + rng.uniform(-f.jitter_ms, f.jitter_ms))
            if f.reorder > 0 and rng.random() < f.reorder:
                stats.reordered += 1
                delay_ms += rng.uniform(0.0, f.reorder_delay_ms) or f.reorder_delay_ms
            arrivals.append(departure + int(delay_ms * _MS))
        stats.delivered += copies
        return None, arrivals


@attrs.frozen
class Partition:
    """From ``start_ns`` to ``end_ns`` no datagram passes between ``side`` and the rest."""

    start_ns: int
    end_ns: int
    side: frozenset[str]

    def separates(self, a: str, b: str, now_ns: int) -> bool:
        return (self.start_ns <= now_ns < self.end_ns) and ((a in self.side) != (b in self.side))


#: ``observer(time_ns, event, source, destination, data)`` sees every trace event.
Observer: TypeAlias = Callable[[int, str, Address, Address, bytes], None]


@functools.lru_cache(maxsize=1024)
def is_multicast(ip: str) -> bool:
    """True for IPv4 224.0.0.0/4 (cached: it runs once per datagram)."""
    return ipaddress.ip_address(ip).is_multicast


@functools.lru_cache(maxsize=4096)
def _text(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


class Network:
    """Hosts (by IP), the sockets bound on them, multicast groups, links and partitions."""

    def __init__(self, loop: EventLoop, rng: random.Random, *,
                 default_faults: LinkFaults | None = None, keep_trace: bool = False) -> None:
        """``rng`` seeds the per-link generators; ``keep_trace`` keeps the trace lines in
        :attr:`trace` (the digest is always kept)."""
        self.loop = loop
        self._seed = rng.getrandbits(64)
        self.default_faults = default_faults or LinkFaults()
        self._faults: dict[tuple[str, str], LinkFaults] = {}
        self._links: dict[tuple[str, str], Link] = {}
        self._bound: dict[Address, Receiver] = {}
        self._groups: dict[Address, dict[str, Receiver]] = {}
        self._toward: dict[tuple[str, Address], tuple[Link, ...]] = {}  # _limited_links_toward
        self._up: dict[str, bool] = {}
        self.partitions: list[Partition] = []
        self.keep_trace = keep_trace
        #: ``(time_ns, event, "src", "dst", length, crc32)`` per event when ``keep_trace``.
        self.trace: list[tuple[int, str, str, str, int, int]] = []
        self._digest = hashlib.sha256()
        self._digest_lines: list[str] = []  # trace lines the digest has yet to take in
        self.events = 0
        self.counts: dict[str, int] = {}
        self.observers: list[Observer] = []
        #: ``drop(time_ns, source, destination, data) -> bool``: a datagram for which any
        #: filter returns True is dropped (``drop-filter``) before the link sees it.  For
        #: surgical faults in tests ("lose the frame at offset X once").
        self.filters: list[Callable[[int, Address, Address, bytes], bool]] = []

    # -- topology ------------------------------------------------------------------------
    def add_host(self, ip: str) -> None:
        """Declare a host (up)."""
        ipaddress.ip_address(ip)
        self._up[ip] = True

    @property
    def hosts(self) -> list[str]:
        return list(self._up)

    def set_up(self, ip: str, up: bool) -> None:
        """Crash (False) or restart (True) a host's network presence."""
        self._up[ip] = up

    def is_up(self, ip: str) -> bool:
        return self._up.get(ip, False)

    def set_faults(self, src: str, dst: str, faults: LinkFaults) -> None:
        """Faults of the direction src → dst (replaces them from now on; the link keeps its
        random generator, queue and Gilbert-Elliott state)."""
        self._faults[(src, dst)] = faults
        link = self._links.get((src, dst))
        if link is not None:
            link.faults = faults
        self._toward.clear()  # a link may have gained or lost its bandwidth limit

    def set_all_faults(self, faults: LinkFaults) -> None:
        """The same faults on every direction of every link, present and future."""
        self.default_faults = faults
        for key in list(self._faults):
            self._faults[key] = faults
        for link in self._links.values():
            link.faults = faults
        self._toward.clear()

    def drained_by_ns(self, src_ip: str, destination: Address, backlog: int,
                      now_ns: int) -> int:
        """When every link from ``src_ip`` toward ``destination`` holds at most ``backlog``
        bytes (``now_ns`` if they do already or have no bandwidth limit)."""
        when = now_ns
        for link in self._limited_links_toward(src_ip, destination):
            waiting = link.backlog_bytes(now_ns)
            if waiting is not None and waiting > backlog:
                when = max(when, now_ns + -(-(waiting - backlog) * 8000
                                            // int(link.faults.rate_mbit * 1000)) * 1000)
        return when

    def backlog_bytes(self, src_ip: str, destination: Address, now_ns: int) -> int | None:
        """The most bytes waiting on a link from ``src_ip`` toward ``destination`` (each
        member of a multicast group), None when none of them has a bandwidth limit: what a
        sender's socket buffer holds while the link's queue drains it."""
        most = None
        for link in self._limited_links_toward(src_ip, destination):
            backlog = link.backlog_bytes(now_ns)
            if backlog is not None and (most is None or backlog > most):
                most = backlog
        return most

    def _limited_links_toward(self, src_ip: str, destination: Address) -> tuple[Link, ...]:
        """The links with a bandwidth limit that a datagram from ``src_ip`` to
        ``destination`` takes (of one per member of a multicast group, in join order), kept
        until a host joins or leaves a group or faults change: a sender asks every duty
        cycle, and with hundreds of members and no limit the answer is empty."""
        key = (src_ip, destination)
        links = self._toward.get(key)
        if links is None:
            if is_multicast(destination[0]):
                targets = [ip for ip in self._groups.get(destination, ()) if ip != src_ip]
            else:
                targets = [destination[0]]
            links = self._toward[key] = tuple(
                link for link in (self.link(src_ip, ip) for ip in targets)
                if link.faults.rate_mbit > 0)
        return links

    def link(self, src: str, dst: str) -> Link:
        """The directed link src → dst (created on first use)."""
        link = self._links.get((src, dst))
        if link is None:
            faults = self._faults.get((src, dst), self.default_faults)
            rng = random.Random(f"{self._seed}/link/{src}/{dst}")
            link = self._links[(src, dst)] = Link(src, dst, faults, rng)
        return link

    @property
    def links(self) -> dict[tuple[str, str], Link]:
        return dict(self._links)

    def bind(self, address: Address, receiver: Receiver) -> None:
        """Deliver datagrams for ``address`` (host ip, port) to ``receiver``."""
        self._bound[address] = receiver

    def unbind(self, address: Address) -> None:
        self._bound.pop(address, None)

    def join(self, group: Address, ip: str, receiver: Receiver) -> None:
        """Host ``ip`` joins the multicast ``group`` (group ip, port): datagrams sent to the
        group reach ``receiver`` (in join order across hosts)."""
        if not is_multicast(group[0]):
            raise ValueError(f"{group[0]} is not a multicast address")
        self._groups.setdefault(group, {})[ip] = receiver
        self._toward.clear()

    def leave(self, group: Address, ip: str) -> None:
        self._groups.get(group, {}).pop(ip, None)
        self._toward.clear()

    def add_partition(self, partition: Partition) -> None:
        self.partitions.append(partition)

    # -- traffic --------------------------------------------------------------------------
    def send(self, source: Address, destination: Address, data: bytes) -> None:
        """Send one datagram now from ``source`` (sender's ip, port)."""
        now = self.loop.now_ns
        src_ip = source[0]
        up = self._up
        if not up.get(src_ip, False):
            self._record(now, "drop-down", source, destination, data)
            return
        dst_ip = destination[0]
        if dst_ip in up:
            targets: Iterable[str] = (dst_ip,)
        elif is_multicast(dst_ip):
            targets = [ip for ip in self._groups.get(destination, ()) if ip != src_ip]
        else:
            self._record(now, "drop-unbound", source, destination, data)
            return
        partitions = self.partitions
        filters = self.filters
        links = self._links
        call_at = self.loop.call_at
        arrive = self._arrive
        port = destination[1]
        for ip in targets:
            target = (ip, port)
            if not up[ip]:
                self._record(now, "drop-down", source, target, data)
                continue
            if partitions and any(p.separates(src_ip, ip, now) for p in partitions):
                self._record(now, "drop-partition", source, target, data)
                continue
            if filters and any(f(now, source, target, data) for f in filters):
                self._record(now, "drop-filter", source, target, data)
                continue
            link = links.get((src_ip, ip)) or self.link(src_ip, ip)
            reason, arrivals = link.transmit(len(data), now)
            if reason is not None:
                self._record(now, reason, source, target, data)
                continue
            for arrival in arrivals:
                # A partial, not a closure or an object with __call__: made and called in C.
                call_at(arrival, functools.partial(arrive, source, destination, target, data),
                        PHASE_INPUT)

    def _arrive(self, source: Address, destination: Address, target: Address,
                data: bytes) -> None:
        now = self.loop.now_ns
        if not self._up.get(target[0], False):
            self._record(now, "drop-down", source, target, data)
            return
        if destination[0] in self._up:
            receiver = self._bound.get(target)
        else:
            receiver = self._groups.get(destination, {}).get(target[0])
        if receiver is None:
            self._record(now, "drop-unbound", source, target, data)
            return
        self._record(now, "deliver", source, target, data)
        receiver(data, source, now)

    def _record(self, now: int, event: str, source: Address, destination: Address,
                data: bytes) -> None:
        crc = zlib.crc32(data)
        src = _text(source)
        dst = _text(destination)
        lines = self._digest_lines
        lines.append(f"{now} {event} {src} {dst} {len(data)} {crc:08x}\n")
        if len(lines) >= _DIGEST_BATCH:
            self._fold_digest()
        self.events += 1
        counts = self.counts
        counts[event] = counts.get(event, 0) + 1
        if self.keep_trace:
            self.trace.append((now, event, src, dst, len(data), crc))
        for observer in self.observers:
            observer(now, event, source, destination, data)

    def _fold_digest(self) -> None:
        """Fold the trace lines not yet hashed into the digest (SHA-256 of the lines in order
        is the same fed at once or one by one; at once costs one call per batch)."""
        self._digest.update("".join(self._digest_lines).encode())
        self._digest_lines = []

    def trace_digest(self) -> str:
        """SHA-256 (hex) of the trace so far: equal for equal runs."""
        self._fold_digest()
        return self._digest.hexdigest()

    def trace_text(self) -> str:
        """The kept trace, one ``time_ns event src dst length crc32`` line per event."""
        return "".join(f"{t} {e} {s} {d} {n} {c:08x}\n" for t, e, s, d, n, c in self.trace)

