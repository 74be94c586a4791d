"""Publish JSON sensor events into slipstream (stream 1001), at a steady rate.

    .venv/bin/python examples/spark_pipeline/producer.py [--rate 2000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from slipstream.client import ADMIN_ACTION, BACK_PRESSURED, NOT_CONNECTED, Client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=int, default=2000, help="events per second")
    parser.add_argument("--stream", type=int, default=1001, help="stream id")
    parser.add_argument("--dir", default=None, help="driver directory (default: the client's)")
    args = parser.parse_args()
    sensors = [f"sensor-{i}" for i in range(8)]
    with Client.connect(args.dir) as client:
        publication = client.add_publication("aeron:ipc", args.stream)
        print(f"publishing {args.rate} events/s to aeron:ipc stream {args.stream}", flush=True)
        sent = waited = 0
        started = time.monotonic()
        while True:
            due = int((time.monotonic() - started) * args.rate)
            while sent < due:
                event = {"ts": int(time.time() * 1000), "sensor": random.choice(sensors),
                         "value": round(random.gauss(20.0, 5.0), 2)}
                result = publication.offer(json.dumps(event).encode())
                if result == NOT_CONNECTED:
                    if not waited:
                        print("no subscriber yet: waiting for the Spark query", flush=True)
                    waited += 1
                    time.sleep(0.1)
                    started = time.monotonic() - sent / args.rate
                    continue
                if result in (BACK_PRESSURED, ADMIN_ACTION):
                    time.sleep(0.001)  # the query holds credit until it commits: wait
                    continue
                if result < 0:
                    raise SystemExit(f"offer failed: {result}")
                sent += 1
                if sent % (args.rate * 5) == 0:
                    print(f"{sent} events published (position {result})", flush=True)
            time.sleep(0.005)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
