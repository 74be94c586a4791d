"""The sender's answer to NAKs (docs/DRIVER.md §3.5; aeron_retransmit_handler.c).

Each NAK becomes a *retransmit action* with a small state machine::

    INACTIVE --NAK, delay == 0--> (resend now) LINGERING --linger expired--> INACTIVE
    INACTIVE --NAK, delay > 0---> DELAYED --delay expired--> (resend) LINGERING

While an action is DELAYED or LINGERING, a NAK whose ``(term_id, term_offset)`` falls inside
the action's range is a duplicate and ignored: the data is already (or about to be) in
flight.  ``retransmit_unicast_delay`` is 0 by default, so unicast data goes out at once and
repeats are ignored for ``retransmit_unicast_linger`` (200 µs; a group publication lingers
at least ``nak_multicast_max_backoff``, 10 ms, the spread of its receivers' NAKs).

Pools: a unicast publication has a single action, which a NAK for another range simply
reuses (one receiver, so its newest NAK wins).  A group channel (multicast, MDC) has a pool of
``max_resend`` actions (default 16); when all are busy the NAK is dropped and
``RETRANSMIT_OVERFLOW`` counted.  A resend the sender could not queue at all frees its action;
one it queued in part lingers over that part, so the receiver's next NAK for the rest is served.

The resend length is capped at ``min(length, receiver window x a multiple, rest of the term)``
(``FlowControl.retransmission_lookahead`` gives the middle term).  The rules run in C
(``ss_retransmit_on_nak`` in daemon/network_retransmit.c), on the publication's
``ss_send_publication_t``:
a NAK is per-datagram work, and the send endpoint's C dispatch answers it (for the driver's
socket and the simulator's virtual network alike) without a trip through Python; NAKs it leaves
(a retransmit delay needs a timer) come to the publication's Python, which calls the same
functions through this class.  Times in ns, offsets and lengths in bytes.

The budget (:class:`RetransmitBudget`, slipstream's; Aeron bounds resends only by
``aeron.max.resend`` and the resend window): a NAK that arrives when the publication has
resent its credit is dropped (``NAK_BUDGET_DROPS``), so that NAKs, which cost a sender 32
bytes each to receive, cannot make it send more than the budget allows.
"""

from __future__ import annotations

import enum

import attrs

from slipstream.client.counters import SystemCounter
from slipstream.daemon._network import lib as network
from slipstream.daemon.protocol.types import ProtocolCounters


class ActionState(enum.IntEnum):
    INACTIVE = network.SS_ACTION_INACTIVE
    DELAYED = network.SS_ACTION_DELAYED
    LINGERING = network.SS_ACTION_LINGERING


@attrs.frozen
class RetransmitBudget:
    """What NAKs may make one publication resend (docs/DRIVER.md §5.7): a bucket of
    ``cap`` bytes (its term window), full at the start, that earns ``percent`` % of each
    byte of new data sent and ``cap`` bytes per ``interval_ns``; a NAK that finds it empty is
    dropped and counted (``NAK_BUDGET_DROPS``).  ``position`` and ``now_ns``: where and when
    it starts."""

    percent: int
    interval_ns: int
    cap: int
    position: int
    now_ns: int


class RetransmitHandler:
    """NAK → resend policy for one publication, kept in its C struct ``c``.

    ``has_group_semantics`` selects the pool of ``max_resend`` actions; otherwise one action.
    """

    def __init__(self, c, *, counters: ProtocolCounters, delay_ns: int, linger_ns: int,
                 has_group_semantics: bool = False, max_resend: int = 16,
                 budget: RetransmitBudget | None = None) -> None:
        """``budget``: what NAKs may make it resend per interval (None: no budget)."""
        if not 1 <= max_resend <= network.SS_RETRANSMIT_ACTIONS_MAX:
            raise ValueError(f"max_resend {max_resend} is not in "
                             f"[1, {network.SS_RETRANSMIT_ACTIONS_MAX}]")
        self.c = c
        c.retransmit_delay_ns = delay_ns
        c.retransmit_linger_ns = linger_ns
        c.has_group_semantics = int(has_group_semantics)
        c.action_count = max_resend if has_group_semantics else 1
        c.active_count = 0
        c.answers_naks = 1
        c.naks_received = counters.address(SystemCounter.NAK_MESSAGES_RECEIVED)
        c.retransmits_sent = counters.address(SystemCounter.RETRANSMITS_SENT)
        c.retransmit_overflow = counters.address(SystemCounter.RETRANSMIT_OVERFLOW)
        c.invalid_packets = counters.address(SystemCounter.INVALID_PACKETS)
        c.nak_budget_drops = counters.address(SystemCounter.NAK_BUDGET_DROPS)
        if budget is not None and budget.percent > 0:
            c.retransmit_budget_cap = budget.cap
            c.retransmit_budget_percent = budget.percent
            c.retransmit_budget_interval_ns = budget.interval_ns
            c.retransmit_credit = budget.cap  # a full bucket to start
            c.retransmit_credit_position = budget.position
            c.retransmit_credit_time_ns = budget.now_ns

    def credit(self, now_ns: int) -> int:
        """The retransmit credit left at ``now_ns`` (bytes; very large without a budget)."""
        return network.ss_retransmit_credit(self.c, now_ns)

    @property
    def active_count(self) -> int:
        return self.c.active_count

    @property
    def actions(self) -> list[tuple[ActionState, int, int, int, int]]:
        """Each action as (state, term_id, term_offset, length, expiry ns)."""
        return [(ActionState(a.state), a.term_id, a.term_offset, a.length, a.expiry_ns)
                for a in (self.c.actions[i] for i in range(self.c.action_count))]

    def set_resend_lookahead(self, lookahead: int) -> None:
        """Flow control's cap on one NAK's resend, bytes (after each status message)."""
        self.c.resend_lookahead = lookahead

    def on_nak(self, term_id: int, term_offset: int, length: int, now_ns: int) -> None:
        """Handle a NAK for ``length`` bytes at ``term_offset`` of ``term_id`` (expiring
        finished actions first); what it resends is queued on the publication for the data
        path."""
        network.ss_retransmit_on_nak(self.c, term_id, term_offset, length, now_ns)

    def process_timeouts(self, now_ns: int) -> None:
        """Fire DELAYED actions whose delay passed; free LINGERING ones whose linger passed."""
        network.ss_retransmit_process_timeouts(self.c, now_ns)

    def next_deadline_ns(self) -> int:
        """When an action next expires (NO_DEADLINE: none active)."""
        return network.ss_retransmit_next_deadline(self.c, 0)

    def next_resend_ns(self) -> int:
        """When a DELAYED action next resends (NO_DEADLINE: none): the only expiry that needs
        a timer.  A LINGERING action's only frees it, and the next NAK (in C or here) frees
        what expired before it is handled."""
        return network.ss_retransmit_next_deadline(self.c, 1)

    def stop(self) -> None:
        """The publication is done: NAKs are no longer answered (its log goes soon)."""
        self.c.answers_naks = 0
