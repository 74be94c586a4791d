"""Min multicast flow control (``fc=min``): the slowest live receiver sets the pace."""

from __future__ import annotations

from collections import deque
from typing import Self

from slipstream.client import strategy_grammar
from slipstream.client.frames import ErrorFrame, StatusMessage
from slipstream.client.layout import NO_DEADLINE
from slipstream.daemon.flow.flow_control import FlowControl, register_flow_control, sm_limit
from slipstream.daemon.protocol.params import FlowControlParams
from slipstream.daemon.protocol.types import Address

# (aeron_flow_control.h AERON_MIN_FLOW_CONTROL_RETRANSMIT_RECEIVER_WINDOW_MULTIPLE)
MIN_RETRANSMIT_WINDOW_MULTIPLE = 16
#: Status messages a new receiver sends, over at least the admission interval, before it
#: may hold the sender back (docs/DRIVER.md §5.7).
ADMISSION_STATUS_MESSAGES = 3
#: Receivers being heard at once at most: an SM naming yet another new receiver waits until
#: one is admitted or forgotten (a flood of receiver ids costs bounded memory).
ADMISSION_CANDIDATES_MAX = 1024
#: SETUP positions remembered for admission (one per SETUP that moved on, each kept for a
#: receiver timeout): past this the oldest goes.
ADMISSION_SETUPS_MAX = 64


class _Candidate:
    """A receiver not admitted yet: since when it has been heard consistently, how many
    status messages, and its last position + window."""

    __slots__ = ("count", "first_ns", "last_ns", "limit")

    def __init__(self, limit: int, now_ns: int) -> None:
        self.first_ns = self.last_ns = now_ns
        self.count = 1
        self.limit = limit


class _Receiver:
    __slots__ = ("eos_flagged", "last_position_plus_window", "receiver_id", "source",
                 "time_of_last_sm_ns")

    def __init__(self, receiver_id: int, limit: int, now_ns: int, source: Address) -> None:
        self.receiver_id = receiver_id
        self.last_position_plus_window = limit
        self.time_of_last_sm_ns = now_ns
        self.source = source
        self.eos_flagged = False


