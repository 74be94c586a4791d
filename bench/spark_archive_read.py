"""A Spark read task's range read from an archive's recording on the archive's host, against
the same range read from the live log, in the same run.

    .venv/bin/python -m bench.spark_archive_read [--messages N] [--size B] [--rounds R]

One driver; a ``slipstream-archive`` process records an IPC stream (local source) of N
messages of B bytes to segment files in a temporary directory on this machine's disk; the
publication stays open, so the log holds the whole range too (its term is long enough) and
the recording is live (the in-place reader reads it up to its time index's last entry, as it
does while a stream is being recorded).  Each round reads ``[0, end)`` with the executor side of the
Spark reader (``read_range``, Arrow record batches included): once as a live-log partition
(the log mapped, ``Image.peek``'s C scan) and once as an archived partition with
``archiveDir`` (the segment files mapped, ``RecordingReader``'s C scan), alternating which
goes first.  Figures: rows/s, medians of the rounds with their range, and the ratio archive
/ live (the target: at least 0.8).  The segment files are in the page cache after the
recording (as they are right after it was written): a read from a cold disk is the disk's.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.archive_record import STREAM, _recordings, _wait
from bench.archive_replay import _free_port
from bench.ipc_throughput import machine
from slipstream.archive.holding import driver_instance
from slipstream.archive.reading import indexed_position
from slipstream.client import Client
from slipstream.client.logview import ImageView
from slipstream.daemon.driver import MediaDriver
from slipstream.spark_bridge.archived import ArchivedSource
from slipstream.spark_bridge.read_task import SlipstreamPartition, read_range


def _rows(partition: SlipstreamPartition) -> tuple[int, float]:
    started = time.perf_counter()
    rows = sum(batch.num_rows for batch in read_range(partition))
    return rows, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    frame = (args.size + 32 + 31) & ~31
    term = 1 << max(26, (args.messages * frame * 2 - 1).bit_length())  # holds it all
    work = Path(tempfile.mkdtemp(prefix="bench-spark-archive-", dir="/var/tmp"))
    directory = Path("/dev/shm") / f"bench-spark-archive-{uuid.uuid4().hex[:6]}"
    archive_dir = work / "archive"
    port = _free_port()
    archive = None
    try:
        with MediaDriver.launch(directory=directory, ipc_term_buffer_length=term) as driver, \
                Client.connect(driver.directory) as client:
            config = work / "archive.toml"
            config.write_text(f'dir = "{archive_dir}"\ndriver_dir = "{driver.directory}"\n'
                              f'control_port = {port}\n'
                              f'[[record]]\nchannel = "aeron:ipc"\nstream_id = {STREAM}\n')
            archive = subprocess.Popen([sys.executable, "-m", "slipstream.archive.cli", "run",
                                        "--config", str(config)], stderr=subprocess.DEVNULL)
            publication = client.add_publication("aeron:ipc", STREAM)
            _wait(lambda: _recordings(archive_dir), 30, "the recording")
            payload = bytes(args.size)
            for _ in range(args.messages):
                while publication.offer(payload, reserved_value=time.time_ns()) < 0:
                    time.sleep(0.0001)
            end = publication.position
            subscription = client.add_subscription("aeron:ipc", STREAM)
            _wait(lambda: subscription.images, 10, "the image")
            view = ImageView(subscription.images[0])
            recording = _recordings(archive_dir)[0]
            # What a read in place reads up to: the time index's last entry (no counters).
            _wait(lambda: indexed_position(archive_dir, recording) >= end, 60,
                  "the range recorded")
            common = dict(directory=str(driver.directory), fail_on_data_loss=True,
                          host="here", replay_timeout_ms=30_000, holder=None)
            live = SlipstreamPartition(view.session_id, STREAM, view.log_path, 0, end,
                                       log=view.identity,
                                       driver=driver_instance(client.counters), **common)
            endpoint = ("127.0.0.1", port, 10)
            archived = SlipstreamPartition(
                view.session_id, STREAM, "", 0, end, log=None, driver=None,
                archived=ArchivedSource(endpoint, recording.recording_id,
                                        view.identity.framing, (endpoint,),
                                        str(archive_dir)), **common)
            rates: dict[str, list[float]] = {"live log": [], "archive, in place": []}
            for round_ in range(args.rounds):
                order = [("live log", live), ("archive, in place", archived)]
                for name, partition in order if round_ % 2 == 0 else order[::-1]:
                    rows, seconds = _rows(partition)
                    assert rows == args.messages, f"{name}: {rows} rows of {args.messages}"
                    rates[name].append(rows / seconds)
            publication.close()
    finally:
        if archive is not None:
            archive.terminate()
            archive.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(directory, ignore_errors=True)
    print(f"# {machine()}")
    print(f"# read_range of {args.messages} messages of {args.size} B, {args.rounds} rounds "
          f"(median [range])")
    for name, values in rates.items():
        print(f"{name:>18}: {statistics.median(values) / 1e6:6.2f} M rows/s "
              f"[{min(values) / 1e6:.2f}-{max(values) / 1e6:.2f}]")
    ratio = statistics.median(rates["archive, in place"]) / statistics.median(rates["live log"])
    print(f"{'archive / live':>18}: {ratio:.2f} (target >= 0.8)")


if __name__ == "__main__":
    main()
