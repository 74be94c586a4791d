"""slipstream in containers against slipstream on the host, in the same run: IPC throughput and
round trip with the driver in one container and the clients in another (the loops of
bench.ipc_throughput and bench.ipc_latency, run inside the client container), the cold start
of a driver container until it accepts clients, and the image's size, on disk and compressed
as a registry would send it.

    sudo .venv/bin/python -m bench.containers [--image localhost/slipstream:latest]
        [--messages 2000000] [--repeat 3] [--rate 10000] [--seconds 5] [--starts 5]

Both sides use the drivers' defaults (64 MiB IPC terms: the driver container gets
``--shm-size=1g``).  The client container shares the driver container's /dev/shm
(``--ipc=container:``), runs as another uid with the driver's group, has no network, and runs
this checkout's ``bench/`` (mounted read-only) with the image's Python and slipstream; the
host's runs use this environment's.  Throughput is the best of ``--repeat`` runs of 32 B
messages, per-message offer and poll, publisher and subscriber pinned to the two CPUs; round
trips are paced at ``--rate`` a second for ``--seconds``.

Cold start: ``podman run`` of a driver container, ``--starts`` times, until the driver is ready
(its control socket and a heartbeat in its counters file, what ``MediaDriver``'s launcher
waits for: the driver directory is a directory of this host mounted at the same path, polled
every 10 ms), and until the first passing ``podman healthcheck run`` (a client connects: what
an orchestrator sees; each check is itself a process started in the container).  Needs root
and podman (``make image`` builds the image).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.ipc_throughput import machine, positive_float, positive_int, run_slipstream

ROOT = Path(__file__).resolve().parent.parent
#: Where the client container finds this checkout's bench package and the histogram library.
INSIDE = Path("/bench")
#: The application uid of the client container (the driver's group is its primary group).
APP_UID = 10002
#: The throughput runs' message size, bytes.
SIZE = 32
#: Polls of the cold start's in-process check, seconds apart.
POLL_S = 0.01


def _image_settings() -> dict[str, str]:
    settings = {}
    for line in (ROOT / "deploy" / "container" / "image.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings


def podman(*args: str, check: bool = True, timeout: float = 600) -> str:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: {result.stderr.strip()[-2000:]}")
    return result.stdout


# -- inside the client container -------------------------------------------------------------
def inside(args: argparse.Namespace) -> int:
    """The client container's part: one measurement against ``$SLIPSTREAM_DIR``, printed as
    one line of JSON."""
    directory = Path(os.environ["SLIPSTREAM_DIR"])
    if args.what == "throughput":
        rates = [run_slipstream(directory, SIZE, args.messages, False, 3001 + i)
                 for i in range(args.repeat)]
        print(json.dumps({"rates": rates}))
    else:
        from bench.ipc_latency import WARMUP, _run, _ss_pinger, _ss_ponger

        context = multiprocessing.get_context("spawn")
        idle_cpu = context.Value("d", -1.0)
        rounds = WARMUP + int(args.rate * args.seconds)
        histogram = _run(_ss_pinger, _ss_ponger, (str(directory), rounds, args.rate),
                         (str(directory), rounds, idle_cpu))
        print(json.dumps(_percentiles(histogram)))
    return 0


def _percentiles(histogram: Any) -> dict[str, int]:
    return {"p50": histogram.get_value_at_percentile(50),
            "p99": histogram.get_value_at_percentile(99),
            "p99.9": histogram.get_value_at_percentile(99.9),
            "count": histogram.get_total_count()}


# -- on the host -----------------------------------------------------------------------------
class Bench:
    """The containers of one run, all removed at :meth:`close`."""

    def __init__(self, image: str) -> None:
        self.image = image
        self.gid = _image_settings()["SLIPSTREAM_GID"]
        self.run_id = uuid.uuid4().hex[:8]
        self.names: list[str] = []
        self.scratch = Path(tempfile.mkdtemp(prefix="slipstream-bench-containers-",
                                             dir="/var/tmp"))
        self.scratch.chmod(0o755)
        # The histogram library (pure Python and one C extension for this Python version)
        # beside this checkout's bench package, for the image's Python.
        import hdrh
        import pyhdrh

        library = self.scratch / "lib"
        shutil.copytree(Path(hdrh.__file__).parent, library / "hdrh")
        shutil.copy(pyhdrh.__file__, library)
        shutil.copytree(ROOT / "bench", library / "bench",
                        ignore=shutil.ignore_patterns("__pycache__", "*.c"))
        for path in library.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        library.chmod(0o755)

    def name(self, role: str) -> str:
        name = f"slipstream-bench-{self.run_id}-{role}"
        self.names.append(name)
        return name

    def driver(self, role: str, *extra: str) -> str:
        name = self.name(role)
        podman("run", "--detach", "--name", name, "--ipc=shareable", "--shm-size=1g",
               "--network=none", "--stop-timeout=15", *extra, self.image)
        return name

    def wait_healthy(self, name: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while subprocess.run(["podman", "healthcheck", "run", name],
                             capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not healthy: {podman('logs', name, check=False)}")
            time.sleep(0.05)

    def client(self, driver: str, *command: str, timeout: float = 900) -> dict[str, Any]:
        """Run ``python -m bench.containers inside COMMAND`` in a client container beside
        ``driver``; its JSON line."""
        out = podman("run", "--rm", "--name", self.name("client"), f"--ipc=container:{driver}",
                     "--network=none", "--no-healthcheck", f"--user={APP_UID}:{self.gid}",
                     "--volume", f"{self.scratch / 'lib'}:{INSIDE}:ro",
                     "--env", f"PYTHONPATH={INSIDE}", "--env", "PYTHONDONTWRITEBYTECODE=1",
                     self.image, "python", "-m", "bench.containers", "inside", *command,
                     timeout=timeout)
        return json.loads(out.strip().splitlines()[-1])

    def cold_start(self) -> tuple[float, float]:
        """Seconds from ``podman run`` to the driver's readiness (its control socket and a
        heartbeat in its counters file: what ``MediaDriver``'s launcher waits for), and to the
        first passing health check."""
        from slipstream.client import control
        from slipstream.client.counters import CountersFile

        directory = Path("/dev/shm") / f"slipstream-bench-{uuid.uuid4().hex[:8]}"
        directory.mkdir(mode=0o750)
        os.chown(directory, int(_image_settings()["SLIPSTREAM_UID"]), int(self.gid))
        name = self.name(f"start-{directory.name[-8:]}")

        def ready() -> bool:
            if not (directory / control.CONDUCTOR_SOCKET).exists():
                return False
            try:
                counters = CountersFile(directory / control.COUNTERS_FILE, writable=False)
            except (OSError, ValueError):
                return False
            try:
                return counters.driver_heartbeat_ns > 0
            finally:
                counters.close()

        try:
            started = time.monotonic()
            subprocess.Popen(["podman", "run", "--detach", "--name", name, "--network=none",
                              "--volume", f"{directory}:{directory}",
                              "--env", f"SLIPSTREAM_DIR={directory}", self.image],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            while not ready():
                if time.monotonic() - started > 60:
                    raise RuntimeError(f"{name} did not start")
                time.sleep(POLL_S)
            accepting = time.monotonic() - started
            self.wait_healthy(name)
            healthy = time.monotonic() - started
        finally:
            podman("rm", "--force", "--time=15", name, check=False)
            shutil.rmtree(directory, ignore_errors=True)
        return accepting, healthy

    def close(self) -> None:
        for name in reversed(self.names):  # clients before the driver they depend on
            podman("rm", "--force", "--time=0", name, check=False)
        shutil.rmtree(self.scratch, ignore_errors=True)


def compressed_size(image: str) -> int:
    """Bytes of ``podman save`` of ``image`` (an OCI archive, layers as tar) through gzip -6:
    what a registry would transfer, as registries' listings give their images' sizes."""
    import zlib

    compressor = zlib.compressobj(6, zlib.DEFLATED, 31)  # 31: the gzip format
    size = 0
    with subprocess.Popen(["podman", "save", "--format", "oci-archive", image],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as save:
        assert save.stdout is not None
        while chunk := save.stdout.read(1 << 20):
            size += len(compressor.compress(chunk))
    if save.returncode != 0:
        raise RuntimeError(f"podman save {image} failed ({save.returncode})")
    return size + len(compressor.flush())


def _host_throughput(messages: int, repeat: int) -> list[float]:
    from slipstream.daemon.driver import MediaDriver

    directory = Path("/dev/shm") / f"slipstream-bench-{uuid.uuid4().hex[:8]}"
    try:
        with MediaDriver.launch(directory=directory) as driver:
            return [run_slipstream(driver.directory, SIZE, messages, False, 3001 + i)
                    for i in range(repeat)]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _host_latency(rate: int, seconds: float) -> dict[str, int]:
    from bench.ipc_latency import WARMUP, _run, _ss_pinger, _ss_ponger
    from slipstream.daemon.driver import MediaDriver

    directory = Path("/dev/shm") / f"slipstream-bench-{uuid.uuid4().hex[:8]}"
    context = multiprocessing.get_context("spawn")
    idle_cpu = context.Value("d", -1.0)
    rounds = WARMUP + int(rate * seconds)
    try:
        with MediaDriver.launch(directory=directory) as driver:
            histogram = _run(_ss_pinger, _ss_ponger, (str(driver.directory), rounds, rate),
                             (str(driver.directory), rounds, idle_cpu))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return _percentiles(histogram)


def _round_trip(label: str, figures: dict[str, int]) -> str:
    return (f"{label:<34} p50 {figures['p50']:>5} µs   p99 {figures['p99']:>5} µs   "
            f"p99.9 {figures['p99.9']:>6} µs   ({figures['count']} round trips)")


def host(args: argparse.Namespace) -> int:
    args.image = args.image or f"{_image_settings()['IMAGE']}:latest"
    if os.geteuid() != 0 or shutil.which("podman") is None:
        print("bench.containers: needs root and podman (make image)", file=sys.stderr)
        return 2
    if subprocess.run(["podman", "image", "exists", args.image]).returncode != 0:
        print(f"bench.containers: no image {args.image} (make image builds it)",
              file=sys.stderr)
        return 2
    print(f"# slipstream in containers vs on the host, {machine()}")
    print(f"# command: python -m bench.containers {' '.join(sys.argv[1:])}")
    print(f"# load average before: {os.getloadavg()[0]:.1f}")
    bench = Bench(args.image)
    try:
        host_rates = _host_throughput(args.messages, args.repeat)
        driver = bench.driver("driver")
        bench.wait_healthy(driver)
        container_rates = bench.client(driver, "throughput", "--messages", str(args.messages),
                                       "--repeat", str(args.repeat))["rates"]
        host_rtt = _host_latency(args.rate, args.seconds)
        container_rtt = bench.client(driver, "latency", "--rate", str(args.rate),
                                     "--seconds", str(args.seconds))
        starts = [bench.cold_start() for _ in range(args.starts)]
        size = int(podman("image", "inspect", "--format", "{{.Size}}", args.image).strip())
        compressed = compressed_size(args.image)
    finally:
        bench.close()
    best_host, best_container = max(host_rates), max(container_rates)
    print(f"IPC throughput, {SIZE} B, offer/poll (best of {args.repeat}):")
    print(f"  on the host                      {best_host / 1e6:6.2f} M msg/s   runs "
          f"{', '.join(f'{r / 1e6:.2f}' for r in host_rates)}")
    print(f"  driver and client in containers  {best_container / 1e6:6.2f} M msg/s   runs "
          f"{', '.join(f'{r / 1e6:.2f}' for r in container_rates)}")
    print(f"  containers / host                {best_container / best_host:6.2f}x")
    print(f"IPC round trip at {args.rate:,}/s for {args.seconds:g} s:")
    print("  " + _round_trip("on the host", host_rtt))
    print("  " + _round_trip("driver and client in containers", container_rtt))
    print(f"  containers / host                p50 {container_rtt['p50'] / host_rtt['p50']:.2f}x"
          f"   p99 {container_rtt['p99'] / host_rtt['p99']:.2f}x")
    readiness = [r for r, _ in starts]
    healthy = [h for _, h in starts]
    print(f"cold start of a driver container ({args.starts} starts), s: to the driver's "
          f"readiness median {statistics.median(readiness):.2f} (max {max(readiness):.2f}); "
          f"to a passing "
          f"health check median {statistics.median(healthy):.2f} (max {max(healthy):.2f}); "
          f"target <= 2 s")
    print(f"image size: {size / 1e6:.0f} MB on disk, {compressed / 1e6:.0f} MB compressed "
          f"(gzip -6 of podman save) ({args.image})")
    print(f"# load average after: {os.getloadavg()[0]:.1f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", help="the image (default: deploy/container/image.env's "
                                         "IMAGE, tagged latest: what make image built)")
    parser.add_argument("--messages", type=positive_int, default=2_000_000,
                        help="messages per throughput run")
    parser.add_argument("--repeat", type=positive_int, default=3, help="throughput runs")
    parser.add_argument("--rate", type=positive_int, default=10_000,
                        help="round trips per second")
    parser.add_argument("--seconds", type=positive_float, default=5.0,
                        help="measured round-trip duration")
    parser.add_argument("--starts", type=positive_int, default=5, help="cold starts")
    commands = parser.add_subparsers(dest="command")
    run_inside = commands.add_parser("inside", help="(run by the benchmark in its container)")
    run_inside.add_argument("what", choices=("throughput", "latency"))
    run_inside.add_argument("--messages", type=positive_int, default=2_000_000)
    run_inside.add_argument("--repeat", type=positive_int, default=3)
    run_inside.add_argument("--rate", type=positive_int, default=10_000)
    run_inside.add_argument("--seconds", type=positive_float, default=5.0)
    args = parser.parse_args()
    return inside(args) if args.command == "inside" else host(args)


if __name__ == "__main__":
    sys.exit(main())
