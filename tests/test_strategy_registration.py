"""A strategy is its class (daemon/flow/strategy.py): one written here, registered here, is
parsed from a URI with its own options (a bad one refused, naming the key), run by the C or
the Python half as it declares, and served to Prometheus with the counter it declares, with
no other file changed; unregistered, it is gone again."""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import pytest
from helpers import NETWORK_SETTINGS, free_port
from test_protocol_pair import URI, Pair, connect

from slipstream.client import Client
from slipstream.client import strategy_grammar as grammar
from slipstream.client.channel import parse_channel
from slipstream.client.errors import ChannelError
from slipstream.client.frames import StatusMessage
from slipstream.client.strategy_grammar import (
    CongestionControlSpec,
    FlowControlSpec,
    Integer,
    Option,
    Size,
    StrategyGrammar,
)
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.driver import MediaDriver
from slipstream.daemon.flow import strategy
from slipstream.daemon.flow.cubic import CubicCongestionControl
from slipstream.daemon.flow.flow_control import FlowControl, sm_limit
from slipstream.daemon.flow.registry import (
    CONGESTION_CONTROLS,
    FLOW_CONTROLS,
    RATE_CONTROLS,
    register_congestion_control,
    register_flow_control,
    unregister,
)
from slipstream.daemon.flow.static_window import StaticWindowCongestionControl
from slipstream.daemon.flow.strategy import StrategyCounter
from slipstream.daemon.flow.unicast import UnicastFlowControl
from slipstream.daemon.protocol.params import (
    FlowControlParams,
    PublicationParams,
    StrategyOptions,
    SubscriptionParams,
)

KIB = 1024
UDP = "aeron:udp?endpoint=10.0.0.1:4000|"


class HalfWindowFlowControl(FlowControl):
    """Holds the sender limit at the receiver's position + a share of its window (half by
    default): not the unicast rule, so the C half must leave its status messages to Python."""

    uri = StrategyGrammar(
        "fc", "half", "the sender limit is a receiver's position + a share of its window",
        options=(Option("share", Integer(1, 100, units="percent"),
                        "the share of the receiver window the sender may run ahead",
                        fields="share", default=50, form="<percent>"),))
    retransmit_window_multiple = 16
    c_fast_path = False

    def __init__(self, share: int) -> None:
        super().__init__()
        self.share = share

    @classmethod
    def from_params(cls, params: FlowControlParams) -> Self:
        return cls(params.options["share"])

    def on_status_message(self, sm: StatusMessage, source, sender_limit: int,
                          initial_term_id: int, position_bits: int, now_ns: int) -> int:
        self.receiver_window = sm.receiver_window
        position = sm_limit(sm, initial_term_id, position_bits) - sm.receiver_window
        return position + sm.receiver_window * self.share // 100


