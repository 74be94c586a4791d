"""The client's idle strategy for loops that retry at once (``spins_before_yield``): past
``spins`` calls in a row that did nothing, the next one waits for work in C with the GIL
released: it gives the CPU up between looks for ``IDLE_YIELD_NS``, then parks on the log's
eventcount (the one the driver, or the publisher of an IPC stream, bumps when the data or the
credit it waits for comes) for at most ``IDLE_PARK_NS``; each further one parks at once.  A
parked thread takes no CPU another thread needs: on a machine with fewer cores than busy
threads, the driver's network threads that bring the credit or the data then get the cores.
``offer()`` runs the same rule in C (client/fastpath.c).  With an embedded driver (invoker
mode) nothing but the waiting thread moves the data, so there it only yields (``sched_yield``)."""

from __future__ import annotations

import os
from collections.abc import Callable

#: How long the first wait of an idle spell gives the CPU up between looks before it parks:
#: work that comes within it costs no wake-up (about 50 µs on a VM whose idle vCPU sleeps).
IDLE_YIELD_NS = 20_000
#: The longest one idle call parks: the loop gets its call back at least this often, whatever
#: wakes it (credit, data, an image, a close).
IDLE_PARK_NS = 1_000_000

#: ``wait(yield_ns, park_ns)``: waits in C for the work a loop retries for.
Wait = Callable[[int, int], object]


class SpinThenPark:
    """Counts calls in a row that did nothing (``misses``); :meth:`idle` after each of them,
    ``misses = 0`` after one that did something.  ``spins`` None never idles; ``wait`` None
    (an embedded driver's client) yields the CPU instead of waiting."""

    __slots__ = ("misses", "spins", "wait")

    def __init__(self, spins: int | None, wait: Wait | None) -> None:
        self.spins = spins
        self.wait = wait
        self.misses = 0

    def idle(self) -> None:
        """A call did nothing: spin on (count it) or, past ``spins``, wait for work: the first
        wait of a spell yields for IDLE_YIELD_NS, then parks; later ones park at once."""
        spins = self.spins
        if spins is None:
            return
        misses = self.misses
        if misses < spins:
            self.misses = misses + 1
        elif self.wait is None:
            os.sched_yield()
        elif misses == spins:
            self.misses = misses + 1
            self.wait(IDLE_YIELD_NS, IDLE_PARK_NS)
        else:
            self.wait(0, IDLE_PARK_NS)
