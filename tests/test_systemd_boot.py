"""The unit under a real systemd: the README's service section, run as root in a container
booted from this machine's own root file system, starts the driver, serves clients of an
application user over IPC and UDP, answers a stuck driver with the watchdog and a crashed one
with a restart, drains on ``systemctl stop``, and keeps its exposure low while it runs.

How the container is made (measured on these machines: boots in about 5 s, without changing the
machine): systemd never runs on the machine's own root.  In a mount namespace of its own, a
tmpfs takes an overlay of ``/`` (every write, whiteouts included, lands in memory), and
``systemd-nspawn --boot`` starts that root's systemd in it, with a network namespace of its own
(only ``lo``: the container's daemons and the driver's ports do not meet the machine's).  The
install reaches PyPI from the machine's network, and pip's cache is the machine's, read through
the overlay.  nspawn's runtime files go to a tmpfs over ``/run/systemd`` in that namespace,
and its cgroups into one made for the test and removed after.  The mounts exist only in the
namespace, so they go with its last process: at the end (the container is powered off, or
killed), also when the test fails, is interrupted, or pytest itself is killed (the processes
carry a parent-death signal; only the test's empty cgroup is left then, which a later run
removes once it is an hour old).

What is tested is what a user clones: the committed ``HEAD`` of this checkout.  Uncommitted
changes are not in it (a warning names them); ``SLIPSTREAM_BOOT_SOURCE=worktree`` copies the
working tree (tracked and untracked files, as ``git status`` sees them) over the clone, to test
them before committing.

The clients run as :data:`CLIENT_USER`, an application user in the group the unit serves.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import lacking

# The boot, the install (it compiles C) and the watchdog's 10 s: minutes on 2 busy cores.
pytestmark = pytest.mark.timeout(900)

CHECKOUT = Path(__file__).resolve().parent.parent
CHECKOUT_INSIDE = "/srv/slipstream-checkout"
README = CHECKOUT / "README.md"
UNIT = "slipstream-driver.service"
PREFIX = "/opt/slipstream"
PYTHON = f"{PREFIX}/.venv/bin/python"
DIRECTORY = "/dev/shm/slipstream"
#: The application user of the README (``usermod -aG slipstream APPUSER``).
APP_USER = "app"
#: Who runs the clients: the application user, a member of the group the unit's
#: SLIPSTREAM_CLIENT_GROUP names (a driver without client_group served only its own user,
#: slipstream).
CLIENT_USER = APP_USER
#: A host name with an IPv4 and an IPv6 address (added to the container's /etc/hosts): glibc
#: sorts its answers with the host's addresses, asked of netlink, which the unit refuses.
DUAL_NAME = "slipstream-dual"
SOURCE = os.environ.get("SLIPSTREAM_BOOT_SOURCE", "head")
BOOT_TIMEOUT_S = 90.0
#: An operator's root shell, with the first python3 on PATH the one running this test when it
#: is under a home directory (pyenv), as on the machine this was written on.
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOMES = ("/root/", "/home/", "/run/user/")
_NETWORK_VARIABLES = frozenset({"http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY",
                                "HTTPS_PROXY", "NO_PROXY", "SSL_CERT_FILE", "SSL_CERT_DIR",
                                "REQUESTS_CA_BUNDLE"})


def _home_python_dir() -> str | None:
    """The bin folder of this test's base interpreter, if it lives under a home directory."""
    base = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    return str(base.parent) if str(base).startswith(HOMES) else None


# -- the container ---------------------------------------------------------------------------

