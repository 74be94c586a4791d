"""Cleaning a log behind its consumers, so that partitions can be reused (docs/PROTOCOL.md §2.8).

Term n reuses the partition of term n - 3, and writers (a publisher appending, a receiver
rebuilding) must find it zeroed.  The cleaner zeroes toward a target one term behind the
slowest consumer, at most ``chunk_length`` bytes per call, so that one duty cycle never holds
its thread for the tens of milliseconds a whole large term takes; the next call continues.

:meth:`LogCleaner.reusable_limit` is the rule that makes any chunk size safe: the highest
position a writer may be allowed to reach is the cleaned position rounded up to a term boundary
plus two terms.  A writer below that limit may claim up to the end of the limit's term and
rotate into the next, and a reader scans on until it finds a zero frame length, at the start of
that next term too; so every partition a writer can reach must already be clean, not only the
bytes below the limit, or a reader would take the old frames behind the tail for new ones.  In
steady state (cleaning one term behind the consumer) the rule never binds; it does while
cleaning lags.  Positions and lengths in bytes.
"""

from __future__ import annotations

from typing import Final

from slipstream.client.logbuffer import LogBuffer
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network

#: Bytes zeroed per call: a whole 64 MiB term at once holds a thread for tens of milliseconds,
#: while 1 MiB takes well under one (0.1 ms; 0.7 ms on the first lap of an IPC log, whose
#: pages the driver's mapping faults in as it cleans).
CLEAN_CHUNK_LENGTH: Final = 1 << 20


class LogCleaner:
    """Zeroes ``log`` from ``position`` toward the targets it is given, a chunk per call.

    The rule and the state are the C half's (``ss_log_cleaner_t``, :attr:`c`): a network
    agent's C half cleans with the same struct between the Python half's passes."""

    __slots__ = ("c", "log")

    def __init__(self, log: LogBuffer, position: int,
                 chunk_length: int = CLEAN_CHUNK_LENGTH) -> None:
        self.log = log
        self.c = c = network_ffi.new("ss_log_cleaner_t *")
        c.position = position  # where the log starts: below, nothing was ever written
        c.target = position
        c.chunk_length = chunk_length

    @property
    def position(self) -> int:
        """Zeroed up to here (bytes)."""
        return self.c.position

    def clean_toward(self, consumer_position: int) -> bool:
        """Zero up to one chunk toward one term behind ``consumer_position``; True when it
        zeroed something (the caller may want another call soon: see :attr:`is_behind`)."""
        log = self.log
        return bool(network.ss_clean_toward(self.c, log.address, log.term_length,
                                            log.position_bits, consumer_position))

    def hold(self) -> None:
        """Nothing to clean for until consumers move again (the last consumer left)."""
        self.c.target = self.c.position

    @property
    def is_behind(self) -> bool:
        """The last call left cleanable bytes for the next."""
        return self.c.position < self.c.target

    def reusable_limit(self) -> int:
        """The highest limit partition reuse allows writers (see the module docstring)."""
        return network.ss_reusable_limit(self.c, self.log.term_length)

    def due_position(self) -> int:
        """The slowest consumer's position from which there is cleaning to do (half a term,
        or a chunk), the rule both halves use (``ss_clean_due_position``)."""
        return network.ss_clean_due_position(self.c, self.log.term_length)