class FixedWindowCongestionControl(StaticWindowCongestionControl):
    """A window of its own (``window:``, capped at half a term), which never changes: static,
    with cc=static's rules, so the C half runs the image's rebuild passes and status messages;
    one counter, the window."""

    uri = StrategyGrammar(
        "cc", "fixed", "a fixed window of its own",
        options=(Option("window", Size(4 * KIB, 1 << 30), "the window the image advertises",
                        fields="window", default=64 * KIB),))
    is_static = True
    counters = (StrategyCounter("rcv-cc-fixed-wnd", "slipstream_image_fixed_window_bytes",
                                "The window of a cc=fixed image",
                                read=lambda cc: cc.window_length),)

    @classmethod
    def from_params(cls, params: SubscriptionParams, term_length: int, sender_mtu: int,
                    now_ns: int = 0) -> Self:
        return cls(min(params.congestion_control_options["window"], term_length // 2))


@pytest.fixture
def registered() -> Iterator[None]:
    """The two strategies above registered for the test, and unregistered after it: the
    grammar takes their names no longer, and the registry is as before."""
    before = (dict(FLOW_CONTROLS), dict(CONGESTION_CONTROLS), dict(RATE_CONTROLS))
    register_flow_control(HalfWindowFlowControl)
    register_congestion_control(FixedWindowCongestionControl)
    try:
        yield
    finally:
        unregister(HalfWindowFlowControl)
        unregister(FixedWindowCongestionControl)
    assert (dict(FLOW_CONTROLS), dict(CONGESTION_CONTROLS), dict(RATE_CONTROLS)) == before
    for uri, key, names in ((UDP + "fc=half", "fc", "max, min, tagged or unicast"),
                            (UDP + "cc=fixed", "cc", "static or cubic")):
        with pytest.raises(ChannelError) as refused:
            parse_channel(uri)
        assert refused.value.part == key and refused.value.problem.endswith(names)


def test_its_uri_values_parse_with_its_options_into_the_streams_parameters(
        registered: None) -> None:
    channel = parse_channel(UDP + "fc=half,share:25|cc=fixed,window:32k")
    assert channel.fc == FlowControlSpec("half", 25) == FlowControlSpec("half", share=25)
    assert (channel.fc.name, channel.fc.share) == ("half", 25)
    assert channel.cc == CongestionControlSpec("fixed", 32 * KIB) == "fixed,window:32768"
    assert channel.canonical() == ("aeron:udp?cc=fixed,window:32768|endpoint=10.0.0.1:4000|"
                                   "fc=half,share:25")
    assert parse_channel(channel.canonical()) == channel
    settings = DriverSettings()
    assert PublicationParams.for_network(channel, settings).flow_control == FlowControlParams(
        "half", settings.flow_control_group_tag, settings.flow_control_group_min_size,
        settings.flow_control_receiver_timeout, StrategyOptions((("share", 25),)),
        settings.flow_control_admission_interval)
    # What the URI leaves out is the declared default.
    assert PublicationParams.for_network(parse_channel(UDP + "fc=half"),
                                         settings).flow_control.options["share"] == 50
    assert SubscriptionParams.resolve(channel, settings).congestion_control_options[
        "window"] == 32 * KIB
    assert SubscriptionParams.resolve(parse_channel(UDP + "cc=fixed"), settings
                                      ).congestion_control_options["window"] == 64 * KIB


@pytest.mark.parametrize(("uri", "part", "problem"), [
    (UDP + "fc=half,share:0", "fc", "0 is out of range 1..100"),
    (UDP + "fc=half,share:most", "fc", "'most' is not an integer"),
    (UDP + "fc=half,ratio:2", "fc", "option 'ratio:2' is not share:<percent>"),
    (UDP + "fc=half,share:20,share:30", "fc", "option share: given twice"),
    (UDP + "fc=halve", "fc", "'halve' is not max, min, tagged, unicast or half"),
    (UDP + "cc=fixed,window:1k", "cc", "1024 is out of range 4096..1073741824 bytes"),
    (UDP + "cc=fixed,t:5s", "cc", "option 't:5s' is not window:<size>"),
    ("aeron:ipc?fc=half", "fc", "aeron:udp only"),
])
def test_a_bad_option_of_it_is_refused_naming_the_key(registered: None, uri: str, part: str,
                                                      problem: str) -> None:
    with pytest.raises(ChannelError) as refused:
        parse_channel(uri)
    assert refused.value.part == part
    assert problem in refused.value.problem


def test_the_c_half_or_the_python_half_runs_it_as_it_declares(registered: None,
                                                             shm: Path) -> None:
    """fc=half has no C fast path: its SMs go to Python, which holds snd-lmt at position +
    half the window; cc=fixed is static: the C half runs its image.  fc=unicast beside it
    (C's rule) is taken by C."""
    pair = Pair(shm, uri=URI + "|fc=half", receiver_uri=URI + "|cc=fixed,window:16k")
    connect(pair)
    payloads = [bytes([i]) * 1000 for i in range(40)]
    for payload in payloads:
        while pair.offer(payload) <= 0:
            pair.run_until(pair.now + 100_000)
    pair.run_until(pair.now + 2_000_000)
    assert pair.received == payloads
    publication, image = pair.publication, pair.image
    assert isinstance(publication.flow_control, HalfWindowFlowControl)
    assert not publication.c.sm_in_c
    _, last_sm = pair.frames("r2p", StatusMessage)[-1]
    assert last_sm.receiver_window == 16 * KIB
    position = sm_limit(last_sm, publication.initial_term_id,
                        publication.position_bits) - 16 * KIB
    assert publication.sender_limit == position + 8 * KIB
    assert isinstance(image.congestion_control, FixedWindowCongestionControl)
    assert image.c.rebuild_in_c and image.c.sm_in_c

    (shm / "unicast").mkdir()
    unicast = Pair(shm / "unicast")
    connect(unicast)
    assert isinstance(unicast.publication.flow_control, UnicastFlowControl)
    assert unicast.publication.c.sm_in_c


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.sockets  # the module's lane is unit
@pytest.mark.timeout(60)
def test_an_embedded_driver_carries_it_and_serves_its_counter(registered: None,
                                                              driver_dir: Path) -> None:
    """A driver in this process, where it is registered: a stream under fc=half and
    cc=fixed, and the image's rcv-cc-fixed-wnd in the metrics exporter's scrape."""
    port = _free_tcp_port()
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    driver = MediaDriver.embedded(driver_dir, metrics_address=f"127.0.0.1:{port}",
                                  **NETWORK_SETTINGS)
    try:
        with Client.connect(driver.directory, invoker=driver.do_work) as client:
            subscription = client.add_subscription(uri + "|cc=fixed,window:32k", 81)
            publication = client.add_publication(uri + "|fc=half,share:50", 81)
            received: list[bytes] = []
            deadline = time.monotonic() + 20
            sent = 0
            while len(received) < 100:
                assert time.monotonic() < deadline, f"{len(received)} of 100 arrived"
                if sent < 100 and publication.offer(bytes([sent]) * 500) > 0:
                    sent += 1
                driver.do_work()
                subscription.poll(lambda data, _h: received.append(bytes(data)), 10)
            assert received == [bytes([i]) * 500 for i in range(100)]
            [image] = subscription.images
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
    finally:
        driver.close()
    assert "# TYPE slipstream_image_fixed_window_bytes gauge" in text
    series = (f'slipstream_image_fixed_window_bytes{{channel="{uri}|cc=fixed,window:32k",'
              f'session="{publication.session_id}",source="{image.source_identity}",'
              f'stream="81"}}')
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    assert match and float(match[1]) == 32 * KIB, text


def test_the_registry_refuses_what_would_fail_silently() -> None:
    class NoGrammar(HalfWindowFlowControl):
        uri = None  # type: ignore[assignment]

    class Counted(HalfWindowFlowControl):
        uri = StrategyGrammar("fc", "counted", "a flow control with a counter")
        counters = (StrategyCounter("snd-fc-x", "slipstream_x", "x", read=lambda fc: 0),)

    class Impostor(UnicastFlowControl):
        uri = StrategyGrammar("fc", "max", "another max")

    class SameCounter(FixedWindowCongestionControl):
        uri = StrategyGrammar("cc", "same", "cubic's counters")
        counters = CubicCongestionControl.counters

    with pytest.raises(TypeError, match="declares no fc= grammar"):
        register_flow_control(NoGrammar)
    with pytest.raises(TypeError, match="not a concrete FlowControl"):
        register_flow_control(FlowControl)  # type: ignore[type-abstract]
    with pytest.raises(TypeError, match="not a concrete FlowControl"):
        register_flow_control(FixedWindowCongestionControl)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nothing would publish"):
        register_flow_control(Counted)  # the publication publishes fc-receivers only
    with pytest.raises(ValueError, match="fc=max is MaxMulticastFlowControl's already"):
        register_flow_control(Impostor)
    with pytest.raises(ValueError, match="CubicCongestionControl's already"):
        register_congestion_control(SameCounter)
    with pytest.raises(TypeError, match="not its grammar's"):
        type("Misnamed", (UnicastFlowControl,), {"name": "x", "uri": grammar.UNICAST})
    assert "counted" not in grammar.grammars("fc") and "same" not in grammar.grammars("cc")


def test_every_grammar_the_client_takes_has_its_strategy_and_back() -> None:
    for key in grammar.KEYS:
        registered = strategy.table(key)
        assert set(grammar.grammars(key)) == set(registered), key
        assert all(cls.uri is grammar.grammars(key)[name] and cls.name == name
                   for name, cls in registered.items())
