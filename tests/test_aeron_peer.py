"""The stock Aeron 1.15.1 peer harness (tests/aeron_peer/), proved with Aeron talking to
itself on loopback: one Java driver per test in a fresh /dev/shm directory.

Needs ``scripts/ensure-aeron`` (``make test`` runs it).  Without the jar or Java 11 these tests
skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import os

import aeron_peer
import pytest
from aeron_peer import (
    AeronDriver,
    SampleFailed,
    basic_publisher,
    basic_subscriber,
    ping,
    pong,
    rate_subscriber,
    streaming_publisher,
)
from helpers import free_port, lacking

pytestmark = pytest.mark.timeout(60)

# Free ports, not Aeron's sample ports: those lie in the ephemeral range, where another socket
# of this machine may hold them.
UNICAST = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
MULTICAST = f"aeron:udp?endpoint=224.0.1.1:{free_port()}|interface=127.0.0.1"
STREAM = 1001
MESSAGES = 5


def require_aeron() -> None:
    """Skip without the jar or Java 11; under CI=true fail instead (in the test, not setup)."""
    reason = aeron_peer.aeron_available()
    if reason is not None:
        lacking(f"the Aeron peer: {reason}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(("channel", "loss"), [
    pytest.param(UNICAST, 0.0, id="unicast"),
    pytest.param(MULTICAST, 0.0, id="multicast-on-lo"),
    pytest.param(UNICAST, 0.05, id="unicast-5%-receive-loss"),
])
def test_basic_publisher_to_basic_subscriber_every_message_once_in_order(
        channel: str, loss: float) -> None:
    require_aeron()
    with AeronDriver(receive_data_loss_rate=loss, receive_data_loss_seed=1) as driver, \
            basic_subscriber(driver, channel, STREAM) as subscriber:
        published = basic_publisher(driver, channel, STREAM, messages=MESSAGES)
        assert published.accepted == list(range(MESSAGES)), published.lines
        subscriber.wait_for_messages(MESSAGES, timeout=10)
        received = subscriber.wait_quiet(0.3)  # a duplicate would show up here
        context = f"{[m.text for m in received]}\n{subscriber.describe()}"
        assert subscriber.hello_world_numbers() == list(range(MESSAGES)), context
        assert len({m.session_id for m in received}) == 1, context
        assert [e.available for e in subscriber.images][:1] == [True], context


def test_streaming_under_5_percent_receive_loss_every_message_once_in_order() -> None:
    require_aeron()
    messages = 20_000
    with AeronDriver(receive_data_loss_rate=0.05, receive_data_loss_seed=7) as driver, \
            basic_subscriber(driver, UNICAST, STREAM) as subscriber:
        streaming_publisher(driver, UNICAST, STREAM, message_length=32, messages=messages)
        subscriber.wait_for_messages(messages, timeout=20)
        received = subscriber.wait_quiet(0.3)
        assert [m.length for m in received[:1]] == [32]
        assert subscriber.sequence_numbers() == list(range(messages))
        # The loss was real and repaired: NAKs went out and retransmits came back.
        assert driver.counter("NAKs sent") > 0
        assert driver.counter("Retransmits sent") > 0


def test_streaming_publisher_to_rate_subscriber_reports_a_positive_rate() -> None:
    require_aeron()
    messages = 2_000_000
    with AeronDriver() as driver, rate_subscriber(driver, UNICAST, STREAM) as subscriber:
        published = streaming_publisher(driver, UNICAST, STREAM, message_length=32,
                                        messages=messages)
        assert published.back_pressure_ratio is not None
        reports = subscriber.wait_for_total(messages, timeout=20)
        assert reports[-1].total_messages == messages
        assert subscriber.peak_msgs_per_sec > 0
        assert subscriber.msgs_per_sec > 0
        assert subscriber.bytes_per_sec > 0


def test_ping_pong_reports_a_latency_histogram() -> None:
    require_aeron()
    with AeronDriver() as driver, pong(driver) as ponger:
        result = ping(driver, messages=200, warmup_messages=100, timeout=30)
        assert ponger.alive()
    assert result.total_count == 200
    assert 0 < result.p50_us <= result.max_us
    assert result.percentiles[-1][1] == 1.0


def test_driver_and_samples_leave_nothing_behind_when_the_test_fails() -> None:
    require_aeron()
    with pytest.raises(RuntimeError, match="boom"), AeronDriver() as driver:
        subscriber = basic_subscriber(driver, UNICAST, STREAM)
        with subscriber:
            driver.wait_for_counter("rcv-channel: " + UNICAST)
            pids = [driver.process.pid, subscriber.pid] if driver.process else []
            raise RuntimeError("boom")
    assert pids and not any(_alive(pid) for pid in pids)
    assert not driver.directory.exists()


def test_a_publisher_without_subscriber_fails_clearly() -> None:
    require_aeron()
    with AeronDriver() as driver, pytest.raises(SampleFailed, match="no subscriber connected"):
        basic_publisher(driver, UNICAST, STREAM, messages=1, connect_timeout=1.0)
