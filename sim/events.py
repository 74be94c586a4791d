"""Virtual time: a deterministic discrete-event loop.

Everything in a simulation happens inside :meth:`EventLoop.run`, one action at a time, in the
order of ``(time_ns, phase, seq)``: earliest virtual time first; at equal times phase 0
(datagram arrivals, application actions) before phase 1 (host service passes, protocol timers);
at equal time and phase, first scheduled first.  ``seq`` is a counter, so two runs that schedule
the same things in the same order execute them in the same order: nothing here reads a real
clock, iterates a ``set`` or depends on ``id()``.

Time is ``int`` nanoseconds from the start of the simulation (0).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Final

#: Phase of arrivals and application work at a time step.
PHASE_INPUT: Final = 0
#: Phase of host service passes and timers: after every input of the same instant.
PHASE_SERVICE: Final = 1

Action = Callable[[], object]


class Timer:
    """A scheduled action; :meth:`cancel` makes the loop skip it."""

    __slots__ = ("action", "time_ns")

    def __init__(self, time_ns: int, action: Action) -> None:
        self.time_ns = time_ns
        self.action: Action | None = action

    def cancel(self) -> None:
        self.action = None

    @property
    def cancelled(self) -> bool:
        return self.action is None


class EventLoop:
    """A heap of ``(time_ns, phase, seq, timer)``; :attr:`now_ns` is the virtual clock."""

    def __init__(self) -> None:
        self.now_ns = 0
        self._heap: list[tuple[int, int, int, Timer]] = []
        self._seq = 0
        #: Actions executed so far (cancelled ones excluded), as of the last :meth:`run`'s return.
        self.executed = 0

    def call_at(self, time_ns: int, action: Action, phase: int = PHASE_INPUT) -> Timer:
        """Run ``action()`` at virtual time ``time_ns`` (ns; clamped to now: no going back)."""
        if time_ns < self.now_ns:
            time_ns = self.now_ns
        timer = Timer(time_ns, action)
        self._seq += 1
        heapq.heappush(self._heap, (time_ns, phase, self._seq, timer))
        return timer

    def call_later(self, delay_ns: int, action: Action, phase: int = PHASE_INPUT) -> Timer:
        """Run ``action()`` ``delay_ns`` ns from now."""
        return self.call_at(self.now_ns + delay_ns, action, phase)

    def next_time_ns(self) -> int | None:
        """Time of the earliest pending action, or None when nothing is pending."""
        heap = self._heap
        while heap and heap[0][3].action is None:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def run(self, until_ns: int, stop: Callable[[], bool] | None = None,
            check_every: int = 1, check_before_gap_ns: int | None = None) -> bool:
        """Execute actions in order until virtual time would pass ``until_ns`` (ns), nothing
        is left, or ``stop()`` returns true (checked every ``check_every`` actions, and, with
        ``check_before_gap_ns``, also before the clock moves on by that much or more: what
        ``stop`` waits for is seen when it happened, however sparse the actions are).

        Returns True when stopped by ``stop``.  The clock is left at the last action's time
        (or at ``until_ns`` when the limit was reached).
        """
        heap = self._heap
        pop = heapq.heappop
        gap_ns = check_before_gap_ns if stop is not None else None
        count = 0
        unchecked = False  # actions ran since stop() was last asked
        try:
            while heap:
                entry = heap[0]
                time_ns = entry[0]
                if unchecked and gap_ns is not None and time_ns - self.now_ns >= gap_ns:
                    unchecked = False
                    if stop():
                        return True
                if time_ns > until_ns:
                    self.now_ns = until_ns
                    # Checked every check_every actions: it may have happened since the last.
                    return bool(stop is not None and stop())
                pop(heap)
                action = entry[3].action
                if action is None:
                    continue
                self.now_ns = time_ns
                action()
                count += 1
                unchecked = True
                if stop is not None and count % check_every == 0:
                    unchecked = False
                    if stop():
                        return True
            return bool(stop is not None and stop())
        finally:
            self.executed += count  # once per run, not per action
