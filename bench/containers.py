"""slipstream in containers against slipstream on the host, in the same run: IPC throughput and
round trip with the driver in one container and the clients in another (the loops of
bench.ipc_throughput and bench.ipc_latency), the cold start of a driver container until it
accepts clients, and the image's size, on disk and compressed as a registry would send it.

    sudo .venv/bin/python -m bench.containers [--image localhost/slipstream:latest]
        [--pairs 8] [--messages 2000000] [--rate 10000] [--seconds 3] [--starts 5]

"The same on the host" is the same program without the containers: both sides run the
image's own files (its Python, Debian's 3.11.2, its slipstream wheel and libraries) and this
checkout's ``bench/`` with the histogram library.  On the host they run from the image's
root file system (a container's, ``podman mount``, never started) by ``chroot``, as the same
users (the driver's uid, the application's uid with the driver's group), with the host's
/dev, /proc and /dev/shm: no namespaces but a private mount table (``unshare --mount``, for
those mounts alone), no seccomp filter, no cgroup of their own.  In containers: the driver
container (``--shm-size=1g``, no network) and a client container sharing its /dev/shm
(``--ipc=container:``).  The only difference is the containers.

Each measurement is one run in a fresh client process, host and containers interleaved in
``--pairs`` pairs (ABBA: host first in even pairs, containers first in odd ones, so drift over
the run falls on both alike); the figure is the median of the per-pair ratios (containers /
host) with their range.  Throughput: 32 B messages, per-message offer and poll, publisher and
subscriber pinned to the two CPUs; round trips paced at ``--rate`` a second for ``--seconds``.
Both drivers run throughout with their defaults (64 MiB IPC terms).

Cold start: ``podman run`` of a driver container, ``--starts`` times, until the driver is ready
(its control socket and a heartbeat in its counters file, what ``MediaDriver``'s launcher
waits for: the driver directory is a directory of this host mounted at the same path, polled
every 10 ms), and until the first passing ``podman healthcheck run`` (a client connects: what
an orchestrator sees; each check is itself a process started in the container).  Needs root,
podman and util-linux's unshare (``make image`` builds the image).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.ipc_throughput import (
    bench_parser,
    positive_float,
    positive_int,
    print_header,
    run_slipstream,
)

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
    if args.what == "version":
        import slipstream.client

        print(json.dumps({"python": f"{platform.python_version()} {sys.executable} "
                                    f"{Path(slipstream.client.__file__).parent}"}))
    elif args.what == "throughput":
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
    """The drivers and clients of one run, on the host and in containers; all removed (the
    host's driver stopped) at :meth:`close`."""

    def __init__(self, image: str, options: list[str]) -> None:
        self.image = image
        #: More ``podman run`` options for the measurements' driver and client containers.
        self.options = options
        settings = _image_settings()
        self.uid, self.gid = settings["SLIPSTREAM_UID"], settings["SLIPSTREAM_GID"]
        self.run_id = uuid.uuid4().hex[:8]
        self.names: list[str] = []
        self.host_driver: subprocess.Popen[bytes] | None = None
        self.host_directory = Path("/dev/shm") / f"slipstream-bench-host-{self.run_id}"
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
        # The image's root file system for the host's runs: a container's, never started.
        self.root_container = self.name("root")
        podman("create", "--name", self.root_container, self.image)
        self.root = Path(podman("mount", self.root_container).strip())
        for folder in ("dev", "proc", INSIDE.name):
            (self.root / folder).mkdir(exist_ok=True)
        shutil.copytree(library, self.root / INSIDE.name, dirs_exist_ok=True)
        self.environment = dict(_image_environment(self.image), PYTHONPATH=str(INSIDE),
                                PYTHONDONTWRITEBYTECODE="1")

    def name(self, role: str) -> str:
        name = f"slipstream-bench-{self.run_id}-{role}"
        self.names.append(name)
        return name

    # -- on the host, the image's files --------------------------------------------------------
    def _chrooted(self, uid: str, gid: str, *command: str) -> list[str]:
        """``command`` run from the image's root as ``uid:gid``, with the host's /dev (and
        /dev/shm) and /proc mounted in a mount table of its own."""
        root = shlex.quote(str(self.root))
        script = (f"mount --rbind /dev {root}/dev && mount -t proc proc {root}/proc && "
                  f"exec chroot --userspec={uid}:{gid} {root} \"$@\"")
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                "env", "-i", *(f"{k}={v}" for k, v in self.environment.items()), *command]

    def start_host_driver(self) -> None:
        self.host_driver = subprocess.Popen(
            self._chrooted(self.uid, self.gid, "/opt/slipstream/bin/slipstream", "driver",
                           "--config", "/etc/slipstream/driver.toml",
                           "--dir", str(self.host_directory)),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while subprocess.run(self._chrooted(str(APP_UID), self.gid, "slipstream-healthcheck",
                                            "--dir", str(self.host_directory)),
                             capture_output=True).returncode != 0:
            if self.host_driver.poll() is not None or time.monotonic() > deadline:
                error = self.host_driver.stderr.read().decode() if self.host_driver.stderr \
                    else ""
                raise RuntimeError(f"the host's driver did not start: {error[-2000:]}")
            time.sleep(0.05)

    def host_client(self, *command: str, timeout: float = 900) -> dict[str, Any]:
        """``python -m bench.containers inside COMMAND`` on the host, from the image's root,
        as the application's uid against the host's driver; its JSON line."""
        result = subprocess.run(
            self._chrooted(str(APP_UID), self.gid, "env",
                           f"SLIPSTREAM_DIR={self.host_directory}", "/opt/slipstream/bin/python",
                           "-m", "bench.containers", "inside", *command),
            capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"the host's client failed: {result.stderr[-2000:]}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    # -- in containers -------------------------------------------------------------------------
    def driver(self, role: str, *extra: str) -> str:
        name = self.name(role)
        podman("run", "--detach", "--name", name, "--ipc=shareable", "--shm-size=1g",
               "--network=none", "--stop-timeout=15", *self.options, *extra, self.image)
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
                     *self.options, self.image, "python", "-m", "bench.containers", "inside",
                     *command,
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
        os.chown(directory, int(self.uid), int(self.gid))
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
        if self.host_driver is not None and self.host_driver.poll() is None:
            self.host_driver.terminate()  # it drains, then exits
            try:
                self.host_driver.wait(20)
            except subprocess.TimeoutExpired:
                self.host_driver.kill()
                self.host_driver.wait()
        shutil.rmtree(self.host_directory, ignore_errors=True)
        podman("umount", self.root_container, check=False)
        for name in reversed(self.names):  # clients before the driver they depend on
            podman("rm", "--force", "--time=0", name, check=False)
        shutil.rmtree(self.scratch, ignore_errors=True)


def _image_environment(image: str) -> dict[str, str]:
    """The image's ENV (PATH, SLIPSTREAM_DIR, SLIPSTREAM_CLIENT_GROUP), for the host's runs."""
    inspected = json.loads(podman("image", "inspect", image))[0]
    return dict(item.split("=", 1) for item in inspected["Config"].get("Env") or [])


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


def _round_trip(label: str, figures: dict[str, int]) -> str:
    return (f"{label:<34} p50 {figures['p50']:>5} µs   p99 {figures['p99']:>5} µs   "
            f"p99.9 {figures['p99.9']:>6} µs")


def _spread(ratios: list[float], target: str) -> str:
    """The median of the per-pair ratios, their interquartile range and their range."""
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return (f"{statistics.median(ratios):.2f}x (middle half {low:.2f}-{high:.2f}, all "
            f"{min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} pairs; target {target})")


def _median_figures(runs: list[dict[str, int]]) -> dict[str, int]:
    return {key: int(statistics.median(run[key] for run in runs))
            for key in ("p50", "p99", "p99.9")}


def host(args: argparse.Namespace) -> int:
    args.image = args.image or f"{_image_settings()['IMAGE']}:latest"
    missing = [tool for tool in ("podman", "unshare", "chroot") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        print(f"bench.containers: needs root, podman, unshare and chroot (missing: "
              f"{', '.join(missing) or 'root'}; make image)", file=sys.stderr)
        return 2
    if subprocess.run(["podman", "image", "exists", args.image]).returncode != 0:
        print(f"bench.containers: no image {args.image} (make image builds it)",
              file=sys.stderr)
        return 2
    print_header("slipstream in containers vs on the host", "bench.containers")
    print(f"# load average before: {os.getloadavg()[0]:.1f}")
    throughput = ("throughput", "--messages", str(args.messages))
    latency = ("latency", "--rate", str(args.rate), "--seconds", str(args.seconds))
    rates: dict[str, list[float]] = {"host": [], "containers": []}
    trips: dict[str, list[dict[str, int]]] = {"host": [], "containers": []}
    bench = Bench(args.image, args.podman_option)
    try:
        bench.start_host_driver()
        driver = bench.driver("driver")
        bench.wait_healthy(driver)
        python = bench.host_client("version")["python"]
        assert python == bench.client(driver, "version")["python"], "not the same Python"
        print(f"# both sides: the image's Python {python}, its slipstream, this bench/")
        sides = {"host": bench.host_client,
                 "containers": lambda *command: bench.client(driver, *command)}
        for pair in range(args.pairs):
            order = ("host", "containers") if pair % 2 == 0 else ("containers", "host")
            for side in order:
                rates[side].append(sides[side](*throughput)["rates"][0])
            for side in order:
                trips[side].append(sides[side](*latency))
            print(f"# pair {pair + 1}: throughput host {rates['host'][-1] / 1e6:.2f}, "
                  f"containers {rates['containers'][-1] / 1e6:.2f} M msg/s; round trip p99 "
                  f"host {trips['host'][-1]['p99']}, containers "
                  f"{trips['containers'][-1]['p99']} µs", flush=True)
        starts = [bench.cold_start() for _ in range(args.starts)]
        size = int(podman("image", "inspect", "--format", "{{.Size}}", args.image).strip())
        compressed = compressed_size(args.image)
    finally:
        bench.close()
    print(f"IPC throughput, {SIZE} B, offer/poll ({args.messages:,} messages a run, medians):")
    for side, label in (("host", "on the host"), ("containers", "driver and client in "
                                                                "containers")):
        runs = rates[side]
        print(f"  {label:<34} {statistics.median(runs) / 1e6:6.2f} M msg/s   runs "
              f"{min(runs) / 1e6:.2f}-{max(runs) / 1e6:.2f}")
    print("  containers / host                " + _spread(
        [c / h for c, h in zip(rates["containers"], rates["host"], strict=True)], ">= 0.95x"))
    print(f"IPC round trip at {args.rate:,}/s for {args.seconds:g} s (medians of the runs):")
    print("  " + _round_trip("on the host", _median_figures(trips["host"])))
    print("  " + _round_trip("driver and client in containers",
                             _median_figures(trips["containers"])))
    for key in ("p50", "p99"):  # a time: lower is better, so 0.95x the host's is 1/0.95 here
        print(f"  containers / host {key:<14} " + _spread(
            [c[key] / h[key] for c, h in zip(trips["containers"], trips["host"],
                                             strict=True)], "<= 1.05x"))
    readiness = [r for r, _ in starts]
    healthy = [h for _, h in starts]
    print(f"cold start of a driver container ({args.starts} starts), s: to the driver's "
          f"readiness median {statistics.median(readiness):.2f} (max {max(readiness):.2f}); "
          f"to a passing "
          f"health check median {statistics.median(healthy):.2f} (max {max(healthy):.2f}); "
          f"target <= 2 s")
    print(f"image size: {size / 1e6:.1f} MB on disk, {compressed / 1e6:.1f} MB compressed "
          f"(gzip -6 of podman save) ({args.image})")
    print(f"# load average after: {os.getloadavg()[0]:.1f}")
    return 0


def main() -> int:
    parser = bench_parser(__doc__,
                          messages=(2_000_000, "messages per throughput run"),
                          rate=(10_000, "round trips per second"),
                          seconds=(3.0, "measured round-trip duration of a run"))
    parser.add_argument("--image", help="the image (default: deploy/container/image.env's "
                                         "IMAGE, tagged latest: what make image built)")
    parser.add_argument("--pairs", type=positive_int, default=8,
                        help="host and container runs of each measurement, interleaved "
                             "(at least 2: the ratios' spread)")
    parser.add_argument("--starts", type=positive_int, default=5, help="cold starts")
    parser.add_argument("--podman-option", action="append", default=[], metavar="OPTION",
                        help="another `podman run` option of the measurements' driver and "
                             "client containers, e.g. --podman-option=--security-opt="
                             "seccomp=unconfined (what costs what); repeatable")
    commands = parser.add_subparsers(dest="command")
    run_inside = commands.add_parser("inside", help="(run by the benchmark: one measurement)")
    run_inside.add_argument("what", choices=("version", "throughput", "latency"))
    run_inside.add_argument("--messages", type=positive_int, default=2_000_000)
    run_inside.add_argument("--repeat", type=positive_int, default=1)
    run_inside.add_argument("--rate", type=positive_int, default=10_000)
    run_inside.add_argument("--seconds", type=positive_float, default=3.0)
    args = parser.parse_args()
    if args.pairs < 2:
        parser.error(f"--pairs {args.pairs}: at least 2, for the spread of the ratios")
    return inside(args) if args.command == "inside" else host(args)


if __name__ == "__main__":
    sys.exit(main())
