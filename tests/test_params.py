"""The parameters resolver: a stream's URI values, else the driver settings, decided once;
and the strategies registered under the names the URI grammar and the settings accept."""

from __future__ import annotations

import pytest

from slipstream.client import channel as uri_grammar
from slipstream.client.channel import parse_channel
from slipstream.client.errors import ChannelError
from slipstream.daemon.config import SETTINGS as SETTINGS_TABLE
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.flow.registry import (
    CONGESTION_CONTROLS,
    FLOW_CONTROLS,
    congestion_control_for,
)
from slipstream.daemon.flow.static_window import StaticWindowCongestionControl
from slipstream.daemon.protocol.params import (
    FlowControlParams,
    PublicationParams,
    RateControlParams,
    SocketParams,
    SubscriptionParams,
    has_group_semantics,
)

KIB = 1024
MS = 1_000_000
SETTINGS = DriverSettings(term_buffer_length=1024 * KIB, mtu_length=1408,
                          publication_linger_timeout=3000 * MS, max_resend=8,
                          term_buffer_sparse_file=True)


def network(uri: str, settings: DriverSettings = SETTINGS) -> PublicationParams:
    return PublicationParams.for_network(parse_channel(uri), settings)


def test_a_publication_takes_the_uri_values_before_the_settings() -> None:
    defaults = network("aeron:udp?endpoint=10.0.0.1:4000")
    assert (defaults.term_length, defaults.mtu, defaults.linger_timeout_ns, defaults.sparse,
            defaults.max_resend, defaults.signal_eos, defaults.setup_ttl) == (
        1024 * KIB, 1408, 3000 * MS, True, 8, True, 0)
    assert defaults.term_window_length == 512 * KIB  # 0: half a term
    assert defaults.session_id is None and defaults.initial_term_id is None
    zero = network("aeron:udp?endpoint=10.0.0.1:4000|linger=0")
    assert zero.linger_timeout_ns == 0  # a value, not "unset"
    given = network("aeron:udp?endpoint=10.0.0.1:4000|term-length=128k|mtu=8k|linger=5ms"
                    "|sparse=false|max-resend=3|eos=false|ttl=4|pub-wnd=32k|session-id=9"
                    "|init-term-id=7|term-id=9|term-offset=64")
    assert (given.term_length, given.mtu, given.linger_timeout_ns, given.sparse,
            given.max_resend, given.signal_eos, given.setup_ttl, given.term_window_length,
            given.session_id) == (128 * KIB, 8 * KIB, 5 * MS, False, 3, False, 4, 32 * KIB, 9)
    assert (given.initial_term_id, given.initial_term_count, given.initial_term_offset) == (
        7, 2, 64)


def test_an_ipc_publication_takes_the_ipc_settings_and_has_no_flow_control() -> None:
    settings = DriverSettings(ipc_term_buffer_length=256 * KIB, ipc_mtu_length=4096)
    params = PublicationParams.for_ipc(parse_channel("aeron:ipc"), settings)
    assert (params.term_length, params.mtu, params.flow_control) == (256 * KIB, 4096, None)
    assert params.term_window_length == 128 * KIB
    windows = DriverSettings(publication_term_window_length="1m",
                             ipc_publication_term_window_length="64k")
    assert (PublicationParams.for_ipc(parse_channel("aeron:ipc"), windows).term_window_length,
            network("aeron:udp?endpoint=10.0.0.1:4000", windows).term_window_length,
            network("aeron:udp?endpoint=10.0.0.1:4000|term-length=1m", windows)
            .term_window_length) == (64 * KIB, 1024 * KIB, 512 * KIB)  # capped at term/2


def test_values_that_cannot_make_a_log_name_their_key() -> None:
    # Each value parses alone; it is the combination with the setting that fails.
    small_terms = DriverSettings(term_buffer_length=64 * KIB)
    with pytest.raises(ChannelError) as refused:
        network("aeron:udp?endpoint=10.0.0.1:4000|mtu=16k", small_terms)
    assert refused.value.part == "mtu"
    with pytest.raises(ChannelError) as refused:
        network("aeron:udp?endpoint=10.0.0.1:4000|init-term-id=1|term-id=1|term-offset=131072",
                small_terms)
    assert refused.value.part == "term-offset"


