"""``slipstream demo``'s arguments and its end when its driver or one of its processes ends."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import wait_for

from slipstream.client.counters import CountersFile
from slipstream.client.errors import InvalidArgumentError
from slipstream.daemon.cli import build_parser

SLIPSTREAM = [sys.executable, "-m", "slipstream.daemon.cli"]


@pytest.mark.parametrize(("arguments", "option"), [
    (["--size", "100000000"], "--size"),  # each publisher died of MessageTooLongError
    (["--size", "-1"], "--size"),  # became 8 B unsaid
    (["--size", "7"], "--size"),  # no room for the sequence number
    (["--rate", "-5"], "--rate"),  # printed -5/s
    (["--duration", "-1"], "--duration"),
    (["--duration", "nan"], "--duration"),
])
def test_the_demo_refuses_arguments_out_of_range_naming_the_option(
        arguments: list[str], option: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["demo", *arguments])
    assert exited.value.code == 2
    assert f"argument {option}: " in capsys.readouterr().err


def test_the_demo_takes_its_largest_message() -> None:
    from slipstream.daemon.demo import max_message_size

    args = build_parser().parse_args(["demo", "--size", str(max_message_size())])
    assert args.size == 2 * 1024 * 1024  # the UDP stream's 16 MiB terms / 8


def test_the_slow_consumer_demo_refuses_a_message_longer_than_its_terms_take(
        driver_dir: Path) -> None:
    from slipstream.daemon.demo import run_demo

    with pytest.raises(InvalidArgumentError, match=r"size: 200000 is not a message size in "
                                                   r"8..131,072 bytes"):
        run_demo(str(driver_dir), size=200_000, slow_consumer=True)
    assert not driver_dir.exists()  # refused before anything started


@pytest.mark.parametrize(("slow_consumer", "policy", "said"), [
    (False, "drop-newest", "policy: is the policy of --slow-consumer's stream"),  # ignored
    (False, "bogus", "policy: is the policy of --slow-consumer's stream"),  # ran unchecked
    (True, "bogus", "policy: "),
    (True, "rate-limit", "policy: "),  # lacks its rate
])
def test_the_demo_refuses_a_policy_it_would_not_use_or_cannot(
        driver_dir: Path, slow_consumer: bool, policy: str, said: str) -> None:
    from slipstream.daemon.demo import run_demo

    with pytest.raises(InvalidArgumentError) as refused:
        run_demo(str(driver_dir), slow_consumer=slow_consumer, policy=policy)
    assert str(refused.value).startswith(said) and "URI" not in str(refused.value)
    assert not driver_dir.exists()  # refused before anything started


def _start_demo(driver_dir: Path) -> subprocess.Popen[str]:
    demo = subprocess.Popen([*SLIPSTREAM, "demo", "--dir", str(driver_dir), "--rate", "1000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (driver_dir / "counters.dat").exists() or demo.poll() is not None,
             timeout=30, what="the demo's driver")
    time.sleep(2.0)  # its publishers and subscribers started
    return demo


def _end(demo: subprocess.Popen[str]) -> tuple[int | None, str, str]:
    """The demo's status (None: still running after 30 s, then stopped) and output."""
    try:
        out, err = demo.communicate(timeout=30)
        return demo.returncode, out, err
    except subprocess.TimeoutExpired:
        demo.send_signal(signal.SIGTERM)
        out, err = demo.communicate(timeout=30)
        return None, out, err


def test_the_demo_ends_with_an_error_when_its_driver_ends(driver_dir: Path) -> None:
    """It printed zeros (once a negative rate) and ran on."""
    demo = _start_demo(driver_dir)
    try:
        counters = CountersFile(driver_dir / "counters.dat", writable=False)
        driver_pid = counters.driver_pid
        counters.close()
        os.kill(driver_pid, signal.SIGTERM)
        status, out, err = _end(demo)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert status == 2, (status, out, err)
    assert f"the demo's driver (pid {driver_pid})" in err and "ended with status 0" in err, err
    assert not re.search(r"\(\s*-[0-9,]+/s\)", out), out  # no negative rate


def test_the_demo_ends_with_an_error_when_one_of_its_processes_dies(driver_dir: Path) -> None:
    demo = _start_demo(driver_dir)
    try:
        children = Path(f"/proc/{demo.pid}/task/{demo.pid}/children").read_text().split()
        workers = [int(pid) for pid in children
                   if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert workers, children
        os.kill(workers[0], signal.SIGKILL)
        status, out, err = _end(demo)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert status == 2, (status, out, err)
    assert f"(pid {workers[0]}) ended with status -9, so the demo stopped" in err, err
    assert not driver_dir.exists()  # its driver was stopped all the same


def test_children_that_returned_are_put_down_to_their_driver_still_draining(
        tmp_path: Path) -> None:
    """A stopping driver closes its clients first, and the demo's processes then return
    (status 0); its drain may go on for seconds on a loaded host (the demo named its
    publisher, ended with status 0, as the cause).  The demo waits for the driver's end up
    to its drain timeout and names the driver."""
    import multiprocessing

    from slipstream.client.errors import DriverError
    from slipstream.daemon.demo import _check_alive
    from slipstream.daemon.driver import MediaDriver

    child = multiprocessing.get_context("fork").Process(target=int)  # returns: status 0
    child.start()
    child.join()
    # The driver's end comes 3 s later, past the 2 s a child killed otherwise is given.
    draining = subprocess.Popen(["sleep", "3"])
    driver = MediaDriver(tmp_path, draining, drain_timeout_s=10.0)
    try:
        with pytest.raises(DriverError, match=rf"the demo's driver \(pid {draining.pid}\)"):
            _check_alive(driver, {child: "ipc publisher"})
    finally:
        draining.kill()
        draining.wait()
