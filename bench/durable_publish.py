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
``status_message_catch_up_interval``, 1 ms: docs/PROTOCOL.md §4.6): the naive loop waits for
that one, where it waited for the timer on every message before.

    .venv/bin/python -m bench.durable_publish [--messages N] [--window W] [--naive N]
        [--set KEY=VALUE ...]

``--set status_message_catch_up_interval=1s`` (its most) all but turns the catch-up rule off,
for a comparison in the same session.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import shutil
import socket
import time
import uuid
from pathlib import Path

from bench.ipc_throughput import driver_setting

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
        durable = "" if mode == "plain" else "|durable=7/1"
        payload = bytes(SIZE)
        with Client.connect(publisher_dir) as client:
            publication = client.add_publication(uri + durable, STREAM)
            deadline = time.monotonic() + 30
            while not publication.is_connected:
                assert time.monotonic() < deadline, "not connected"
                time.sleep(0.01)
            positions = [0] * count
            started = time.perf_counter()
            for k in range(count):
                while (position := publication.offer(payload)) < 0:
                    time.sleep(0)
                positions[k] = position
                if mode == "naive":
                    assert publication.wait_durable(position, 10.0), publication.why_not_durable(
                        position)
                elif mode == "pipelined" and k >= window:
                    assert publication.wait_durable(positions[k - window], 10.0)
            if mode != "plain":
                assert publication.wait_durable(positions[-1], 10.0)
            elapsed = time.perf_counter() - started
            publication.close()
    finally:
        subscriber.join(30)
        if subscriber.is_alive():
            subscriber.kill()
    return count / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--window", type=int, default=512,
                        help="messages in flight before the pipelined loop waits")
    parser.add_argument("--naive", type=int, default=20, help="messages of the naive loop")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--set", dest="settings", action="append", default=[],
                        type=driver_setting, metavar="KEY=VALUE",
                        help="a setting of both drivers (repeatable)")
    args = parser.parse_args()

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
