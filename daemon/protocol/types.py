"""Small shared values of the sans-I/O protocol core (sender and receiver state machines).

Nothing here does I/O.  The protocol objects (:mod:`network_publication`,
:mod:`publication_image`, :mod:`receiver`) take bytes and ``now`` (monotonic ns) and hand back
:class:`Datagram` values and deadlines; whoever drives them (the simulator, the real driver)
owns sockets and clocks.

Conventions used across the core:

* times and durations are ``int`` nanoseconds of the driver's monotonic clock;
* sizes, offsets and positions are ``int`` bytes;
* a deadline is the time at which the caller must call ``datagrams_to_send(now)`` again;
  ``NO_DEADLINE`` (:mod:`slipstream.client.layout`: INT64_MAX, larger than any real deadline,
  so ``min()`` just works) means "nothing scheduled"; a deadline ``<= now`` means "call it
  now".
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import struct
from typing import Protocol, TypeAlias

import attrs

from slipstream.client._native import ffi
from slipstream.client.counters import SystemCounter

Address: TypeAlias = tuple[str, int]


@attrs.frozen(slots=True)
class Datagram:
    """One UDP datagram to send: ``data`` (exactly the wire bytes) to ``address``.

    ``data`` may be a view of a buffer that is reused (a receive buffer, a log): send it
    before the next duty cycle, or copy it (``bytes(data)``) to keep it.  ``via``: the
    receive destination (its index) of a multi-destination subscription whose socket it
    leaves from, the path its answer belongs to; -1: the endpoint's own socket.
    """

    data: bytes | memoryview
    address: Address
    via: int = -1


class ProtocolCounters(Protocol):
    """Where the protocol objects count (Aeron's system counters): the driver's shared
    ``CountersFile``, or :class:`LocalCounters` in unit tests.  ``address`` is the int64 cell
    the C data path counts into."""

    def add(self, counter_id: int, delta: int = 1) -> int: ...

    def address(self, counter_id: int):  # -> cffi int64_t *
        ...


class LocalCounters:
    """In-process :class:`ProtocolCounters` (one int64 cell per system counter), for tests:
    ``counters[SystemCounter.X]`` reads it."""

    __slots__ = ("_cells",)

    def __init__(self) -> None:
        self._cells = ffi.new("int64_t[]", len(SystemCounter))

    def add(self, counter_id: int, delta: int = 1) -> int:
        previous = self._cells[counter_id]
        self._cells[counter_id] = previous + delta
        return previous

    def address(self, counter_id: int):  # -> cffi int64_t *
        return self._cells + counter_id

    def __getitem__(self, counter: SystemCounter) -> int:
        return self._cells[counter]

    def snapshot(self) -> dict[str, int]:
        """``{counter name: value}`` of the non-zero counters, for reports."""
        return {c.name: self._cells[c] for c in SystemCounter if self._cells[c]}

    def __repr__(self) -> str:
        return f"LocalCounters({self.snapshot()})"


# -- socket addresses as the C data path sees them (struct sockaddr bytes) ---------------------

_SOCKADDR_IN = struct.Struct("=H2s4s8x")  # family (native), port (network order), address
_SOCKADDR_IN6 = struct.Struct("=H2sI16sI")  # family, port, flow info, address, scope id


@functools.lru_cache(maxsize=1024)  # a send endpoint's control comes from a few receivers
def sockaddr(address: Address) -> bytes:
    """``(ip, port)`` (an IP literal, v4 or v6) as a ``struct sockaddr_in``/``_in6``."""
    host, port = address
    ip = ipaddress.ip_address(host)
    if ip.version == 4:
        return _SOCKADDR_IN.pack(socket.AF_INET, port.to_bytes(2, "big"), ip.packed)
    return _SOCKADDR_IN6.pack(socket.AF_INET6, port.to_bytes(2, "big"), 0, ip.packed, 0)


def hash_table_slots(entries: int) -> int:
    """Slots of an open-addressing table in C for ``entries`` (a power of two, at least 16,
    and a load of at most one half: a lookup ends at an empty slot, so the table never
    fills)."""
    slots = 16
    while slots < 2 * entries + 2:
        slots *= 2
    return slots


def address_of(raw: bytes | memoryview) -> Address:
    """The ``(ip, port)`` of a ``struct sockaddr_in``/``_in6`` (the inverse of
    :func:`sockaddr`)."""
    family = struct.unpack_from("=H", raw)[0]
    if family == socket.AF_INET:
        _, port, packed = _SOCKADDR_IN.unpack_from(raw)
        return socket.inet_ntop(socket.AF_INET, packed), int.from_bytes(port, "big")
    if family == socket.AF_INET6:
        _, port, _, packed, _ = _SOCKADDR_IN6.unpack_from(raw)
        return socket.inet_ntop(socket.AF_INET6, packed), int.from_bytes(port, "big")
    raise ValueError(f"address family {family} is not IPv4 or IPv6")
