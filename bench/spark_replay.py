"""A Spark read task's range read on a host that does not hold the log, against a local read of
the same range, in the same run.

    .venv/bin/python -m bench.spark_replay [--messages N] [--size B] [--runs R] [--pin] [--cpu]
        [--archive] [--gap S] [--set KEY=VALUE ...]

Two drivers on this machine stand for two hosts: the holder's (an IPC log of N messages of B
bytes, held by a subscription that never reads, and the query's replay server, the archive's
control stream over that log (``planning._Holder``) at 127.0.0.2, in a process of its own as
a holder is) and the executor's (its replays arrive at 127.0.0.1, the address
the kernel sends to 127.0.0.2 from, the same port).  Each run reads the range once with the
executor side of the Spark reader (``read_range``), in this process: locally, mapping the log,
and replayed, through the executor's driver; the figure is rows/s of the whole call, Arrow
batches included, and the ratio replayed / local.  The best of ``--runs``, with the time its
first batch took (for a replay, its set-up: the request, the holder's answer and the streams
between the two drivers), and the median of the runs beside it.

Each run also measures what the drivers themselves carry: a warm, steady UDP stream of the
same messages (as many, as long) from the holder's driver to the executor's, subscribed as a
replay is (the drivers' defaults but the 2 MiB receiver window every reply endpoint asks
for), read in this process by the same reader code as ``read_range``'s local path (C scans
of up to 4096 messages, one Arrow batch each), parked when nothing is there as a replay's
reader is.  The holder publishes the range twice: the first pass writes every page of the
stream's two logs; the second, the one timed, starts when the reader has read the first and
finds them all resident.  A replay carries the same messages through the same two drivers
with the same window, plus its set-up and two new logs: the stream is the reference it is
measured against (its publisher offers from Python, where a replay's holder copies blocks:
a reference, not a proof of a bound).  The drivers make a replay's logs in the files of
earlier replays' logs they released (``log_reuse_bytes``) once no process maps those: the
holder's and the reader's clients unmap a closed replay's logs at once
(``resource_linger_s=0``), but the reader's driver holds a replay's image a while after its
subscription closed; ``--gap S`` pauses S seconds before each replay (4 lets every replay
after the first two find its logs kept), and ``--set KEY=VALUE`` sets both drivers'
settings (``--set log_reuse_bytes=0``: new files always).  The command prints how many logs
each driver made from released ones, in all and per replayed read.

``--pin`` gives each "host" a CPU of its own: the holder's process and driver on CPU 1, this
process (the reader) and the executor's driver on CPU 0 (every thread, as ``taskset`` would).
Without it the scheduler places them on the machine's cores as it likes.  ``--cpu`` prints
where a replayed read's CPU goes: per thread of the four processes (the median of the runs, ms
of CPU from ``/proc/<pid>/task/<tid>/schedstat``, and its page faults), the archive's
replayed read's (the archive's process too), and the warm stream's timed pass's beside them.

``--archive`` adds the archive's replay of the same range: a ``slipstream-archive`` process
beside the holder's driver (control endpoint at 127.0.0.1) records the holder's IPC stream
(local source) from its first message to segment files in a temporary directory on this
machine's disk, and each run reads the range a third way, as a partition of that recording
(``archived``, no ``archiveDir``: the executor's host does not mount the archive's
directory) with the same ``read_range``, which asks the archive for a replay through the
executor's driver (:func:`slipstream.archive.locate.read_session`).  Its first batch comes
after, one after the other: the reader's subscription (a round trip to the executor's
driver), the call to the archive, the archive's replay publication (its log made by the
holder's driver, which sends its SETUP at once), the reader's image (its log made by the
executor's driver, its first status message, the image handed to this process), the
archive's first block once connected, and its first frames.  Its figures sit beside
the holder's replay and the warm stream's; it reads after the holder's replay in even runs,
before it in odd ones.

It also prints what writing the range's bytes costs in this machine's shared memory, into fresh
pages and again into the same pages, resident: a replay writes its range into two new logs
(the holder's replay publication and the executor's image), a local read into none.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from array import array
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench.archive_record import _recordings, _wait, stop_archive
from bench.ipc_throughput import BATCH, add_driver_settings, machine
from bench.spark_archive_read import archive_process
from bench.udp_throughput import free_port
from slipstream.archive.client import ArchiveClient
from slipstream.archive.holding import driver_instance
from slipstream.archive.reading import indexed_position
from slipstream.client import (
    ADMIN_ACTION,
    BACK_PRESSURED,
    NOT_CONNECTED,
    Client,
    Publication,
    Subscription,
)
from slipstream.client.counters import CountersFile, SystemCounter, read_system_counters
from slipstream.client.holding import REPLY_WINDOW, reply_subscription_channel
from slipstream.client.layout import FRAME_ALIGNMENT, HEADER_LENGTH, align
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.driver import MediaDriver
from slipstream.spark_bridge.archived import ArchivedSource
from slipstream.spark_bridge.planning import _Holder
from slipstream.spark_bridge.read_task import (
    _ROWS_PER_BATCH,
    SlipstreamPartition,
    _arrow_batch,
    _schema,
    read_range,
)

PORT = 40195
STREAM = 77
WARM_STREAM = 78  # the warm UDP stream's, the ceiling
IDLE_LIMIT_S = 30  # the longest the warm stream's reader waits for its image, or a message
HOLDER_CPU, READER_CPU = 1, 0  # with --pin


def pin_process(pid: int, cpu: int) -> None:
    """Every thread of process ``pid`` on ``cpu`` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def _add_difference(table: dict[tuple[str, str], list[tuple[int, int]]],
                    before: dict[tuple[str, str], tuple[int, int]],
                    after: dict[tuple[str, str], tuple[int, int]]) -> None:
    """Append each thread's CPU ns and page faults from ``before`` to ``after``
    (:func:`thread_cpu`'s) to its samples in ``table``."""
    for thread, (ns, faults) in after.items():
        ns0, faults0 = before.get(thread, (0, 0))
        table[thread].append((ns - ns0, faults - faults0))


