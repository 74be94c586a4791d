"""Small shared values of the sans-I/O protocol core (sender and receiver state machines).

Nothing here does I/O.  The protocol objects (:mod:`network_publication`,
:mod:`publication_image`, :mod:`receiver`) take bytes and ``now`` (monotonic ns) and hand back
:class:`Datagram` values and deadlines; whoever drives them (the simulator, the real driver)
owns sockets and clocks.

Conventions used across the core:

* times and durations are ``int`` nanoseconds of the driver's monotonic clock;
* sizes, offsets and positions are ``int`` bytes;
* a deadline is the time at which the caller must call ``datagrams_to_send(now)`` again;
  :data:`NO_DEADLINE` means "nothing scheduled"; a deadline ``<= now`` means "call it now".
"""

from __future__ import annotations

from typing import Final, Protocol, TypeAlias

import attrs

from slipstream.client.counters import SystemCounter

Address: TypeAlias = tuple[str, int]

#: "No timer armed" (INT64_MAX): larger than any real deadline, so ``min()`` just works.
NO_DEADLINE: Final = (1 << 63) - 1


@attrs.frozen(slots=True)
class Datagram:
    """One UDP datagram to send: ``data`` (exactly the wire bytes) to ``address``."""

    data: bytes
    address: Address


class ProtocolCounters(Protocol):
    """Where the protocol objects count (Aeron's system counters).

    The simulator and the tests use :class:`LocalCounters`; the driver passes an adapter over
    the shared ``CountersFile``.  ``add`` must be cheap: it runs on the per-datagram path.
    """

    def add(self, counter: SystemCounter, delta: int = 1) -> None: ...


class LocalCounters:
    """In-memory :class:`ProtocolCounters`: ``counters[SystemCounter.X]`` reads 0 when unset."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: dict[SystemCounter, int] = {}

    def add(self, counter: SystemCounter, delta: int = 1) -> None:
        values = self.values
        values[counter] = values.get(counter, 0) + delta

    def __getitem__(self, counter: SystemCounter) -> int:
        return self.values.get(counter, 0)

    def snapshot(self) -> dict[str, int]:
        """``{counter name: value}`` of the non-zero counters, for reports."""
        return {c.name: v for c, v in sorted(self.values.items()) if v}

    def __repr__(self) -> str:
        return f"LocalCounters({self.snapshot()})"


# -- receiver-side events (ReceiveChannel.poll_events) -----------------------------------------


@attrs.frozen(eq=False)
class ImageAvailable:
    """A new image (a PublicationImage) was created from a SETUP; subscribers may attach."""

    image: object  # PublicationImage (kept untyped here to avoid an import cycle)


@attrs.frozen(eq=False)
class ImageUnavailable:
    """An image ended (EOS consumed, liveness timeout, or no subscribers) and was removed."""

    image: object  # PublicationImage


ImageEvent: TypeAlias = ImageAvailable | ImageUnavailable
