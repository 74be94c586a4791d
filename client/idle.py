"""The client's idle strategy for loops that retry at once (``spins_before_yield``), counted
per thread: past ``spins`` calls of a thread in a row that did nothing (offers without credit,
polls that moved nothing, of any publication or subscription), the next one waits for work
in C with the GIL released: it gives the CPU up between looks for ``IDLE_YIELD_NS``, then
parks on the log's eventcount (the one the driver, or the publisher of an IPC stream, bumps
when the data or the credit it waits for comes) for at most ``IDLE_PARK_NS``; each further one
parks at once.  A call that did something starts the count again.  So a loop that serves
several streams waits only once none of them has work, as an agent's duty cycle idles, and
then for one of them: another's work waits for the park's end (``IDLE_PARK_NS`` at most).

A parked thread takes no CPU another thread needs: on a machine with fewer cores than busy
threads, the driver's network threads that bring the credit or the data then get the cores.
``offer()`` runs the same rule in C (client/fastpath.c, which holds the count).  With an
embedded driver (invoker mode) nothing but the waiting thread moves the data, so there a
call only yields (``sched_yield``)."""

from __future__ import annotations

import os
from collections.abc import Callable

from slipstream.client import _fastpath

#: How long the first wait of an idle spell gives the CPU up between looks before it parks:
#: work that comes within it costs no wake-up (about 50 µs on a VM whose idle vCPU sleeps).
IDLE_YIELD_NS = 20_000
#: The longest one idle call parks: the loop gets its call back at least this often, whatever
#: wakes it (credit, data, an image, a close).
IDLE_PARK_NS = 1_000_000

#: ``wait(yield_ns, park_ns)``: waits in C for the work a loop retries for.
Wait = Callable[[int, int], object]

#: A call of this thread did something: its idle count starts again.
progress: Callable[[], None] = _fastpath.idle_progress


class SpinThenPark:
    """The idle strategy of one publication's or subscription's calls: :meth:`idle` after
    each call that did nothing, :func:`progress` after one that did something.  ``spins``
    None never idles; ``wait`` None (an embedded driver's client) yields the CPU instead of
    waiting.  ``waits`` counts the calls that gave the CPU up."""

    __slots__ = ("spins", "wait", "waits")

    def __init__(self, spins: int | None, wait: Wait | None) -> None:
        self.spins = spins
        self.wait = wait
        self.waits = 0

    def idle(self) -> None:
        """A call did nothing: spin on or, past ``spins`` such calls of this thread, wait for
        work: the first wait of a spell yields for IDLE_YIELD_NS, then parks; later ones park
        at once."""
        spins = self.spins
        if spins is None:
            return
        phase = _fastpath.idle_miss(spins)
        if not phase:
            return
        self.waits += 1
        if self.wait is None:
            os.sched_yield()
        else:
            self.wait(IDLE_YIELD_NS if phase == 1 else 0, IDLE_PARK_NS)
