"""Loss detection and NAK timing on the receiver (docs/DRIVER.md §4.4; aeron_loss_detector.c).

An image's rebuild pass (``ss_image_track_rebuild``, daemon/network_duty.c) scans with the
detector's C struct (:attr:`LossDetector.c`); :meth:`LossDetector.scan` is one term's scan
from a rebuild position to a high-water mark.  One C call (``ss_loss_scan``,
daemon/network_loss.c) finds the gaps between them,
up to :data:`MAX_GAPS` in stream order (Aeron's detector handles only the first; see the
class), and keeps their timers:

* a gap seen for the first time gets a timer at ``now + delay`` (first delay);
* when its timer expires the gap is NAKed (``on_loss``) and re-armed with the retry delay, so
  the same gap is re-NAKed until it is filled; a filled gap is forgotten.

The delays are drawn ahead, and again only once a scan has used them: the gaps first seen in
one pass share a first delay, those NAKed in one pass a retry delay (for the multicast
generator, one random backoff per pass, which is what spreads receivers apart).

Delay generators (one small class each, chosen by the image):

* :class:`StaticDelayGenerator` for unicast: ``nak_unicast_delay`` (100 µs) first, then
  ``delay * nak_unicast_retry_delay_ratio`` (10 ms) between retries.  A unicast image's
  detector adapts the retry (``adapt_retry``): once it has measured a repair (the time from a
  gap's only NAK to the scan that finds it filled, smoothed as RFC 6298 smooths a round
  trip), a gap is NAKed again after ``srtt + 4 rttvar`` within [first delay, that ceiling],
  doubled for each further NAK of the same gap up to the ceiling (so a partition costs a NAK
  per gap every ceiling, as before, not one per measured repair time).
  On a LAN a lost retransmission is then asked for again within a few hundred µs, where a
  fixed 10 ms (Aeron's, which suits a WAN) pinned the window for 10 ms each time; on a WAN
  the measured time keeps retries from outrunning the repair in flight.
* :class:`OptimalMulticastDelayGenerator` for multicast/group images: a random truncated
  exponential backoff in ``[0, max_backoff)`` for first and retry alike, so one receiver's NAK
  (and the retransmit everyone sees) suppresses the others'.

All times in ns, offsets and lengths in bytes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from slipstream.client.logbuffer import compute_term_id
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network


class StaticDelayGenerator:
    """Fixed delays (aeron_loss_detector static generator): first ``delay_ns``, retries
    ``retry_delay_ns``."""

    __slots__ = ("delay_ns", "retry_delay_ns")

    def __init__(self, delay_ns: int, retry_delay_ns: int) -> None:
        self.delay_ns = delay_ns
        self.retry_delay_ns = retry_delay_ns

    def first_delay(self) -> int:
        return self.delay_ns

    def retry_delay(self) -> int:
        return self.retry_delay_ns

    def __repr__(self) -> str:
        return f"StaticDelayGenerator({self.delay_ns}, {self.retry_delay_ns})"


class OptimalMulticastDelayGenerator:
    """Optimal multicast feedback delay (Nonnenmacher & Biersack), as Aeron's
    ``aeron_optimal_multicast_delay_generator``.

    With ``T = max_backoff_ns`` and ``N = group_size``, ``λ = ln(N) + 1``:
    ``x = U[0,1)·λ/T + λ/(T(e^λ−1))`` and ``delay = (T/λ)·ln(x·(e^λ−1)·T/λ)`` in ``[0, T)``.
    ``rng`` is injected so simulations are reproducible.
    """

    __slots__ = (
        "_factor",
        "_lambda",
        "_offset",
        "_scale",
        "group_size",
        "max_backoff_ns",
        "rng",
    )

    def __init__(self, max_backoff_ns: int, group_size: int, rng: random.Random) -> None:
        self.max_backoff_ns = max_backoff_ns
        self.group_size = group_size
        self.rng = rng
        t = float(max_backoff_ns)
        lam = math.log(group_size) + 1.0
        self._lambda = lam
        self._factor = (math.exp(lam) - 1.0) * (t / lam)  # (e^λ − 1)·T/λ
        self._offset = lam / (t * (math.exp(lam) - 1.0))  # λ/(T(e^λ−1))
        self._scale = t / lam

    def _generate(self) -> int:
        t = float(self.max_backoff_ns)
        x = self.rng.random() * self._lambda / t + self._offset
        delay = int(self._scale * math.log(x * self._factor))
        return min(max(delay, 0), self.max_backoff_ns - 1) if self.max_backoff_ns > 0 else 0

    def first_delay(self) -> int:
        return self._generate()

    def retry_delay(self) -> int:
        return self._generate()

    def __repr__(self) -> str:
        return f"OptimalMulticastDelayGenerator({self.max_backoff_ns}, {self.group_size})"


DelayGenerator = StaticDelayGenerator | OptimalMulticastDelayGenerator

#: on_loss(term_id, term_offset, length)
LossHandler = Callable[[int, int, int], None]


#: Gaps a scan tracks at once, in stream order (Aeron tracks one; see LossDetector): a window
#: of megabytes at a few percent loss holds hundreds.
MAX_GAPS = network.SS_LOSS_GAPS_MAX


class LossDetector:
    """The gaps of the rebuild term and their NAK timers (aeron_loss_detector_t, widened).

    Aeron's detector keeps one active gap: the second gap of a window is NAKed only once the
    first is filled, so with random loss the gaps of one window are repaired one round trip
    after another, and a window of a few megabytes at 1 % loss (dozens of gaps) stalls the
    stream for dozens of round trips.  This one tracks up to :data:`MAX_GAPS` gaps from the
    rebuild position, each with its own timer from when it was first seen (first delay, then
    retry delay), and NAKs each when its timer fires.  On the wire these are plain NAKs, so
    any Aeron sender answers them.
    """

    __slots__ = ("_first_delay", "_retry_delay", "c", "delay_generator", "new_gaps", "on_gap",
                 "on_loss")

    def __init__(self, delay_generator: DelayGenerator, on_loss: LossHandler | None = None,
                 on_gap: Callable[[int, int], None] | None = None, *,
                 adapt_retry: bool = False) -> None:
        """``on_loss(term_id, term_offset, length)`` sends a NAK; ``on_gap(length, count)``
        hears of the gaps each scan saw first (their bytes and number: the loss report): what
        :meth:`scan` calls (an image's rebuild pass, ``ss_image_track_rebuild``, queues the
        NAKs and records the gaps itself, and calls :meth:`used_delays`);
        ``adapt_retry``: the generator's retry delay is a ceiling, and a gap is NAKed again
        after the measured repair time allows (unicast: see the module docstring)."""
        self.delay_generator = delay_generator
        self.on_loss = on_loss
        self.on_gap = on_gap
        self.c = network_ffi.new("ss_loss_detector_t *")
        self.c.adapt_retry = int(adapt_retry)
        self.new_gaps = 0  # of the last scan: gaps it saw first
        self._first_delay = delay_generator.first_delay()
        self._retry_delay = delay_generator.retry_delay()

    def delays(self) -> tuple[int, int]:
        """(first delay, retry delay) drawn ahead for the next scan (ns)."""
        return self._first_delay, self._retry_delay

    def used_delays(self) -> None:
        """A scan ran (:attr:`c` holds what it saw): draw again the delays it used, the first
        delay if it saw a gap first, the retry delay if it NAKed one."""
        c = self.c
        if c.fresh_count:
            self._first_delay = self.delay_generator.first_delay()
        if c.due_count:
            self._retry_delay = self.delay_generator.retry_delay()

    @property
    def repair_time_ns(self) -> tuple[int, int] | None:
        """The smoothed repair time and its variation (ns), None before the first repair of a
        gap NAKed once."""
        c = self.c
        return (c.repair_srtt_ns, c.repair_rttvar_ns) if c.repair_samples else None

    def retry_delay_ns(self) -> int:
        """The delay a gap NAKed now waits before it is NAKed again."""
        return network.ss_loss_retry_delay(self.c, self._first_delay, self._retry_delay)

    @property
    def gaps(self) -> dict[tuple[int, int], tuple[int, int]]:
        """The tracked gaps: (term_id, term_offset) -> (expiry ns, length)."""
        c = self.c
        return {(g.term_id, g.term_offset): (g.expiry_ns, g.length)
                for g in (c.gaps[i] for i in range(c.gap_count))}

    def scan(self, term, rebuild_position: int, hwm_position: int, now_ns: int,
             term_length: int, position_bits: int, initial_term_id: int) -> tuple[int, bool]:
        """Scan ``term`` (cffi ``uint8_t *`` of the partition holding ``rebuild_position``).

        Returns ``(rebuild_offset, loss_found)``: the offset in the rebuild term up to which
        everything is present (the term length when the term is complete), and whether a gap
        lies before the high-water mark.  :attr:`new_gaps` says how many of the gaps this scan
        saw for the first time (Aeron's ``loss_found``, what congestion control hears).
        Calls ``on_loss`` for each gap whose timer expired.
        """
        c = self.c
        self.new_gaps = 0
        rebuild_offset = rebuild_position & (term_length - 1)
        if rebuild_position >= hwm_position:
            if c.gap_count:
                network.ss_loss_all_filled(c, now_ns)
            return rebuild_offset, False
        rebuild_term_count = rebuild_position >> position_bits
        limit_offset = (hwm_position & (term_length - 1)
                        if rebuild_term_count == hwm_position >> position_bits else term_length)
        term_id = compute_term_id(rebuild_position, position_bits, initial_term_id)
        first = network.ss_loss_scan(c, term, term_id, rebuild_offset, limit_offset, now_ns,
                                     self._first_delay, self._retry_delay)
        if first >= limit_offset:
            # Everything up to the limit is there; nothing to NAK (a gap beyond the limit, in
            # a later term, shows up on the next pass from the new rebuild position).
            return first, False
        self.new_gaps = c.fresh_count
        if c.fresh_count and self.on_gap is not None:
            self.on_gap(c.fresh_bytes, c.fresh_count)
        self.used_delays()
        if c.due_count and self.on_loss is not None:
            gaps, due, on_loss = c.gaps, c.due, self.on_loss
            for i in range(c.due_count):
                gap = gaps[due[i]]
                on_loss(term_id, gap.term_offset, gap.length)
        return first, True

    def next_deadline_ns(self) -> int:
        """When the next gap's NAK (re)fires; NO_DEADLINE without a gap."""
        return network.ss_loss_next_deadline(self.c)

    def __repr__(self) -> str:
        return f"<LossDetector gaps={self.gaps}>"
