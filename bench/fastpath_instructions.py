"""Instructions per message of the client's hot paths, counted by callgrind: a figure that the
machine's load does not move, so two builds compare in one sitting on a busy machine.

    .venv/bin/python -m bench.fastpath_instructions [--python PYTHON ...] [--repeat R]

For each interpreter given (default: this one; each imports the slipstream its environment
has, so ``--python old/.venv/bin/python --python .venv/bin/python`` compares two checkouts),
alternating between them R times, JOBS at once, one process under ``valgrind
--tool=callgrind`` connects to a driver (started here, not counted) and, after a warm-up, runs
one of the paths over N1 and then over N2 messages of 32 bytes on an IPC stream; the
per-message figure is the difference of the two runs' instruction totals over N2 - N1, so
start-up and set-up cancel out:

* offer: ``publication.offer(message)``, one call per message;
* batch: ``offer_batch`` of 256 messages a call;
* poll: ``subscription.poll(handler, 256)`` with a handler that does nothing (the call into
  Python is the whole of its cost), less batch's figure (the messages it reads are appended
  by offer_batch in the same run);
* controlled: ``controlled_poll`` likewise;
* gathered: ``image.poll_gathered(4096)`` (the Spark source's read), less batch's figure.

Needs valgrind (Debian's package).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

PATHS = ("offer", "batch", "poll", "controlled", "gathered")
#: The paths whose runs append with offer_batch first: batch's figure is taken off theirs.
READS = ("poll", "controlled", "gathered")
CHANNEL = "aeron:ipc?term-length=64m"  # no rotation, and a window past N2 + the warm-up
STREAM_ID = 4711
SIZE = 32
BATCH = 256
WARM_UP = 2048


def run_path(directory: str, path: str, count: int) -> None:
    """In the measured process: the warm-up, then ``path`` over ``count`` messages."""
    from slipstream.client import Client, ControlledPollAction

    with Client.connect(directory) as client:
        publication = client.add_publication(CHANNEL, STREAM_ID)
        subscription = client.add_subscription(CHANNEL, STREAM_ID)
        while not (publication.is_connected and subscription.images):
            time.sleep(0.001)
        message = bytes(SIZE)
        data = bytes(SIZE * BATCH)
        lengths = array("i", [SIZE] * BATCH)
        go_on = ControlledPollAction.CONTINUE

        def nothing(data: object, header: object) -> None:
            return None

        def going_on(data: object, header: object) -> object:
            return go_on

        def append(n: int) -> None:
            for _ in range(n // BATCH):
                assert publication.offer_batch(data, lengths) == BATCH

        def step(n: int) -> None:
            if path == "offer":
                offer = publication.offer
                for _ in range(n):
                    assert offer(message) > 0
            elif path == "batch":
                append(n)
            elif path == "poll":
                append(n)
                read = 0
                while read < n:
                    read += subscription.poll(nothing, BATCH)
            elif path == "controlled":
                append(n)
                read = 0
                while read < n:
                    read += subscription.controlled_poll(going_on, BATCH)
            else:
                append(n)
                image = subscription.images[0]
                read = 0
                while read < n:
                    chunk = image.poll_gathered(4096)
                    read += 0 if chunk is None else len(chunk)

        step(WARM_UP)
        step(count)


def callgrind_total(python: str, directory: str, path: str, count: int) -> int:
    """The instructions one process running ``path`` over ``count`` messages executed."""
    with tempfile.TemporaryDirectory(prefix="slipstream-callgrind-") as scratch:
        out = Path(scratch) / "callgrind.out"
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                        python, __file__, "--measured", directory, path, str(count)],
                       check=True, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, cwd=scratch)
        for line in out.read_text().splitlines():
            found = re.match(r"(?:totals|summary):\s+(\d+)", line)
            if found:
                return int(found.group(1))
    raise RuntimeError(f"no totals in callgrind's output for {python} {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", help="an interpreter (repeatable)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2, help="callgrind runs at once")
    parser.add_argument("--messages", default="25600,76800", help="N1,N2 (multiples of 256)")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--measured", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measured:
        directory, path, count = args.measured
        run_path(directory, path, int(count))
        return 0
    if shutil.which("valgrind") is None:
        raise SystemExit("fastpath_instructions: valgrind is missing (apt-get install valgrind)")
    from slipstream.daemon.driver import MediaDriver

    pythons = args.python or [sys.executable]
    first, second = (int(n) for n in args.messages.split(","))
    paths = args.paths.split(",")
    figures: dict[tuple[str, str], list[float]] = {}
    directory = Path("/dev/shm") / f"slipstream-callgrind-{os.getpid()}"
    def measure(python: str, path: str) -> None:
        low = callgrind_total(python, str(directory), path, first)
        high = callgrind_total(python, str(directory), path, second)
        figure = (high - low) / (second - first)
        figures.setdefault((python, path), []).append(figure)
        print(f"{python} {path}: {figure:.1f} instructions/message", flush=True)

    # The counts do not depend on the machine's load: the runs may share the cores.
    try:
        with MediaDriver.launch(directory=directory), \
                concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            runs = [pool.submit(measure, python, path) for _ in range(args.repeat)
                    for path in paths for python in pythons]
            for run in runs:
                run.result()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print("\nbest of each (reads less batch's figure):")
    for python in pythons:
        best = {path: min(figures[(python, path)]) for path in paths}
        shown = {path: best[path] - best["batch"] if path in READS and "batch" in best
                 else best[path] for path in paths}
        print(python + ": " + ", ".join(f"{p} {v:.1f}" for p, v in shown.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
