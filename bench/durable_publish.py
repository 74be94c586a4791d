"""Durable publishing (``durable=7/1``): 1 KiB messages to a subscriber tagged ``gtag=7`` on
another driver, three ways in the same run, and the ratio to plain offers:

* plain: ``offer()`` as fast as the stream takes them (no ``durable=`` key), timed until the
  publisher's last offer returned;
* pipelined: the publisher waits for message k to be durable while it offers k + window
  (``wait_durable(position of k - window)``), timed until the last message is durable;
* naive: what a first program writes, ``offer()`` then ``wait_durable()`` each message.

Two drivers on loopback (each its own process; the subscriber polls in a third), not namespace
hosts: the figure is what the driver and the status messages cost, without a link's delay.
The subscriber's driver sends a status message each quarter of its window consumed, every
``status_message_timeout`` (200 ms), and, its subscription being tagged, as soon as the
subscriber has consumed all it received (at most one per
``status_message_catch_up_interval``, 1 ms: docs/DRIVER.md §4.6): the naive loop waits for
that one, not for the timer.

    .venv/bin/python -m bench.durable_publish [--messages N] [--window W] [--naive N]
        [--set KEY=VALUE ...]

``--set status_message_catch_up_interval=1s`` (its most) all but turns the catch-up rule off,
for a comparison in the same session.

``--hosts`` (needs root): an archive on another host instead.  Two namespace hosts on a bridge
(sim/real/hosts.py), a driver on each with its defaults unless ``--set`` says otherwise; on
host 2 a real ``slipstream-archive run`` records the stream as ``source = "remote"`` with a
``gtag=7`` subscription (its subscriber position is its recorded position, so durable means
recorded under its sync policy, ``--sync``); on host 1 this process publishes, plain and
pipelined in alternating rounds whose order rotates, to the same receiver, and prints each
round and the medians.  Plain is timed to its last offer and, beside it, to the archive's
recording position reaching its end (what a durable publisher waits for); each run also
prints the status messages the publisher's driver received and the time the pipelined loop
spent waiting.  The hosts, the drivers, the archive and its files are removed at the end.

    sudo .venv/bin/python -m bench.durable_publish --hosts [--messages N] [--rounds R]
        [--window W] [--sync none|segment|interval] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.ipc_throughput import add_driver_settings, bench_parser

SIZE = 1024
STREAM = 11


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _subscribe(directory: str, uri: str, stream_id: int, count: int, ready) -> None:
    """A subscriber process: read ``count`` messages, then wait to be stopped."""
    from slipstream.client import Client

    with Client.connect(directory) as client:
        subscription = client.add_subscription(uri, stream_id)
        ready.set()
        got = 0

        def on_message(_data: memoryview, _header: object) -> None:
            nonlocal got
            got += 1

        while got < count:
            if not subscription.poll(on_message, 256):
                time.sleep(0)
        time.sleep(1.0)  # its last status messages go out


def _connected_publication(client, uri: str, mode: str):
    """A publication on ``uri`` (with ``durable=7/1`` unless ``mode`` is plain), once its
    subscriber is connected."""
    durable = "" if mode == "plain" else "|durable=7/1"
    publication = client.add_publication(uri + durable, STREAM)
    deadline = time.monotonic() + 30
    while not publication.is_connected:
        assert time.monotonic() < deadline, "not connected"
        time.sleep(0.01)
    return publication


def _publish(publication, mode: str, count: int, window: int) -> tuple[float, float]:
    """Offer ``count`` 1 KiB messages on ``publication`` the ``mode``'s way (plain, pipelined,
    naive); returns the seconds from the first offer to the last offer returned (plain) or
    to the last message durable, and the seconds spent in ``wait_durable``."""
    payload = bytes(SIZE)
    offer, wait_durable = publication.offer, publication.wait_durable
    positions = [0] * count
    waited = 0.0
    clock = time.perf_counter
    started = clock()
    for k in range(count):
        while (position := offer(payload)) < 0:
            time.sleep(0)
        positions[k] = position
        if mode == "naive":
            assert wait_durable(position, 10.0), publication.why_not_durable(position)
        elif mode == "pipelined" and k >= window:
            before = clock()
            assert wait_durable(positions[k - window], 10.0), publication.why_not_durable(
                positions[k - window])
            waited += clock() - before
    if mode != "plain":
        before = clock()
        assert wait_durable(positions[-1], 10.0), publication.why_not_durable(positions[-1])
        waited += clock() - before
    return clock() - started, waited


def _run(mode: str, publisher_dir: Path, subscriber_dir: Path, count: int,
         window: int) -> float:
    """Messages per second of one mode."""
    from slipstream.client import Client

    port = _free_port()
    uri = f"aeron:udp?endpoint=127.0.0.1:{port}"
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    subscriber = context.Process(target=_subscribe, args=(
        str(subscriber_dir), uri + "|gtag=7", STREAM, count, ready))
    subscriber.start()
    try:
        ready.wait(30)
        with Client.connect(publisher_dir) as client:
            publication = _connected_publication(client, uri, mode)
            elapsed, _ = _publish(publication, mode, count, window)
            publication.close()
    finally:
        subscriber.join(30)
        if subscriber.is_alive():
            subscriber.kill()
    return count / elapsed


# -- --hosts: the archive on another namespace host ---------------------------------------------
def _recording_end(archive_dir: Path, counters, session_id: int, end: int,
                   timeout_s: float) -> float | None:
    """The monotonic time the archive's recording of ``session_id`` reached ``end`` (its
    position counter in ``counters``, polled every 0.2 ms), None if not within
    ``timeout_s``."""
    from slipstream.archive import Catalog
    from slipstream.archive.catalog import CATALOG_FILE
    from slipstream.archive.reading import recording_position_key
    from slipstream.client.counters import CounterType

    deadline = time.monotonic() + timeout_s
    reader = None
    while time.monotonic() < deadline:
        if reader is None and (archive_dir / CATALOG_FILE).exists():
            with Catalog.open(archive_dir, writable=False) as catalog:
                found = [r for r in catalog.recordings() if r.session_id == session_id]
            if found:
                if found[0].stop_position is not None and found[0].stop_position >= end:
                    return time.monotonic()
                info = counters.find(CounterType.RECORDING_POSITION, recording_position_key(
                    found[0].recording_id, session_id, STREAM, archive_dir))
                if info is not None:
                    reader = counters.reader(info.counter_id, info.registration_id)
        if reader is not None and reader.is_allocated and reader.get() >= end:
            return time.monotonic()
        time.sleep(0.0002)
    return None


def _hosts_run(mode: str, publisher_dir: Path, uri: str, count: int, window: int,
               archive_dir: Path, archive_counters, pids: dict[str, int]) -> dict[str, float]:
    """One run of ``mode`` (plain, pipelined) from this process through the driver in
    ``publisher_dir``: its rates, what it cost in status messages, and the CPU seconds of
    this process and of each of ``pids`` (name: pid) from the first offer to the end."""
    from bench.archive_record import _cpu_s
    from slipstream.client import Client
    from slipstream.client.counters import SystemCounter, read_system_counters

    with Client.connect(publisher_dir) as client:
        publication = _connected_publication(client, uri, mode)
        sms = read_system_counters(publisher_dir)[SystemCounter.STATUS_MESSAGES_RECEIVED]
        cpu = {name: _cpu_s(pid) for name, pid in pids.items()} | {"publisher": _cpu_s()}
        started = time.monotonic()
        elapsed, waited = _publish(publication, mode, count, window)
        end = publication.position
        recorded_at = _recording_end(archive_dir, archive_counters, publication.session_id,
                                     end, 60.0)
        sms = read_system_counters(publisher_dir)[SystemCounter.STATUS_MESSAGES_RECEIVED] - sms
        cpu = {name: (_cpu_s(pids[name]) if name in pids else _cpu_s()) - before
               for name, before in cpu.items()}
        publication.close()
    assert recorded_at is not None, f"the archive did not record {mode}'s stream to {end}"
    return {"rate": count / elapsed, "recorded": count / (recorded_at - started),
            "waited": waited / elapsed, "sms": sms,
            **{f"cpu {name}": seconds for name, seconds in cpu.items()}}


def hosts_main(args: argparse.Namespace) -> int:
    """The ``--hosts`` mode (see the module's docstring)."""
    from bench.archive_record import stop_archive
    from bench.ipc_throughput import machine
    from slipstream.archive.catalog import CATALOG_FILE
    from slipstream.client.control import COUNTERS_FILE
    from slipstream.client.counters import CountersFile
    from slipstream.sim.real.hosts import HostsError, namespace_hosts, unavailable

    problem = unavailable()
    if problem is not None:
        print(f"bench.durable_publish --hosts: {problem}", file=sys.stderr)
        return 2
    settings = dict(args.settings)
    work = Path(tempfile.mkdtemp(prefix="slipstream-durable-bench-", dir=args.dir))
    archive = None
    print(f"# durable publishing, archive on another namespace host: {args.messages:,} x "
          f"{SIZE} B, window {args.window} messages, archive sync {args.sync}, driver "
          f"settings {settings or 'defaults'}; {machine()}, load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "pipelined": []}
    try:
        with namespace_hosts(2) as hosts:
            publisher_driver = hosts.start_driver(1, **settings)
            archive_driver = hosts.start_driver(2, **settings)
            port = 40_123
            uri = f"aeron:udp?endpoint={hosts[2].address}:{port}"
            archive_dir = work / "archive"
            config = work / "archive.toml"
            config.write_text(
                f'dir = "{archive_dir}"\ndriver_dir = "{archive_driver.directory}"\n'
                f'sync = "{args.sync}"\n[[record]]\nchannel = "{uri}|gtag=7"\n'
                f'stream_id = {STREAM}\nsource = "remote"\n')
            with open(work / "archive.log", "wb") as log:
                archive = hosts[2].popen(sys.executable, "-m", "slipstream.archive.cli", "run",
                                         "--config", str(config), stdout=subprocess.DEVNULL,
                                         stderr=log)
            deadline = time.monotonic() + 30
            while not (archive_dir / CATALOG_FILE).exists() and archive.poll() is None:
                assert time.monotonic() < deadline, "the archive did not start"
                time.sleep(0.05)
            time.sleep(0.3)  # its subscription, before the first publication
            pids = {"driver 1": publisher_driver.pid, "driver 2": archive_driver.pid,
                    "archive": archive.pid}
            counters = CountersFile(Path(archive_driver.directory) / COUNTERS_FILE,
                                    writable=False)
            try:
                for round_ in range(args.rounds):
                    order = ["plain", "pipelined"][::1 if round_ % 2 == 0 else -1]
                    for mode in order:
                        if archive.poll() is not None:
                            raise RuntimeError("the archive stopped: " + (
                                work / "archive.log").read_text()[-2000:])
                        run = _hosts_run(mode, publisher_driver.directory, uri, args.messages,
                                         args.window, archive_dir, counters, pids)
                        runs[mode].append(run)
                        print(f"round {round_ + 1} {mode:>9}: {run['rate']:>10,.0f} msg/s "
                              f"({run['rate'] * SIZE / 1e6:,.1f} MB/s); to recorded "
                              f"{run['recorded']:>10,.0f} msg/s; {run['sms']:,.0f} SMs"
                              + (f", waiting {run['waited'] * 100:.0f} % of the time"
                                 if mode == "pipelined" else "")
                              + "; CPU s " + ", ".join(f"{k[4:]} {v:.2f}" for k, v in run.items()
                                                       if k.startswith("cpu ")), flush=True)
            finally:
                counters.close()
                stop_archive(archive)
    except HostsError as e:
        print(f"bench.durable_publish --hosts: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def median(mode: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[mode])

    def spread(mode: str, key: str) -> str:
        values = [run[key] for run in runs[mode]]
        return f"{statistics.median(values):,.0f} [{min(values):,.0f}-{max(values):,.0f}]"

    print(f"plain offers: {spread('plain', 'rate')} msg/s; to recorded "
          f"{spread('plain', 'recorded')}")
    print(f"pipelined to durable: {spread('pipelined', 'rate')} msg/s")
    ratios = [p["rate"] / q["rate"] for p, q in zip(runs["pipelined"], runs["plain"], strict=True)]
    print(f"pipelined / plain: {median('pipelined', 'rate') / median('plain', 'rate'):.2f}x "
          f"(medians; per round {min(ratios):.2f}-{max(ratios):.2f}; target >= 0.7x); "
          f"/ plain to recorded {median('pipelined', 'rate') / median('plain', 'recorded'):.2f}x")
    return 0


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--window", type=int, default=512,
                        help="messages in flight before the pipelined loop waits")
    parser.add_argument("--naive", type=int, default=20, help="messages of the naive loop")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--hosts", action="store_true",
                        help="the archive on another namespace host (needs root)")
    parser.add_argument("--rounds", type=int, default=5, help="--hosts: rounds of each mode")
    parser.add_argument("--sync", default="none", choices=["none", "segment", "interval"],
                        help="--hosts: the archive's sync policy")
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"),
                        help="--hosts: where the archive's directory goes (a disk)")
    add_driver_settings(parser, "a setting of both drivers (repeatable)")
    args = parser.parse_args()
    if args.hosts:
        return hosts_main(args)

    from slipstream.daemon.driver import MediaDriver

    directories = [Path("/dev/shm") / f"slipstream-bench-durable-{uuid.uuid4().hex[:8]}"
                   for _ in range(2)]
    settings = {"rcv_initial_window_length": "2m", "socket_so_rcvbuf": "4m",
                **dict(args.settings)}
    try:
        with contextlib.ExitStack() as stack:
            a, b = (stack.enter_context(MediaDriver.launch(directory=d, **settings))
                    for d in directories)
            best: dict[str, float] = {}
            for _ in range(args.repeat):
                for mode, count in (("plain", args.messages), ("pipelined", args.messages),
                                    ("naive", args.naive)):
                    rate = _run(mode, a.directory, b.directory, count, args.window)
                    best[mode] = max(best.get(mode, 0.0), rate)
                    print(f"{mode:>9}: {rate:>12,.0f} msg/s ({rate * SIZE / 1e6:,.1f} MB/s)",
                          flush=True)
            print(f"pipelined / plain: {best['pipelined'] / best['plain']:.2f}x "
                  f"(window {args.window} messages; target >= 0.7x)")
            print(f"naive / plain: {best['naive'] / best['plain']:.5f}x")
    finally:
        for d in directories:
            shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
