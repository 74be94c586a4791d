"""NAK-strength send-rate adaptation (``rc=nak-strength``; docs/FLOW.md, docs/DRIVER.md §5.6).

Receivers say how full they are; the sender adapts its rate.  No list of receivers: a receiver
that pauses or dies stops signalling and costs the sender nothing, which is the point of the
design against ``fc=min``, whose sender waits for its slowest receiver until a timeout.

* **Receiver** (:class:`NakStrengthSignaller`, one per image of a sender that announced
  itself with a :class:`~slipstream.client.frames.RateAnnounce`): the image's fill is the
  bytes between its slowest subscriber and its high-water mark, per mille of its window,
  counting only what its subscribers could have read: data that has been readable for
  :data:`READ_GRACE_NS`, and data above a gap only once that gap outlived two repairs
  (``SS_RATE_SIGNAL_GAP_NAKS``, see the class).  Crossing a threshold upward sends a
  :class:`~slipstream.client.frames.RateSignal` (with the rate its subscribers took
  lately); staying above one repeats it once per window while the backlog is not
  shrinking.  Below the lowest threshold it sends nothing, and so does a receiver whose
  subscribers took nothing for a window.
* **Sender** (:class:`NakStrengthRateControl`): a send-rate limit (bytes/s), enforced per
  datagram by the C data path (a token bucket on ``ss_send_publication_t``).  It starts
  unlimited.  A signal cuts the rate the sender was achieving, or the rate the signalling
  receiver's subscribers took if that is lower (the signal carries it), by ``depth x
  threshold``; within one window only a signal that cuts deeper counts (from the same base),
  so N receivers that signal together cut once, to what the slowest of them takes.  While
  no signal comes the limit climbs once per window: quickly back toward the *knee* (the rate
  the last cut started from), then past it in doubling steps, and once it is four times the
  knee the limit is lifted, unless the sender used most of it (it has a backlog, which a
  lift would burst at line rate): then the doubling goes on until the limit no longer binds.

The climb's steps and the depth of a cut are not tuned by hand for one system: what they
depend on (the volatility of the send rate, the latency of the link) is found here as the
stream runs:

* the **steps** scale with the knee, so the same defaults serve a loopback stream of GB/s and a
  100 Mbit/s link, and the climb slows where the last signal came;
* the **depth** of a cut adapts to how soon the next signal comes: a signal within two
  windows of the last hold means the cut was too shallow (deeper next time, up to
  :data:`MAX_DEPTH`); a signal after :data:`CALM_WINDOWS` quiet windows means it was deeper
  than needed (shallower, down to :data:`MIN_DEPTH`).

Both classes are sans-I/O: every call takes ``now_ns``; units are bytes, bytes/s and ns.

The sender's side is a strategy behind the :class:`RateControl` interface (``rc=`` names one),
as flow and congestion control are; NAK strength is the one shipped, and lives here beside
the interface with the receiver's side of the signals, which every strategy's receivers run.
"""

from __future__ import annotations

import abc
from collections import deque
from typing import Self

from slipstream.client import strategy_grammar
from slipstream.client.frames import RateAnnounce
from slipstream.client.layout import NO_DEADLINE, RATE_SIGNAL_MAX_RATE
from slipstream.daemon.flow.strategy import Strategy, registrar
from slipstream.daemon.protocol.params import RateControlParams

#: How often a sender repeats its announcement (and at once to each new receiver).
ANNOUNCE_INTERVAL_NS = 1_000_000_000
#: The first cut takes rate x (1 - depth x threshold/100): half the rate at 100 %.
INITIAL_DEPTH = 0.5
MIN_DEPTH = 0.2
MAX_DEPTH = 0.9
#: Quiet windows after which a signal finds the last cut deeper than needed.
CALM_WINDOWS = 40
#: The limit is lifted once it climbed to this multiple of the knee with no signal, unless it
#: binds: a sender that sent at least BINDING_NUMERATOR / BINDING_DENOMINATOR of it over the
#: last window has a backlog, which a lift would send at line rate before any receiver could
#: signal; its limit goes on doubling its steps instead, and is lifted once it no longer binds.
LIFT_FACTOR = 4
BINDING_NUMERATOR = 3
BINDING_DENOMINATOR = 4
#: The lowest limit (datagrams of one MTU per second): a receiver that keeps signalling slows
#: the stream to a trickle, never to a stop.
MIN_DATAGRAMS_PER_S = 64
#: The bucket holds this much time at the limit (and at least BURST_DATAGRAMS datagrams): a
#: parked network thread wakes late by the scheduler's latency (and in whole milliseconds on a
#: kernel without epoll_pwait2), so less would lose rate to the late wake-ups.
BURST_NS = 4_000_000
BURST_DATAGRAMS = 4
#: Data counts in a receiver's fill once it has been readable this long: what a repair makes
#: readable all at once, a subscriber that keeps up has read by then, and a slow one has not
#: (its first signal comes this much later).
READ_GRACE_NS = 1_000_000