def _reused_since(before: tuple[int, int], after: tuple[int, int]) -> tuple[int, int]:
    """The logs each driver made in released logs' files from ``before`` to ``after``
    (their LOGS_REUSED counters)."""
    return after[0] - before[0], after[1] - before[1]


def _per_read(counts: list[tuple[int, int]]) -> str:
    return " ".join(f"{sender}/{reader}" for sender, reader in counts)


def thread_cpu(pids: dict[str, int]) -> dict[tuple[str, str], tuple[int, int]]:
    """CPU ns and minor page faults so far of every thread of ``pids`` (label -> pid), by
    (label, thread name with its id)."""
    seen: dict[tuple[str, str], tuple[int, int]] = {}
    for label, pid in pids.items():
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ns = int(f.read().split()[0])
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            faults = int(stat[stat.rindex(")") + 2:].split()[7])
            seen[(label, f"{name}/{tid}")] = (ns, faults)
    return seen


def page_cost(directory: Path, length: int, runs: int = 3) -> tuple[float, float]:
    """Seconds to write ``length`` bytes in 1 MiB blocks into a new file's fresh shared-memory
    pages in ``directory``, and to write them again into the same pages (resident, mapped):
    the medians of ``runs``."""
    block = b"\x01" * (1 << 20)
    fresh: list[float] = []
    resident: list[float] = []
    path = directory / f"page-cost-{uuid.uuid4().hex[:6]}"
    for _ in range(runs):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, length)
            with mmap.mmap(fd, length) as mapped:
                for times in (fresh, resident):
                    began = time.perf_counter()
                    for offset in range(0, length, len(block)):
                        mapped[offset:offset + len(block)] = block[:length - offset]
                    times.append(time.perf_counter() - began)
        finally:
            os.close(fd)
            path.unlink()
    return statistics.median(fresh), statistics.median(resident)


def rows_of(partition: SlipstreamPartition) -> tuple[int, float, float]:
    """Rows read, seconds for all of them, and seconds to the first batch (a replay's set-up:
    its request, answer and streams)."""
    began = time.perf_counter()
    rows, first = 0, 0.0
    for batch in read_range(partition):
        if not rows:
            first = time.perf_counter() - began
        rows += batch.num_rows
    return rows, time.perf_counter() - began, first


