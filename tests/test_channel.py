"""Channel URIs (docs/CHANNELS.md §7): every parameter, errors naming the bad part, multicast."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.client.channel import (
    NAK_DELAY_RANGE_NS,
    PUBLICATION_WINDOW_RANGE,
    RECEIVER_WINDOW_RANGE,
    SOCKET_BUFFER_RANGE,
    Channel,
    FlowControlSpec,
    HostPort,
    RateControlSpec,
    parse_channel,
)
from slipstream.client.errors import ChannelError
from slipstream.client.layout import FRAME_ALIGNMENT, INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN

UDP = "aeron:udp?endpoint=localhost:40123|"

VALID: dict[str, dict[str, Any]] = {
    "aeron:ipc": {"media": "ipc"},
    "aeron:ipc?": {"media": "ipc"},
    "aeron:ipc?term-length=64k|mtu=8k|linger=0": {
        "term_length": 65536, "mtu": 8192, "linger_ns": 0},
    "aeron:udp?endpoint=localhost:40123": {
        "media": "udp", "endpoint": HostPort("localhost", 40123)},
    "aeron:udp?endpoint=LocalHost:40123|": {"endpoint": HostPort("localhost", 40123)},
    "aeron:udp?endpoint=10.1.2.3:0": {"endpoint": HostPort("10.1.2.3", 0)},
    "aeron:udp?endpoint=[::1]:40123": {"endpoint": HostPort("::1", 40123)},
    "aeron:udp?endpoint=[FE80:0::1]:9": {"endpoint": HostPort("fe80::1", 9)},
    "aeron:udp?control=10.0.0.1:40124|control-mode=dynamic": {
        "control": HostPort("10.0.0.1", 40124), "control_mode": "dynamic"},
    "aeron:udp?control-mode=manual": {"control_mode": "manual"},
    "aeron:udp?control-mode=response": {"control_mode": "response"},
    "aeron:udp?tags=1001": {"channel_tag": 1001, "entity_tag": None},
    "aeron:udp?tags=1001,1002": {"channel_tag": 1001, "entity_tag": 1002},
    UDP + "interface=192.168.1.0/24": {"interface": HostPort("192.168.1.0", None, 24)},
    UDP + "interface=10.0.0.1:4040/8": {"interface": HostPort("10.0.0.1", 4040, 8)},
    UDP + "interface=[::1]/64": {"interface": HostPort("::1", None, 64)},
    UDP + "interface=eth-host": {"interface": HostPort("eth-host")},
    UDP + "ttl=16": {"ttl": 16},
    UDP + "term-length=1g": {"term_length": 1 << 30},
    UDP + "term-length=65536": {"term_length": 65536},
    UDP + "mtu=1408": {"mtu": 1408},
    UDP + "mtu=64": {"mtu": 64},
    UDP + "mtu=65504": {"mtu": 65504},
    UDP + "rcv-wnd=128k|pub-wnd=1m": {"rcv_wnd": 131072, "pub_wnd": 1 << 20},
    UDP + "so-sndbuf=2m|so-rcvbuf=4194304": {"so_sndbuf": 2 << 20, "so_rcvbuf": 4 << 20},
    UDP + "nak-delay=100us|linger=5s": {"nak_delay_ns": 100_000, "linger_ns": 5_000_000_000},
    UDP + "untethered-window-limit-timeout=2s|untethered-resting-timeout=10ms": {
        "untethered_window_limit_timeout_ns": 2_000_000_000,
        "untethered_resting_timeout_ns": 10_000_000},
    UDP + "eos=false|reliable=true|sparse=true|tether=false|rejoin=false|group=true|ssc=true": {
        "eos": False, "reliable": True, "sparse": True, "tether": False, "rejoin": False,
        "group": True, "ssc": True},
    UDP + "spies-simulate-connection=false": {"ssc": False},
    UDP + "session-id=-7": {"session_id": -7, "session_id_tag": None},
    UDP + "session-id=tag:99": {"session_id": None, "session_id_tag": 99},
    UDP + "fc=max": {"fc": FlowControlSpec("max")},
    UDP + "fc=unicast": {"fc": FlowControlSpec("unicast")},
    UDP + "fc=min": {"fc": FlowControlSpec("min")},
    UDP + "fc=min,g:/3,t:5s": {"fc": FlowControlSpec("min", None, 3, 5_000_000_000)},
    UDP + "fc=tagged,g:1001": {"fc": FlowControlSpec("tagged", 1001)},
    UDP + "fc=tagged,t:10s,g:-1/0": {"fc": FlowControlSpec("tagged", -1, 0, 10_000_000_000)},
    UDP + "fc=tagged,g:/10": {"fc": FlowControlSpec("tagged", None, 10)},
    UDP + "fc=preferred,g:7": {"fc": FlowControlSpec("tagged", 7)},  # Aeron's older name
    UDP + "rc=nak-strength": {"rc": RateControlSpec("nak-strength")},
    UDP + "rc=nak-strength,window:20ms,thresholds:40/90": {
        "rc": RateControlSpec("nak-strength", (40, 90), 20_000_000)},
    UDP + "gtag=-9223372036854775808": {"gtag": -(2**63)},
    UDP + "cc=cubic": {"cc": "cubic"},
    UDP + "cc=static|max-resend=256": {"cc": "static", "max_resend": 256},
    UDP + "init-term-id=-5|term-id=-3|term-offset=4096": {
        "init_term_id": -5, "term_id": -3, "term_offset": 4096},
    UDP + "init-term-id=2147483647|term-id=-2147483648|term-offset=0": {  # wraps forward
        "init_term_id": 2**31 - 1, "term_id": -(2**31)},
    UDP + "term-length=64k|init-term-id=0|term-id=0|term-offset=65536": {"term_offset": 65536},
    UDP + "alias=my=feed:1|stream-id=1001|response-correlation-id=-1": {
        "alias": "my=feed:1", "stream_id": 1001, "response_correlation_id": -1},
    "aeron-spy:aeron:udp?endpoint=224.0.1.1:40456": {"spy": True, "media": "udp"},
    "aeron:ipc?control-mode=response|session-id=5|alias=x": {"control_mode": "response"},
}


@pytest.mark.parametrize("uri", VALID)
def test_valid_uris_parse_to_typed_fields(uri: str) -> None:
    channel = parse_channel(uri)
    for name, value in VALID[uri].items():
        assert getattr(channel, name) == value, name
    assert str(channel) == uri
    assert parse_channel(channel.canonical()) == channel


INVALID: list[tuple[str, str, str]] = [
    ("aeron:tcp?endpoint=a:1", "media", "'tcp' is not udp or ipc"),
    ("aeron:udp", "media", "needs '?'"),
    ("aeron:udpx?endpoint=a:1", "media", "'udpx' is not udp or ipc"),
    ("aeron-spy:aeron:ipc", "media", "spy"),
    ("aeron:", "media", "'' is not udp or ipc"),
    ("udp?endpoint=a:1", "scheme", "aeron:"),
    ("aeron:udp?endpoint=a:1|" + "alias=" + "x" * 4095, "uri", "maximum of 4095"),
    ("aeron:udp?", "endpoint", "needs endpoint, control, tags or control-mode"),
    ("aeron:udp?term-length=64k", "endpoint", "needs endpoint"),
    ("aeron:udp?control-mode=dynamic", "control-mode", "control address"),
    ("aeron:udp?endpoint=a:1|lingr=5s", "lingr", "unknown parameter (did you mean 'linger'?)"),
    ("aeron:udp?endpoint=a:1|ats=true", "ats", "does not support"),
    ("aeron:udp?endpoint=a:1|endpoint=b:2", "endpoint", "given twice"),
    ("aeron:udp?endpoint=a:1|ssc=true|spies-simulate-connection=true",
     "spies-simulate-connection", "given twice"),
    ("aeron:udp?endpoint=a:1|linger", "linger", "no '=value'"),
    ("aeron:udp?endpoint=a:1|linger=", "linger", "empty value"),
    ("aeron:udp?endpoint=a:1|=5", "params", "empty key"),
    ("aeron:udp?endpoint=a:1||linger=5", "params", "empty parameter"),
    ("aeron:ipc?endpoint=a:1", "endpoint", "aeron:udp only"),
    ("aeron:ipc?fc=max", "fc", "aeron:udp only"),
    ("aeron:ipc?control-mode=manual", "control-mode", "response only"),
    (UDP.replace("localhost:40123", "localhost:70000"), "endpoint",
     "port 70000 is out of range 0..65535"),
    ("aeron:udp?endpoint=localhost", "endpoint", "has no port"),
    ("aeron:udp?endpoint=localhost:http", "endpoint", "port 'http' is not a number"),
    ("aeron:udp?endpoint=::1:40123", "endpoint", "brackets"),
    ("aeron:udp?endpoint=[::1:40123", "endpoint", "missing ']'"),
    ("aeron:udp?endpoint=[::g]:1", "endpoint", "not an IPv6 address"),
    ("aeron:udp?endpoint=[::1]40123", "endpoint", "expected ':port'"),
    ("aeron:udp?endpoint=1.2.3:40123", "endpoint", "not a valid IPv4 address"),
    ("aeron:udp?endpoint=bad_host!:1", "endpoint", "not a host name"),
    ("aeron:udp?endpoint=:1", "endpoint", "host is empty"),
    ("aeron:udp?endpoint=224.0.1.2:40456", "endpoint", "odd last byte"),
    ("aeron:udp?endpoint=[ff02::2]:40456", "endpoint", "odd last byte"),
    (UDP + "interface=10.0.0.1/33", "interface", "prefix length 33 is out of range 0..32"),
    (UDP + "interface=10.0.0.1/x", "interface", "prefix length 'x'"),
    (UDP + "ttl=256", "ttl", "256 is out of range 0..255"),
    (UDP + "term-length=1000", "term-length", "1000 is not a power of two between 64k and 1g"),
    (UDP + "term-length=32k", "term-length", "32768 is not a power of two"),
    (UDP + "term-length=2g", "term-length", "is not a power of two between 64k and 1g"),
    (UDP + "term-length=big", "term-length", "'big' is not a size"),
    (UDP + "mtu=32", "mtu", "32 is not a multiple of 32 between 64 and 65504"),
    (UDP + "mtu=1400", "mtu", "1400 is not a multiple of 32"),
    (UDP + "mtu=65536", "mtu", "65536 is not a multiple of 32"),
    (UDP + "term-length=64k|mtu=16k", "mtu", "exceeds the maximum message length 8192"),
    (UDP + "rcv-wnd=0", "rcv-wnd", "out of range"),
    # The ranges of the settings these keys override (a value means the same in both).
    (UDP + "rcv-wnd=63", "rcv-wnd", "63 is out of range 64..1073741824 bytes"),
    (UDP + "so-rcvbuf=2g", "so-rcvbuf", "out of range 1..1073741824 bytes"),
    (UDP + "so-rcvbuf=0", "so-rcvbuf", "out of range 1..1073741824 bytes"),
    (UDP + "pub-wnd=0", "pub-wnd", "out of range 1..1073741824 bytes"),
    (UDP + "nak-delay=2s", "nak-delay", "2s is out of range 0ns..1s"),
    (UDP + "linger=2h", "linger", "7200s is out of range 0ns..3600s"),
    ("aeron:ipc?untethered-window-limit-timeout=1000h", "untethered-window-limit-timeout",
     "out of range 0ns..3600s"),
    (UDP + "so-sndbuf=4g", "so-sndbuf", "out of range"),
    (UDP + "nak-delay=soon", "nak-delay", "'soon' is not a duration"),
    (UDP + "linger=-1s", "linger", "is not a duration"),
    (UDP + "eos=yes", "eos", "'yes' is not true or false"),
    (UDP + "sparse=TRUE", "sparse", "is not true or false"),
    (UDP + "session-id=2147483648", "session-id", "out of range"),
    (UDP + "session-id=tag:x", "session-id", "'x' is not an integer"),
    (UDP + "session-id=0x10", "session-id", "'0x10' is not an integer"),
    (UDP + "fc=maximum", "fc", "'maximum' is not max, min, tagged or unicast"),
    (UDP + "fc=max,t:5s", "fc", "max takes no options"),
    (UDP + "fc=min,g:100/3", "fc", "min takes a group size only"),
    (UDP + "fc=min,g:100", "fc", "min takes a group size only"),
    (UDP + "fc=min,o:1", "fc", "option 'o:1'"),
    (UDP + "fc=min,t1a0s", "fc", "option 't1a0s'"),
    (UDP + "fc=tagged,g:", "fc", "option 'g:'"),
    (UDP + "fc=tagged,g:/", "fc", "is not an integer"),
    (UDP + "fc=tagged,g:1/", "fc", "is not an integer"),
    (UDP + "fc=tagged,g:1f2", "fc", "'1f2' is not an integer"),
    (UDP + "fc=tagged,t:5s,t:6s", "fc", "given twice"),
    (UDP + "fc=tagged,t:never", "fc", "'never' is not a duration"),
    (UDP + "fc=min,t:0", "fc", "not a receiver timeout in 1ms..3600s"),  # min would be max
    (UDP + "fc=tagged,t:100000h", "fc", "not a receiver timeout in 1ms..3600s"),
    (UDP + "rc=cubic", "rc", "'cubic' is not nak-strength"),
    (UDP + "rc=nak-strength,thresholds:90/40", "rc", "are not 1 to 4 ascending"),
    (UDP + "rc=nak-strength,thresholds:50/50", "rc", "are not 1 to 4 ascending"),
    (UDP + "rc=nak-strength,thresholds:10/20/30/40/50", "rc", "are not 1 to 4 ascending"),
    (UDP + "rc=nak-strength,thresholds:0/50", "rc", "0"),
    (UDP + "rc=nak-strength,thresholds:50/101", "rc", "101"),
    (UDP + "rc=nak-strength,window:100us", "rc", "not between 1ms and 10s"),
    (UDP + "rc=nak-strength,window:1s,window:2s", "rc", "given twice"),
    (UDP + "rc=nak-strength,rate:5", "rc", "option 'rate:5'"),
    ("aeron:ipc?rc=nak-strength", "rc", ""),
    (UDP + "gtag=9223372036854775808", "gtag", "out of range"),
    (UDP + "cc=reno", "cc", "'reno' is not static or cubic"),
    (UDP + "control-mode=auto", "control-mode", "'auto' is not manual or dynamic or response"),
    (UDP + "max-resend=0", "max-resend", "0 is out of range 1..256"),
    (UDP + "max-resend=257", "max-resend", "257 is out of range 1..256"),
    (UDP + "init-term-id=1|term-id=1", "term-offset", "go together"),
    (UDP + "term-offset=0", "init-term-id", "go together"),
    (UDP + "init-term-id=0|term-id=0|term-offset=33", "term-offset", "not a multiple of 32"),
    (UDP + "init-term-id=0|term-id=0|term-offset=-32", "term-offset", "out of range"),
    (UDP + "term-length=64k|init-term-id=0|term-id=0|term-offset=65568", "term-offset",
     "beyond term-length 65536"),
    (UDP + "init-term-id=5|term-id=4|term-offset=0", "term-id", "before init-term-id 5"),
    (UDP + "tags=a", "tags", "'a' is not an integer"),
    (UDP + "tags=-1", "tags", "out of range"),
    (UDP + "stream-id=x", "stream-id", "not an integer"),
]


@pytest.mark.parametrize(("uri", "part", "problem"), INVALID)
def test_invalid_uris_raise_naming_the_part(uri: str, part: str, problem: str) -> None:
    with pytest.raises(ChannelError) as caught:
        parse_channel(uri)
    assert caught.value.part == part
    assert problem in caught.value.problem
    assert f"{part}: " in str(caught.value)


def test_non_string_uri_is_a_channel_error() -> None:
    with pytest.raises(ChannelError, match="must be a str"):
        parse_channel(b"aeron:ipc")  # type: ignore[arg-type]


def test_the_error_message_names_uri_part_and_problem() -> None:
    uri = UDP.replace("40123", "70000")
    with pytest.raises(ChannelError) as caught:
        parse_channel(uri)
    assert str(caught.value) == (f"bad channel URI {uri!r}: endpoint: port 70000 is out of "
                                 f"range 0..65535")


def test_max_uri_length_is_accepted() -> None:
    uri = "aeron:ipc?alias="
    uri += "x" * (4095 - len(uri))
    assert parse_channel(uri).alias is not None


# -- multicast ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("endpoint", "control"), [
    ("224.0.1.1:40456", "224.0.1.2:40456"),
    ("239.255.255.255:1", "239.255.255.0:1"),  # Aeron increments the byte, which wraps
    ("[ff02::1]:40456", "[ff02::2]:40456"),
])
def test_multicast_endpoint_has_the_next_address_as_control_group(endpoint: str,
                                                                  control: str) -> None:
    channel = parse_channel(f"aeron:udp?endpoint={endpoint}|interface=127.0.0.1")
    assert channel.is_multicast
    assert str(channel.control_group) == control


@pytest.mark.parametrize("uri", ["aeron:udp?endpoint=127.0.0.1:40123",
                                 "aeron:udp?endpoint=[::1]:40123",
                                 "aeron:udp?endpoint=223.255.255.255:1",
                                 "aeron:udp?endpoint=240.0.0.1:1",
                                 "aeron:udp?control=224.0.1.2:1|control-mode=dynamic",
                                 "aeron:ipc"])
def test_unicast_and_ipc_are_not_multicast(uri: str) -> None:
    channel = parse_channel(uri)
    assert not channel.is_multicast
    assert channel.control_group is None


def test_names_resolve_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    looked_up: list[str] = []

    def fake_getaddrinfo(host: str, *args: Any, **kwargs: Any) -> list[Any]:
        looked_up.append(host)
        if host == "feed.example":
            return [(socket.AF_INET, socket.SOCK_DGRAM, 17, "", ("224.0.1.3", 0))]
        if host == "even.example":
            return [(socket.AF_INET, socket.SOCK_DGRAM, 17, "", ("224.0.1.4", 0))]
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    feed = parse_channel("aeron:udp?endpoint=feed.example:40456")
    assert looked_up == []
    assert feed.endpoint_address() == ipaddress.ip_address("224.0.1.3")
    assert feed.is_multicast
    assert feed.control_group == HostPort("224.0.1.4", 40456)

    even = parse_channel("aeron:udp?endpoint=even.example:40456")
    with pytest.raises(ChannelError) as caught:
        _ = even.control_group
    assert caught.value.part == "endpoint" and "odd last byte" in caught.value.problem

    missing = parse_channel("aeron:udp?endpoint=nowhere.example:1")
    with pytest.raises(ChannelError, match=r"cannot resolve 'nowhere\.example'"):
        _ = missing.is_multicast
    assert parse_channel("aeron:udp?endpoint=224.0.1.1:1").endpoint_address() is not None
    assert "224.0.1.1" not in looked_up


# -- canonical form ----------------------------------------------------------------------------


def test_canonical_form_sorts_keys_and_normalises_spellings() -> None:
    a = parse_channel("aeron:udp?term-length=64k|endpoint=LOCALHOST:40123|linger=5000ms|"
                      "spies-simulate-connection=true|fc=tagged,t:5s,g:7/2")
    b = parse_channel("aeron:udp?endpoint=localhost:40123|fc=tagged,g:7/2,t:5000000000|"
                      "ssc=true|linger=5s|term-length=65536")
    assert a == b and hash(a) == hash(b)
    assert a.canonical() == b.canonical() == (
        "aeron:udp?endpoint=localhost:40123|fc=tagged,g:7/2,t:5s|linger=5s|ssc=true|"
        "term-length=65536")
    assert str(a) != str(b)
    assert {a: 1}[b] == 1
    assert repr(a) == f"<Channel {a.canonical()}>"


def test_canonical_keeps_spy_prefix_and_bare_ipc() -> None:
    assert parse_channel("aeron:ipc?").canonical() == "aeron:ipc"
    spy = parse_channel("aeron-spy:aeron:udp?endpoint=[0::1]:1|session-id=tag:4")
    assert spy.is_spy and spy.is_udp and not spy.is_ipc
    assert spy.canonical() == "aeron-spy:aeron:udp?endpoint=[::1]:1|session-id=tag:4"
    assert parse_channel("aeron:udp?endpoint=a:1") != parse_channel("aeron-spy:aeron:udp?"
                                                                    "endpoint=a:1")


def test_a_channel_built_directly_prints_canonically() -> None:
    channel = Channel("ipc", term_length=65536)
    assert str(channel) == channel.canonical() == "aeron:ipc?term-length=65536"


def _sizes(values: st.SearchStrategy[int]) -> st.SearchStrategy[str]:
    """A size in bytes, spelled as a number or with a k/m suffix when exact."""
    def spell(n: int) -> st.SearchStrategy[str]:
        options = [str(n)]
        if n % 1024 == 0:
            options.append(f"{n // 1024}k")
        if n % (1 << 20) == 0:
            options.append(f"{n >> 20}m")
        return st.sampled_from(options)
    return values.flatmap(spell)


def _durations(low_ms: int = 0, high_ms: int = 3_600_000) -> st.SearchStrategy[str]:
    ns = st.integers(low_ms * 10**6, min(10**12, high_ms * 10**6))
    return st.one_of(ns.map(str), ns.map(lambda n: f"{n}ns"),
                     st.integers(low_ms, min(10**6, high_ms)).map(lambda n: f"{n}ms"),
                     st.integers(1 if low_ms else 0, min(1000, high_ms // 1000)).map(
                         lambda n: f"{n}s"))


_octet = st.integers(0, 255)
_host_ports = st.one_of(
    st.tuples(_octet, _octet, _octet, _octet).map(lambda o: ".".join(map(str, o))),
    st.sampled_from(["localhost", "Feed-1.example", "a_b"]),
    st.integers(0, 2**128 - 1).map(lambda n: f"[{ipaddress.IPv6Address(n)}]"),
).flatmap(lambda host: st.integers(0, 65535).map(lambda port: f"{host}:{port}"))
_int32 = st.integers(INT32_MIN, INT32_MAX)
_bools = st.sampled_from(["true", "false"])
_flow_control = st.one_of(
    st.sampled_from(["max", "min", "unicast", "tagged", "min,g:/3", "min,t:1s,g:/0"]),
    st.tuples(st.integers(INT64_MIN, INT64_MAX), st.integers(0, INT32_MAX),
              _durations(low_ms=1)).map(
        lambda t: f"tagged,g:{t[0]}/{t[1]},t:{t[2]}"),
)

_OPTIONAL_PARAMS: dict[str, st.SearchStrategy[str]] = {
    "interface": st.sampled_from(["127.0.0.1", "10.0.0.0/8", "[::1]:0/128", "eth0"]),
    "ttl": st.integers(0, 255).map(str),
    "term-length": _sizes(st.integers(16, 30).map(lambda b: 1 << b)),
    # <= term-length / 8 always
    "mtu": _sizes(st.integers(2, 256).map(lambda n: n * FRAME_ALIGNMENT)),
    "rcv-wnd": _sizes(st.integers(*RECEIVER_WINDOW_RANGE)),
    "pub-wnd": _sizes(st.integers(1, PUBLICATION_WINDOW_RANGE[1])),
    "so-sndbuf": _sizes(st.integers(1, SOCKET_BUFFER_RANGE[1])),
    "so-rcvbuf": _sizes(st.integers(1, SOCKET_BUFFER_RANGE[1])),
    "nak-delay": _durations(high_ms=NAK_DELAY_RANGE_NS[1] // 10**6),
    "linger": _durations(),
    "untethered-window-limit-timeout": _durations(),
    "untethered-resting-timeout": _durations(),
    "eos": _bools, "reliable": _bools, "sparse": _bools, "tether": _bools, "rejoin": _bools,
    "group": _bools, "ssc": _bools,
    "session-id": st.one_of(_int32.map(str), st.integers(0, INT64_MAX).map(lambda n: f"tag:{n}")),
    "fc": _flow_control,
    "gtag": st.integers(INT64_MIN, INT64_MAX).map(str),
    "cc": st.sampled_from(["static", "cubic"]),
    "max-resend": st.integers(1, 256).map(str),
    "alias": st.text(st.characters(codec="ascii", exclude_characters="|"), min_size=1,
                     max_size=20),
    "tags": st.one_of(st.integers(0, INT64_MAX).map(str),
                      st.tuples(st.integers(0, 99), st.integers(0, 99)).map(
                          lambda t: f"{t[0]},{t[1]}")),
    "stream-id": _int32.map(str),
    "response-correlation-id": st.integers(INT64_MIN, INT64_MAX).map(str),
}


@st.composite
def _uris(draw: st.DrawFn) -> str:
    params = {"endpoint": draw(_host_ports)}
    for key in draw(st.lists(st.sampled_from(sorted(_OPTIONAL_PARAMS)), unique=True)):
        params[key] = draw(_OPTIONAL_PARAMS[key])
    if draw(st.booleans()):
        init, delta = draw(_int32), draw(st.integers(0, INT32_MAX))
        params["init-term-id"] = str(init)
        params["term-id"] = str((init + delta + 2**31) % 2**32 - 2**31)
        # <= 64k, the minimum term length
        params["term-offset"] = str(draw(st.integers(0, 2048)) * FRAME_ALIGNMENT)
    items = draw(st.permutations(list(params.items())))
    prefix = "aeron-spy:" if draw(st.booleans()) else ""
    return prefix + "aeron:udp?" + "|".join(f"{k}={v}" for k, v in items)


def _odd_multicast(uri: str) -> bool:
    try:
        parse_channel(uri)
    except ChannelError as e:
        return e.part != "endpoint" or "odd last byte" not in e.problem
    return True


@settings(max_examples=300, deadline=None)
@given(_uris().filter(_odd_multicast))
def test_canonical_round_trip(uri: str) -> None:
    channel = parse_channel(uri)
    canonical = channel.canonical()
    again = parse_channel(canonical)
    assert again == channel
    assert again.canonical() == canonical
    assert str(channel) == uri and str(again) == canonical


_URI_ALPHABET = st.sampled_from([
    *"aeronudpic:?|=,/[]%.-_+ 0123456789gkmstxf",
    "endpoint", "control", "interface", "fc", "tags", "session-id", "tag:", "mtu", "ttl",
    "term-length", "init-term-id", "term-id", "term-offset", "linger", "control-mode",
    "224.0.1.", "::", "tagged", "min", "g:", "t:",
])


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(["", "aeron:udp?", "aeron:ipc?", "aeron-spy:aeron:udp?"]),
       st.lists(_URI_ALPHABET, max_size=30).map("".join))
def test_parse_channel_raises_nothing_but_channel_error(prefix: str, rest: str) -> None:
    try:
        channel = parse_channel(prefix + rest)
    except ChannelError as e:
        assert e.part and e.problem
    else:
        assert parse_channel(channel.canonical()) == channel


def test_a_name_with_an_ipv4_and_an_ipv6_address_resolves_to_the_ipv4_one(monkeypatch) -> None:
    """A dual-stack name whose resolver answers ``::1`` first: an interface= of it joined an
    IPv4 group with an IPv6 string (inet_aton failed), on hosts that sort it so."""
    import socket

    from slipstream.client.channel import resolve_host
    from slipstream.daemon.media import names

    answers = {"dual.test": [(socket.AF_INET6, socket.SOCK_DGRAM, 17, "", ("::1", 0, 0, 0)),
                             (socket.AF_INET, socket.SOCK_DGRAM, 17, "", ("127.0.0.1", 0))],
               "six.test": [(socket.AF_INET6, socket.SOCK_DGRAM, 17, "", ("::1", 0, 0, 0))]}
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *_, **__: answers[host])
    assert resolve_host("dual.test") == "127.0.0.1"
    assert resolve_host("six.test") == "::1"
    channel = parse_channel("aeron:udp?endpoint=224.0.1.1:40456|interface=dual.test")
    cache = names.NameCache()
    cache.store(names.resolve(["dual.test"]), now_s=0.0)
    assert cache.lookup(channel, "interface", "dual.test") == "127.0.0.1"
    assert str(parse_channel("aeron:udp?endpoint=dual.test:40456").endpoint_address()) == (
        "127.0.0.1")
