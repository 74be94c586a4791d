"""Prometheus metrics from the counters file, scraped over HTTP as Prometheus would."""

from __future__ import annotations

import json
import random
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import FAST_DRIVER_SETTINGS, free_port, free_tcp_port, scrape, value, wait_for

from slipstream.client import Client
from slipstream.client.counters import SystemCounter
from slipstream.client.errors import RegistrationError
from slipstream.client.logbuffer import compute_log_length
from slipstream.daemon.config import load_settings
from slipstream.daemon.driver import MediaDriver
from slipstream.daemon.ops.stat import run_stat


def test_the_driver_serves_its_counters_to_prometheus(driver_dir: Path) -> None:
    port = free_tcp_port()
    with MediaDriver.launch(directory=driver_dir, metrics_address=f"127.0.0.1:{port}",
                            **FAST_DRIVER_SETTINGS), Client.connect(driver_dir) as client:
        publication = client.add_publication("aeron:ipc", 77)
        subscription = client.add_subscription("aeron:ipc", 77)
        wait_for(lambda: publication.is_connected)
        for _ in range(10):
            while publication.offer(b"x" * 100) < 0:
                pass
        subscription.receive(lambda d, h: None, 10, timeout=2)
        text = scrape(port)
    assert "# TYPE slipstream_nak_messages_sent_total counter" in text
    # Values now, which go down as well as up: gauges, or rate() would read resets.
    assert "# TYPE slipstream_governor_pressure gauge" in text
    assert "# TYPE slipstream_governor_step gauge" in text
    assert "slipstream_governor_step_total" not in text
    assert "# TYPE slipstream_released_log_bytes gauge" in text
    assert "# TYPE slipstream_released_logs_ready gauge" in text
    assert value(text, "slipstream_sent_bytes_total") == 0  # IPC only: nothing on a wire
    # Names that followed a peer to a new address (docs/CHANNELS.md §7.2): none here.
    assert "# TYPE slipstream_resolution_changes_total counter" in text
    assert value(text, "slipstream_resolution_changes_total") == 0
    assert value(text, "slipstream_clients") == 1
    session = publication.session_id
    assert value(text, f'slipstream_position_bytes{{channel="aeron:ipc",kind="sub-pos",'
                       f'session="{session}",stream="77",subscription='
                       f'"{subscription.registration_id}"}}') == 10 * 160
    # Younger than the driver_timeout after which its clients would deem it dead.
    driver_timeout_s = load_settings(env={}, overrides=FAST_DRIVER_SETTINGS).driver_timeout / 1e9
    assert value(text, "slipstream_driver_heartbeat_age_seconds") < driver_timeout_s
    # The capacity a user can hit, by its setting: system counters, the client's heartbeat
    # and the pair's counters are in use.
    assert "counters_capacity" in text
    assert value(text, "slipstream_counters_capacity") == load_settings(
        env={}, overrides=FAST_DRIVER_SETTINGS).counters_capacity
    assert len(SystemCounter) + 1 < value(text, "slipstream_counters_allocated") < value(
        text, "slipstream_counters_capacity")


@pytest.mark.timeout(60)  # an exporter that never prints must fail the readline, not hang it
def test_slipstream_metrics_runs_beside_a_driver_and_names_the_port_it_got(
        driver_dir: Path) -> None:
    """Port 0: the kernel picks one, and the line the exporter prints names it."""
    with MediaDriver.launch(directory=driver_dir, **FAST_DRIVER_SETTINGS):
        exporter = subprocess.Popen([sys.executable, "-m", "slipstream.daemon.cli", "metrics",
                                     "--dir", str(driver_dir), "--address", "127.0.0.1:0"],
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert exporter.stdout is not None
            line = exporter.stdout.readline()
            match = re.fullmatch(r"slipstream metrics: http://127\.0\.0\.1:([0-9]+)/metrics\n",
                                 line)
            assert match and int(match[1]) != 0, line
            text = scrape(int(match[1]))
            assert value(text, "slipstream_clients") == 0
            assert "slipstream_errors_total" in text
        finally:
            exporter.terminate()
            exporter.wait(10)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slipstream.daemon.cli", *args],
                          capture_output=True, text=True, timeout=60)