def publish_passes(publication: Publication, messages: int, size: int, passes: int) -> None:
    """``passes`` times ``messages`` messages of ``size`` zero bytes in a row, offered in
    batches of ``BATCH`` as bench.udp_throughput's publisher offers them; a batch that finds
    no credit (or no subscriber yet) is offered again after 0.1 ms, one that rotated the term
    at once."""
    data, lengths = bytes(size * BATCH), array("i", [size] * BATCH)
    left = passes * messages
    while left:
        if left < len(lengths):  # the last batch: as many messages as are left
            data, lengths = data[:left * size], lengths[:left]
        done = publication.offer_batch(data, lengths)
        if done > 0:
            left -= done
        elif done in (BACK_PRESSURED, NOT_CONNECTED):
            time.sleep(0.0001)
        elif done != ADMIN_ACTION:
            raise SystemExit(f"the warm stream's publication refused a batch ({done})")


def _sample_into(samples: list[Any], pids: dict[str, int]) -> None:
    samples.append(thread_cpu(pids))


def read_warm_stream(connection: Any, subscription: Subscription, messages: int,
                     on_timed: Callable[[], None] = lambda: None) -> float:
    """Ask the holder (``connection``) for the range's messages twice on the warm stream and
    read both passes from ``subscription``'s image as ``read_range`` reads a log locally: a C
    scan of up to ``_ROWS_PER_BATCH`` messages, one Arrow batch of it; parked in
    ``wait_for_data`` when nothing is there, as a replay's reader is.  Returns rows/s of the
    second pass, which the holder starts once this has read the first ("go"), timed from
    then to its last message; checks that each pass brought ``messages`` rows and that the
    image ends at the holder's publication position.  ``on_timed`` is called as the second
    pass begins and again once it ended (the holder's publication included)."""
    image = subscription.images[0]
    schema = _schema()
    ids: dict[int, tuple[object, object]] = {}

    def read_pass() -> None:
        rows = 0
        while rows < messages:  # no scan past the pass: the second is timed on its own
            chunk = image.poll_gathered(min(_ROWS_PER_BATCH, messages - rows))
            if chunk is not None:
                rows += _arrow_batch(chunk, image.session_id, WARM_STREAM, schema, ids).num_rows
            elif not subscription.wait_for_data(IDLE_LIMIT_S * 10**9, 0):  # parked, as a replay's
                raise SystemExit(f"the warm stream stopped for {IDLE_LIMIT_S} s after {rows} "
                                 f"of {messages} messages of a pass, at {image.position}")

    connection.send("stream")
    read_pass()  # the pass that writes the pages of both logs
    on_timed()
    connection.send("go")
    began = time.perf_counter()
    read_pass()
    seconds = time.perf_counter() - began
    published = connection.recv()
    on_timed()
    assert image.position == published, (image.position, published)
    return messages / seconds


def hold(connection: Any, holder_dir: str, messages: int, size: int, term: int,
         warm_channel: str, cpu: int | None) -> None:
    """The holder's process: publish the range into an IPC log, hold it with a subscription
    that never reads, send its description to ``connection`` and serve replays of it until
    ``connection`` says "stop".  Each "stream" it gets meanwhile, it publishes the range's
    messages on the warm stream (``warm_channel``, ``WARM_STREAM``), again on "go", and
    answers its publication's position once they are all offered."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    with Client.connect(holder_dir) as local:
        publication = local.add_publication(f"aeron:ipc?term-length={term}", STREAM)
        warm = local.add_publication(warm_channel, WARM_STREAM)
        keeper = local.add_subscription("aeron:ipc", STREAM)  # holds the range
        while not keeper.images:
            time.sleep(0.01)
        payload = bytes(size)
        for _ in range(messages):
            while publication.offer(payload) < 0:
                time.sleep(0.0001)
        image = keeper.images[0]
        server = _Holder(holder_dir, "127.0.0.2", PORT)
        server.holds.publish({(STREAM, image.session_id): (image.log_path, 0, image.channel_key)})
        connection.send({"session_id": image.session_id, "log_path": image.log_path,
                         "start": image.position, "end": image.available_position(),
                         "identity": image.identity, "holder": server.address})
        while connection.recv() == "stream":  # until "stop"
            publish_passes(warm, messages, size, 1)
            connection.recv()  # "go": the reader has read the first pass
            publish_passes(warm, messages, size, 1)
            connection.send(warm.position)
        server.close()


def start_archive(work: Path, holder_dir: str, executor_dir: str
                  ) -> tuple[subprocess.Popen[bytes], tuple[str, int, int]]:
    """A ``slipstream-archive`` process beside the holder's driver recording the range's IPC
    stream into ``work / "archive"``, and its control endpoint, once it answers a call from
    the executor's driver (it subscribes to the stream before it takes calls)."""
    port = free_port()
    archive = archive_process(work, holder_dir, port, [STREAM])
    with Client.connect(executor_dir) as client, \
            ArchiveClient(client, "127.0.0.1", port, timeout_s=IDLE_LIMIT_S) as link:
        if not link.await_connected(IDLE_LIMIT_S):
            archive.kill()
            raise SystemExit(f"the archive took no calls at 127.0.0.1:{port} after "
                             f"{IDLE_LIMIT_S} s")
        link.list_all_recordings(stream_id=STREAM)
        return archive, link.archive


