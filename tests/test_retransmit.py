"""RetransmitHandlerTest: delay, linger, dedup, pool and overflow (PROTOCOL.md §3.5)."""

from __future__ import annotations

from slipstream.client.counters import SystemCounter
from slipstream.client.frames import StatusMessage
from slipstream.daemon.flow_control import MaxMulticastFlowControl, UnicastFlowControl
from slipstream.daemon.protocol_types import NO_DEADLINE, LocalCounters
from slipstream.daemon.retransmit import RetransmitHandler

TERM = 64 * 1024
MTU = 1408
MS = 1_000_000


def handler(delay: int = 0, group: bool = False, max_resend: int = 16):
    counters = LocalCounters()
    resent: list[tuple[int, int, int]] = []
    h = RetransmitHandler(counters=counters, delay_ns=delay, linger_ns=10 * MS,
                          has_group_semantics=group, max_resend=max_resend)
    fc = MaxMulticastFlowControl() if group else UnicastFlowControl()
    fc.on_status_message(StatusMessage(1, 1, 0, 0, 128 * 1024, 1), ("a", 1), 0, 0, 16, 0)
    def resend(term_id: int, term_offset: int, length: int) -> int:
        resent.append((term_id, term_offset, length))
        return length

    return h, fc, counters, resent, resend


def test_immediate_retransmit_then_linger_ignores_duplicates() -> None:
    h, fc, _counters, resent, resend = handler()
    h.on_nak(3, 64, 128, TERM, MTU, fc, 0, resend)
    assert resent == [(3, 64, 128)]
    h.on_nak(3, 64, 128, TERM, MTU, fc, 5 * MS, resend)
    h.on_nak(3, 128, 64, TERM, MTU, fc, 5 * MS, resend)  # inside the action's range
    assert len(resent) == 1
    assert h.next_deadline_ns() == 10 * MS
    h.process_timeouts(10 * MS, resend)
    assert h.next_deadline_ns() == NO_DEADLINE
    h.on_nak(3, 64, 128, TERM, MTU, fc, 11 * MS, resend)
    assert len(resent) == 2


def test_delayed_retransmit() -> None:
    h, fc, _, resent, resend = handler(delay=2 * MS)
    h.on_nak(3, 0, 64, TERM, MTU, fc, 0, resend)
    assert resent == [] and h.next_deadline_ns() == 2 * MS
    h.on_nak(3, 0, 64, TERM, MTU, fc, 1 * MS, resend)
    h.process_timeouts(2 * MS, resend)
    assert resent == [(3, 0, 64)]
    assert h.next_deadline_ns() == 12 * MS


def test_unicast_reuses_its_single_action() -> None:
    h, fc, counters, resent, resend = handler()
    h.on_nak(3, 0, 64, TERM, MTU, fc, 0, resend)
    h.on_nak(3, 1024, 64, TERM, MTU, fc, 1 * MS, resend)
    assert resent == [(3, 0, 64), (3, 1024, 64)]
    assert counters[SystemCounter.RETRANSMIT_OVERFLOW] == 0
    assert len(h.actions) == 1


def test_group_pool_overflow_is_counted() -> None:
    h, fc, counters, resent, resend = handler(group=True, max_resend=2)
    for i in range(3):
        h.on_nak(3, i * 1024, 64, TERM, MTU, fc, 0, resend)
    assert len(resent) == 2
    assert counters[SystemCounter.RETRANSMIT_OVERFLOW] == 1


def test_invalid_nak_is_counted_and_length_capped() -> None:
    h, fc, counters, resent, resend = handler()
    h.on_nak(3, TERM - 16, 64, TERM, MTU, fc, 0, resend)
    h.on_nak(3, -32, 64, TERM, MTU, fc, 0, resend)
    assert resent == [] and counters[SystemCounter.INVALID_PACKETS] == 2
    h.on_nak(3, TERM - 64, 4096, TERM, MTU, fc, 0, resend)
    assert resent == [(3, TERM - 64, 64)]


def test_naks_at_misaligned_or_out_of_range_offsets_are_counted_and_dropped() -> None:
    h, fc, counters, resent, resend = handler()
    for offset, length in ((7, 64), (-32, 64), (TERM - 16, 64), (TERM, 64), (64, 0),
                           (64, -5)):
        h.on_nak(3, offset, length, TERM, MTU, fc, 0, resend)
    assert resent == []
    assert counters[SystemCounter.INVALID_PACKETS] == 6


def test_a_resend_the_sender_could_not_take_frees_its_action() -> None:
    """A resend that took nothing (the sender's queue was full) leaves no lingering action:
    it would hold a slot of the pool, and hide the receiver's next NAK, for nothing sent."""
    h, fc, counters, resent, resend = handler(group=True, max_resend=2)
    for i in range(5):
        h.on_nak(3, i * 1024, 64, TERM, MTU, fc, 0, lambda *_: 0)
    assert h.active_count == 0 and h.next_deadline_ns() == NO_DEADLINE
    assert counters[SystemCounter.RETRANSMIT_OVERFLOW] == 0
    h.on_nak(3, 0, 64, TERM, MTU, fc, 1, resend)  # the same NAK again: served
    assert resent == [(3, 0, 64)]


def test_a_partly_taken_resend_lingers_over_the_part_taken() -> None:
    h, fc, _, resent, resend = handler()
    h.on_nak(3, 0, 4096, TERM, MTU, fc, 0, lambda *_: 1024)
    h.on_nak(3, 512, 64, TERM, MTU, fc, 1, resend)  # inside what went: a repeat
    h.on_nak(3, 1024, 3072, TERM, MTU, fc, 2, resend)  # the rest: served
    assert resent == [(3, 1024, 3072)]