class RateControl(Strategy):
    """A publication's send-rate limit from its receivers' rate signals: the interface of the
    ``rc=`` strategies.

    :attr:`rate_limit` is what the C data path enforces (a token bucket of :meth:`burst`
    bytes; 0: no limit); the publication sends :meth:`announcement` (its receivers then
    signal), calls :meth:`on_signal` for each
    :class:`~slipstream.client.frames.RateSignal` it heeds and :meth:`on_tick` at
    :meth:`next_deadline_ns`, passing snd-pos.  Its declarations
    (:class:`~slipstream.daemon.flow.strategy.Strategy`): ``uri``, the ``rc=`` grammar (the
    options beyond the thresholds and window reach it as ``params.options``); its counter is
    the interface's (``snd-rate``: :attr:`rate_limit`)."""

    uri_key = "rc"
    #: bytes/s the data path may send; 0: no limit.
    rate_limit: int

    @classmethod
    @abc.abstractmethod
    def from_params(cls, params: RateControlParams, *, mtu: int, now_ns: int,
                    sender_position: int) -> Self:
        """The strategy of a publication with ``params`` and ``mtu``, made at ``now_ns`` with
        the sender at ``sender_position``."""

    @abc.abstractmethod
    def on_signal(self, now_ns: int, threshold: int, sender_position: int,
                  consumption_rate: int = 0) -> bool:
        """A receiver crossed ``threshold`` percent of its window; its subscribers took
        ``consumption_rate`` bytes/s lately (0: unknown).  Returns whether the limit went
        down."""

    @abc.abstractmethod
    def on_tick(self, now_ns: int, sender_position: int) -> None:
        """Time passed (at :meth:`next_deadline_ns` or later)."""

    @abc.abstractmethod
    def next_deadline_ns(self) -> int:
        """When :meth:`on_tick` has work."""

    @abc.abstractmethod
    def burst(self) -> int:
        """The token bucket's size for the current limit (bytes)."""

    @abc.abstractmethod
    def announcement(self, session_id: int, stream_id: int) -> RateAnnounce:
        """What the sender tells its receivers so that they signal."""


#: Registers a RateControl class under its ``rc=`` name (a strategy module calls it at its
#: bottom); returns the class.
register_rate_control = registrar(RateControl)


