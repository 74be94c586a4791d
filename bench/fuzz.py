"""Fuzz runs against real drivers: hostile datagrams beside a live stream, then hostile commands.

    .venv/bin/python -m bench.fuzz [--datagrams 1000000] [--commands 100000] [--seed S]

Datagrams: two drivers on loopback carry a multicast stream (``fc=min``), checked message by
message, while another process sends ``--datagrams`` hostile datagrams for that very session
and stream (``slipstream.sim.real.fuzz.DatagramFuzzer``), alternately to the data group (the
receiving driver) and the control group (the sending driver).  Commands: ``--commands``
hostile frames (``CommandFuzzer``) on one driver's control socket; every frame that names a
correlation id must be answered.  Prints what was tried, what the drivers counted, and
whether both drivers lived, served and kept the stream exactly once; exit status 0 only then.
Figures: docs/RELIABILITY.md.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import random
import shutil
import socket
import struct
import sys
import time
import uuid
from pathlib import Path

from bench.ipc_throughput import bench_parser, machine, positive_int
from bench.udp_throughput import free_port

SETTINGS = {"client_liveness_timeout": "5s", "image_liveness_timeout": "5s",
            "publication_linger_timeout": "500ms"}
_SEQUENCE = struct.Struct("<Q")


def _send_datagrams(count: int, session_id: int, stream_id: int, targets: list[tuple[str, int]],
                    seed: int, done: multiprocessing.Queue) -> None:
    from slipstream.sim.real.fuzz import DatagramFuzzer

    fuzzer = DatagramFuzzer(session_id, stream_id, seed=seed)
    sent = refused = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        for i in range(count):
            try:
                sock.sendto(fuzzer.next(), targets[i & 1])
                sent += 1
            except OSError:  # EMSGSIZE never (< 64 KiB); ENOBUFS under load: counted
                refused += 1
            if i % 64 == 63:
                time.sleep(0)  # let the drivers and the stream have the cores too
    done.put((sent, refused, dict(fuzzer.counts)))


def _counters(directory: Path) -> dict[str, int]:
    from slipstream.client.counters import read_system_counters

    return {c.name: v for c, v in read_system_counters(directory).items()}


def run_datagrams(count: int, seed: int) -> bool:
    """The datagram run (module docstring); True when both drivers kept everything."""
    from slipstream.client import Client
    from slipstream.daemon.driver import MediaDriver

    group = random.Random(seed).randrange(1, 250, 2)
    port = free_port()
    uri = f"aeron:udp?endpoint=224.0.3.{group}:{port}|interface=127.0.0.1|fc=min"
    targets = [(f"224.0.3.{group}", port), (f"224.0.3.{group + 1}", port)]
    directories = [Path("/dev/shm") / f"slipstream-fuzz-{uuid.uuid4().hex[:8]}"
                   for _ in range(2)]
    context = multiprocessing.get_context("spawn")
    ok = True
    try:
        with contextlib.ExitStack() as stack:
            sender_driver, receiver_driver = (
                stack.enter_context(MediaDriver.launch(directory=d, **SETTINGS))
                for d in directories)
            a = stack.enter_context(Client.connect(sender_driver.directory))
            b = stack.enter_context(Client.connect(receiver_driver.directory))
            subscription = b.add_subscription(uri, 77)
            publication = a.add_publication(uri, 77)
            deadline = time.monotonic() + 15
            while not (publication.is_connected and subscription.images):
                if time.monotonic() > deadline:
                    print("the stream did not connect", file=sys.stderr)
                    return False
                time.sleep(0.01)
            done: multiprocessing.Queue = context.Queue()
            fuzzer = context.Process(target=_send_datagrams, args=(
                count, publication.session_id, 77, targets, seed, done))
            started = time.monotonic()
            fuzzer.start()
            expected = 0
            offered = 0
            wrong = 0

            def on_message(data: memoryview, _header: object) -> None:
                nonlocal expected, wrong
                sequence = _SEQUENCE.unpack_from(data)[0]
                if sequence != expected or bytes(data[8:]) != bytes(len(data) - 8):
                    wrong += 1
                expected = sequence + 1

            # The stream runs for as long as the fuzzer does, at a modest pace.
            while fuzzer.is_alive() or expected < offered:
                while (fuzzer.is_alive() and offered - expected < 1000
                       and publication.offer(_SEQUENCE.pack(offered) + bytes(200)) > 0):
                    offered += 1
                if not subscription.poll(on_message, 100):
                    time.sleep(0.0001)
                if time.monotonic() - started > 600:
                    print("the run took over 10 minutes", file=sys.stderr)
                    ok = False
                    break
            fuzzer.join()
            sent, refused, kinds = done.get(timeout=10)
            elapsed = time.monotonic() - started
            alive = sender_driver.process.poll() is None and receiver_driver.process.poll() is None
            counters = {"sender": _counters(sender_driver.directory),
                        "receiver": _counters(receiver_driver.directory)}
    finally:
        for directory in directories:
            shutil.rmtree(directory, ignore_errors=True)
    exactly_once = wrong == 0 and expected == offered
    print(f"datagrams  {sent:,} sent in {elapsed:.1f} s ({sent / elapsed:,.0f}/s), "
          f"{refused:,} refused by the local kernel")
    print(f"  kinds: {json.dumps(kinds)}")
    for side, values in counters.items():
        shown = {k.lower(): values[k] for k in (
            "INVALID_PACKETS", "FOREIGN_SOURCE_DROPS", "NAK_MESSAGES_RECEIVED",
            "STATUS_MESSAGES_RECEIVED", "FLOW_CONTROL_OVER_RUNS", "FLOW_CONTROL_UNDER_RUNS",
            "IMAGES_REJECTED", "HEARTBEATS_RECEIVED", "ERRORS")}
        print(f"  {side} driver counted: {json.dumps(shown)}")
    print(f"  stream beside it: {offered:,} messages offered, {expected:,} delivered, "
          f"{wrong} wrong -> {'exactly once, in order' if exactly_once else 'BROKEN'}")
    print(f"  drivers alive: {alive}; errors counters (anything the drivers logged as an error): "
          f"{counters['sender']['ERRORS'] + counters['receiver']['ERRORS']}")
    return ok and alive and exactly_once and not (
        counters["sender"]["ERRORS"] or counters["receiver"]["ERRORS"])


def run_commands(count: int, seed: int) -> bool:
    """The command run (module docstring); True when every owed answer came and the driver
    still serves a well-behaved client."""
    import zmq

    from slipstream.client import Client, control
    from slipstream.daemon.driver import MediaDriver
    from slipstream.sim.real.fuzz import CommandFuzzer

    directory = Path("/dev/shm") / f"slipstream-fuzz-{uuid.uuid4().hex[:8]}"
    fuzzer = CommandFuzzer(seed=seed)
    owed: set[int] = set()
    answered: set[int] = set()
    try:
        with MediaDriver.launch(directory=directory, ipc_term_buffer_length="64k",
                                **SETTINGS) as driver:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(control.conductor_endpoint(directory))
            started = time.monotonic()
            try:
                for _ in range(count):
                    frames, answer = fuzzer.next()
                    sock.send_multipart(frames)
                    if answer:
                        owed.add(json.loads(frames[0])["correlation_id"])
                    while sock.poll(0):
                        answered.add(control.decode(sock.recv()).get("correlation_id"))
                while owed - answered and sock.poll(5000):
                    answered.add(control.decode(sock.recv()).get("correlation_id"))
            finally:
                sock.close(0)
            elapsed = time.monotonic() - started
            with Client.connect(directory) as client:
                publication = client.add_publication("aeron:ipc", 1)
                subscription = client.add_subscription("aeron:ipc", 1)
                while publication.offer(b"still serving") < 0:
                    time.sleep(0.001)
                got: list[bytes] = []
                subscription.receive(lambda data, _h: got.append(bytes(data)), 1, timeout=5)
            serves = got == [b"still serving"]
            errors = _counters(directory)["ERRORS"]
            alive = driver.process.poll() is None
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    unanswered = len(owed - answered)
    print(f"commands   {count:,} sent in {elapsed:.1f} s ({count / elapsed:,.0f}/s): "
          f"{len(owed):,} named a correlation id, {unanswered} of them unanswered; "
          f"{count - len(owed):,} not commands (counted: errors counter {errors:,})")
    print(f"  kinds: {json.dumps(dict(fuzzer.counts))}")
    print(f"  driver alive: {alive}; serves a client afterwards: {serves}")
    return alive and serves and unanswered == 0


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--datagrams", type=positive_int, default=1_000_000)
    parser.add_argument("--commands", type=positive_int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"# fuzz, {machine()}, {time.strftime('%Y-%m-%d')}")
    print(f"# command: python -m bench.fuzz --datagrams {args.datagrams} "
          f"--commands {args.commands} --seed {args.seed}")
    ok = run_datagrams(args.datagrams, args.seed) if args.datagrams else True
    ok = (run_commands(args.commands, args.seed) if args.commands else True) and ok
    print("result: " + ("the drivers took it all" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
