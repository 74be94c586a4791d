#!/opt/slipstream/bin/python
"""slipstream-sample: a publisher and a subscriber to try a driver with, as Aeron's samples.

    slipstream-sample subscribe CHANNEL STREAM [--count N]
    slipstream-sample publish CHANNEL STREAM [--count N] [--size BYTES] [--rate PER_S]

The publisher waits for a subscriber, then offers messages numbered 0, 1, 2, ... (each starts
with its number, 8 bytes little-endian), retrying while back-pressured, at most ``--rate`` a
second (0: as fast as they are taken); with ``--count N`` it stops after N and waits until
its subscribers have gone (they leave once they have all), so its end never cuts the stream
short.  The subscriber checks that each publisher's numbers arrive one after the other from
the first it sees (one that joins late starts where the stream is) and, with ``--count N``,
exits 0 after N, printing ``received N in order (FIRST..LAST)``; a gap or a number out of
order exits 1.  ``--count 0`` (either side): until SIGTERM or SIGINT, which end it with exit
0; the subscriber then prints what it has every 5 s.  Both find the driver by
``$SLIPSTREAM_DIR`` (the image sets it).  The container tests and the Kubernetes examples
(deploy/kubernetes/) run them.
"""

from __future__ import annotations

import argparse
import signal
import struct
import sys
import time
from collections.abc import Sequence
from types import FrameType

from slipstream.client import Client
from slipstream.client.errors import SlipstreamError
from slipstream.client.messages import Header

NUMBER = struct.Struct("<Q")
#: Seconds between the lines of a subscriber that runs until stopped.
REPORT_INTERVAL_S = 5.0


class Stopped(Exception):
    """SIGTERM or SIGINT: end as asked (exit 0)."""


def _stop(signum: int, _frame: FrameType | None) -> None:
    raise Stopped(signal.Signals(signum).name)


def publish(client: Client, channel: str, stream_id: int, count: int, size: int,
            rate: float, timeout: float) -> str:
    """Offer numbered messages of ``size`` bytes (``count`` of them, 0: until stopped); the
    outcome, or a TimeoutError."""
    publication = client.add_publication(channel, stream_id)
    deadline = time.monotonic() + timeout
    while not publication.is_connected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no subscriber of {channel} stream {stream_id} within "
                               f"{timeout} s")
        time.sleep(0.01)
    body = bytearray(max(size, NUMBER.size))
    number = 0
    started = time.monotonic()
    try:
        while count == 0 or number < count:
            if rate and number > (time.monotonic() - started) * rate:
                time.sleep(1 / rate)
                continue
            NUMBER.pack_into(body, 0, number)
            if publication.offer(body) > 0:
                number += 1
            elif count and time.monotonic() > deadline:
                raise TimeoutError(f"offered {number} of {count} messages within {timeout} s")
            else:
                time.sleep(0)
        while publication.is_connected and time.monotonic() < deadline:
            time.sleep(0.01)  # until the subscribers, which leave once they have all, are gone
    except Stopped:
        pass
    return f"published {number}"


def subscribe(client: Client, channel: str, stream_id: int, count: int,
              timeout: float) -> str:
    """Receive ``count`` messages (0: until stopped), each publisher's numbered one after the
    other; the outcome, or an AssertionError / TimeoutError."""
    subscription = client.add_subscription(channel, stream_id)
    print(f"subscribed to {channel} stream {stream_id}", flush=True)
    received = 0
    first: dict[int, int] = {}  # session id -> the first number seen
    due: dict[int, int] = {}  # session id -> the number due next

    def handler(data: memoryview, header: Header) -> None:
        nonlocal received
        number = NUMBER.unpack_from(data)[0]
        session = header.session_id
        first.setdefault(session, number)
        if due.setdefault(session, number) != number:
            raise AssertionError(f"message {number} of session {session} arrived where "
                                 f"{due[session]} was due")
        due[session] = number + 1
        received += 1

    def outcome() -> str:
        ranges = ", ".join(f"{first[s]}..{due[s] - 1}" for s in first)
        return f"received {received} in order ({ranges})"

    deadline = time.monotonic() + timeout
    report = time.monotonic() + REPORT_INTERVAL_S
    try:
        while count == 0 or received < count:
            now = time.monotonic()
            if count and now > deadline:
                raise TimeoutError(f"received {received} of {count} within {timeout} s")
            if not count and now > report:
                print(outcome(), flush=True)
                report = now + REPORT_INTERVAL_S
            limit = min(count - received, 256) if count else 256
            subscription.receive(handler, limit, timeout=0.1)
    except Stopped:
        pass
    return outcome()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slipstream-sample", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("publish", "subscribe"):
        command = commands.add_parser(name)
        command.add_argument("channel", help="channel URI, e.g. aeron:ipc")
        command.add_argument("stream_id", type=int, help="stream id")
        command.add_argument("--count", type=int, default=1000,
                             help="messages (0: until stopped; default 1000)")
        command.add_argument("--timeout", type=float, default=60.0,
                             help="seconds before giving up (default 60)")
        if name == "publish":
            command.add_argument("--size", type=int, default=64,
                                 help="message size, bytes, at least 8 (default 64)")
            command.add_argument("--rate", type=float, default=0.0,
                                 help="messages a second at most (0: as fast as taken)")
    args = parser.parse_args(argv)
    if args.count < 0:
        parser.error(f"--count {args.count}: give a number of messages, or 0 for no end")
    signal.signal(signal.SIGTERM, _stop)  # as PID 1 of a container it is ignored otherwise
    signal.signal(signal.SIGINT, _stop)
    try:
        with Client.connect() as client:
            if args.command == "publish":
                outcome = publish(client, args.channel, args.stream_id, args.count, args.size,
                                  args.rate, args.timeout)
            else:
                outcome = subscribe(client, args.channel, args.stream_id, args.count,
                                    args.timeout)
    except Stopped:
        return 0
    except (SlipstreamError, TimeoutError, AssertionError) as e:
        print(f"slipstream-sample {args.command}: {e}", file=sys.stderr)
        return 1
    print(outcome, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
