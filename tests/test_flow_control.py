"""FlowControlTest: each strategy's limit rules (docs/DRIVER.md §5)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from slipstream.client.channel import parse_channel
from slipstream.client.frames import ErrorFrame, StatusMessage
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.flow.max_multicast import MaxMulticastFlowControl
from slipstream.daemon.flow.min_multicast import MinMulticastFlowControl
from slipstream.daemon.flow.registry import flow_control_for
from slipstream.daemon.flow.tagged_multicast import TaggedMulticastFlowControl
from slipstream.daemon.flow.unicast import UnicastFlowControl
from slipstream.daemon.protocol.params import PublicationParams

INITIAL = 5
BITS = 16  # 64 KiB terms
SRC = ("10.0.0.9", 1)
S = 1_000_000_000


def sm(offset: int, window: int = 1000, receiver_id: int = 1, term_id: int = INITIAL,
       flags: int = 0, tag: int | None = None) -> StatusMessage:
    return StatusMessage(1, 2, term_id, offset, window, receiver_id, flags, tag)


def test_unicast_limit_is_position_plus_window_and_never_goes_back() -> None:
    fc = UnicastFlowControl()
    assert fc.on_status_message(sm(100), SRC, 0, INITIAL, BITS, 0) == 1100
    assert fc.on_status_message(sm(50), SRC, 1100, INITIAL, BITS, 0) == 1100
    assert fc.on_status_message(sm(0, term_id=INITIAL + 1), SRC, 1100, INITIAL, BITS, 0) == (
        65536 + 1000)
    assert fc.on_idle(10 * S, 5000, 0, False) == 5000
    assert fc.has_required_receivers()


@given(st.lists(st.tuples(st.integers(0, 65535), st.integers(0, 1 << 20)), max_size=30))
def test_max_is_monotonic_max_of_position_plus_window(sms: list[tuple[int, int]]) -> None:
    fc = MaxMulticastFlowControl()
    limit = 0
    for offset, window in sms:
        new = fc.on_status_message(sm(offset, window), SRC, limit, INITIAL, BITS, 0)
        assert new == max(limit, offset + window)
        limit = new


def test_retransmission_lookahead_is_the_window_times_the_strategys_multiple() -> None:
    fc = UnicastFlowControl()
    assert fc.retransmission_lookahead(1408) == 16 * 1408  # no SM yet: MTUs
    fc.on_status_message(sm(0, window=1024), SRC, 0, INITIAL, BITS, 0)
    assert fc.retransmission_lookahead(1408) == 16 * 1024
    mx = MaxMulticastFlowControl()
    mx.on_status_message(sm(0, window=1024), SRC, 0, INITIAL, BITS, 0)
    assert mx.retransmission_lookahead(1408) == 4 * 1024


def test_min_follows_the_slowest_and_times_out_receivers() -> None:
    fc = MinMulticastFlowControl(receiver_timeout_ns=5 * S)
    assert fc.on_status_message(sm(1000, receiver_id=1), SRC, 0, INITIAL, BITS, 0) == 2000
    assert fc.on_status_message(sm(500, receiver_id=2), SRC, 2000, INITIAL, BITS, S) == 2000
    assert fc.on_status_message(sm(3000, receiver_id=1), SRC, 2000, INITIAL, BITS, S) == 2000
    assert fc.on_status_message(sm(900, receiver_id=2), SRC, 2000, INITIAL, BITS, 2 * S) == 2000
    assert fc.on_status_message(sm(1500, receiver_id=2), SRC, 2000, INITIAL, BITS, 2 * S) == 2500
    assert fc.receiver_count() == 2
    assert fc.next_deadline_ns() == S + 5 * S + 1
    # Receiver 1 (last SM at 1 s) times out; receiver 2 remains and alone sets the limit.
    assert fc.on_idle(6 * S, 2500, 0, False) == 2500
    assert fc.receiver_count() == 2
    assert fc.on_idle(6 * S + 1, 2500, 0, False) == 2500
    assert set(fc.receivers) == {2}


def test_min_keeps_an_end_of_stream_receiver_counted_until_the_next_idle_check() -> None:
    fc = MinMulticastFlowControl(receiver_timeout_ns=5 * S)
    fc.on_status_message(sm(1000, receiver_id=1), SRC, 0, INITIAL, BITS, 0)
    fc.on_status_message(sm(500, receiver_id=2), SRC, 2000, INITIAL, BITS, 0)
    assert fc.on_status_message(sm(500, receiver_id=2, flags=0x40), SRC, 2000, INITIAL, BITS,
                                S) == 2000
    assert fc.receiver_count() == 2 and fc.next_deadline_ns() == 0
    assert fc.on_idle(S, 2000, 0, False) == 2000
    assert set(fc.receivers) == {1}
    # An EOS SM from a receiver it does not know adds nothing.
    fc.on_status_message(sm(9000, receiver_id=3, flags=0x40), SRC, 2000, INITIAL, BITS, S)
    assert set(fc.receivers) == {1}


def test_min_on_idle_lets_a_slower_newcomer_pull_the_limit_back() -> None:
    """A receiver within one window of the minimum joins behind it: status messages never
    lower the limit, the next idle check does (the sender waits for it)."""
    fc = MinMulticastFlowControl(receiver_timeout_ns=5 * S)
    assert fc.on_status_message(sm(5000, receiver_id=1), SRC, 0, INITIAL, BITS, 0) == 6000
    assert fc.on_status_message(sm(4500, receiver_id=2), SRC, 6000, INITIAL, BITS, 0) == 6000
    assert fc.on_idle(S, 6000, 5000, False) == 5500
    # One more than a window behind the minimum: not taken on, it cannot hold the others.
    fc.on_status_message(sm(3000, receiver_id=3), SRC, 5500, INITIAL, BITS, S)
    assert 3 not in fc.receivers


def test_min_group_size_holds_the_limit_and_connection() -> None:
    fc = MinMulticastFlowControl(receiver_timeout_ns=5 * S, group_min_size=2)
    assert fc.on_status_message(sm(1000, receiver_id=1), SRC, 0, INITIAL, BITS, 0) == 0
    assert not fc.has_required_receivers()
    assert fc.on_idle(S, 0, 0, False) == 0
    assert fc.on_status_message(sm(1000, receiver_id=2), SRC, 0, INITIAL, BITS, 0) == 2000
    assert fc.has_required_receivers()
    fc.on_error(ErrorFrame(1, 2, 1, 13, "rejected"), 0)  # flagged: gone at the idle check
    assert fc.has_required_receivers()
    assert fc.on_idle(S, 2000, 0, False) == 2000
    assert not fc.has_required_receivers() and fc.receiver_count() == 1


def test_min_join_protection_caps_the_limit_until_a_receiver_joins_or_a_timeout_passes() -> None:
    fc = MinMulticastFlowControl(receiver_timeout_ns=5 * S)
    fc.on_status_message(sm(1000, receiver_id=1), SRC, 0, INITIAL, BITS, 0)
    fc.on_trigger_send_setup(sm(0, receiver_id=2, flags=0x80), SRC, 0)
    fc.on_setup(S, 2000)  # the SETUP goes with the limit at 2000
    assert fc.on_status_message(sm(4000, receiver_id=1), SRC, 2000, INITIAL, BITS, S) == 2000
    assert fc.on_status_message(sm(4000, receiver_id=1), SRC, 2000, INITIAL, BITS,
                                6 * S + 1) == 5000
    fc.on_trigger_send_setup(sm(0, receiver_id=2, flags=0x80), SRC, 7 * S)
    fc.on_setup(7 * S, 5000)
    assert fc.on_status_message(sm(9000, receiver_id=1), SRC, 5000, INITIAL, BITS, 7 * S) == 5000
    # The newcomer's first SM lifts the cap.
    assert fc.on_status_message(sm(8000, receiver_id=2), SRC, 5000, INITIAL, BITS, 7 * S) == 9000


def test_min_join_protection_is_not_armed_for_a_newcomer_that_has_joined_already() -> None:
    """Its SM overtook the SETUP it asked for: nobody is still to come, so nothing caps the
    limit (a cap would stall every receiver for a receiver timeout)."""
    fc = MinMulticastFlowControl(receiver_timeout_ns=5 * S)
    fc.on_status_message(sm(1000, receiver_id=1), SRC, 0, INITIAL, BITS, 0)
    fc.on_trigger_send_setup(sm(0, receiver_id=2, flags=0x80), SRC, 0)
    fc.on_status_message(sm(1000, receiver_id=2), SRC, 2000, INITIAL, BITS, 0)
    fc.on_trigger_send_setup(sm(0, receiver_id=1, flags=0x80), SRC, 0)  # one it tracks
    fc.on_setup(S, 2000)
    assert fc.on_status_message(sm(4000, receiver_id=1), SRC, 2000, INITIAL, BITS, S) == 2000
    assert fc.on_status_message(sm(4000, receiver_id=2), SRC, 2000, INITIAL, BITS, S) == 5000


def test_tagged_ignores_other_tags() -> None:
    fc = TaggedMulticastFlowControl(group_tag=7, receiver_timeout_ns=5 * S, group_min_size=1)
    assert fc.on_status_message(sm(100, receiver_id=1), SRC, 0, INITIAL, BITS, 0) == 0
    assert fc.on_status_message(sm(100, receiver_id=2, tag=8), SRC, 0, INITIAL, BITS, 0) == 0
    assert fc.on_status_message(sm(100, receiver_id=3, tag=7), SRC, 0, INITIAL, BITS, 0) == 1100
    assert set(fc.receivers) == {3}
    # A faster untagged receiver does not move the limit past the tagged one.
    assert fc.on_status_message(sm(9000, receiver_id=1), SRC, 1100, INITIAL, BITS, 0) == 1100


def test_tagged_with_no_tagged_receiver_follows_the_status_messages() -> None:
    """With no group minimum and nobody carrying the tag, the publication reports connected:
    it follows the SMs (as max) instead of stalling."""
    fc = TaggedMulticastFlowControl(group_tag=7, receiver_timeout_ns=5 * S)
    assert fc.has_required_receivers()
    assert fc.on_status_message(sm(100, receiver_id=1), SRC, 0, INITIAL, BITS, 0) == 1100
    assert fc.on_status_message(sm(3000, receiver_id=2, tag=8), SRC, 1100, INITIAL, BITS,
                                0) == 4000
    assert fc.on_idle(S, 4000, 0, False) == 4000 and fc.receiver_count() == 0


def _strategy(uri: str, settings: DriverSettings):
    return flow_control_for(PublicationParams.for_network(parse_channel(uri), settings))


def test_flow_control_for_chooses_by_uri_and_settings() -> None:
    settings = DriverSettings()
    assert type(_strategy("aeron:udp?endpoint=10.0.0.1:1", settings)) is UnicastFlowControl
    assert type(_strategy("aeron:udp?endpoint=224.0.1.1:1", settings)) is MaxMulticastFlowControl
    fc = _strategy("aeron:udp?endpoint=224.0.1.1:1|fc=min,g:/3,t:2s", settings)
    assert isinstance(fc, MinMulticastFlowControl)
    assert (fc.group_min_size, fc.receiver_timeout_ns) == (3, 2 * S)
    fc = _strategy("aeron:udp?endpoint=224.0.1.1:1|fc=tagged,g:99/2", settings)
    assert isinstance(fc, TaggedMulticastFlowControl)
    assert (fc.group_tag, fc.group_min_size) == (99, 2)
    settings = DriverSettings(multicast_flow_control="min")
    assert isinstance(_strategy("aeron:udp?endpoint=224.0.1.1:1", settings),
                      MinMulticastFlowControl)
