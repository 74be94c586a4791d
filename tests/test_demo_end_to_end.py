"""``slipstream demo`` end to end: both streams move and stop cleanly, the slow-consumer
demo shows its back-pressure episodes live, and SIGTERM stops the demo and its driver."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

SLIPSTREAM = [sys.executable, "-m", "slipstream.daemon.cli"]


def test_sigterm_stops_the_demo_and_its_driver(driver_dir: Path) -> None:
    demo = subprocess.Popen([*SLIPSTREAM, "demo", "--dir", str(driver_dir), "--rate", "1000"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert "slipstream demo" in (demo.stdout.readline() if demo.stdout else "")
        deadline = time.monotonic() + 20
        while not (driver_dir / "counters.dat").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.0)
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(20) == 0
    finally:
        if demo.poll() is None:
            demo.kill()
    assert not driver_dir.exists()  # the driver stopped and removed its directory


def test_the_demo_streams_and_stops_cleanly(driver_dir: Path) -> None:
    result = subprocess.run([*SLIPSTREAM, "demo", "--dir", str(driver_dir), "--duration", "3",
                             "--rate", "20000"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rates = [line for line in result.stdout.splitlines() if line.startswith("[")]
    assert rates and "(        0/s)" not in rates[-1]  # both streams, IPC and UDP, move
    assert "NAKs 0 " not in rates[-1]  # the UDP stream's loss is repaired
    assert "expected message" not in result.stdout  # both arrived whole and in order
    assert "slipstream demo: stopped" in result.stdout
    assert not driver_dir.exists()


def test_the_slow_consumer_demo_shows_episodes_live(driver_dir: Path) -> None:
    result = subprocess.run([*SLIPSTREAM, "demo", "--dir", str(driver_dir), "--duration", "7",
                             "--rate", "20000", "--slow-consumer"],
                            capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # Its subscriber slows down from 2 s to 4 s: the publisher's callback hears the episode.
    assert "slow stream: back-pressure episode 1 began (depth 524,288 bytes" in out, out
    assert "slow stream: episode 1 ended after" in out, out
    slow = [line for line in out.splitlines() if line.lstrip().startswith("slow ")]
    assert slow and "episodes 0 " not in slow[-1] and "peak 524,288 B" in slow[-1]
    assert "slipstream demo: stopped" in out

