"""A Spark read task's range read from an archive's recording, and a Spark query's start at a
time the archive holds, each against its peer in the same run.

    .venv/bin/python -m bench.spark_archive_read [--part read|plan|all] [--messages N]
        [--size B] [--rounds R] [--spark] [--plan-term BYTES] [--terms-back T]

**The read** (``--part read``).  Two drivers on this machine stand for two hosts: the
archive's, and another that mounts the archive's directory (the same files, as a shared
file system gives them) but is not the archive's host (no archive runs beside its driver).
A ``slipstream-archive`` process beside the first driver records an IPC stream (local
source) of N messages of B bytes, offered by the first program's loop, to segment files in a
temporary directory on this machine's disk; the publication stays open, so the log holds the
whole range too (its term is long enough) and the recording is live (a read in place reads
it up to its time index's last entry).  Each round reads ``[0, end)`` with the executor side
of the Spark reader (``read_range``, Arrow record batches included) three ways, in an order
that rotates from round to round: as a live-log partition on the archive's host (the log
mapped, ``Image.peek``'s C scan); as an archived partition (``archiveDir``) by a task on the
archive's host; and the same archived partition by a task on the other host (its
``directory`` that host's driver).  Both archived reads go through the one failover reader,
:func:`slipstream.archive.locate.read_session`, which finds the recording in the catalog
and maps its segment files (``RecordingReader``'s C scan); the bench checks that the task on
the other host made no link to the archive (nothing was replayed).  Figures: rows/s,
medians of the rounds with their range, the ratios other host / archive's host (the target:
at least 0.8) and archive / live log.  The segment files are in the page cache after the
recording (as they are right after it was written): a read from a cold disk is the disk's.
``--spark`` adds the first program's read, in a ``local[2]`` Spark session:
``spark.read.format("slipstream")`` with ``archive`` and ``archiveDir`` and no holder, then
``count()``, with ``directory`` the archive's host's driver and the other host's in
alternating rounds (the whole query: planning, a Python worker's task, Spark's own costs).

**The start** (``--part plan``).  One driver, the archive beside it recording two IPC
streams whose messages the first program's loop offers, each stamped with its offer time
(the reserved value, as the slipstream writer stamps): the one planned, in terms of
``--plan-term`` bytes, and the peer, in one term that holds the whole run.  Each stream gets
a term of messages, a time T, then ``--terms-back`` terms of messages: the planned stream's
log rotated well past T (it holds three terms), the peer's log still holds it.  Each round
times a new query's planner (``SlipstreamStreamReader``, as Spark's source runner calls it,
with ``archive`` naming the archive) in an order that rotates: ``initialOffset()`` with
``startingTimestamp`` T on the planned stream (the log's oldest message is after T, so the
archive's time index and then the stamps find it), the same on the peer stream (found in the
live log), and ``startingOffsets=earliest`` on the planned stream (the archive's earliest).
Each is timed twice: a new query's first call (connect, subscribe, join the image, ask the
archive) and the call again (Spark plans batch 0 anew after a restart: held already).  The
bench checks that each start is the first message stamped at or after T.  Figures: ms,
medians with their range, and the ratio of the archived start to each peer (the target: the
archived start under 2 s).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from bench.archive_record import STREAM, _recordings, _wait, stop_archive
from bench.archive_replay import _free_port
from bench.ipc_throughput import machine
from slipstream.archive.holding import driver_instance
from slipstream.archive.reading import indexed_position
from slipstream.client import Client, Publication
from slipstream.client.layout import FRAME_ALIGNMENT, HEADER_LENGTH, align
from slipstream.client.logview import ImageView
from slipstream.daemon.driver import MediaDriver
from slipstream.spark_bridge import archived as archived_links
from slipstream.spark_bridge.archived import ArchivedSource
from slipstream.spark_bridge.options import parse_options
from slipstream.spark_bridge.read_task import SlipstreamPartition, read_range
from slipstream.spark_bridge.reader import SlipstreamStreamReader

PEER_STREAM = STREAM + 1  # the start's peer: a log that still holds the time


def _rows(partition: SlipstreamPartition) -> tuple[int, float]:
    started = time.perf_counter()
    rows = sum(batch.num_rows for batch in read_range(partition))
    return rows, time.perf_counter() - started


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _median_range(values: list[float], scale: float, unit: str) -> str:
    return (f"{statistics.median(values) * scale:8.2f} {unit} "
            f"[{min(values) * scale:.2f}-{max(values) * scale:.2f}]")


def _offer(publication: Publication, payload: bytes, stamp: bool) -> int:
    """The first program's offer loop (stamped with the offer time when ``stamp``): the
    position after the message."""
    while True:
        position = publication.offer(payload, reserved_value=time.time_ns() if stamp else 0)
        if position > 0:
            return position
        time.sleep(0.0001)


def archive_process(work: Path, driver_dir: Path | str, port: int, streams: list[int]
                    ) -> subprocess.Popen[bytes]:
    """A ``slipstream-archive`` beside the driver in ``driver_dir``, recording ``streams``
    over IPC into ``work / "archive"``."""
    config = work / "archive.toml"
    config.write_text(f'dir = "{work / "archive"}"\ndriver_dir = "{driver_dir}"\n'
                      f'control_port = {port}\n' + "".join(
                          f'[[record]]\nchannel = "aeron:ipc"\nstream_id = {stream}\n'
                          for stream in streams))
    return subprocess.Popen([sys.executable, "-m", "slipstream.archive.cli", "run",
                             "--config", str(config)], stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def running_archive(work: Path, driver_dir: Path | str, port: int,
                    streams: list[int]) -> Iterator[subprocess.Popen[bytes]]:
    """:func:`archive_process` for the block, stopped (:func:`stop_archive`) when it ends."""
    archive = archive_process(work, driver_dir, port, streams)
    try:
        yield archive
    finally:
        stop_archive(archive)


def read_part(args: argparse.Namespace) -> None:
    frame = align(HEADER_LENGTH + args.size, FRAME_ALIGNMENT)
    term = 1 << max(26, (args.messages * frame * 2 - 1).bit_length())  # holds it all
    work = Path(tempfile.mkdtemp(prefix="bench-spark-archive-", dir="/var/tmp"))
    tag = uuid.uuid4().hex[:6]
    directories = [Path("/dev/shm") / f"bench-spark-archive-{tag}-{host}"
                   for host in ("archive", "other")]
    archive_dir = work / "archive"
    port = _free_port()
    loads = [_load()]
    try:
        with MediaDriver.launch(directory=directories[0], ipc_term_buffer_length=term) as driver, \
                MediaDriver.launch(directory=directories[1]) as other, \
                Client.connect(driver.directory) as client, \
                running_archive(work, driver.directory, port, [STREAM]):
            publication = client.add_publication("aeron:ipc", STREAM)
            _wait(lambda: _recordings(archive_dir), 30, "the recording")
            payload = bytes(args.size)
            for _ in range(args.messages):
                _offer(publication, payload, stamp=True)
            end = publication.position
            subscription = client.add_subscription("aeron:ipc", STREAM)
            _wait(lambda: subscription.images, 10, "the image")
            view = ImageView(subscription.images[0])
            recording = _recordings(archive_dir)[0]
            # What a read in place reads up to: the time index's last entry (no counters).
            _wait(lambda: indexed_position(archive_dir, recording) >= end, 60,
                  "the range recorded")
            common = dict(fail_on_data_loss=True, host="here", replay_timeout_ms=30_000,
                          holder=None)
            endpoint = ("127.0.0.1", port, 10)
            source = ArchivedSource(endpoint, recording.recording_id, view.identity.framing,
                                    (endpoint,), str(archive_dir))
            contenders = {
                "live log": SlipstreamPartition(
                    view.session_id, STREAM, view.log_path, 0, end, str(driver.directory),
                    log=view.identity, driver=driver_instance(client.counters), **common),
                "archive host": SlipstreamPartition(
                    view.session_id, STREAM, "", 0, end, str(driver.directory), log=None,
                    driver=None, archived=source, **common),
                "other host": SlipstreamPartition(
                    view.session_id, STREAM, "", 0, end, str(other.directory), log=None,
                    driver=None, archived=source, **common),
            }
            rates: dict[str, list[float]] = {name: [] for name in contenders}
            names = list(contenders)
            for round_ in range(args.rounds):
                shift = round_ % len(names)
                for name in names[shift:] + names[:shift]:
                    rows, seconds = _rows(contenders[name])
                    assert rows == args.messages, f"{name}: {rows} rows of {args.messages}"
                    rates[name].append(rows / seconds)
            if args.spark:
                spark_rates = spark_reads(args, {"archive host": driver.directory,
                                                 "other host": other.directory},
                                          f"127.0.0.1:{port}", archive_dir)
                rates.update({f"Spark, {name}": values for name, values in spark_rates.items()})
            with archived_links._archive_clients.entries() as links:
                linked = [key for key in links if key[0] == str(other.directory)]
            assert not linked, f"the other host's task linked to the archive: {linked}"
            publication.close()
            loads.append(_load())
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for directory in directories:
            shutil.rmtree(directory, ignore_errors=True)
    print(f"# read_range of {args.messages} messages of {args.size} B, {args.rounds} rounds, "
          f"median [range]; load average (1/5/15 min) before {loads[0]}, after {loads[-1]}")
    for name, values in rates.items():
        print(f"{name:>20}: {_median_range(values, 1e-6, 'M rows/s')}")
    median = {name: statistics.median(values) for name, values in rates.items()}
    per_round = [o / a for o, a in zip(rates["other host"], rates["archive host"],
                                       strict=True)]
    print(f"{'other / archive':>20}: {median['other host'] / median['archive host']:.2f} "
          f"(per round {min(per_round):.2f}-{max(per_round):.2f}, median "
          f"{statistics.median(per_round):.2f}; target >= 0.8)")
    print(f"{'archive / live':>20}: {median['archive host'] / median['live log']:.2f}")
    if args.spark:
        per_round = [o / a for o, a in zip(rates["Spark, other host"],
                                           rates["Spark, archive host"], strict=True)]
        print(f"{'Spark, other / archive':>20}: "
              f"{median['Spark, other host'] / median['Spark, archive host']:.2f} (per round "
              f"{min(per_round):.2f}-{max(per_round):.2f}, median "
              f"{statistics.median(per_round):.2f})")


def spark_reads(args: argparse.Namespace, directories: dict[str, Path], archive: str,
                archive_dir: Path) -> dict[str, list[float]]:
    """rows/s of ``spark.read ... load().count()`` of the archive's recording (no holder),
    planned and read on each host of ``directories`` (its driver's directory), rounds
    alternating after one unmeasured read each."""
    from slipstream.spark_bridge import session

    spark = session(master="local[2]", app_name="bench-spark-archive-read")
    rates: dict[str, list[float]] = {name: [] for name in directories}
    try:
        def count(directory: Path) -> tuple[int, float]:
            began = time.perf_counter()
            rows = (spark.read.format("slipstream").option("streamId", str(STREAM))
                    .option("channel", "aeron:ipc").option("directory", str(directory))
                    .option("archive", archive).option("archiveDir", str(archive_dir))
                    .load().count())
            return rows, time.perf_counter() - began

        names = list(directories)
        for name in names:  # the Python workers started, the JVM's code compiled
            count(directories[name])
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                rows, seconds = count(directories[name])
                assert rows == args.messages, f"Spark, {name}: {rows} rows of {args.messages}"
                rates[name].append(rows / seconds)
    finally:
        spark.stop()
    return rates


def plan_part(args: argparse.Namespace) -> None:
    frame = align(HEADER_LENGTH + args.size, FRAME_ALIGNMENT)
    per_term = args.plan_term // frame
    peer_term = 1 << ((args.terms_back + 2) * args.plan_term * 2 - 1).bit_length()
    work = Path(tempfile.mkdtemp(prefix="bench-spark-plan-", dir="/var/tmp"))
    directory = Path("/dev/shm") / f"bench-spark-plan-{uuid.uuid4().hex[:6]}"
    port = _free_port()
    loads = [_load()]
    try:
        with MediaDriver.launch(directory=directory) as driver, \
                Client.connect(driver.directory) as client, \
                running_archive(work, driver.directory, port, [STREAM, PEER_STREAM]):
            planned = client.add_publication(f"aeron:ipc?term-length={args.plan_term}", STREAM)
            peer = client.add_publication(f"aeron:ipc?term-length={peer_term}", PEER_STREAM)
            _wait(lambda: len(_recordings(work / "archive")) == 2, 30, "the recordings")
            payload = bytes(args.size)
            for _ in range(per_term):
                for publication in (planned, peer):
                    _offer(publication, payload, stamp=True)
            time.sleep(0.01)
            at_ms = time.time_ns() // 1_000_000 + 1
            time.sleep(0.01)
            first = {stream: _offer(publication, payload, stamp=True) - frame
                     for stream, publication in ((STREAM, planned), (PEER_STREAM, peer))}
            for _ in range(args.terms_back * per_term):
                for publication in (planned, peer):
                    _offer(publication, payload, stamp=True)
            for stream, publication in ((STREAM, planned), (PEER_STREAM, peer)):
                end = publication.position
                recording = next(r for r in _recordings(work / "archive")
                                 if r.stream_id == stream)
                _wait(lambda r=recording, e=end: indexed_position(work / "archive", r) >= e,
                      60, "the range recorded")
            base = {"channel": "aeron:ipc", "directory": str(driver.directory),
                    "archive": f"127.0.0.1:{port}", "replayTimeoutMs": "30000"}
            contenders = {
                "timestamp, archive": ({**base, "streamId": str(STREAM),
                                        "startingTimestamp": str(at_ms)}, first[STREAM]),
                "timestamp, live log": ({**base, "streamId": str(PEER_STREAM),
                                         "startingTimestamp": str(at_ms)}, first[PEER_STREAM]),
                "earliest, archive": ({**base, "streamId": str(STREAM),
                                       "startingOffsets": "earliest"}, 0),
            }
            times: dict[str, tuple[list[float], list[float]]] = {
                name: ([], []) for name in contenders}
            names = list(contenders)
            held_from: dict[str, int] = {}
            for round_ in range(args.rounds):
                shift = round_ % len(names)
                for name in names[shift:] + names[:shift]:
                    given, expected = contenders[name]
                    query = SlipstreamStreamReader(parse_options(given))
                    try:
                        for timed in times[name]:
                            began = time.perf_counter()
                            start = query.initialOffset()
                            timed.append(time.perf_counter() - began)
                            (sid, entry), = ((k, v) for k, v in start.items()
                                             if not k.startswith("@"))
                            assert entry["position"] == expected, (name, entry, expected)
                        held_from[name] = query._images()[sid].earliest_position()
                    finally:
                        query.stop()
            assert held_from["timestamp, archive"] > first[STREAM] + args.plan_term, \
                "the planned stream's log still holds the time"
            assert held_from["timestamp, live log"] <= first[PEER_STREAM]
            planned.close()
            peer.close()
            loads.append(_load())
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(directory, ignore_errors=True)
    back = (first[STREAM] - held_from["timestamp, archive"]) / args.plan_term
    print(f"# a new query's initialOffset(): a start at a time {args.terms_back} terms of "
          f"{args.plan_term >> 10} KiB back ({per_term} messages of {args.size} B a term; the "
          f"log's oldest position is {-back:.1f} terms after it); {args.rounds} rounds, "
          f"median [range] ms; load average (1/5/15 min) before {loads[0]}, after {loads[-1]}")
    for name, (new, again) in times.items():
        print(f"{name:>20}: new query {_median_range(new, 1e3, 'ms')}, "
              f"again {_median_range(again, 1e3, 'ms')}")

    def median(name: str, i: int) -> float:
        return statistics.median(times[name][i])

    for peer_name in ("timestamp, live log", "earliest, archive"):
        print(f"{'archive / ' + peer_name:>36}: new query "
              f"{median('timestamp, archive', 0) / median(peer_name, 0):.2f}, again "
              f"{median('timestamp, archive', 1) / median(peer_name, 1):.2f}")
    print(f"{'timestamp, archive':>36}: new query {median('timestamp, archive', 0):.3f} s "
          f"(target < 2 s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("read", "plan", "all"), default="all")
    parser.add_argument("--messages", type=int, default=300_000,
                        help="the read's range, messages")
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--spark", action="store_true",
                        help="also time the first program's Spark batch read on each host")
    parser.add_argument("--plan-term", type=int, default=1 << 20,
                        help="the planned stream's term length, bytes")
    parser.add_argument("--terms-back", type=int, default=10,
                        help="how many of its terms the start reaches back")
    args = parser.parse_args()
    print(f"# {machine()}")
    print(f"# {' '.join(sys.argv)}")
    if args.part in ("read", "all"):
        read_part(args)
    if args.part in ("plan", "all"):
        plan_part(args)


if __name__ == "__main__":
    main()