def test_an_address_the_exporter_cannot_serve_is_an_error_naming_its_key(
        driver_dir: Path) -> None:
    """A port in use, or no host:port at all: one line naming the setting and exit 2, not a
    traceback; the driver that could not start leaves nothing behind."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        in_use = f"127.0.0.1:{taken.getsockname()[1]}"
        driver = _cli("driver", "--dir", str(driver_dir), "--set", f"metrics_address={in_use}")
        exporter = _cli("metrics", "--dir", str(driver_dir), "--address", in_use)
    assert driver.returncode == 2
    assert (f"configuration key 'metrics_address': cannot listen on {in_use}"
            in driver.stderr), driver.stderr
    assert not driver_dir.exists() or not any(driver_dir.iterdir())
    assert exporter.returncode == 2
    assert f"configuration key '--address': cannot listen on {in_use}" in exporter.stderr
    for bad in ("127.0.0.1:99999", "nohost", "127.0.0.1:abc", "[::1:9100", "::1:9100",
                "[::1]]:9100"):
        refused = _cli("metrics", "--dir", str(driver_dir), "--address", bad)
        assert refused.returncode == 2
        assert f"'--address': '{bad}' is not host:port" in refused.stderr, refused.stderr


def test_stat_refuses_an_interval_that_is_not_above_zero(driver_dir: Path) -> None:
    for bad in ("-1", "0", "nan", "soon"):
        refused = _cli("stat", "--dir", str(driver_dir), "--interval", bad)
        assert refused.returncode == 2
        assert "--interval" in refused.stderr and "above 0" in refused.stderr, refused.stderr


def test_the_receivers_min_flow_control_counts_are_a_metric(driver_dir: Path) -> None:
    port = free_tcp_port()
    uri = (f"aeron:udp?endpoint=224.0.1.{random.randrange(1, 250, 2)}:{free_port()}"
           "|interface=127.0.0.1|fc=min")  # a data group's last byte is odd
    with MediaDriver.launch(directory=driver_dir, metrics_address=f"127.0.0.1:{port}",
                            **FAST_DRIVER_SETTINGS), Client.connect(driver_dir) as client:
        subscription = client.add_subscription(uri, 78)
        publication = client.add_publication(uri, 78)
        wait_for(lambda: publication.is_connected and bool(subscription.images))
        text = scrape(port)
    assert value(text, f'slipstream_flow_control_receivers{{channel="{uri}",session='
                       f'"{publication.session_id}",stream="78"}}') == 1


def test_a_cubic_images_round_trip_and_window_are_metrics(driver_dir: Path) -> None:
    """cc=cubic keeps two counters per image, as Aeron's (rcv-cc-cubic-rtt, -wnd): the round
    trip its RTTMs measured through the sender (0 until one came back) and the window it
    advertises, a whole number of the sender's datagrams."""
    port = free_tcp_port()
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    with MediaDriver.launch(directory=driver_dir, metrics_address=f"127.0.0.1:{port}",
                            cubic_measure_rtt=True, **FAST_DRIVER_SETTINGS), \
            Client.connect(driver_dir) as client:
        subscription = client.add_subscription(uri + "|cc=cubic", 79)
        publication = client.add_publication(uri, 79)
        wait_for(lambda: publication.is_connected and bool(subscription.images))
        [image] = subscription.images
        series = (f'{{channel="{uri}|cc=cubic",session="{publication.session_id}",'
                  f'source="{image.source_identity}",stream="79"}}')
        wait_for(lambda: value(scrape(port), "slipstream_image_cubic_rtt_seconds" + series) > 0,
                 what="a round trip measured")
        text = scrape(port)
    assert 0 < value(text, "slipstream_image_cubic_rtt_seconds" + series) < 0.1
    window = value(text, "slipstream_image_cubic_window_bytes" + series)
    assert window % 1408 == 0 and 1408 <= window <= 128 * 1024  # up to the static window


def test_a_dropped_datagram_shows_by_cause_in_stat_and_prometheus(driver_dir: Path) -> None:
    """A datagram the driver turns away is counted under its cause: ``slipstream stat``'s
    drops-by-cause section (and ``--json``'s ``drops``) and ``slipstream_drops_total``."""
    import json

    port = free_tcp_port()
    udp_port = free_port()
    with MediaDriver.launch(directory=driver_dir, metrics_address=f"127.0.0.1:{port}",
                            **FAST_DRIVER_SETTINGS), Client.connect(driver_dir) as client:
        client.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{udp_port}", 7)
        attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

        def malformed_counted() -> bool:
            # Sent until counted: the receive endpoint binds on the receiver's thread.
            # Shorter than a frame header.
            attacker.sendto(b"\x01\x02\x03", ("127.0.0.1", udp_port))
            return value(scrape(port), 'slipstream_drops_total{cause="malformed"}') >= 3

        with attacker:
            wait_for(malformed_counted, what="three malformed datagrams counted")
        text = scrape(port)
        assert "# TYPE slipstream_drops_total counter" in text
        assert value(text, 'slipstream_drops_total{cause="foreign-source"}') == 0
        result = subprocess.run([sys.executable, "-m", "slipstream.daemon.cli", "stat", "--once",
                                 "--json", "--dir", str(driver_dir)],
                                capture_output=True, text=True, timeout=30, check=True)
        assert json.loads(result.stdout)["drops"]["malformed"] >= 3
        table = subprocess.run([sys.executable, "-m", "slipstream.daemon.cli", "stat", "--once",
                                "--dir", str(driver_dir)],
                               capture_output=True, text=True, timeout=30, check=True).stdout
    section = table.split("drops by cause", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"^\s+malformed\s+[3-9]", section, re.M), section


