"""The loss report file and what ``slipstream stat`` makes of the counters (no driver needed:
the files are the interface)."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import as_another_user
from hypothesis import given
from hypothesis import strategies as st

from slipstream.client.counters import CounterInfo, CounterType, parse_position_label
from slipstream.client.layout import INT32_MAX, INT32_MIN
from slipstream.daemon.ops.stat import render, snapshot_json, stream_rows
from slipstream.daemon.reports.error_log import (
    MAX_ENTRIES,
    ErrorEntry,
    ErrorLogHandler,
    read_error_log,
)
from slipstream.daemon.reports.loss_report import (
    FILE,
    HEADER_LENGTH,
    LABEL_MAX_LENGTH,
    LossReport,
    read_loss_report,
)


def test_the_loss_report_keeps_each_images_gaps_and_bytes(tmp_path: Path) -> None:
    report = LossReport(tmp_path / FILE, capacity=4)
    try:
        quiet = report.add(1, 10, "aeron:udp?endpoint=10.0.0.1:40123 source=10.0.0.2:5000")
        lossy = report.add(2, 10, "aeron:udp?endpoint=10.0.0.1:40123 source=10.0.0.3:5000")
        assert quiet is not None and lossy is not None
        for length in (256, 1024, 64):
            lossy.record(length)
        [entry] = read_loss_report(tmp_path)  # an image without gaps is not shown
    finally:
        report.close()
    assert (entry.observations, entry.bytes_lost) == (3, 1344)
    assert (entry.session_id, entry.stream_id) == (2, 10)
    assert 0 < entry.first_ns <= entry.last_ns
    assert entry.label.endswith("source=10.0.0.3:5000")


def test_a_full_loss_report_takes_no_more_images(tmp_path: Path) -> None:
    report = LossReport(tmp_path / FILE, capacity=2)
    try:
        assert report.add(1, 1, "a") is not None and report.add(2, 1, "b") is not None
        assert report.add(3, 1, "c") is None
    finally:
        report.close()


def test_a_long_label_is_cut_and_never_spills_into_the_next_entry(tmp_path: Path) -> None:
    report = LossReport(tmp_path / FILE, capacity=2)
    try:
        first = report.add(1, 1, "x" * 1000)
        second = report.add(2, 1, "y")
        assert first is not None and second is not None
        first.record(32)
        second.record(32)
        entries = read_loss_report(tmp_path)
    finally:
        report.close()
    assert [e.label for e in entries] == ["x" * LABEL_MAX_LENGTH, "y"]


@pytest.mark.parametrize("damage", ["truncated", "foreign", "lying count"])
def test_a_damaged_or_foreign_report_reads_as_empty_or_whole_entries(tmp_path: Path,
                                                                     damage: str) -> None:
    report = LossReport(tmp_path / FILE, capacity=2)
    entry = report.add(1, 1, "a")
    assert entry is not None
    entry.record(32)
    report.close()
    path = tmp_path / FILE
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[:HEADER_LENGTH - 1]
    elif damage == "foreign":
        data[0:4] = b"ELF\x7f"
    else:
        struct.pack_into("<ii", data, 8, 1 << 30, 1 << 30)  # capacity and count past the file
    path.write_bytes(data)
    entries = read_loss_report(tmp_path)
    assert entries == [] if damage != "lying count" else [e.label for e in entries] == ["a"]


def test_no_report_reads_as_empty(tmp_path: Path) -> None:
    assert read_loss_report(tmp_path) == []


@given(channel=st.from_regex(r"aeron:(ipc|udp\?endpoint=[0-9.]+:[0-9]+)(\|[a-z]+=[a-z0-9,: ]+)*",
                             fullmatch=True),
       stream_id=st.integers(INT32_MIN, INT32_MAX), session_id=st.integers(INT32_MIN, INT32_MAX),
       subscription=st.none() | st.integers(0, 2**62))
def test_position_labels_read_back_what_the_driver_wrote(channel: str, stream_id: int,
                                                         session_id: int,
                                                         subscription: int | None) -> None:
    suffix = "" if subscription is None else f" sub={subscription}"
    label = f"sub-pos: {channel} stream={stream_id} session={session_id}{suffix}"
    parsed = parse_position_label(label)
    assert parsed is not None
    assert (parsed.kind, parsed.channel, parsed.stream_id, parsed.session_id,
            parsed.subscription_id) == ("sub-pos", channel, stream_id, session_id, subscription)


def test_an_image_label_names_its_source() -> None:
    parsed = parse_position_label("rcv-hwm: aeron:udp?endpoint=127.0.0.1:40456 stream=5 "
                                  "session=-77 source=127.0.0.1:51234")
    assert parsed is not None and parsed.source == "127.0.0.1:51234"
    assert parse_position_label("client-heartbeat: 12") is None


def _info(counter_id: int, type_id: int, label: str, value: int) -> CounterInfo:
    return CounterInfo(counter_id, type_id, 0, 0, 0, 0, label, value)


def test_stat_groups_positions_by_stream_and_shows_the_slowest_subscriber() -> None:
    tail = "aeron:udp?endpoint=127.0.0.1:40456 stream=5 session=3"
    counters = [
        _info(0, CounterType.SYSTEM, "bytes sent", 1000),
        _info(30, CounterType.RECEIVER_HWM, f"rcv-hwm: {tail} source=127.0.0.1:1", 4096),
        _info(31, CounterType.RECEIVER_POSITION, f"rcv-pos: {tail} source=127.0.0.1:1", 2048),
        _info(32, CounterType.SUBSCRIBER_POSITION, f"sub-pos: {tail} sub=7", 2048),
        _info(33, CounterType.SUBSCRIBER_POSITION, f"sub-pos: {tail} sub=8", 1024),
        # A subscription that named itself (alias) reads the same stream: the same row.
        _info(35, CounterType.SUBSCRIBER_POSITION,
              "sub-pos: aeron:udp?endpoint=127.0.0.1:40456|alias=second stream=5 session=3 "
              "sub=9", 1536),
        _info(34, CounterType.PUBLISHER_LIMIT,
              "pub-lmt: aeron:ipc?term-length=64k|session-id=9 stream=1 session=9", 65536),
        # The subscription gives none of the publication's parameters: the same row.
        _info(36, CounterType.SUBSCRIBER_POSITION, "sub-pos: aeron:ipc stream=1 session=9 sub=4",
              4096),
    ]
    [udp, ipc] = stream_rows(counters)
    assert (udp.stream_id, udp.session_id, udp.subscribers) == (5, 3, 3)
    assert udp.positions == {"rcv-hwm": 4096, "rcv-pos": 2048, "sub-pos": 1024}
    assert ipc.positions == {"pub-lmt": 65536, "sub-pos": 4096} and ipc.channel == "aeron:ipc"
    assert udp.channel == "aeron:udp?endpoint=127.0.0.1:40456"
    text = render(counters, {0: 500}, 0.5, "header", now_ns=0)
    assert "streams (2)" in text and "1,000" in text and "loss report (0 image(s)" in text
    [bytes_sent] = [line for line in text.splitlines() if line.strip().startswith("bytes sent")]
    assert bytes_sent.split()[-1] == "1,000"  # (1000 - 500) / 0.5 s


def test_stat_json_gives_a_publications_back_pressure_counters_not_stream_fields() -> None:
    tail = "aeron:ipc stream=1 session=9"
    counters = [
        _info(40, CounterType.PUBLISHER_LIMIT, f"pub-lmt: {tail}", 65536),
        _info(41, CounterType.SUBSCRIBER_POSITION, f"sub-pos: {tail} sub=4", 4096),
        _info(42, CounterType.BP_EPISODES, f"bp-episodes: {tail}", 3),
        _info(43, CounterType.PUBLISHER_DROPS, f"pub-drops: {tail}", 7),
    ]
    snapshot = snapshot_json(counters, [], pid=1, heartbeat_age_s=0.0)
    [stream] = snapshot["streams"]
    assert stream["subscribers"] == 1
    [pressured] = snapshot["back_pressure"]
    assert pressured == {"channel": "aeron:ipc", "stream_id": 1, "session_id": 9,
                         "counters": {"bp-episodes": 3, "pub-drops": 7}}

def _record(message: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord("slipstream.daemon", logging.ERROR, __file__, 1, message, args,
                             exc_info)


def test_the_error_log_keeps_distinct_errors_with_count_and_first_and_last_time(
        tmp_path: Path) -> None:
    handler = ErrorLogHandler(tmp_path)
    handler.handle(_record("add_publication failed: stream %d over the limit", 10))
    handler.handle(_record("add_publication failed: stream %d over the limit", 11))
    handler.handle(_record("a duty cycle failed", exc=KeyError("x")))
    handler.handle(_record("a duty cycle failed", exc=ValueError("y")))
    handler.flush()
    entries = {e.key: e for e in read_error_log(tmp_path)}
    assert set(entries) == {"add_publication failed: stream # over the limit",
                            "a duty cycle failed [KeyError]", "a duty cycle failed [ValueError]"}
    refusal = entries["add_publication failed: stream # over the limit"]
    assert refusal.count == 2 and refusal.first_ns <= refusal.last_ns
    assert refusal.message == "add_publication failed: stream 11 over the limit"  # the last
    assert "KeyError('x')" in entries["a duty cycle failed [KeyError]"].message
    assert (tmp_path / "errors.json").stat().st_mode & 0o777 == 0o600


def test_warnings_are_not_errors(tmp_path: Path) -> None:
    handler = ErrorLogHandler(tmp_path)
    logger = logging.getLogger("slipstream.tests.error_log")
    logger.addHandler(handler)
    try:
        logger.warning("SO_RCVBUF capped at %d", 212992)
    finally:
        logger.removeHandler(handler)
    handler.flush()
    assert read_error_log(tmp_path) == []


def test_a_full_error_log_counts_the_rest_as_other_errors(tmp_path: Path) -> None:
    handler = ErrorLogHandler(tmp_path)
    for n in range(MAX_ENTRIES + 5):
        handler.handle(_record(f"error kind {chr(0x4e00 + n)}"))  # no digits: all distinct
    handler.flush()
    entries = read_error_log(tmp_path)
    assert len(entries) == MAX_ENTRIES
    [other] = [e for e in entries if e.key == "other errors"]
    assert other.count == 6  # the entry that found the log full, and five more


@pytest.mark.parametrize("content", ["", "not json", "[1, 2]", '[{"key": "k"}]', "{}"])
def test_a_damaged_error_log_reads_as_empty(tmp_path: Path, content: str) -> None:
    (tmp_path / "errors.json").write_text(content)
    assert read_error_log(tmp_path) == []


def test_stat_shows_the_error_log() -> None:
    error = ErrorEntry("k", 3, 1_700_000_000_000_000_000, 1_700_000_060_000_000_000,
                       "add_publication failed: no memory")
    text = render([], {}, 1.0, "header", now_ns=0, errors=[error])
    assert "errors (1 distinct)" in text
    [line] = [line for line in text.splitlines() if "no memory" in line]
    assert line.split()[:2] == ["3", "x"]


def test_a_full_error_log_writes_a_repeat_of_other_errors_at_most_once_a_second(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    handler = ErrorLogHandler(tmp_path)
    for n in range(MAX_ENTRIES + 1):
        handler.handle(_record(f"error kind {chr(0x4e00 + n)}"))
    writes: list[int] = []
    monkeypatch.setattr(handler, "_write", lambda now_ns: writes.append(now_ns))
    for n in range(100):
        handler.handle(_record(f"yet another kind {chr(0x5e00 + n)}"))
    assert len(writes) <= 1  # not a whole file per error
    handler.close()


def test_object_addresses_do_not_make_errors_distinct(tmp_path: Path) -> None:
    handler = ErrorLogHandler(tmp_path)
    handler.handle(_record("handling <Event at 0x7f3a2b4c5d60> failed"))
    handler.handle(_record("handling <Event at 0x7f3affff0010> failed"))
    handler.flush()
    [entry] = read_error_log(tmp_path)
    assert entry.count == 2


# -- stat against a directory: --match, a driver replaced, another user's directory ----------

def _fake_driver_directory(path: Path) -> int:
    """A directory as a live driver keeps it, counters and a loss report with one image of
    stream 7 that saw a gap, its lock held by this process (stat opens the lock anew: its
    shared lock is refused while our exclusive one stands).  Returns the lock's fd."""
    from slipstream.client.counters import CountersFile
    from slipstream.daemon.reports.loss_report import LossReport

    path.mkdir(mode=0o700)
    fd = os.open(path / "driver.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, f"slipstream driver directory\ncreated: yes\npid: {os.getpid()}\n".encode(), 0)
    counters = CountersFile.create(path / "counters.dat", 256)
    counters.beat(time.time_ns())
    counters.close()
    report = LossReport(path / "loss-report.dat", capacity=4)
    entry = report.add(12345, 7, "aeron:udp?endpoint=127.0.0.1:40123 <- 127.0.0.1:50000")
    assert entry is not None
    entry.record(4096)
    other = report.add(54321, 77, "aeron:udp?endpoint=127.0.0.1:40177 <- 127.0.0.1:50000")
    assert other is not None
    other.record(4096)
    report.close()
    return fd


def test_match_stream_keeps_that_streams_loss_report(shm: Path, capsys) -> None:
    """``--match stream=7`` filters every section by the same text: the loss report's label
    has no ``stream=`` of its own, and its entry used to be hidden.  Stream 77's is not
    stream 7's (a plain substring match kept it too)."""
    from slipstream.daemon.ops.stat import run_stat

    directory = shm / "driver"
    fd = _fake_driver_directory(directory)
    try:
        assert run_stat(str(directory), once=True, match="stream=7") == 0
        out = capsys.readouterr().out
        assert "loss report (1 image(s) with gaps)" in out, out
        # The capacity a user can hit, by its setting, counted over every counter.
        assert re.search(r"counters_capacity [\d,]+ of 256 \(\d+%\)", out), out
        assert run_stat(str(directory), once=True, match="session=12345") == 0
        assert "loss report (1 image(s) with gaps)" in capsys.readouterr().out
        assert run_stat(str(directory), once=True, match="stream=8") == 0
        assert "loss report (0 image(s) with gaps)" in capsys.readouterr().out
        assert run_stat(str(directory), once=True, match="stream=77") == 0
        assert "loss report (1 image(s) with gaps)" in capsys.readouterr().out
        assert run_stat(str(directory), once=True, match="127.0.0.1:4017") == 0
        assert "loss report (0 image(s) with gaps)" in capsys.readouterr().out
        assert run_stat(str(directory), once=True, match="aeron:udp") == 0
        assert "loss report (2 image(s) with gaps)" in capsys.readouterr().out
    finally:
        os.close(fd)



def test_stat_of_another_users_directory_says_whose_it_is(shm: Path) -> None:
    """Another user's driver directory (0700): a message naming it and its owner and exit 2,
    not a PermissionError traceback."""
    directory = shm / "driver"
    fd = _fake_driver_directory(directory)
    try:
        os.chmod(shm, 0o755)  # the driver's directory itself stays closed to others
        result = subprocess.run(
            [*as_another_user(65534), sys.executable, "-m", "slipstream.daemon.cli", "stat",
             "--once", "--dir", str(directory)], capture_output=True, text=True, timeout=60)
    finally:
        os.close(fd)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert f"the driver directory {directory} belongs to root (uid 0)" in result.stderr
    assert "nobody (uid 65534)" in result.stderr


def test_stat_shows_a_new_driver_in_the_directory_of_one_that_was_killed(
        driver_dir: Path, tmp_path: Path) -> None:
    """kill -9 leaves the dead driver's counters file mapped (and readable) after the next
    driver replaces it: stat flags the dead one, then maps the new one's file."""
    from helpers import wait_for

    from slipstream.daemon.driver import MediaDriver

    first = MediaDriver.start(driver_dir, {})
    output = tmp_path / "stat.out"
    second = None
    with output.open("w") as sink:
        stat = subprocess.Popen([sys.executable, "-m", "slipstream.daemon.cli", "stat",
                                 "--interval", "0.2", "--dir", str(driver_dir)],
                                stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: f"driver pid {first.pid} " in output.read_text(), timeout=20,
                 what="stat showing the first driver")
        first.kill()
        wait_for(lambda: "DEAD: no driver holds the lock" in output.read_text(), timeout=10,
                 what="stat flagging the killed driver")
        second = MediaDriver.start(driver_dir, {})
        wait_for(lambda: f"driver pid {second.pid} " in output.read_text(), timeout=10,
                 what="stat showing the new driver")
        time.sleep(0.5)
        last = output.read_text().split("slipstream driver pid ")[-1]
        assert last.startswith(f"{second.pid} ") and "DEAD" not in last.splitlines()[0], last
        assert stat.poll() is None  # still watching
    finally:
        stat.terminate()
        stat.wait(10)
        first.kill()
        if second is not None:
            second.stop()
