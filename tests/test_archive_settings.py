"""``slipstream-archive run``'s settings through the real command: the file, the
``SLIPSTREAM_ARCHIVE_<KEY>`` environment and ``--dir``/``--set`` layered, ``--print-config``
saying where each value came from, a bad value refused naming its key, and a service that
runs on settings given by the environment and the command line alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

from helpers import free_port, wait_for
from test_archive import archive_process

from slipstream.archive.catalog import CATALOG_FILE
from slipstream.archive.client import ArchiveClient
from slipstream.archive.settings import SyncPolicy, load_settings
from slipstream.client import Client

COMMAND = [sys.executable, "-m", "slipstream.archive.cli", "run"]


def _env(**settings: str) -> dict[str, str]:
    """This process's environment without archive settings of its own, plus ``settings``."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("SLIPSTREAM_ARCHIVE_")}
    return {**env, **settings}


def test_print_config_layers_the_file_the_environment_and_the_command_line(
        tmp_path: Path) -> None:
    config = tmp_path / "archive.toml"
    config.write_text('sync = "segment"\ncontrol_port = 9001\nblock_length = "64k"\n'
                      '[[record]]\nchannel = "aeron:ipc"\nstream_id = 7\n')
    run = subprocess.run(
        [*COMMAND, "--config", str(config), "--dir", str(tmp_path / "a"),
         "--set", "block-length=256k", "--print-config"],
        env=_env(SLIPSTREAM_ARCHIVE_CONTROL_PORT="9002",
                 SLIPSTREAM_ARCHIVE_BLOCK_LENGTH="128k",
                 SLIPSTREAM_ARCHIVE_PEERS="10.0.0.2:8010,10.0.0.3:9000/12"),
        capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert 'sync = "segment"  # file' in lines
    assert "control_port = 9002  # env" in lines
    assert 'block_length = "256k"  # cli' in lines
    assert f'dir = "{tmp_path / "a"}"  # cli' in lines
    assert 'peers = ["10.0.0.2:8010/10", "10.0.0.3:9000/12"]  # env' in lines
    assert "retention_max_bytes = 0  # default" in lines
    assert not (tmp_path / "a").exists()  # printed, not run
    printed = tmp_path / "printed.toml"
    printed.write_text(run.stdout)
    settings = load_settings(printed, {})
    assert (settings.sync, settings.control_port, settings.block_length) == (
        SyncPolicy.SEGMENT, 9002, 256 * 1024)
    assert [(spec.channel, spec.stream_id) for spec in settings.records] == [("aeron:ipc", 7)]
    assert set(tomllib.loads(run.stdout)) >= {"dir", "sync", "peers", "record"}


def _refused(args: list[str], **env: str) -> str:
    """The stderr of ``run`` with ``args`` in ``env``, which must refuse its settings."""
    run = subprocess.run([*COMMAND, *args], env=_env(**env), capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and not run.stdout, run
    return run.stderr


def test_a_bad_setting_from_the_environment_or_the_command_line_is_refused_by_name() -> None:
    stderr = _refused(["--print-config"], SLIPSTREAM_ARCHIVE_SEGMENT_LENGTH="96k")
    assert "archive setting 'segment_length'" in stderr
    assert "from $SLIPSTREAM_ARCHIVE_SEGMENT_LENGTH" in stderr
    stderr = _refused(["--set", "control_port=70000"])
    assert "archive setting 'control_port'" in stderr and "by override" in stderr
    stderr = _refused(["--print-config"], SLIPSTREAM_ARCHIVE_CONTROL_PROT="8010")
    assert "SLIPSTREAM_ARCHIVE_CONTROL_PROT" in stderr
    assert "did you mean SLIPSTREAM_ARCHIVE_CONTROL_PORT?" in stderr


def test_the_service_runs_on_the_environment_and_the_command_line_alone(
        driver, tmp_path: Path) -> None:
    """No file: the driver directory from the environment, the archive's directory and its
    control stream from the command line; the running archive answers there."""
    archive_dir = tmp_path / "archive"
    port = free_port()
    with archive_process(None, tmp_path / "archive.log",
                         args=["--dir", str(archive_dir), "--set", f"control_port={port}",
                               "--set", "control_stream_id=77"],
                         env=_env(SLIPSTREAM_ARCHIVE_DRIVER_DIR=str(driver.directory),
                                  SLIPSTREAM_ARCHIVE_SEGMENT_LENGTH="128k")) as process:
        wait_for(lambda: (archive_dir / CATALOG_FILE).exists(), timeout=30,
                 what="the archive started")
        with Client.connect(driver.directory) as client, \
                ArchiveClient(client, "127.0.0.1", port, 77, timeout_s=10) as archive:
            assert archive.list_recordings() == []
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    assert f"archive in {archive_dir}" in (tmp_path / "archive.log").read_text()