#: Run by ``unshare --mount --propagation private``: mounts in the namespace alone, then nspawn.
#: The cgroup files to join come last in its arguments.  The checkout is bound in read-only at
#: :data:`CHECKOUT_INSIDE` (the container has a /tmp of its own, where a checkout may be).
#: Its parent's death (the test's) or a SIGTERM kills the container: its init, which outlives
#: a killed nspawn otherwise, and with it every process of its pid namespace.  The
#: container's basic.target is enough for the service (no multi-user daemons of the machine:
#: they are not the test's, and cost time).  Its network is lo alone, so there is nothing to
#: wait for to be online: the wait-online services are masked, or the unit's
#: After=network-online.target would wait for their timeout (2 minutes for
#: systemd-networkd's, whose daemon basic.target does not start).
_WRAPPER = r"""
set -euo pipefail
top=$1 name=$2 checkout=$3; shift 3
for procs in "$@"; do echo $$ > "$procs"; done
mount -t tmpfs -o size=6g,mode=0700 slipstream-boot "$top"
mkdir "$top/upper" "$top/work" "$top/root"
mount -t overlay slipstream-boot -o "lowerdir=/,upperdir=$top/upper,workdir=$top/work" "$top/root"
rm -f "$top/root/etc/machine-id"
for wait in systemd-networkd-wait-online NetworkManager-wait-online; do
    ln -sfn /dev/null "$top/root/etc/systemd/system/$wait.service"
done
if [ -d /run/systemd ]; then run=/run/systemd; else run=/run; fi
mount -t tmpfs -o mode=0755 slipstream-boot "$run"
setpriv --pdeathsig KILL systemd-nspawn -D "$top/root" --machine="$name" --boot \
    --console=pipe --register=no --link-journal=no --keep-unit --private-network \
    --bind-ro="$checkout:/srv/slipstream-checkout" -- --unit=basic.target &
nspawn=$!
kill_container() {
    kill -KILL $(pgrep -P "$nspawn" -x systemd) "$nspawn" 2>/dev/null || true
}
trap 'kill_container; exit 143' TERM INT HUP
echo "nspawn $nspawn"
code=0
wait "$nspawn" || code=$?
umount "$run" "$top/root" "$top" || true
echo "nspawn exited $code"
"""


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (mounts, systemd-nspawn)"
    for tool, package in (("systemd-nspawn", "systemd-container"), ("unshare", "util-linux"),
                          ("nsenter", "util-linux"), ("setpriv", "util-linux"),
                          ("git", "git"), ("make", "make")):
        if shutil.which(tool) is None:
            return (f"{tool} is missing (Debian package {package}; make test installs "
                    f"systemd-container: scripts/ensure-tools)")
    if "\toverlay\n" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlay file system"
    if not Path("/usr/lib/systemd/systemd").exists():
        return "this machine's root has no systemd to boot"
    if not _cgroup_roots():
        return "no cgroup hierarchy for systemd (cgroup2 or name=systemd) is mounted"
    return None


def _cgroup_roots() -> list[Path]:
    """This process's cgroups in the hierarchies nspawn uses: the unified one (cgroup2) and
    the named v1 one of systemd, where mounted."""
    mounts: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _source, options = right.split(" ")[:3]
        mount_point = Path(left.split(" ")[4])
        if fstype == "cgroup2":
            mounts.setdefault("", mount_point)
        elif fstype == "cgroup" and "name=systemd" in options.split(","):
            mounts.setdefault("name=systemd", mount_point)
    roots = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers in mounts:
            roots.append(mounts[controllers] / path.lstrip("/"))
    return roots