def archived_partition(archive_dir: Path, endpoint: tuple[str, int, int],
                       log: dict[str, Any], executor_dir: str) -> SlipstreamPartition:
    """The range as a partition of the archive's recording of it, read on the executor's
    host (no ``archiveDir``: replayed), once the archive has recorded all of it."""
    deadline = time.monotonic() + IDLE_LIMIT_S
    while True:
        found = [r for r in _recordings(archive_dir) if r.session_id == log["session_id"]]
        if found and indexed_position(archive_dir, found[0]) >= log["end"]:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"the archive did not record the range in {IDLE_LIMIT_S} s")
        time.sleep(0.01)
    recording = found[0]
    if recording.start_position > log["start"]:
        raise SystemExit(f"the archive began recording at {recording.start_position}, past "
                         f"the range's start {log['start']}")
    return SlipstreamPartition(
        log["session_id"], STREAM, "", log["start"], log["end"], executor_dir, True, "holder",
        log=None, driver=None, holder=None, replay_timeout_ms=30_000,
        archived=ArchivedSource(endpoint, recording.recording_id, log["identity"].framing,
                                (endpoint,), None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000,
                        help="at most what half a 128 MiB term holds (a receiver's longest)")
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pin", action="store_true",
                        help="the holder's side on CPU 1, the reader's on CPU 0")
    parser.add_argument("--cpu", action="store_true",
                        help="print the CPU of each thread per replayed read")
    parser.add_argument("--archive", action="store_true",
                        help="also read the range replayed by an archive that recorded it")
    parser.add_argument("--gap", type=float, default=0.0,
                        help="seconds of pause before each replay (a task that starts after "
                             "the clients' resource linger, 3 s: the drivers may make its "
                             "logs from those earlier replays released, log_reuse_bytes)")
    add_driver_settings(parser, "a setting of both drivers (repeatable)")
    args = parser.parse_args()
    if args.pin and not {HOLDER_CPU, READER_CPU} <= os.sched_getaffinity(0):
        parser.error(f"--pin needs CPUs {READER_CPU} and {HOLDER_CPU} (this process may run on "
                     f"{sorted(os.sched_getaffinity(0))})")
    # Twice the data: an IPC publication may run half a term ahead of its slowest subscriber.
    term = 1 << max(16, (args.messages * (args.size + 32 + 31)).bit_length() + 1)
    # The warm stream's terms: the drivers' default, or the longest shorter one whose log (three
    # terms) a pass of the range fills, so that the first pass writes every page of the holder's
    # publication log and of the executor's image, and the second, timed, none fresh.  At least
    # twice the replay's receiver window (an image caps its window at half a term).
    range_bytes = args.messages * align(HEADER_LENGTH + args.size, FRAME_ALIGNMENT)
    warm_term = max(2 * REPLY_WINDOW, min(DriverSettings().term_buffer_length,
                                          1 << ((range_bytes // 3).bit_length() - 1)))
    warm_channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|term-length={warm_term}"
    directories = [Path("/dev/shm") / f"slipstream-bench-replay-{uuid.uuid4().hex[:6]}-{n}"
                   for n in ("holder", "executor")]
    if args.pin:
        os.sched_setaffinity(0, {READER_CPU})
    launches = [MediaDriver.launch(directory=d, **dict(args.settings)) for d in directories]
    spawn = multiprocessing.get_context("spawn")
    here, there = spawn.Pipe()
    holder: Any = None
    reader: Client | None = None
    archive: subprocess.Popen[bytes] | None = None
    work = Path(tempfile.mkdtemp(prefix="bench-spark-replay-", dir="/var/tmp"))
    archive_dir = work / "archive"
    try:
        drivers = [launch.__enter__() for launch in launches]
        if args.pin:
            pin_process(drivers[0].pid, HOLDER_CPU)
            pin_process(drivers[1].pid, READER_CPU)
        holder_dir, executor_dir = (str(d) for d in directories)
        if args.archive:
            archive, archive_endpoint = start_archive(work, holder_dir, executor_dir)
            if args.pin:
                pin_process(archive.pid, HOLDER_CPU)
        holder = spawn.Process(target=hold, args=(there, holder_dir, args.messages, args.size,
                                                  term, warm_channel,
                                                  HOLDER_CPU if args.pin else None),
                               daemon=True)
        holder.start()
        while not here.poll(1.0):  # the holder publishes the range first
            if not holder.is_alive():
                raise SystemExit(f"the holder's process ended ({holder.exitcode}) before it "
                                 f"held the range")
        log = here.recv()
        reader = Client.connect(executor_dir)
        warm = reader.add_subscription(reply_subscription_channel(warm_channel), WARM_STREAM)
        _wait(lambda: warm.images, IDLE_LIMIT_S, f"an image of the warm stream ({warm_channel})")
        counters = CountersFile(Path(holder_dir) / "counters.dat")
        holder_driver = driver_instance(counters)
        counters.close()
        pids = {"reader": os.getpid(), "holder": holder.pid, "holder's driver": drivers[0].pid,
                "reader's driver": drivers[1].pid}
        archived: SlipstreamPartition | None = None
        if archive is not None:
            archived = archived_partition(archive_dir, archive_endpoint, log, executor_dir)

        def partition(directory: str) -> SlipstreamPartition:
            return SlipstreamPartition(
                log["session_id"], STREAM, log["log_path"], log["start"], log["end"],
                directory, True, "holder", log=log["identity"], driver=holder_driver,
                holder=log["holder"], replay_timeout_ms=30_000,
                held={"channel": "aeron:ipc", "stream_id": STREAM, "group": "query"})

        local_runs: list[tuple[float, float]] = []
        replayed_runs: list[tuple[float, float]] = []
        archive_runs: list[tuple[float, float]] = []
        stream_runs: list[float] = []
        cpu: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
        stream_cpu: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
        archive_cpu: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
        archive_pids = {**pids, "archive": archive.pid} if archive is not None else pids
        # Per replayed read, how many logs each driver made in released logs' files.
        holder_reused: list[tuple[int, int]] = []
        archive_reused: list[tuple[int, int]] = []

        def logs_reused() -> tuple[int, int]:
            counts = [read_system_counters(d)[SystemCounter.LOGS_REUSED] for d in directories]
            return counts[0], counts[1]

        def archive_run() -> None:
            if archived is not None:
                time.sleep(args.gap)
                reused_before = logs_reused()
                before = thread_cpu(archive_pids)
                rows, seconds, first = rows_of(archived)
                _add_difference(archive_cpu, before, thread_cpu(archive_pids))
                archive_reused.append(_reused_since(reused_before, logs_reused()))
                assert rows == args.messages, rows
                archive_runs.append((rows / seconds, first))

        for run in range(args.runs):
            rows, seconds, first = rows_of(partition(holder_dir))
            assert rows == args.messages, rows
            local_runs.append((rows / seconds, first))
            if run % 2:  # the archive's replay before the holder's in every other run
                archive_run()
            time.sleep(args.gap)
            reused_before = logs_reused()
            before = thread_cpu(pids)
            rows, seconds, first = rows_of(partition(executor_dir))
            _add_difference(cpu, before, thread_cpu(pids))
            holder_reused.append(_reused_since(reused_before, logs_reused()))
            assert rows == args.messages, rows
            replayed_runs.append((rows / seconds, first))
            if not run % 2:
                archive_run()
            timed: list[dict[tuple[str, str], tuple[int, int]]] = []
            stream_runs.append(read_warm_stream(here, warm, args.messages,
                                                partial(_sample_into, timed, pids)))
            _add_difference(stream_cpu, timed[0], timed[1])
        reused = [read_system_counters(d)[SystemCounter.LOGS_REUSED] for d in directories]
        here.send("stop")
        holder.join(10)
        log_bytes = log["end"] - log["start"]
        local_best, local_first = max(local_runs)
        replayed_best, replayed_first = max(replayed_runs)
        local_median = statistics.median(rate for rate, _ in local_runs)
        replayed_median = statistics.median(rate for rate, _ in replayed_runs)
        stream_best, stream_median = max(stream_runs), statistics.median(stream_runs)
        print(f"machine: {machine()}")
        print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}")
        layout = "pinned: the holder's side on CPU 1, the reader's on CPU 0"
        print(f"layout: {layout if args.pin else 'unpinned'}")
        if args.gap:
            print(f"gap before each replay: {args.gap:g} s")
        if args.settings:
            print("driver settings: " + ", ".join(f"{k}={v}" for k, v in args.settings))
        print(f"range: {args.messages} messages of {args.size} B ({log_bytes} bytes of log)")
        print(f"local read   : {local_best / 1e6:.3f} M rows/s (first batch after "
              f"{local_first * 1e3:.1f} ms; median {local_median / 1e6:.3f})")
        print(f"replayed read: {replayed_best / 1e6:.3f} M rows/s (first batch after "
              f"{replayed_first * 1e3:.1f} ms: the request, the answer and the streams; median "
              f"{replayed_median / 1e6:.3f})")
        print(f"ratio replayed / local: {replayed_best / local_best:.2f} (medians "
              f"{replayed_median / local_median:.2f})")
        print(f"warm UDP stream through the same drivers: {stream_best / 1e6:.3f} M rows/s "
              f"(median {stream_median / 1e6:.3f}; the second of two passes, "
              f"{warm_term >> 20} MiB terms); stream / local {stream_best / local_best:.2f}, "
              f"replayed / stream {replayed_best / stream_best:.2f} (medians "
              f"{stream_median / local_median:.2f}, {replayed_median / stream_median:.2f})")
        if archive_runs:
            archive_best, archive_first = max(archive_runs)
            archive_median = statistics.median(rate for rate, _ in archive_runs)
            print(f"the archive's replay: {archive_best / 1e6:.3f} M rows/s (first batch after "
                  f"{archive_first * 1e3:.1f} ms; median {archive_median / 1e6:.3f}); "
                  f"archive / stream {archive_best / stream_best:.2f}, archive / local "
                  f"{archive_best / local_best:.2f}, archive / holder "
                  f"{archive_best / replayed_best:.2f} (medians "
                  f"{archive_median / stream_median:.2f}, {archive_median / local_median:.2f}, "
                  f"{archive_median / replayed_median:.2f}; target archive / stream >= 0.8)")
            print("  the archive's runs, in order: " + ", ".join(
                f"{rate / 1e6:.2f} M rows/s (first batch {first * 1e3:.0f} ms)"
                for rate, first in archive_runs))
        if range_bytes < 3 * warm_term:
            print(f"  (a pass of {range_bytes} bytes does not fill the stream's three "
                  f"{warm_term >> 20} MiB terms: its timed pass wrote fresh pages too)")
        fresh_s, resident_s = page_cost(directories[1], log_bytes)
        print(f"shared memory, the range's bytes written once: into fresh pages "
              f"{fresh_s * 1e3:.1f} ms, again into the same pages {resident_s * 1e3:.1f} ms "
              f"(a replay fills two new logs; the best local read took "
              f"{args.messages / local_best * 1e3:.1f} ms)")
        print(f"logs made in the files of released ones (log_reuse_bytes): the holder's "
              f"driver {reused[0]}, the reader's {reused[1]}; per replayed read, in run "
              f"order (the replaying side's driver / the reader's): the holder's "
              f"{_per_read(holder_reused)}"
              + (f", the archive's {_per_read(archive_reused)}" if archive_reused else ""))
        if args.cpu:
            tables = [("replayed read", cpu), ("archive's replayed read", archive_cpu),
                      ("warm stream's timed pass", stream_cpu)]
            for what, table in tables:
                if not table:
                    continue
                print(f"CPU per {what} (median of the runs; minor page faults):")
                total = 0.0
                for (label, name), samples in sorted(table.items()):
                    ms = statistics.median(ns for ns, _ in samples) / 1e6
                    faults = statistics.median(f for _, f in samples)
                    total += ms
                    if ms >= 0.5:
                        print(f"  {label:16} {name:24} {ms:7.1f} ms {faults:8.0f} faults")
                print(f"  {'all':41} {total:7.1f} ms")
    finally:
        if reader is not None:
            reader.close()
        if holder is not None and holder.is_alive():
            holder.kill()
        if archive is not None:
            stop_archive(archive)
        shutil.rmtree(work, ignore_errors=True)
        for launch in reversed(launches):
            launch.__exit__(None, None, None)
        here.close()
        there.close()
        for directory in directories:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
