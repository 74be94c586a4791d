"""The floor under a parked publisher's resume (docs/BACKPRESSURE.md, "Why it waits as it
does"): one process waking another in plain C (bench/wake_floor.c, built with the system's cc
into a temporary directory), with nothing of slipstream in the way.

    .venv/bin/python -m bench.wake_floor [--trials T] [--samples N]

A publisher under ``policy=block`` that outlives its yield parks on a futex, and the driver's
conductor wakes it when it moves pub-lmt, then goes on with its cycle.  Each case wakes the
other process every 2 ms, N times, and reports the time from the waker's clock before the wake
to the wakee's clock after it; T trials each:

* the waker **busy** after the wake (as the conductor): the wakee must run on the other vCPU;
* the waker **sleeps** after the wake: unpinned, the wakee may run on the waker's vCPU at once
  (what a blocking ``recv`` between two processes usually sees: the sender goes back to sleep);
* **pinned apart** (waker on CPU 0, wakee on CPU 1): the other vCPU every time;
* the same through a **pipe** (the wake a socket or a pipe gives a blocking read), the peer.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.ipc_throughput import bench_parser, machine, positive_int

SOURCE = Path(__file__).with_name("wake_floor.c")

CASES = (  # (label, mechanism, waker cpu, wakee cpu, waker after the wake)
    ("futex, waker busy, not pinned (the conductor's case)", "futex", -1, -1, "busy"),
    ("futex, waker busy, pinned apart", "futex", 0, 1, "busy"),
    ("futex, waker sleeps, pinned apart", "futex", 0, 1, "sleeps"),
    ("futex, waker sleeps, not pinned", "futex", -1, -1, "sleeps"),
    ("pipe, waker busy, not pinned", "pipe", -1, -1, "busy"),
    ("pipe, waker sleeps, not pinned", "pipe", -1, -1, "sleeps"),
)


def build(directory: Path) -> Path:
    """Compile wake_floor.c; raises if there is no C compiler (a fresh machine has gcc)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("bench.wake_floor needs a C compiler (cc or gcc)")
    binary = directory / "wake_floor"
    subprocess.run([compiler, "-O2", "-o", str(binary), str(SOURCE)], check=True)
    return binary


def run_case(binary: Path, mechanism: str, waker_cpu: int, wakee_cpu: int, waker: str,
             samples: int) -> tuple[float, float, float]:
    """One trial: (p50, p99, p99.9) in µs."""
    pinned = max(waker_cpu, wakee_cpu)
    if pinned >= (os.cpu_count() or 1):
        raise SystemExit(f"pinning to CPU {pinned} needs {pinned + 1} CPUs")
    out = subprocess.run([str(binary), mechanism, str(waker_cpu), str(wakee_cpu), waker,
                          str(samples), "2000"], check=True, capture_output=True, text=True,
                         timeout=60 + samples * 0.01).stdout
    p50, p99, p999 = (int(v) / 1000 for v in out.split())
    return p50, p99, p999


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--trials", type=positive_int, default=3)
    parser.add_argument("--samples", type=positive_int, default=2000)
    args = parser.parse_args()
    print(f"# {machine()}")
    print(f"# {args.samples} wakes 2 ms apart per trial, {args.trials} trials; µs, median of "
          "the trials [lowest-highest]")
    with tempfile.TemporaryDirectory(prefix="slipstream-wake-floor-") as directory:
        binary = build(Path(directory))
        print(f"{'case':<56} {'p50':>16} {'p99':>18} {'p99.9':>20}")
        for label, mechanism, waker_cpu, wakee_cpu, waker in CASES:
            trials = [run_case(binary, mechanism, waker_cpu, wakee_cpu, waker, args.samples)
                      for _ in range(args.trials)]
            cells = []
            for column in zip(*trials, strict=True):
                cells.append(f"{statistics.median(column):.1f} "
                             f"[{min(column):.1f}-{max(column):.1f}]")
            print(f"{label:<56} {cells[0]:>16} {cells[1]:>18} {cells[2]:>20}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
