"""Print the per-window aggregates the Spark query publishes (stream 1002).

    .venv/bin/python examples/spark_pipeline/consumer.py [--dir DIR]
"""

from __future__ import annotations

import argparse
import json

from slipstream.client import Client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stream", type=int, default=1002, help="stream id")
    parser.add_argument("--dir", default=None, help="driver directory (default: the client's)")
    args = parser.parse_args()

    def show(data: memoryview, header) -> None:
        row = json.loads(bytes(data))
        print(f"{row['window_start']} .. {row['window_end'][11:]}  {row['sensor']:<9} "
              f"n={row['events']:<5} mean={row['mean']:6.2f} max={row['max']:6.2f}", flush=True)

    with Client.connect(args.dir) as client:
        subscription = client.add_subscription("aeron:ipc", args.stream)
        print(f"waiting for aggregates on aeron:ipc stream {args.stream}", flush=True)
        while True:
            subscription.receive(show, 100, timeout=1.0)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
