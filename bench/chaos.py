"""Chaos on one host (slipstream.sim.real.chaos): publishers, subscribers and the driver killed with
SIGKILL at random points of a long run and replaced; checks every session message by message
and looks for leaks afterwards.

    .venv/bin/python -m bench.chaos [--seconds 300] [--kill-interval S] [--driver-kill-interval S]

Exit status 0 when nothing was lost, duplicated or reordered and nothing leaked.  Figures:
docs/RELIABILITY.md.
"""

from __future__ import annotations

import sys
import time

from bench.ipc_throughput import bench_parser, machine, positive_float, positive_int


def main() -> int:
    from slipstream.sim.real.chaos import run_chaos

    parser = bench_parser(__doc__)
    parser.add_argument("--seconds", type=positive_float, default=300.0)
    parser.add_argument("--publishers", type=positive_int, default=3)
    parser.add_argument("--subscribers", type=positive_int, default=2, help="per stream")
    parser.add_argument("--streams", type=positive_int, default=2)
    parser.add_argument("--kill-interval", type=positive_float, default=0.5,
                        help="mean seconds between kills of a publisher or subscriber")
    parser.add_argument("--driver-kill-interval", type=positive_float, default=10.0,
                        help="seconds between kills of the driver")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"# chaos, {machine()}, {time.strftime('%Y-%m-%d')}")
    print(f"# command: python -m bench.chaos --seconds {args.seconds:g} --kill-interval "
          f"{args.kill_interval:g} --driver-kill-interval {args.driver_kill_interval:g} "
          f"--seed {args.seed}")
    report = run_chaos(args.seconds, publishers=args.publishers, subscribers=args.subscribers,
                       streams=args.streams, kill_interval=args.kill_interval,
                       driver_kill_interval=args.driver_kill_interval, seed=args.seed)
    print(report.format_text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