@pytest.mark.parametrize(("uri", "settings", "part"), [
    ("aeron:udp?endpoint=10.0.0.1:4000|mtu=8k|so-sndbuf=1k", {}, "so-sndbuf"),
    ("aeron:udp?endpoint=10.0.0.1:4000|mtu=8k", {"socket_so_sndbuf": "4k"}, "mtu"),
])
def test_a_datagram_the_send_buffer_cannot_hold_names_the_key_as_the_setting_does(
        uri: str, settings: dict[str, str], part: str) -> None:
    with pytest.raises(ChannelError, match="must hold one datagram") as refused:
        network(uri, DriverSettings(**settings))
    assert refused.value.part == part


@pytest.mark.parametrize(("uri", "part"), [
    ("aeron:udp?endpoint=10.0.0.1:4000|so-rcvbuf=1k", "so-rcvbuf"),
    ("aeron:udp?endpoint=10.0.0.1:4000|rcv-wnd=1m", "rcv-wnd"),
])
def test_a_window_the_receive_buffer_cannot_hold_names_the_key_as_the_setting_does(
        uri: str, part: str) -> None:
    with pytest.raises(ChannelError, match="must hold a full window") as refused:
        SubscriptionParams.resolve(parse_channel(uri), SETTINGS)
    assert refused.value.part == part
    both = SubscriptionParams.resolve(
        parse_channel("aeron:udp?endpoint=10.0.0.1:4000|rcv-wnd=1m|so-rcvbuf=1m"), SETTINGS)
    assert both.receiver_window_length == 1 << 20


def test_flow_control_comes_from_fc_else_the_setting_for_the_channel_kind() -> None:
    assert network("aeron:udp?endpoint=10.0.0.1:4000").flow_control == FlowControlParams(
        "unicast", SETTINGS.flow_control_group_tag, SETTINGS.flow_control_group_min_size,
        SETTINGS.flow_control_receiver_timeout,
        admission_interval_ns=SETTINGS.flow_control_admission_interval)
    assert network("aeron:udp?endpoint=224.0.1.1:4000").flow_control.name == "max"
    tagged = network("aeron:udp?endpoint=224.0.1.1:4000|fc=tagged,g:99/2,t:1s").flow_control
    assert tagged == FlowControlParams("tagged", 99, 2, 1000 * MS,
                                       admission_interval_ns=100 * MS)


def test_rate_control_comes_from_rc_with_seed_001s_values_for_what_it_leaves_out() -> None:
    assert network("aeron:udp?endpoint=10.0.0.1:4000").rate_control is None
    assert network("aeron:udp?endpoint=10.0.0.1:4000|rc=nak-strength").rate_control == (
        RateControlParams("nak-strength", (50, 75, 87, 100), 50 * MS))
    assert network("aeron:udp?endpoint=10.0.0.1:4000|rc=nak-strength,thresholds:30/60,"
                   "window:1s").rate_control == RateControlParams("nak-strength", (30, 60),
                                                                  1000 * MS)


@pytest.mark.parametrize(("uri", "sender_is_group", "group"), [
    ("aeron:udp?endpoint=10.0.0.1:4000", False, False),
    ("aeron:udp?endpoint=10.0.0.1:4000", True, True),  # the sender's SETUP says so
    ("aeron:udp?endpoint=224.0.1.1:4000", False, True),
    ("aeron:udp?endpoint=224.0.1.1:4000|group=false", True, False),
    ("aeron:udp?endpoint=10.0.0.1:4000|group=false", True, False),
    ("aeron:udp?endpoint=10.0.0.1:4000|group=true", False, True),
])
def test_group_semantics_are_decided_by_one_rule_on_both_sides(
        uri: str, sender_is_group: bool, group: bool) -> None:
    channel = parse_channel(uri)
    subscription = SubscriptionParams.resolve(channel, SETTINGS)
    assert subscription.image_is_group(sender_is_group) is group
    if not sender_is_group or channel.group is not None:
        assert has_group_semantics(channel) is group
        assert network(uri).group is group