class MinMulticastFlowControl(FlowControl):
    """The slowest live receiver sets the pace (aeron_min_flow_control.c, ``fc=min``).

    Keeps ``receiver_id -> (position + window, time of last SM)``; the rules are Aeron's
    (docs/DRIVER.md §5.3, §5.4):

    * an SM gives ``max(snd_lmt, min over receivers)``; while fewer than ``group_min_size``
      receivers are known the limit stays and the publication is not connected (this is
      checked first); otherwise, with none tracked at all (``g:/0``, or none carrying the
      tag under ``tagged`` with no group minimum) the sender follows the SMs as ``max`` does
      rather than stall while it reports connected;
    * a receiver is added only within one window of the current minimum (a newcomer far
      behind would stall everyone) and never from an EOS SM;
    * :meth:`on_idle` drops receivers silent for ``receiver_timeout_ns`` and those flagged
      end-of-stream (an EOS SM or an ERR naming them: they stay counted until then), and
      gives the minimum itself, so a receiver that joined behind pulls the limit back;
    * admission (slipstream's, docs/DRIVER.md §5.7; ``admission_interval_ns`` 0 turns it
      off, as Aeron): a new receiver is tracked only once it was heard consistently, three
      SMs over at least ``admission_interval_ns``, each one past the last or with all that
      was sent (``sender_position``), none a window behind the one before (none ahead of
      snd-pos reaches it); until then it does not hold the sender back.  One that does not
      move is consistent too while it sits exactly at the position of a SETUP sent within
      the receiver timeout: that is where a receiver joining from it starts, and one whose
      subscriber has not read yet (a replay merge catching up) must hold the sender from
      there, or it would be over-run and left behind.  A receiver of the
      stream's start (its SM before the stream sent its first window, with all of it) is
      admitted at once: the receivers of a new stream join together, and one slower than
      the stream would be over-run while it waited.  A receiver admitted that then stops
      still holds the sender until ``receiver_timeout_ns``: that is what min means;
    * join protection: after an S-flagged SM from a receiver it does not track, the limit at
      the next SETUP caps the computed limit until a new receiver is added or one receiver
      timeout passes, so a newcomer can join before the window moves on (Aeron caps on any
      S-flagged SM; one from a receiver that has joined meanwhile stalled every receiver for
      the timeout, docs/DRIVER.md §5.4).
    """

    uri = strategy_grammar.MIN
    retransmit_window_multiple = MIN_RETRANSMIT_WINDOW_MULTIPLE
    tracks_receivers = True

    def __init__(self, *, receiver_timeout_ns: int, group_min_size: int = 0,
                 admission_interval_ns: int = 0) -> None:
        super().__init__()
        self.receiver_timeout_ns = receiver_timeout_ns
        self.group_min_size = group_min_size
        self.admission_interval_ns = admission_interval_ns
        self.receivers: dict[int, _Receiver] = {}
        #: Receivers being heard before they are admitted (admission_interval_ns > 0).
        self.candidates: dict[int, _Candidate] = {}
        self._start_position: int | None = None  # snd-pos at the first SM
        #: Receivers that asked for a SETUP (S-flagged SM) and are not tracked yet.
        self._setup_requesters: set[int] = set()
        self._last_setup_limit: int | None = None
        self._last_setup_ns = 0
        #: (time ns, position) of the SETUPs sent within the receiver timeout, oldest first:
        #: where a receiver that joined and has not read since sits.
        self._setups: deque[tuple[int, int]] = deque(maxlen=ADMISSION_SETUPS_MAX)

    @classmethod
    def from_params(cls, params: FlowControlParams) -> Self:
        return cls(receiver_timeout_ns=params.receiver_timeout_ns,
                   group_min_size=params.group_min_size,
                   admission_interval_ns=params.admission_interval_ns)

    def _admitted(self, sm: StatusMessage, limit: int, now_ns: int) -> bool:
        """Whether a new receiver's SM (``limit``: its position + window) completes its
        admission; records it as a candidate otherwise."""
        if self.admission_interval_ns <= 0:
            return True
        window = sm.receiver_window
        position = limit - window
        if self._start_position is None:
            self._start_position = self.sender_position
        if (self.sender_position - self._start_position <= window
                and position >= self.sender_position):
            # The stream has not sent its first window yet, and it has all of it: a receiver
            # of the stream's start (they join together, with the SETUP), admitted at once.
            self.candidates.pop(sm.receiver_id, None)
            return True
        candidate = self.candidates.get(sm.receiver_id)
        # Consistent: it moved on since its last SM, or it has all that was sent, or it sits
        # where a recent SETUP put a receiver, and it never went a window backwards.
        consistent = candidate is None or (
            (limit > candidate.limit or position >= self.sender_position
             or self._at_a_setup(position, now_ns))
            and limit >= candidate.limit - window)
        if not consistent:
            self.candidates.pop(sm.receiver_id, None)
            return False
        if candidate is None:
            if len(self.candidates) < ADMISSION_CANDIDATES_MAX:
                self.candidates[sm.receiver_id] = _Candidate(limit, now_ns)
            return False
        candidate.count += 1
        candidate.last_ns = now_ns
        candidate.limit = limit
        if (candidate.count < ADMISSION_STATUS_MESSAGES
                or now_ns - candidate.first_ns < self.admission_interval_ns):
            return False
        del self.candidates[sm.receiver_id]
        return True

    def _at_a_setup(self, position: int, now_ns: int) -> bool:
        """Whether ``position`` is that of a SETUP sent within the receiver timeout."""
        setups = self._setups
        while setups and setups[0][0] + self.receiver_timeout_ns - now_ns < 0:
            setups.popleft()
        return any(at == position for _, at in setups)

    def _matches(self, sm: StatusMessage) -> bool:
        return True

    def _setup_cap(self, now_ns: int) -> int | None:
        """The limit at the last SETUP a newcomer asked for, while it still protects it."""
        if self._last_setup_limit is not None and (
                self._last_setup_ns + self.receiver_timeout_ns - now_ns < 0):
            self._last_setup_limit = None
        return self._last_setup_limit

    def _minimum(self, now_ns: int) -> int | None:
        """The least position + window over the receivers (capped by join protection), None
        with no receivers."""
        if not self.receivers:
            return None
        limit = min(r.last_position_plus_window for r in self.receivers.values())
        cap = self._setup_cap(now_ns)
        return limit if cap is None else min(limit, cap)

    def on_status_message(self, sm: StatusMessage, source: Address, sender_limit: int,
                          initial_term_id: int, position_bits: int, now_ns: int) -> int:
        limit = sm_limit(sm, initial_term_id, position_bits)
        matches = self._matches(sm)
        if matches:
            self.receiver_window = sm.receiver_window
            receiver = self.receivers.get(sm.receiver_id)
            if receiver is not None:
                receiver.last_position_plus_window = limit
                receiver.time_of_last_sm_ns = now_ns
                receiver.source = source
                receiver.eos_flagged = sm.is_eos
            elif not sm.is_eos and self._admitted(sm, limit, now_ns):
                current = self._minimum(now_ns)
                if current is None or limit >= current - sm.receiver_window:
                    self.receivers[sm.receiver_id] = _Receiver(sm.receiver_id, limit, now_ns,
                                                               source)
                    self._setup_requesters.discard(sm.receiver_id)
                    self._last_setup_limit = None
        if len(self.receivers) < self.group_min_size:
            return sender_limit
        if not self.receivers:
            return max(sender_limit, limit)
        minimum = self._minimum(now_ns)
        assert minimum is not None
        return max(sender_limit, minimum)

    def on_idle(self, now_ns: int, sender_limit: int, sender_position: int,
                is_eos: bool) -> int:
        timeout = self.receiver_timeout_ns
        gone = [rid for rid, r in self.receivers.items()
                if r.eos_flagged or r.time_of_last_sm_ns + timeout - now_ns < 0]
        for rid in gone:
            del self.receivers[rid]
        silent = [rid for rid, c in self.candidates.items() if c.last_ns + timeout - now_ns < 0]
        for rid in silent:
            del self.candidates[rid]
        if not self.receivers or len(self.receivers) < self.group_min_size:
            return sender_limit
        minimum = self._minimum(now_ns)
        assert minimum is not None
        return minimum

    def on_trigger_send_setup(self, sm: StatusMessage, source: Address, now_ns: int) -> None:
        if self._matches(sm) and sm.receiver_id not in self.receivers:
            self._setup_requesters.add(sm.receiver_id)

    def on_setup(self, now_ns: int, sender_limit: int) -> None:
        # Only for a newcomer still to come: one that joined from an earlier SETUP (its SM
        # overtook the SETUP it asked for) would never lift the cap, and everyone would
        # wait a receiver timeout for nothing.
        if self._setup_requesters and self.receivers:
            self._last_setup_limit = sender_limit
            self._last_setup_ns = now_ns
        self._setup_requesters.clear()

    def on_setup_frame(self, position: int, now_ns: int) -> None:
        if self.admission_interval_ns > 0:
            if self._setups and self._setups[-1][1] == position:
                self._setups.pop()  # the same place, sent again: kept from now on
            self._setups.append((now_ns, position))

    def on_error(self, err: ErrorFrame, now_ns: int) -> None:
        self.candidates.pop(err.receiver_id, None)
        receiver = self.receivers.get(err.receiver_id)
        if receiver is not None:
            receiver.eos_flagged = True

    def has_required_receivers(self) -> bool:
        return len(self.receivers) >= self.group_min_size

    def receiver_count(self) -> int:
        return len(self.receivers)

    def next_deadline_ns(self) -> int:
        if not self.receivers:
            return NO_DEADLINE
        if any(r.eos_flagged for r in self.receivers.values()):
            return 0
        oldest = min(r.time_of_last_sm_ns for r in self.receivers.values())
        deadline = oldest + self.receiver_timeout_ns + 1
        if self._last_setup_limit is not None:  # the cap ends: the limit may rise then
            deadline = min(deadline, self._last_setup_ns + self.receiver_timeout_ns + 1)
        return deadline


register_flow_control(MinMulticastFlowControl)
