"""The command line: a bad configuration value names its key, --print-config shows the
resolved values, every sub-command's help says what it does, and ``slipstream stat``
reads a live driver, says when there is none, and shows a dead one's last counters and
errors."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import FAST_DRIVER_SETTINGS

from slipstream.client import Client, ConfigurationError, DriverError
from slipstream.daemon.config import load_settings
from slipstream.daemon.driver import MediaDriver

SLIPSTREAM = [sys.executable, "-m", "slipstream.daemon.cli"]


def test_a_bad_configuration_value_names_the_key(driver_dir: Path) -> None:
    with pytest.raises(ConfigurationError) as error, \
            MediaDriver.launch(directory=driver_dir, mtu_length=1000):
        pass
    assert "mtu_length" in str(error.value)
    result = subprocess.run([*SLIPSTREAM, "driver", "--dir", str(driver_dir),
                             "--set", "ipc_term_buffer_length=3m"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "ipc_term_buffer_length" in result.stderr
    assert not driver_dir.exists()


def test_print_config_shows_the_resolved_values(driver_dir: Path) -> None:
    env = {**os.environ, "SLIPSTREAM_MTU_LENGTH": "4096"}
    result = subprocess.run([*SLIPSTREAM, "driver", "--dir", str(driver_dir), "--print-config",
                             "--set", "client_liveness_timeout=3s"],
                            capture_output=True, text=True, timeout=30, env=env)
    assert result.returncode == 0, result.stderr
    assert 'mtu_length = "4k"  # env' in result.stdout
    assert 'client_liveness_timeout = "3s"' in result.stdout
    assert not driver_dir.exists()  # printing the configuration starts nothing


def test_stat_prints_the_counters(driver) -> None:
    with Client.connect(driver.directory) as client:
        client.add_publication("aeron:ipc", 11)
        client.add_subscription("aeron:ipc", 11)
        result = subprocess.run([*SLIPSTREAM, "stat", "--dir", str(driver.directory), "--once"],
                                capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    for label in ("bytes sent", "client timeouts", "back pressure events", "pub-lmt: aeron:ipc",
                  "sub-pos: aeron:ipc"):
        assert label in result.stdout
    [heartbeat] = [line for line in result.stdout.splitlines()
                   if f"client-heartbeat: {client.client_id} " in line]
    age_ms = int(heartbeat.split("ms ago")[0].split()[-1].replace(",", ""))
    # A live client's heartbeat is younger than the liveness timeout that would end it.
    liveness_ns = load_settings(env={}, overrides=FAST_DRIVER_SETTINGS).client_liveness_timeout
    assert 0 <= age_ms < liveness_ns / 1e6, age_ms


def test_stat_without_a_driver_says_so(driver_dir: Path) -> None:
    result = subprocess.run([*SLIPSTREAM, "stat", "--dir", str(driver_dir), "--once"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert f"no slipstream driver is running in {driver_dir}" in result.stderr


def test_stat_shows_the_error_log_and_the_last_counters_after_the_driver_died(
        driver_dir: Path) -> None:
    with MediaDriver.launch(directory=driver_dir, log_buffer_memory_limit="1m") as driver:
        with Client.connect(driver_dir) as client:
            for stream_id in (20, 21):
                with pytest.raises(DriverError, match="log_buffer_memory_limit"):
                    client.add_publication("aeron:ipc?term-length=1m", stream_id)
            deadline = time.monotonic() + 5  # a repeat is written within a second
            while True:
                result = subprocess.run([*SLIPSTREAM, "stat", "--dir", str(driver_dir),
                                         "--json"], capture_output=True, text=True, timeout=30)
                assert result.returncode == 0, result.stderr
                [error] = json.loads(result.stdout)["errors"]  # one distinct error
                if error["count"] == 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert error["count"] == 2 and "stream 21" in error["message"]
            driver.kill()  # SIGKILL: no clean-up, the error log stays for the operator
        result = subprocess.run([*SLIPSTREAM, "stat", "--dir", str(driver_dir), "--once"],
                                capture_output=True, text=True, timeout=30)
    assert result.returncode == 1, result.stderr
    # Its last counters too, under a header that says it died (it said only "no driver").
    assert "DEAD: no driver holds the lock" in result.stdout
    assert "client-heartbeat: " in result.stdout
    assert "errors (1 distinct)" in result.stdout
    assert "log_buffer_memory_limit" in result.stdout
    # systemd restarts a crashed driver at once: the new one keeps the dead one's log.
    with MediaDriver.launch(directory=driver_dir):
        result = subprocess.run([*SLIPSTREAM, "stat", "--dir", str(driver_dir), "--json"],
                                capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    snapshot = json.loads(result.stdout)
    assert snapshot["errors"] == []
    [previous] = snapshot["previous_errors"]
    assert previous["count"] == 2 and "log_buffer_memory_limit" in previous["message"]


def _sub_commands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{parser.prog} {name}".removeprefix("slipstream "), sub
                yield from _sub_commands(sub)


@pytest.mark.unit
def test_every_sub_commands_help_says_what_it_does_and_shows_its_defaults() -> None:
    from slipstream.cli import build_parser

    commands = dict(_sub_commands(build_parser()))
    assert {"driver", "stat", "metrics", "demo", "sim", "sim relay", "sim hosts"} <= set(commands)
    for name, parser in commands.items():
        assert parser.description, f"slipstream {name} --help does not say what it does"
        for action in parser._actions:
            if action.option_strings and action.default not in (None, False, [], "==SUPPRESS=="):
                assert "default" in (action.help or ""), (
                    f"slipstream {name} {action.option_strings[0]} does not show its default")