def _remove_cgroup(path: Path) -> None:
    """Remove a cgroup and its children, deepest first (each must be empty of processes)."""
    if not path.is_dir():
        return
    for child in sorted((p for p in path.rglob("*") if p.is_dir()),
                        key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            child.rmdir()
    path.rmdir()


class Container:
    """A systemd booted by nspawn over a throw-away overlay of ``/`` (module docstring)."""

    def __init__(self, scratch: Path) -> None:
        self.name = f"slipstream-boot-{uuid.uuid4().hex[:8]}"
        self.scratch = scratch
        self.cgroups = [root / self.name for root in _cgroup_roots()]
        self.console: deque[str] = deque(maxlen=200)
        self.wrapper: subprocess.Popen[str] | None = None
        self.nspawn_pid: int | None = None
        self.init_pid: int | None = None
        self._reader: threading.Thread | None = None
        # Of the README's install (the host fixture).
        self.install_path = ROOT_PATH
        self.install_s = 0.0
        self.tested = ""

    # -- start and stop

    def boot(self) -> None:
        self._remove_stale_cgroups()
        for cgroup in self.cgroups:
            cgroup.mkdir()
        self.wrapper = subprocess.Popen(
            ["setpriv", "--pdeathsig", "TERM", "unshare", "--mount", "--propagation", "private",
             "bash", "-c", _WRAPPER, "wrapper", str(self.scratch), self.name, str(CHECKOUT),
             *(str(c / "cgroup.procs") for c in self.cgroups)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace", start_new_session=True)
        self._reader = threading.Thread(target=self._read_console, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while self.init_pid is None:
            if self.wrapper.poll() is not None or time.monotonic() > deadline:
                self._cannot_boot("nspawn did not start the container's systemd")
            if self.nspawn_pid is not None:
                found = subprocess.run(["pgrep", "-P", str(self.nspawn_pid), "-x", "systemd"],
                                       capture_output=True, text=True).stdout.split()
                self.init_pid = int(found[0]) if found else None
            time.sleep(0.1)
        state = ""
        while state not in ("running", "degraded"):  # degraded: firstboot fails, and that is all
            if self.wrapper.poll() is not None or time.monotonic() > deadline:
                self._cannot_boot(f"the container's systemd did not finish booting ({state!r})")
            try:
                state = self.run("systemctl is-system-running --wait", check=False,
                                 timeout=max(1.0, deadline - time.monotonic())).stdout.strip()
            except subprocess.TimeoutExpired:
                continue
            if state not in ("running", "degraded"):
                time.sleep(0.2)  # "Failed to connect to bus" while it is starting

    def _cannot_boot(self, what: str) -> None:
        tail = "\n".join(list(self.console)[-30:])
        self.remove()
        lacking(f"this machine cannot boot a systemd container: {what}; console:\n{tail}")

    def _read_console(self) -> None:
        assert self.wrapper is not None and self.wrapper.stdout is not None
        for line in self.wrapper.stdout:
            self.console.append(line.rstrip("\n"))
            if line.startswith("nspawn ") and self.nspawn_pid is None:
                with contextlib.suppress(ValueError):
                    self.nspawn_pid = int(line.split()[1])

    def remove(self) -> None:
        """Power off (or kill) the container; its mounts go with the namespace; remove the
        cgroups.  Safe to call at any stage, and again."""
        wrapper, self.wrapper = self.wrapper, None
        if wrapper is not None:
            if self.init_pid is not None and wrapper.poll() is None:
                with contextlib.suppress(subprocess.SubprocessError):
                    self._nsenter(["systemctl", "poweroff"], timeout=10)
            try:
                wrapper.wait(30)
            except subprocess.TimeoutExpired:
                wrapper.terminate()  # it kills the container
                try:
                    wrapper.wait(10)
                except subprocess.TimeoutExpired:
                    wrapper.kill()
                    wrapper.wait(10)
            if self._reader is not None:
                self._reader.join(10)
        # Whatever is left in the container's cgroups (nothing, unless the above failed).
        deadline = time.monotonic() + 10
        for cgroup in self.cgroups:
            while True:
                for procs in cgroup.rglob("cgroup.procs"):
                    for pid in procs.read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
                try:
                    _remove_cgroup(cgroup)
                    break
                except OSError:  # its last processes are still leaving
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)

    def _remove_stale_cgroups(self) -> None:
        """Empty cgroups of earlier runs whose pytest was killed (nothing else removes them);
        an hour old, so never one of a run in progress."""
        for root in _cgroup_roots():
            for stale in root.glob("slipstream-boot-*"):
                with contextlib.suppress(OSError):
                    if time.time() - stale.stat().st_mtime > 3600:
                        _remove_cgroup(stale)

    # -- commands inside

    def _nsenter(self, argv: list[str], *, host_network: bool = False, **kwargs):
        namespaces = ["-m", "-u", "-i", "-p", "-C"] + ([] if host_network else ["-n"])
        return subprocess.run(["nsenter", "-t", str(self.init_pid), *namespaces, "--", *argv],
                              capture_output=True, text=True, errors="replace", **kwargs)

    def _env(self, path: str = ROOT_PATH, *, network: bool = False) -> list[str]:
        """An operator's root environment; what reaches PyPI from this machine (proxies, pip's
        settings, CA bundles) too when the command uses the machine's network."""
        passed = [f"{key}={value}" for key, value in os.environ.items()
                  if network and (key.startswith("PIP_") or key in _NETWORK_VARIABLES)]
        return ["env", "-i", f"PATH={path}", "HOME=/root", "LANG=C.UTF-8", "TERM=dumb",
                *passed]

    def run(self, script: str, *, check: bool = True, timeout: float = 60.0,
            host_network: bool = False, path: str = ROOT_PATH,
            nice: bool = False) -> subprocess.CompletedProcess[str]:
        """``bash -c script`` as root in the container (its network, or the machine's)."""
        argv = [*self._env(path, network=host_network), *(["nice", "-n", "10"] if nice else []),
                "bash", "-c", script]
        result = self._nsenter(argv, host_network=host_network, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"in the container, exit {result.returncode}: {script}\n"
                                 f"{result.stdout}{result.stderr}")
        return result

    def client(self, script: str, *args: str, user: str = CLIENT_USER,
               timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Python client of the service's venv, as ``user``, to its end."""
        result = self._nsenter([*self._env(), *_as(user, script, args)], timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"client as {user}: exit {result.returncode}\n"
                                 f"{result.stdout}{result.stderr}")
        return result

    def background(self, script: str, *args: str, user: str = CLIENT_USER) -> Background:
        """A Python client as ``user`` that runs until its stdin closes (or it ends)."""
        namespaces = ["-m", "-u", "-i", "-p", "-C", "-n"]
        process = subprocess.Popen(
            ["nsenter", "-t", str(self.init_pid), *namespaces, "--", *self._env(),
             *_as(user, script, args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace")
        return Background(process)

    # -- the service

    def show(self, *properties: str) -> dict[str, str]:
        out = self.run(f"systemctl show {UNIT} " + " ".join(f"-p {p}" for p in properties))
        return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)

    def journal(self) -> str:
        return self.run(f"journalctl -u {UNIT} -o cat --no-pager").stdout

    def wait_restarted(self, old_pid: str, restarts: int, timeout: float = 40.0) -> str:
        """Wait until the unit is active again with a new main process after ``restarts``
        restarts; returns that process's pid."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.show("ActiveState", "SubState", "MainPID", "NRestarts")
            if (state["ActiveState"] == "active" and state["MainPID"] not in ("0", old_pid)
                    and int(state["NRestarts"]) >= restarts):
                return state["MainPID"]
            assert time.monotonic() < deadline, f"not restarted within {timeout} s: {state}"
            time.sleep(0.2)


def _as(user: str, script: str, args: tuple[str, ...]) -> list[str]:
    # -I: neither the working directory nor PYTHON* variables reach sys.path (a checkout named
    # slipstream in the working directory would shadow the installed package).
    return ["runuser", "-u", user, "--", PYTHON, "-I", "-c", script, *args]


class Background:
    """A running client: its output lines as they come; it ends when its stdin closes."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: list[str] = []  # every line so far, appended by the reading thread
        self._ended = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
        self._ended.set()

    def wait_for(self, prefix: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            ended = self._ended.is_set()
            found = [line for line in self.lines if line.startswith(prefix)]
            if found:
                return found[0]
            if ended:
                raise AssertionError(f"ended before {prefix!r}: {self.lines}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {prefix!r} within {timeout} s: {self.lines}")
            time.sleep(0.02)

    def end(self, timeout: float = 30.0) -> list[str]:
        """Close its stdin, wait for it; every line it wrote."""
        with contextlib.suppress(OSError):
            assert self.process.stdin is not None
            self.process.stdin.close()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._ended.wait(5)
        return self.lines


# -- the clients -----------------------------------------------------------------------------

#: Publishes and receives N messages on each channel of its arguments, one after another.
ROUND_TRIP = r"""
import sys, time
from slipstream.client import Client
n = int(sys.argv[1])
with Client.connect("/dev/shm/slipstream", timeout=10) as client:
    for i, channel in enumerate(sys.argv[2:]):
        subscription = client.add_subscription(channel, 100 + i)
        publication = client.add_publication(channel, 100 + i)
        got, sent, deadline = [], 0, time.monotonic() + 30
        while len(got) < n:
            if sent < n and publication.offer(b"%d" % sent) > 0:
                sent += 1
            subscription.poll(lambda data, _header: got.append(int(bytes(data))), 100)
            if time.monotonic() > deadline:
                sys.exit(f"{channel}: sent {sent}, received {len(got)} of {n}")
        assert got == list(range(n)), f"{channel}: out of order"
        publication.close()
        subscription.close()
        print("delivered", n, channel, flush=True)
"""

#: Holds a publication (its log file in the driver directory) until stdin closes.
HOLD = r"""
import sys
from slipstream.client import Client
client = Client.connect("/dev/shm/slipstream", timeout=10)
publication = client.add_publication("aeron:ipc", 7)
print("holding", flush=True)
sys.stdin.read()
"""

#: Offers N sequence-numbered messages on each channel, says so, and stays until stdin closes
#: (or the driver is gone).
PUBLISH = r"""
import struct, sys, time
from slipstream.client import Client, SlipstreamError
n, channels = int(sys.argv[1]), sys.argv[2:]
client = Client.connect("/dev/shm/slipstream", timeout=10)
publications = [client.add_publication(channel, 200 + i) for i, channel in enumerate(channels)]
deadline = time.monotonic() + 30
while not all(p.is_connected for p in publications):
    assert time.monotonic() < deadline, "no subscriber connected"
    time.sleep(0.01)
for publication in publications:
    sent = 0
    while sent < n:
        if publication.offer(struct.pack("<Q", sent) + bytes(56)) > 0:
            sent += 1
        else:
            assert time.monotonic() < deadline, f"offered only {sent}"
            time.sleep(0.0001)
print("offered", n, flush=True)
sys.stdin.read()
try:
    client.close()
except SlipstreamError:
    pass
"""

#: Receives on each channel, slowly (about 5000 messages a second each), checking the sequence,
#: until it has N of each or the driver is gone; reports its progress and the end.
SUBSCRIBE = r"""
import struct, sys, time
from slipstream.client import Client, SlipstreamError
n, channels = int(sys.argv[1]), sys.argv[2:]
client = Client.connect("/dev/shm/slipstream", timeout=10)
subscriptions = [client.add_subscription(channel, 200 + i) for i, channel in enumerate(channels)]
counts = [0] * len(channels)
wrong = []
def handler(i):
    def on_message(data, _header):
        (seq,) = struct.unpack_from("<Q", data)
        if seq != counts[i]:
            wrong.append((i, counts[i], seq))
        counts[i] += 1
    return on_message
handlers = [handler(i) for i in range(len(channels))]
print("subscribed", flush=True)
ended, last, deadline = "", 0.0, time.monotonic() + 60
try:
    while min(counts) < n and time.monotonic() < deadline:
        for subscription, on_message in zip(subscriptions, handlers):
            subscription.poll(on_message, 10)
        time.sleep(0.002)
        if time.monotonic() - last > 0.1:
            last = time.monotonic()
            print("progress", *counts, flush=True)
except SlipstreamError as e:
    ended = type(e).__name__ + ": " + str(e).splitlines()[0]
print("received", *counts, "wrong", len(wrong), wrong[:3], ended, flush=True)
"""


# -- the README ------------------------------------------------------------------------------


def _readme_blocks() -> list[list[str]]:
    """The command lines of the code blocks of the README's "Run it as a service" section,
    comments removed: the README of what is tested (HEAD's, or the working tree's)."""
    if SOURCE == "worktree":
        text = README.read_text()
    else:
        text = subprocess.run(["git", "-C", str(CHECKOUT), "show", "HEAD:README.md"],
                              capture_output=True, text=True, check=True).stdout
    start = text.index("### Run it as a service\n")
    end = text.index("\n## ", start)
    blocks = re.findall(r"^```\n(.*?)^```$", text[start:end], re.MULTILINE | re.DOTALL)
    return [[line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
            for block in blocks]


def _source_commands() -> tuple[str, str]:
    """How the test gets the checkout into the container's /opt/slipstream, and what it is."""
    head = subprocess.run(["git", "-C", str(CHECKOUT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    clone = (f"git config --global --add safe.directory '*' && "
             f"git clone -q --no-hardlinks {CHECKOUT_INSIDE} {PREFIX}")
    if SOURCE == "worktree":
        copy = (f"cd {CHECKOUT_INSIDE} && "
                f"git ls-files -z --cached --others --exclude-standard "
                f"| tar --null --ignore-failed-read -T - -cf - 2>/dev/null "
                f"| tar -C {PREFIX} -xf - && "
                f"git ls-files -z --deleted | (cd {PREFIX} && xargs -0r rm -f --)")
        return f"{clone} && {copy}", f"the working tree over HEAD {head}"
    assert SOURCE == "head", f"SLIPSTREAM_BOOT_SOURCE={SOURCE!r}: head or worktree"
    changed = subprocess.run(["git", "-C", str(CHECKOUT), "status", "--porcelain"],
                             capture_output=True, text=True, check=True).stdout.splitlines()
    if changed:
        warnings.warn(
            f"test_systemd_boot tests the committed HEAD {head}, as a user clones it; "
            f"{len(changed)} uncommitted change(s) are not in it (e.g. "
            f"{', '.join(line[3:] for line in changed[:6])}): SLIPSTREAM_BOOT_SOURCE=worktree "
            f"tests them", stacklevel=1)
    return clone, f"HEAD {head}"


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    """The container, with the README's install block run in it as an operator would (as
    root, the first python3 on PATH this test's if it is under a home directory)."""
    problem = _unavailable()
    if problem is not None:
        lacking(f"a systemd container: {problem}")
    install, tested = _source_commands()
    container = Container(tmp_path_factory.mktemp("boot"))
    try:
        container.boot()
        # An application user of the host (the README adds it to the group).
        container.run(f"useradd --system --no-create-home --shell /usr/sbin/nologin {APP_USER}"
                      f" && useradd --system --no-create-home --shell /usr/sbin/nologin other"
                      f" && printf '127.0.0.1 {DUAL_NAME}\\n::1 {DUAL_NAME}\\n' >> /etc/hosts")
        home_python = _home_python_dir()
        path = f"{home_python}:{ROOT_PATH}" if home_python else ROOT_PATH
        commands = []
        for line in _readme_blocks()[0]:
            line = line.replace(f"git clone ... {PREFIX}", install, 1)
            commands.append(line.replace("APPUSER", APP_USER))
        started = time.monotonic()
        try:
            result = container.run(" && ".join(f"( {c} )" for c in commands),
                                   host_network=True, timeout=600, path=path, nice=True)
        except AssertionError as e:
            status = container.run(f"systemctl status {UNIT} --no-pager -n 30", check=False)
            raise AssertionError(f"{e}\n{status.stdout}{status.stderr}") from None
        container.install_s = time.monotonic() - started
        print(f"installed {tested} in {container.install_s:.0f} s:", result.stderr[-2000:])
        container.install_path = path
        container.tested = tested
        yield container
    finally:
        container.remove()
        assert not any(c.exists() for c in container.cgroups), container.cgroups


# -- the tests -------------------------------------------------------------------------------


def test_the_install_builds_the_services_venv_from_the_system_python(host: Container) -> None:
    first = host.run("readlink -f $(command -v python3)", path=host.install_path).stdout.strip()
    venv = host.run(f"readlink -f {PYTHON}").stdout.strip()
    assert not venv.startswith(HOMES), venv
    assert venv.startswith("/usr/bin/python3"), venv  # SERVICE_PYTHON's default
    if _home_python_dir() is not None:  # the case this guards: the first python3 is a home's
        assert first.startswith(HOMES), first
    # As an operator installs it: a wheel in site-packages, not an editable checkout.
    where = host.client("import slipstream.daemon, sys; print(slipstream.daemon.__file__)",
                        user="slipstream").stdout.strip()
    assert "/site-packages/slipstream/daemon/" in where, where
    host.run("id slipstream")  # the system user, and its group
    groups = host.run(f"id -nG {APP_USER}").stdout.split()
    assert "slipstream" in groups  # the README's usermod
    assert host.run("test -f /etc/slipstream/driver.toml", check=False).returncode == 0
    # An interpreter under a home directory is refused, saying why and what to do (before
    # anything is changed).
    if _home_python_dir() is not None:
        refused = host.run(f"make -C {PREFIX} install-service "
                           f"SERVICE_PYTHON={_home_python_dir()}/python3", check=False)
        assert refused.returncode != 0
        assert "ProtectHome=yes hides it" in refused.stderr, refused.stderr
        assert "SERVICE_PYTHON=/usr/bin/python3" in refused.stderr, refused.stderr


def test_it_starts_ready_with_a_status(host: Container) -> None:
    state = host.show("ActiveState", "SubState", "Type", "StatusText", "UnitFileState",
                      "MainPID", "Result")
    # Type=notify: "active (running)" only once the driver sent READY=1.
    assert (state["Type"], state["ActiveState"], state["SubState"]) == (
        "notify", "active", "running"), (state, host.journal())
    assert state["UnitFileState"] == "enabled"
    assert re.match(r"\d+ clients, \d+ publications", state["StatusText"]), state
    # The README's looks at it, as written.
    [status_line, journal_line] = [line for line in _readme_blocks()[1]
                                   if line.startswith(("systemctl status", "journalctl"))]
    status = host.run(status_line).stdout
    assert f"Status: \"{state['StatusText']}\"" in status and "active (running)" in status, status
    journal = host.run(journal_line).stdout
    assert f"slipstream[{state['MainPID']}]: " in journal, journal
    assert f"slipstream driver {state['MainPID']} running in {DIRECTORY}" in journal, journal


def test_systemctl_kill_usr1_has_the_driver_print_its_stacks_to_the_journal_and_go_on(
        host: Container) -> None:
    """docs/OPERATIONS.md's thread dump, under the unit's hardening: the stacks of its threads
    (the trio loop, the network thread and the futex watcher at least) reach the journal, and
    the same process serves on, never restarted."""
    before = host.show("MainPID", "NRestarts")
    printed = host.journal().count("most recent call first")
    host.run(f"systemctl kill -s USR1 {UNIT}")
    deadline = time.monotonic() + 20
    while host.journal().count("most recent call first") < printed + 3:
        assert time.monotonic() < deadline, host.journal()[-3000:]
        time.sleep(0.2)
    assert "daemon/shell.py" in host.journal()
    after = host.show("MainPID", "NRestarts", "ActiveState")
    assert (after["MainPID"], after["NRestarts"], after["ActiveState"]) == (
        before["MainPID"], before["NRestarts"], "active"), after
    host.client(ROUND_TRIP, "100", "aeron:ipc")  # it serves on


def test_clients_of_an_application_user_publish_and_receive_over_ipc_and_udp(
        host: Container) -> None:
    channels = [
        "aeron:ipc",
        "aeron:udp?endpoint=127.0.0.1:40123",
        "aeron:udp?endpoint=127.0.0.1:40124|interface=127.0.0.1",
        "aeron:udp?endpoint=224.0.1.1:40456|interface=127.0.0.1",  # multicast on lo
        f"aeron:udp?endpoint={DUAL_NAME}:40125",  # glibc asks netlink to sort it: refused
        "aeron:udp?endpoint=224.0.1.3:40458|interface=localhost",
    ]
    result = host.client(ROUND_TRIP, "5000", *channels)
    assert [line.split(" ", 2)[2] for line in result.stdout.splitlines()] == channels
    # The README's counters, as the driver's user.
    [stat] = [line for line in _readme_blocks()[1] if " stat " in line]
    snapshot = host.run(f"{stat} --once")
    assert f"in {DIRECTORY}" in snapshot.stdout
    # Not a member of the group: refused, with what to do.
    refused = host.client(ROUND_TRIP, "1", "aeron:ipc", user="other", check=False)
    assert refused.returncode != 0
    assert "group slipstream" in refused.stderr.splitlines()[-1], refused.stderr
    assert "Operation not permitted" not in host.journal()


def test_a_stopped_driver_is_killed_by_the_watchdog_and_restarted(host: Container) -> None:
    before = host.show("MainPID", "NRestarts")
    started = time.monotonic()
    host.run(f"kill -STOP {before['MainPID']}")
    pid = host.wait_restarted(before["MainPID"], int(before["NRestarts"]) + 1, timeout=40)
    took = time.monotonic() - started
    journal = host.journal()
    assert "Watchdog timeout (limit 10s)" in journal
    assert f"Killing process {before['MainPID']} (slipstream) with signal SIGABRT" in journal
    assert "status=6/ABRT" in journal
    # The last ping came 0-5 s before the stop, the timeout 10 s after it.
    assert 4 < took < 30, took
    assert f"slipstream driver {pid} running in {DIRECTORY}" in journal
    host.client(ROUND_TRIP, "100", "aeron:ipc")  # it serves again


def test_a_crashed_driver_is_restarted_and_the_new_one_cleans_its_files(
        host: Container) -> None:
    holder = host.background(HOLD)
    try:
        holder.wait_for("holding")
        logs = host.run(f"ls {DIRECTORY}/publications").stdout.split()
        assert len(logs) == 1 and logs[0].endswith(".logbuffer"), logs
        before = host.show("MainPID", "NRestarts")
        host.run(f"kill -9 {before['MainPID']}")
        pid = host.wait_restarted(before["MainPID"], int(before["NRestarts"]) + 1)
    finally:
        holder.end()
    assert "status=9/KILL" in host.journal()
    assert host.run(f"ls {DIRECTORY}/publications").stdout.split() == []  # the old log went
    assert f"pid: {pid}\n" in host.run(f"cat {DIRECTORY}/driver.lock").stdout
    host.client(ROUND_TRIP, "100", "aeron:ipc")


def test_the_running_units_exposure_stays_under_two(host: Container) -> None:
    result = host.run(f"systemd-analyze security {UNIT} --no-pager")
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert match, result.stdout
    print(match.group(0))
    assert float(match.group(1)) < 2.0, result.stdout


#: Offers N sequence-numbered messages on aeron:ipc stream 300 once a subscriber (the
#: archive's) is there, and says so.
RECORDED = r"""
import struct, sys, time
from slipstream.client import Client
n = int(sys.argv[1])
with Client.connect("/dev/shm/slipstream", timeout=10) as client:
    publication = client.add_publication("aeron:ipc", 300)
    deadline = time.monotonic() + 30
    while not publication.is_connected:
        assert time.monotonic() < deadline, "the archive did not subscribe"
        time.sleep(0.01)
    sent = 0
    while sent < n:
        if publication.offer(struct.pack("<Q", sent) + bytes(120)) > 0:
            sent += 1
        else:
            assert time.monotonic() < deadline, f"offered only {sent}"
            time.sleep(0.0001)
    print("offered", n, "to", publication.position, flush=True)
    if len(sys.argv) > 2:
        sys.stdin.read()  # the stream stays open: the recording goes on
"""

ARCHIVE_UNIT = "slipstream-archive.service"
ARCHIVE_DIR = "/var/lib/slipstream-archive"


def test_the_archive_records_under_systemd_and_recovers_after_a_kill(
        host: Container) -> None:
    """The README's archive block: the unit installed beside the driver's records an IPC
    stream of an application user into its state directory, shows its position as a counter,
    is restarted after a kill -9 and recovers the recording it had open, and stops cleanly."""
    host.run("printf '\\n[[record]]\\nchannel = \"aeron:ipc\"\\nstream_id = 300\\n' "
             ">> /etc/slipstream/archive.toml")

    def archive_state() -> dict[str, str]:
        out = host.run(f"systemctl show {ARCHIVE_UNIT} -p ActiveState -p MainPID -p Result")
        return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)

    [enable, listing] = _readme_blocks()[2]
    host.run(enable)
    deadline = time.monotonic() + 30
    while archive_state()["ActiveState"] != "active" or \
            host.run(f"test -e {ARCHIVE_DIR}/archive.catalog", check=False).returncode:
        assert time.monotonic() < deadline, host.run(
            f"journalctl -u {ARCHIVE_UNIT} --no-pager -n 40", check=False).stdout
        time.sleep(0.2)
    pid = archive_state()["MainPID"]
    publisher = host.background(RECORDED, "3000", "stay")
    try:
        publisher.wait_for("offered")
        deadline = time.monotonic() + 20
        while "active" not in host.run(listing).stdout:
            assert time.monotonic() < deadline, host.run(listing).stdout
            time.sleep(0.2)
        stat = host.run(f"runuser -u slipstream -- {PREFIX}/.venv/bin/slipstream stat "
                        f"--dir {DIRECTORY} --once").stdout
        assert "rec-pos: 0 " in stat, stat
        host.run(f"kill -9 {pid}")
        deadline = time.monotonic() + 30
        while True:  # Restart=on-failure brings it back; it recovers the open recording
            now = archive_state()
            if now["MainPID"] not in (pid, "0") and now["ActiveState"] == "active" and \
                    "recovered" in host.run(listing).stdout:
                break
            assert time.monotonic() < deadline, (now, host.run(listing).stdout)
            time.sleep(0.2)
    finally:
        publisher.end()
    listed = host.run(listing).stdout
    assert "recovered" in listed, listed
    stopped = host.run(f"systemctl stop {ARCHIVE_UNIT}", check=False, timeout=60)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    final = archive_state()
    assert (final["ActiveState"], final["Result"]) == ("inactive", "success"), final
    journal = host.run(f"journalctl -u {ARCHIVE_UNIT} --no-pager", check=False).stdout
    assert "status=9/KILL" in journal, journal[-3000:]
    exposure = host.run(f"systemd-analyze security {ARCHIVE_UNIT} --no-pager").stdout
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", exposure)
    assert match and float(match.group(1)) < 2.0, exposure[-2000:]


def _read_at_least(subscriber: Background, count: int) -> bool:
    progress = [line for line in subscriber.lines if line.startswith("progress")]
    return bool(progress) and min(map(int, progress[-1].split()[1:])) >= count


def test_systemctl_stop_mid_stream_drains_and_exits_zero_with_nothing_lost(
        host: Container) -> None:
    count = 10_000
    channels = ["aeron:ipc", "aeron:udp?endpoint=127.0.0.1:40130"]
    subscriber = host.background(SUBSCRIBE, str(count), *channels)
    publisher = host.background(PUBLISH, str(count), *channels)
    try:
        subscriber.wait_for("subscribed")
        publisher.wait_for("offered")
        deadline = time.monotonic() + 20
        while not _read_at_least(subscriber, count // 20):  # mid-stream: some read, most not
            assert time.monotonic() < deadline, subscriber.lines[-3:]
            time.sleep(0.01)
        at_stop = [line for line in subscriber.lines if line.startswith("progress")][-1]
        stopped = host.run(f"systemctl stop {UNIT}", check=False, timeout=60)
    finally:
        publisher.end()
        lines = subscriber.end()
    [received] = [line for line in lines if line.startswith("received")]
    print("when stopped:", at_stop, "at the end:", received)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    # The stop came while the subscriber still read (it reads ~5000 messages a second): a
    # good part of the stream was left to drain.
    assert max(map(int, at_stop.split()[1:])) < count * 0.8, at_stop
    assert received.startswith(f"received {count} {count} wrong 0"), received
    state = host.show("ActiveState", "Result", "ExecMainCode", "ExecMainStatus")
    assert state == {"ActiveState": "inactive", "Result": "success", "ExecMainCode": "1",
                     "ExecMainStatus": "0"}, (state, host.journal()[-3000:])
    assert host.run(f"test -e {DIRECTORY}", check=False).returncode != 0  # it cleaned up
    journal = host.journal()
    assert "received SIGTERM: draining for at most" in journal, journal[-3000:]
    assert re.search(r"drained in \d+\.\d+ s", journal), journal[-3000:]
    assert "drain_timeout passed" not in journal
    assert "slipstream driver stopped" in journal
