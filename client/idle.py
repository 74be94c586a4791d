"""The client's idle strategy for loops that retry at once (``spins_before_yield``):
past ``spins`` calls in a row that did nothing, each further one gives the CPU up
(``sched_yield``), so that on a machine with fewer cores than busy threads the driver that
brings the credit or the data gets to run.  ``offer()`` runs the same rule in C
(client/fastpath.c)."""

from __future__ import annotations

import os


class SpinThenYield:
    """Counts calls in a row that did nothing (``misses``); :meth:`idle` after each of them,
    ``misses = 0`` after one that did something.  ``spins`` None never yields."""

    __slots__ = ("misses", "spins")

    def __init__(self, spins: int | None) -> None:
        self.spins = spins
        self.misses = 0

    def idle(self) -> None:
        """A call did nothing: spin on (count it) or, past ``spins``, yield the CPU."""
        spins = self.spins
        if spins is None:
            return
        if self.misses < spins:
            self.misses += 1
        else:
            os.sched_yield()
