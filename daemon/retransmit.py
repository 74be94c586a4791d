"""The sender's answer to NAKs (PROTOCOL.md §3.5; aeron_retransmit_handler.c).

Each NAK becomes a *retransmit action* with a small state machine::

    INACTIVE --NAK, delay == 0--> (resend now) LINGERING --linger expired--> INACTIVE
    INACTIVE --NAK, delay > 0---> DELAYED --delay expired--> (resend) LINGERING

While an action is DELAYED or LINGERING, a NAK whose ``(term_id, term_offset)`` falls inside
the action's range is a duplicate and ignored: the data is already (or about to be) in
flight.  ``retransmit_unicast_delay`` is 0 by default, so unicast data goes out at once and
repeats are ignored for ``retransmit_unicast_linger`` (10 ms).

Pools: a unicast publication has a single action, which a NAK for another range simply
reuses (one receiver, so its newest NAK wins).  A group channel (multicast, MDC) has a pool of
``max_resend`` actions (default 16); when all are busy the NAK is dropped and
``RETRANSMIT_OVERFLOW`` counted.

The resend length is capped by flow control (``max_retransmission_length``).  Times in ns,
offsets and lengths in bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from slipstream.client.counters import SystemCounter
from slipstream.client.frames import HEADER_LENGTH
from slipstream.daemon.flow_control import FlowControl
from slipstream.daemon.protocol_types import NO_DEADLINE, ProtocolCounters

#: resend(term_id, term_offset, length) -> bytes: put the range on the wire again; returns how
#: much of it from term_offset on it took (less when the sender could take no more at once: the
#: action then covers only that, and a NAK for the rest is served, not ignored as a repeat; 0:
#: none, and the action is free again).
ResendFunction = Callable[[int, int, int], int]


class ActionState(enum.Enum):
    INACTIVE = "inactive"
    DELAYED = "delayed"
    LINGERING = "lingering"


class RetransmitAction:
    __slots__ = ("expiry_ns", "length", "state", "term_id", "term_offset")

    def __init__(self) -> None:
        self.state = ActionState.INACTIVE
        self.term_id = 0
        self.term_offset = 0
        self.length = 0
        self.expiry_ns = 0

    def covers(self, term_id: int, term_offset: int) -> bool:
        return (self.term_id == term_id
                and self.term_offset <= term_offset < self.term_offset + self.length)

    def __repr__(self) -> str:
        return (f"<RetransmitAction {self.state.value} {self.term_id}:{self.term_offset}"
                f"+{self.length} expiry={self.expiry_ns}>")


class RetransmitHandler:
    """NAK → resend policy for one publication.

    ``has_group_semantics`` selects the pool of ``max_resend`` actions; otherwise one action.
    """

    def __init__(self, *, counters: ProtocolCounters, delay_ns: int, linger_ns: int,
                 has_group_semantics: bool = False, max_resend: int = 16) -> None:
        self.counters = counters
        self.delay_ns = delay_ns
        self.linger_ns = linger_ns
        self.has_group_semantics = has_group_semantics
        self.actions = [RetransmitAction()
                        for _ in range(max_resend if has_group_semantics else 1)]
        self.active_count = 0

    def _available_action(self, term_id: int, term_offset: int) -> RetransmitAction | None:
        """An action to use for this NAK, or None when it is a duplicate or the pool is full."""
        available = None
        for action in self.actions:
            if action.state is ActionState.INACTIVE:
                if available is None:
                    available = action
            elif action.covers(term_id, term_offset):
                return None  # duplicate of an action in flight
            elif not self.has_group_semantics:
                available = action  # unicast: reuse the single action for the newer NAK
        if available is None:
            self.counters.add(SystemCounter.RETRANSMIT_OVERFLOW)
            return None
        if available.state is ActionState.INACTIVE:
            self.active_count += 1
        return available

    def on_nak(self, term_id: int, term_offset: int, length: int, term_length: int, mtu: int,
               flow_control: FlowControl, now_ns: int, resend: ResendFunction) -> None:
        """Handle a NAK for ``length`` bytes at ``term_offset`` of ``term_id``."""
        if (term_offset < 0 or term_offset > term_length - HEADER_LENGTH
                or term_offset & (HEADER_LENGTH - 1) or length <= 0):
            self.counters.add(SystemCounter.INVALID_PACKETS)
            return
        action = self._available_action(term_id, term_offset)
        if action is None:
            return
        action.term_id = term_id
        action.term_offset = term_offset
        action.length = flow_control.max_retransmission_length(term_offset, length,
                                                               term_length, mtu)
        if self.delay_ns == 0:
            self._resent(action, resend(term_id, term_offset, action.length), now_ns)
        else:
            action.state = ActionState.DELAYED
            action.expiry_ns = now_ns + self.delay_ns

    def _resent(self, action: RetransmitAction, taken: int, now_ns: int) -> None:
        """The sender took ``taken`` bytes of the action's range: linger over those."""
        if taken <= 0:
            action.state = ActionState.INACTIVE
            self.active_count -= 1
            return
        action.length = min(action.length, taken)
        action.state = ActionState.LINGERING
        action.expiry_ns = now_ns + self.linger_ns

    def process_timeouts(self, now_ns: int, resend: ResendFunction) -> None:
        """Fire DELAYED actions whose delay passed; free LINGERING ones whose linger passed."""
        if self.active_count == 0:
            return
        for action in self.actions:
            if action.state is ActionState.INACTIVE or now_ns < action.expiry_ns:
                continue
            if action.state is ActionState.DELAYED:
                self._resent(action, resend(action.term_id, action.term_offset, action.length),
                             now_ns)
            else:
                action.state = ActionState.INACTIVE
                self.active_count -= 1

    def next_deadline_ns(self) -> int:
        if self.active_count == 0:
            return NO_DEADLINE
        return min((a.expiry_ns for a in self.actions if a.state is not ActionState.INACTIVE),
                   default=NO_DEADLINE)
