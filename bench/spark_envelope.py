"""What a Spark read task's Arrow batches cost with envelopes (keys and headers) beside plain
messages, in the same run.

    .venv/bin/python -m bench.spark_envelope [--messages N] [--size B] [--runs R]

Builds batches of N messages of B-byte values as ``Image.poll_gathered`` hands them to the
read task (payloads back to back, offsets, positions, reserved values) and times the read
task's ``_arrow_batch`` on each, alternately, R rounds: plain messages stamped by their
publisher (the slipstream writer's plain rows), plain unstamped ones (a publisher that sets no
reserved value), and envelopes with a 8-byte key and one header, read without and with the
``headers`` column.  Prints each kind's median µs per batch and rows/s, and the envelope's
cost per message over the plain batch's.  Judge a run by the ratios: the machine's load moves
every figure.
"""

from __future__ import annotations

import argparse
import statistics
import time
from array import array


def _chunk(messages: list[bytes], reserved: int) -> object:
    from slipstream.client import GatheredMessages

    n = len(messages)
    offsets = array("i", [0]) * (n + 1)
    end = 0
    for i, message in enumerate(messages):
        end += len(message)
        offsets[i + 1] = end
    return GatheredMessages(bytearray(b"".join(messages)), offsets,
                            array("i", [len(m) for m in messages]),
                            array("q", range(128, 128 * (n + 1), 128)),
                            array("q", [reserved] * n), 7)


def main() -> None:
    from slipstream.client.layout import RESERVED_VALUE_ENVELOPE_BIT
    from slipstream.spark_bridge.envelope import encode_message
    from slipstream.spark_bridge.read_task import _arrow_batch, _schema

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=4096)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    n, value = args.messages, b"v" * args.size
    stamp = time.time_ns()
    envelope = encode_message(value, b"key-0001", [("trace", b"abc")])
    kinds = {
        "plain, stamped": (_chunk([value] * n, stamp), _schema(False)),
        "plain, unstamped": (_chunk([value] * n, 0), _schema(False)),
        "envelopes": (_chunk([envelope] * n, stamp + RESERVED_VALUE_ENVELOPE_BIT),
                      _schema(False)),
        "envelopes + headers": (_chunk([envelope] * n, stamp + RESERVED_VALUE_ENVELOPE_BIT),
                                _schema(True)),
    }
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.runs):
        for kind, (chunk, schema) in kinds.items():
            ids: dict = {}
            _arrow_batch(chunk, 7, 10, schema, ids)  # type: ignore[arg-type]
            rounds = 200 if kind.startswith("plain") else 5
            started = time.perf_counter()
            for _ in range(rounds):
                _arrow_batch(chunk, 7, 10, schema, ids)  # type: ignore[arg-type]
            times[kind].append((time.perf_counter() - started) / rounds)
    plain = statistics.median(times["plain, stamped"])
    for kind, samples in times.items():
        median = statistics.median(samples)
        extra = (median - plain) / n * 1e9
        print(f"{kind:22s} {median * 1e6:9.1f} µs/batch  {n / median / 1e6:7.2f} M rows/s"
              f"  {extra:+8.1f} ns/message over plain, stamped")


if __name__ == "__main__":
    main()