class NakStrengthRateControl(RateControl):
    """A publication's send-rate limit from NAK-strength signals.  See the module docstring.

    :attr:`rate_limit` is what the C data path enforces (0: none); the publication calls
    :meth:`on_signal` for each :class:`RateSignal` and :meth:`on_tick` at
    :meth:`next_deadline_ns`, passing snd-pos (the rate it achieves is measured from it)."""

    uri = strategy_grammar.NAK_STRENGTH

    def __init__(self, params: RateControlParams, *, mtu: int, now_ns: int,
                 sender_position: int) -> None:
        self.thresholds = params.thresholds
        self.window_ns = params.window_ns
        self.mtu = mtu
        self.min_rate = mtu * MIN_DATAGRAMS_PER_S
        #: bytes/s the data path may send; 0: no limit.
        self.rate_limit = 0
        #: The rate the last cut started from: where signals came last (bytes/s; 0: none yet).
        self.knee = 0
        self.depth = INITIAL_DEPTH
        self.signals = 0  # received
        self.cuts = 0
        #: bytes/s sent over the last whole window (snd-pos).
        self.sent_rate = 0
        self._sample = (now_ns, sender_position)  # the start of the current window
        self._previous_sample = self._sample  # the start of the one before
        self._next_tick_ns = now_ns + self.window_ns
        self._hold_until_ns = 0  # a window in which only a deeper cut counts
        self._cut_base = 0
        self._probe_step = 0
        self._last_cut_ns: int | None = None

    @classmethod
    def from_params(cls, params: RateControlParams, *, mtu: int, now_ns: int,
                    sender_position: int) -> Self:
        return cls(params, mtu=mtu, now_ns=now_ns, sender_position=sender_position)

    # -- signals -------------------------------------------------------------------------
    def on_signal(self, now_ns: int, threshold: int, sender_position: int,
                  consumption_rate: int = 0) -> bool:
        """A receiver crossed ``threshold`` percent of its window; its subscribers took
        ``consumption_rate`` bytes/s lately (0: unknown).  Returns whether the limit went
        down: to the rate achieved (or the receiver's, if lower) x (1 - depth x threshold).
        Within the window of the last cut a signal counts only if it cuts deeper, from the
        base of that cut or the lower rate this receiver took."""
        self.signals += 1
        in_hold = now_ns < self._hold_until_ns
        if in_hold:
            base = self._cut_base
        else:
            base = self._achieved_rate(now_ns, sender_position)
            if self.rate_limit:
                base = min(base, self.rate_limit) if base else self.rate_limit
            self._tune_depth(now_ns)
        if consumption_rate > 0:
            base = min(base, consumption_rate) if base else consumption_rate
        # A rate measured over the first nanoseconds of a stream can be any size: the limit
        # stays below what a signal may carry (and the C data path's arithmetic takes).
        base = min(max(base, self.min_rate), RATE_SIGNAL_MAX_RATE - 1)
        limit = max(self.min_rate, int(base * (1.0 - self.depth * threshold / 100)))
        if in_hold and self.rate_limit and limit >= self.rate_limit:
            return False
        if not in_hold:
            self._hold_until_ns = now_ns + self.window_ns
        self._cut_base = self.knee = base
        before = self.rate_limit
        self.rate_limit = min(before, limit) if before else limit
        self._probe_step = 0
        self._last_cut_ns = now_ns
        if self.rate_limit == before:
            return False  # already at the floor: held there for the window, no cut
        self.cuts += 1
        return True

    def _tune_depth(self, now_ns: int) -> None:
        """Deeper when signals recur within two windows of the last hold, shallower after a
        long calm (the module docstring)."""
        if self._last_cut_ns is None:
            return
        quiet_ns = now_ns - self._hold_until_ns
        if quiet_ns < 2 * self.window_ns:
            self.depth = min(MAX_DEPTH, self.depth * 1.25)
        elif quiet_ns > CALM_WINDOWS * self.window_ns:
            self.depth = max(MIN_DEPTH, self.depth * 0.8)

    def _achieved_rate(self, now_ns: int, sender_position: int) -> int:
        """bytes/s sent from the start of the last whole window to now."""
        start_ns, start_position = self._previous_sample
        elapsed = now_ns - start_ns
        if elapsed <= 0:
            return self.sent_rate
        return (sender_position - start_position) * 1_000_000_000 // elapsed

    # -- time ----------------------------------------------------------------------------
    def on_tick(self, now_ns: int, sender_position: int) -> None:
        """A window passed: measure the rate sent, and raise the limit unless a signal came
        within the window."""
        if now_ns < self._next_tick_ns:
            return
        start_ns, start_position = self._sample
        if now_ns > start_ns:
            self.sent_rate = (sender_position - start_position) * 1_000_000_000 // (
                now_ns - start_ns)
        self._previous_sample = self._sample
        self._sample = (now_ns, sender_position)
        self._next_tick_ns = now_ns + self.window_ns
        if not self.rate_limit or now_ns < self._hold_until_ns:
            return
        step_floor = max(self.min_rate, self.knee // 32)
        if self.rate_limit < self.knee:
            self.rate_limit = min(self.knee, self.rate_limit + max(
                step_floor, (self.knee - self.rate_limit) // 4))
        else:
            # The window just measured ran under the limit before this raise.
            binding = self.sent_rate * BINDING_DENOMINATOR >= self.rate_limit * BINDING_NUMERATOR
            self._probe_step = 2 * self._probe_step if self._probe_step else step_floor
            self.rate_limit += self._probe_step
            if self.rate_limit >= RATE_SIGNAL_MAX_RATE or (
                    self.rate_limit >= LIFT_FACTOR * self.knee and not binding):
                self.rate_limit = 0

    def next_deadline_ns(self) -> int:
        """When :meth:`on_tick` has work: the end of the current window."""
        return self._next_tick_ns

    def burst(self) -> int:
        """The token bucket's size for the current limit (bytes)."""
        return max(BURST_DATAGRAMS * self.mtu, self.rate_limit * BURST_NS // 1_000_000_000)

    def announcement(self, session_id: int, stream_id: int) -> RateAnnounce:
        """What the sender tells its receivers so that they signal."""
        return RateAnnounce(session_id, stream_id, max(1, self.window_ns // 1000),
                            self.thresholds)

    def __repr__(self) -> str:
        return (f"<NakStrengthRateControl limit={self.rate_limit} knee={self.knee} "
                f"depth={self.depth:.2f} cuts={self.cuts}>")


class NakStrengthSignaller:
    """An image's NAK-strength signals, once its sender announced itself.  See the module
    docstring; these rules keep the signals to what slowing the sender can fix:

    * the fill counts what the subscribers could have read and did not.  The image passes
      the *top* it counts to (``ss_image_rate_signal_top``): its hwm, but only what arrived
      in order while the first gap has not outlived two repairs, since a one-off loss keeps
      data waiting above the gap that no rate would have saved.  Of that, what became
      readable less than ``read_grace_ns`` ago does not count yet: a repair makes a whole
      window readable at once, which a subscriber that keeps up reads at once.  Data above
      a gap that outlives two repairs does count: a narrow link whose queue drops the
      repairs too must slow the sender (``cc=cubic`` is the answer to a link the stream
      merely overruns, docs/FLOW.md);

    * a held level is repeated (once per window) only while the backlog (the counted top minus the
      slowest subscriber, bytes) is not shrinking: a receiver that drains its backlog at the
      rate it was given asks for nothing more;
    * a receiver whose subscribers took nothing for a whole window is *stalled* (paused or
      dead, not slow): no rate would help it, so it signals nothing, as a dead one would,
      and the stream goes on for the others.  When its subscribers move again, crossing a
      threshold signals at once.
    """

    def __init__(self, announce: RateAnnounce, *, read_grace_ns: int = READ_GRACE_NS) -> None:
        self.thresholds: tuple[int, ...] = ()
        self.window_ns = 0
        self.read_grace_ns = read_grace_ns
        #: (time, top) at each look that moved the top, from the latest one at least
        #: read_grace_ns old.
        self._tops: deque[tuple[int, int]] = deque()
        self._matures_ns = NO_DEADLINE  # when a top already past a threshold starts to count
        self.level = 0  # the threshold signalled last while above it; 0: below all
        self.stalled = False
        self._window_start_ns = 0  # of the window a held level is judged over
        self._backlog_at_window_start = 0
        self._consumption_position: int | None = None
        self._last_progress_ns = 0
        self._last_look_ns = 0
        # (time, consumption) at the start of the previous window and of the current one:
        # the consumption rate is measured over one to two windows.
        self._rate_samples: tuple[tuple[int, int], tuple[int, int]] | None = None
        self.on_announce(announce)

    def on_announce(self, announce: RateAnnounce) -> None:
        """The sender (re)announced its thresholds and window."""
        self.thresholds = announce.thresholds
        self.window_ns = announce.window_us * 1000

    @staticmethod
    def fill_permille(consumption_position: int, hwm_position: int, window: int) -> int:
        """How full the image is: the bytes between the slowest subscriber and the high-water
        mark, per mille of the window, at most 1000."""
        if window <= 0:
            return 1000
        return max(0, min(1000, (hwm_position - consumption_position) * 1000 // window))

    def consumption_rate(self, now_ns: int, consumption_position: int) -> int:
        """bytes/s the slowest subscriber took over the last one to two windows (0: less
        than a millisecond measured)."""
        samples = self._rate_samples
        if samples is None:
            samples = self._rate_samples = ((now_ns, consumption_position),) * 2
        elif now_ns - samples[1][0] >= self.window_ns:
            samples = self._rate_samples = (samples[1], (now_ns, consumption_position))
        start_ns, start_position = samples[0]
        if now_ns - start_ns < 1_000_000:
            return 0
        return max(0, consumption_position - start_position) * 1_000_000_000 // (
            now_ns - start_ns)

    def readable_position(self, now_ns: int, consumption_position: int,
                          top_position: int) -> int:
        """Where the counted fill ends: the lowest top since the last look at least
        ``read_grace_ns`` ago (what has been there all that time), or the consumption position
        when no look is that old.  Records this look."""
        tops = self._tops
        if not tops or tops[-1][1] != top_position:  # kept: when the top first got there
            tops.append((now_ns, top_position))
        horizon = now_ns - self.read_grace_ns
        while len(tops) > 1 and tops[1][0] <= horizon:
            tops.popleft()
        if tops[0][0] > horizon:
            return consumption_position
        return max(consumption_position, min(top for _, top in tops))

    def signal(self, now_ns: int, consumption_position: int, top_position: int,
               window: int) -> tuple[int, int, int] | None:
        """(threshold, fill per mille, consumption rate in bytes/s) to signal at ``now_ns``,
        or None: a higher threshold crossed, or the current one held for a window with the
        backlog not shrinking.  ``top_position``: where the image counts its fill to now (the
        class docstring); what reached there less than ``read_grace_ns`` ago counts later."""
        self._last_look_ns = now_ns
        counted = self.readable_position(now_ns, consumption_position, top_position)
        if top_position <= consumption_position:
            # Nothing waited for the subscribers: what they took was what arrived, not what
            # they can take.  The rate is measured from the next look that finds something
            # waiting (at a stream's start, the milliseconds before its data skewed it low).
            self._rate_samples = None
            rate = 0
        else:
            rate = self.consumption_rate(now_ns, consumption_position)
        if self._consumption_position is None or consumption_position > self._consumption_position:
            self._consumption_position = consumption_position
            self._last_progress_ns = now_ns
        elif now_ns - self._last_progress_ns > self.read_grace_ns:
            # Not reading now (a pause begins, or a stall): what it took lately says nothing of
            # what it can take; the sender cuts from its own rate.
            rate = 0
        backlog = max(0, counted - consumption_position)
        fill = self.fill_permille(consumption_position, counted, window)
        level = 0
        for threshold in self.thresholds:
            if fill >= threshold * 10:
                level = threshold
        stalled = level > 0 and now_ns - self._last_progress_ns > self.window_ns
        if self.stalled and not stalled:
            # Moving again: what it takes is measured from now, not over the pause.
            self._rate_samples = ((now_ns, consumption_position),) * 2
            rate = 0
        self.stalled = stalled
        if stalled or not level:
            self.level = 0
            return None
        window_over = now_ns >= self._window_start_ns + self.window_ns
        if level > self.level or (window_over and backlog >= self._backlog_at_window_start):
            self._start_window(now_ns, level, backlog)
            return level, fill, rate
        if level < self.level or window_over:
            # Lower, or draining: no signal, and the next window is judged from here.
            self._start_window(now_ns, level, backlog)
        return None

    def _start_window(self, now_ns: int, level: int, backlog: int) -> None:
        self.level = level
        self._window_start_ns = now_ns
        self._backlog_at_window_start = backlog

    def next_signal_position(self, consumption_position: int, window: int) -> int:
        """The top (the image's, as passed to :meth:`signal`) from which the image, at
        ``consumption_position``, crosses a threshold above its level (NO_DEADLINE: none
        left, or stalled, or the top is past it already and counts from
        :meth:`next_deadline_ns`): the C half wakes Python there."""
        self._matures_ns = NO_DEADLINE
        if self.stalled:
            return NO_DEADLINE
        for threshold in self.thresholds:
            if threshold > self.level:
                position = consumption_position + (window * threshold + 99) // 100
                # Past it already, but not for long enough: it counts once the latest run of
                # looks at or past it is read_grace_ns old (the top can fall back, as when an
                # old gap is repaired and a young one is next).
                crossed_ns = None
                for seen_ns, seen_top in reversed(self._tops):
                    if seen_top < position:
                        break
                    crossed_ns = seen_ns
                if crossed_ns is None:
                    return position
                self._matures_ns = max(crossed_ns + self.read_grace_ns, self._last_look_ns + 1)
                return NO_DEADLINE
        return NO_DEADLINE

    def next_deadline_ns(self) -> int:
        """When a held level may be signalled again, a stalled receiver looks whether its
        subscribers moved, or a top past the next threshold starts to count (NO_DEADLINE:
        none of these)."""
        if self.stalled:
            return self._last_look_ns + self.window_ns
        held = self._window_start_ns + self.window_ns if self.level else NO_DEADLINE
        return min(held, self._matures_ns)


register_rate_control(NakStrengthRateControl)
