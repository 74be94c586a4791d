"""Min multicast flow control (``fc=min``): the slowest live receiver sets the pace."""

from __future__ import annotations

from typing import Self

from slipstream.client import strategy_grammar
from slipstream.client.frames import ErrorFrame, StatusMessage
from slipstream.client.layout import NO_DEADLINE
from slipstream.daemon.flow.flow_control import FlowControl, register_flow_control, sm_limit
from slipstream.daemon.protocol.params import FlowControlParams
from slipstream.daemon.protocol.types import Address

# (aeron_flow_control.h AERON_MIN_FLOW_CONTROL_RETRANSMIT_RECEIVER_WINDOW_MULTIPLE)
MIN_RETRANSMIT_WINDOW_MULTIPLE = 16


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
    (docs/PROTOCOL.md §5.3, §5.4):

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
    * join protection: after an S-flagged SM from a receiver it does not track, the limit at
      the next SETUP caps the computed limit until a new receiver is added or one receiver
      timeout passes, so a newcomer can join before the window moves on (Aeron caps on any
      S-flagged SM; one from a receiver that has joined meanwhile stalled every receiver for
      the timeout, docs/PROTOCOL.md §5.4).
    """

    uri = strategy_grammar.MIN
    retransmit_window_multiple = MIN_RETRANSMIT_WINDOW_MULTIPLE
    tracks_receivers = True

    def __init__(self, *, receiver_timeout_ns: int, group_min_size: int = 0) -> None:
        super().__init__()
        self.receiver_timeout_ns = receiver_timeout_ns
        self.group_min_size = group_min_size
        self.receivers: dict[int, _Receiver] = {}
        #: Receivers that asked for a SETUP (S-flagged SM) and are not tracked yet.
        self._setup_requesters: set[int] = set()
        self._last_setup_limit: int | None = None
        self._last_setup_ns = 0

    @classmethod
    def from_params(cls, params: FlowControlParams) -> Self:
        return cls(receiver_timeout_ns=params.receiver_timeout_ns,
                   group_min_size=params.group_min_size)

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
            elif not sm.is_eos:
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

    def on_error(self, err: ErrorFrame, now_ns: int) -> None:
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
