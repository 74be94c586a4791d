"""Min multicast flow control (``fc=min``): the slowest live receiver sets the pace."""

from __future__ import annotations

from typing import Self

from slipstream.client.frames import ErrorFrame, StatusMessage
from slipstream.client.layout import NO_DEADLINE
from slipstream.daemon.flow.flow_control import FlowControl, sm_limit
from slipstream.daemon.protocol.params import FlowControlParams
from slipstream.daemon.protocol.types import Address

# (aeron_flow_control.h AERON_MIN_FLOW_CONTROL_RETRANSMIT_RECEIVER_WINDOW_MULTIPLE)
MIN_RETRANSMIT_WINDOW_MULTIPLE = 16


class _Receiver:
    __slots__ = ("last_position_plus_window", "receiver_id", "source", "time_of_last_sm_ns")

    def __init__(self, receiver_id: int, limit: int, now_ns: int, source: Address) -> None:
        self.receiver_id = receiver_id
        self.last_position_plus_window = limit
        self.time_of_last_sm_ns = now_ns
        self.source = source


class MinMulticastFlowControl(FlowControl):
    """The slowest live receiver sets the pace (aeron_min_flow_control.c, ``fc=min``).

    Keeps ``receiver_id -> (position + window, time of last SM)``.  ``snd_lmt = max(snd_lmt,
    min over receivers)`` once at least ``group_min_size`` receivers are known (before that the
    limit stays and the publication is not connected).  A receiver is forgotten after
    ``receiver_timeout_ns`` without an SM, on an EOS SM and on an ERR naming it.

    Join protection (docs/PROTOCOL.md §5.4): after an S-flagged SM, the limit at the next SETUP caps
    the computed limit until a new receiver is added or one receiver timeout passes, so a
    newcomer can join before the window moves on.
    """

    name = "min"
    retransmit_window_multiple = MIN_RETRANSMIT_WINDOW_MULTIPLE

    def __init__(self, *, receiver_timeout_ns: int, group_min_size: int = 0) -> None:
        super().__init__()
        self.receiver_timeout_ns = receiver_timeout_ns
        self.group_min_size = group_min_size
        self.receivers: dict[int, _Receiver] = {}
        self._setup_requested = False
        self._last_setup_limit: int | None = None
        self._last_setup_deadline_ns = 0

    @classmethod
    def from_params(cls, params: FlowControlParams) -> Self:
        return cls(receiver_timeout_ns=params.receiver_timeout_ns,
                   group_min_size=params.group_min_size)

    def _matches(self, sm: StatusMessage) -> bool:
        return True

    def _min_limit(self) -> int | None:
        if not self.receivers:
            return None
        return min(r.last_position_plus_window for r in self.receivers.values())

    def _limit(self, sender_limit: int, now_ns: int) -> int:
        if not self.receivers or len(self.receivers) < self.group_min_size:
            return sender_limit
        limit = self._min_limit()
        assert limit is not None
        if self._last_setup_limit is not None:
            if now_ns - self._last_setup_deadline_ns < 0:
                limit = min(limit, max(sender_limit, self._last_setup_limit))
            else:
                self._last_setup_limit = None
        return max(sender_limit, limit)

    def on_status_message(self, sm: StatusMessage, source: Address, sender_limit: int,
                          initial_term_id: int, position_bits: int, now_ns: int) -> int:
        if not self._matches(sm):
            return self._limit(sender_limit, now_ns)
        self.receiver_window = sm.receiver_window
        limit = sm_limit(sm, initial_term_id, position_bits)
        if sm.is_eos:
            self.receivers.pop(sm.receiver_id, None)
            return self._limit(sender_limit, now_ns)
        receiver = self.receivers.get(sm.receiver_id)
        if receiver is not None:
            receiver.last_position_plus_window = limit
            receiver.time_of_last_sm_ns = now_ns
            receiver.source = source
        else:
            current = self._min_limit()
            # A newcomer far behind would stall everyone: accept it only within one window
            # of the current minimum (aeron_min_flow_control_strategy_process_sm).
            if current is None or limit >= current - sm.receiver_window:
                self.receivers[sm.receiver_id] = _Receiver(sm.receiver_id, limit, now_ns, source)
                self._last_setup_limit = None
        return self._limit(sender_limit, now_ns)

    def on_idle(self, now_ns: int, sender_limit: int, sender_position: int,
                is_eos: bool) -> int:
        timeout = self.receiver_timeout_ns
        expired = [rid for rid, r in self.receivers.items()
                   if now_ns - (r.time_of_last_sm_ns + timeout) > 0]
        for rid in expired:
            del self.receivers[rid]
        return self._limit(sender_limit, now_ns)

    def on_trigger_send_setup(self, sm: StatusMessage, source: Address, now_ns: int) -> None:
        if self._matches(sm):
            self._setup_requested = True

    def on_setup(self, now_ns: int, sender_limit: int) -> None:
        if self._setup_requested and self.receivers:
            self._setup_requested = False
            self._last_setup_limit = sender_limit
            self._last_setup_deadline_ns = now_ns + self.receiver_timeout_ns

    def on_error(self, err: ErrorFrame, now_ns: int) -> None:
        self.receivers.pop(err.receiver_id, None)

    def has_required_receivers(self) -> bool:
        return len(self.receivers) >= self.group_min_size

    def next_deadline_ns(self) -> int:
        if not self.receivers:
            return NO_DEADLINE
        oldest = min(r.time_of_last_sm_ns for r in self.receivers.values())
        return oldest + self.receiver_timeout_ns + 1