@pytest.mark.parametrize(("uri", "asks", "correlation_id"), [
    ("aeron:udp?endpoint=10.0.0.1:4000", False, None),
    ("aeron:udp?endpoint=10.0.0.1:4000|response-correlation-id=42", True, 42),
    ("aeron:udp?control-mode=response|control=10.0.0.1:4001|response-correlation-id=43",
     False, 43),
])
def test_only_a_request_publication_asks_for_a_response(uri: str, asks: bool,
                                                        correlation_id: int | None) -> None:
    """docs/CHANNELS.md §7.6: response-correlation-id= without control-mode=response is a
    request publication's, whose SETUP asks for a response; a response publication's names
    the image it answers and asks for nothing; neither is a group."""
    params = network(uri)
    assert params.sends_response_setup is asks
    assert params.response_correlation_id == correlation_id
    assert not params.group


def test_a_subscription_takes_the_uri_values_before_the_settings() -> None:
    settings = DriverSettings(rcv_initial_window_length=128 * KIB, receiver_group_tag=5,
                              reliable_stream=True)
    defaults = SubscriptionParams.resolve(parse_channel("aeron:udp?endpoint=10.0.0.1:4000"),
                                          settings)
    assert (defaults.receiver_window_length, defaults.group_tag, defaults.reliable,
            defaults.nak_delay_ns, defaults.congestion_control) == (
        128 * KIB, 5, True, settings.nak_unicast_delay, "static")
    given = SubscriptionParams.resolve(parse_channel(
        "aeron:udp?endpoint=10.0.0.1:4000|rcv-wnd=64k|gtag=-3|reliable=false|nak-delay=2ms"),
        settings)
    assert (given.receiver_window_length, given.group_tag, given.reliable,
            given.nak_delay_ns) == (64 * KIB, -3, False, 2 * MS)
    # Zero is a value, not "unset", for these keys.
    zeros = SubscriptionParams.resolve(parse_channel(
        "aeron:udp?endpoint=10.0.0.1:4000|gtag=0|nak-delay=0"), settings)
    assert (zeros.group_tag, zeros.nak_delay_ns) == (0, 0)


def test_socket_options_take_the_uri_values_before_the_settings() -> None:
    settings = DriverSettings(socket_so_rcvbuf=256 * KIB, socket_so_sndbuf=0,
                              socket_multicast_ttl=0)
    assert SocketParams.resolve(parse_channel("aeron:udp?endpoint=224.0.1.1:4000"),
                                settings) == SocketParams(256 * KIB, 0, 0)
    assert SocketParams.resolve(parse_channel(
        "aeron:udp?endpoint=224.0.1.1:4000|so-rcvbuf=64k|so-sndbuf=32k|ttl=3"),
        settings) == SocketParams(64 * KIB, 32 * KIB, 3)


def test_every_name_the_uri_and_settings_accept_has_a_registered_strategy() -> None:
    assert set(FLOW_CONTROLS) == set(uri_grammar.FLOW_CONTROLS)
    unicast, multicast = (SETTINGS_TABLE[key].choices
                          for key in ("unicast_flow_control", "multicast_flow_control"))
    assert set(unicast) <= set(FLOW_CONTROLS) and set(multicast) <= set(FLOW_CONTROLS)
    # Every congestion control cc= names is registered, and only those.
    assert set(CONGESTION_CONTROLS) == set(uri_grammar.CONGESTION_CONTROLS)


def test_the_static_window_is_the_receiver_window_capped_at_half_a_term() -> None:
    params = SubscriptionParams.resolve(
        parse_channel("aeron:udp?endpoint=10.0.0.1:4000|rcv-wnd=1m|so-rcvbuf=1m"), SETTINGS)
    cc = congestion_control_for(params, 1024 * KIB, 1408)
    assert isinstance(cc, StaticWindowCongestionControl)
    assert cc.initial_window_length() == cc.max_window_length() == 512 * KIB
    assert cc.on_track_rebuild(0, consumption_position=0, last_sm_position=0,
                               hwm_position=4096, rebuild_start_position=0,
                               rebuild_end_position=0, loss_found=True) == (False, 512 * KIB)
    assert not cc.should_measure_rtt(0)