def test_the_security_page_lists_every_drop_cause_by_its_counter() -> None:
    """docs/SECURITY.md's drops-by-cause table is DROP_CAUSES: each cause with its counter,
    none missing, none that the driver does not count."""
    from slipstream.client.counters import DROP_CAUSES

    page = (Path(__file__).parents[1] / "docs" / "SECURITY.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z-]+)` \| `([A-Z_]+)` \|", page, re.M))
    assert rows == {cause: counter.name for counter, cause in DROP_CAUSES.items()}


# Every capacity a user can reach says so: the refusal names the setting to raise and its
# value, and `slipstream stat` and the metrics show its use and its limit (`capacities` in
# client/counters.py).  The image bounds': test_setup_flood.py.
KIB = 1024


def stat_capacities(directory: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """``slipstream stat --json --once``'s capacities, by setting."""
    capsys.readouterr()
    assert run_stat(str(directory), once=True, as_json=True) == 0
    return json.loads(capsys.readouterr().out)["capacity"]


def capacity_series(text: str, kind: str, setting: str, unit: str) -> float:
    """``slipstream_capacity_<kind>`` (counts) or ``..._<kind>_bytes`` of ``setting`` in a
    scrape."""
    suffix = "" if unit == "count" else f"_{unit}"
    return value(text, f'slipstream_capacity_{kind}{suffix}{{setting="{setting}"}}')


def test_log_buffer_memory_limit_refuses_the_log_past_it_and_shows_its_use(
        driver_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A limit of three 64 KiB-term logs and a byte: the fourth IPC publication is refused
    naming log_buffer_memory_limit and its value; stat and the metrics show the three logs'
    bytes of the limit, and one fewer once one is closed."""
    log_length = compute_log_length(64 * KIB)
    limit = 3 * log_length + 1
    port = free_tcp_port()
    with MediaDriver.launch(directory=driver_dir, log_buffer_memory_limit=str(limit),
                            metrics_address=f"127.0.0.1:{port}", **FAST_DRIVER_SETTINGS), \
            Client.connect(driver_dir) as client:
        publications = [client.add_publication("aeron:ipc", stream_id) for stream_id in (1, 2, 3)]
        with pytest.raises(RegistrationError,
                           match=rf"past log_buffer_memory_limit \({limit / 2**20:g} MiB\).*"
                                 r"raise log_buffer_memory_limit"):
            client.add_publication("aeron:ipc", 4)

        def shown(logs: int) -> bool:
            found = stat_capacities(driver_dir, capsys)["log_buffer_memory_limit"]
            text = scrape(port)
            return (found == {"used": logs * log_length, "limit": limit, "unit": "bytes"}
                    and capacity_series(text, "used", "log_buffer_memory_limit", "bytes")
                    == logs * log_length
                    and capacity_series(text, "limit", "log_buffer_memory_limit", "bytes")
                    == limit)

        wait_for(lambda: shown(3), what="three logs of the limit shown")
        publications[0].close()
        wait_for(lambda: shown(2), what="two logs of the limit shown")


def test_counters_capacity_refuses_the_stream_past_it_and_shows_its_use(
        driver_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The least counters file (256 slots) fills with IPC pairs: the subscription that finds
    no counter is refused naming counters_capacity and its value, and stat and the metrics
    show the file's slots in use of 256."""
    port = free_tcp_port()
    with MediaDriver.launch(directory=driver_dir, counters_capacity="256",
                            metrics_address=f"127.0.0.1:{port}", **FAST_DRIVER_SETTINGS), \
            Client.connect(driver_dir) as client:
        with pytest.raises(RegistrationError, match=r"counters_capacity = 256: raise "
                                                    r"counters_capacity"):
            for stream_id in range(1, 256):
                client.add_publication("aeron:ipc", stream_id)
                client.add_subscription("aeron:ipc", stream_id)
        found = stat_capacities(driver_dir, capsys)["counters_capacity"]
        text = scrape(port)
    # A refused command takes back what it allocated: a few slots may stay free.
    assert found["limit"] == 256 and 256 - 8 < found["used"] <= 256, found
    assert capacity_series(text, "limit", "counters_capacity", "count") == 256
    assert 256 - 8 < capacity_series(text, "used", "counters_capacity", "count") <= 256
