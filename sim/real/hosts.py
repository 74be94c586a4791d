"""Test hosts on one machine: network namespaces on a Linux bridge, a driver in each.

:class:`NamespaceHosts` makes ``count`` hosts, each a network namespace with one veth into a
bridge that lives in a namespace of its own (nothing is added to the machine's own network):
host ``i`` has the address ``10.<net>.0.<i>/24``; multicast works between them (the bridge
floods it: snooping off; each host routes 224.0.0.0/4 to its veth).  :meth:`start_driver` runs a
real slipstream driver inside a host (``ip netns exec``); its directory is under /dev/shm, which
every namespace shares, so clients in any namespace (the test's own, too) connect to it.

Faults on the links are the kernel's: :meth:`drop` adds ``iptables -m statistic`` rules in a
host (random loss, or bursts: runs of consecutive datagrams), :meth:`rate_limit` a ``tc tbf``
qdisc on its veth, :meth:`partition` drops everything between two hosts until healed.  Delay,
jitter, reordering and duplication need the userspace relay (:mod:`slipstream.sim.real.relay`);
this kernel has no netem.

``NamespaceHosts(count, isolated=True)`` makes hosts that are machines of their own to the
processes in them: each also has a private /dev/shm (a tmpfs) and hostname, held by one holder
process per host (``unshare --mount --uts`` inside its network namespace, then ``sleep``), and
every process of the host runs through :meth:`Host.run` / :meth:`Host.popen` (``nsenter`` into
the holder's network, mount and UTS namespaces).  Processes of one host share its /dev/shm;
other hosts, and the test's own process, do not see it, so a driver there
(:meth:`start_driver`) is reached only by clients run inside its host.  The rest of the file
system is the machine's.  Names are IP addresses: the hostnames (:attr:`Host.hostname`) resolve
nowhere, and nothing is written to /etc/hosts.  A host may have names of its own
(:meth:`NamespaceHosts.set_names`): ``ip netns exec`` bind-mounts ``/etc/netns/<namespace>/hosts``
over /etc/hosts for what it starts, so the processes of that host (not the machine's) find them
through the system's resolver (getaddrinfo, nsswitch), and a change is seen at once.

Everything is removed by :meth:`close` (a context manager), and namespaces of an earlier run
that died are removed by the next (they carry this module's prefix).  Needs root, ``ip`` and,
for :meth:`drop`, ``iptables`` (:func:`ensure_iptables` installs Debian's when missing).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from slipstream.client import control
from slipstream.daemon.driver import MediaDriver

#: Namespaces of these hosts are ``ssh-<creator pid>-<run>-<i>`` (and ``...-br``); their veths
#: ``ssh<run>v<i>`` (interface names have at most 15 characters).
PREFIX: Final = "ssh"

#: The end of the namespace names of isolated hosts (``ssh-<pid>-<run>-<i>-iso``): a stale one
#: may still hold processes (its holder at least), which :func:`remove_stale` kills.
ISOLATED_SUFFIX: Final = "-iso"


class HostsError(RuntimeError):
    """The hosts cannot be made here (not root, no ``ip``, ...): the message says why."""


def _run(*command: str, check: bool = True, timeout: float | None = None,
         env: Mapping[str, str] | None = None,
         cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                            cwd=cwd)
    if check and result.returncode != 0:
        raise HostsError(f"{' '.join(command)} failed: {result.stderr.strip()}")
    return result


def unavailable() -> str | None:
    """Why namespace hosts cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    return None


def ensure_iptables() -> None:
    """Install Debian's iptables when it is missing (root, package registries only)."""
    if shutil.which("iptables") is not None:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "iptables"]):
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        if result.returncode != 0:
            raise HostsError(f"cannot install iptables: {result.stderr.strip()[-500:]}")


def remove_stale() -> None:
    """Remove the namespaces of runs whose process is gone (killed before its cleanup)."""
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) < 4 or parts[0] != PREFIX or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            if name.endswith(ISOLATED_SUFFIX):
                _kill_processes_in(name)
            _run("ip", "netns", "del", name, check=False)
            # Its hosts file (NamespaceHosts.set_names), named by the run's namespace alone.
            stale = Path("/etc/netns") / name
            with contextlib.suppress(OSError):
                (stale / "hosts").unlink(missing_ok=True)
                stale.rmdir()
        except PermissionError:
            pass


def _kill_processes_in(namespace: str, timeout: float = 5.0) -> None:
    """SIGKILL every process in network namespace ``namespace`` (``ip netns pids``), again
    until none is left (one may fork while the others die) or ``timeout`` s have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [int(p) for p in _run("ip", "netns", "pids", namespace, check=False).stdout.split()
                if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


@attrs.define
class Host:
    """One test host: its namespace, veth and address; for an isolated host also its hostname
    and the holder process whose mount and UTS namespaces (private /dev/shm, hostname) every
    process of the host joins."""

    index: int
    namespace: str
    veth: str
    address: str
    hostname: str | None = None
    holder: subprocess.Popen[bytes] | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def isolated(self) -> bool:
        """Whether the host has its own /dev/shm and hostname (its holder is running)."""
        return self.holder is not None

    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside this host: ``nsenter`` into the
        holder's network, mount and UTS namespaces for an isolated host, ``ip netns exec``
        (its network only) otherwise.  Both exec the program: its pid is the one started."""
        if self.holder is not None:
            return ["nsenter", "-t", str(self.holder.pid), "-n", "-m", "-u", "--"]
        return ["ip", "netns", "exec", self.namespace]

    def run(self, *command: str, check: bool = True, timeout: float | None = None,
            env: Mapping[str, str] | None = None,
            cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``command`` inside the host and wait for it; its output is captured (text).
        Raises :class:`HostsError` with its stderr when it fails and ``check``, and
        :class:`subprocess.TimeoutExpired` after ``timeout`` s (the command is killed, not its
        children).  ``env``: its whole environment (default: this process's)."""
        return _run(*self.prefix(), *command, check=check, timeout=timeout, env=env, cwd=cwd)

    def popen(self, *command: str, **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``command`` inside the host and return at once (``popen_kwargs`` are
        :class:`subprocess.Popen`'s).  The caller stops it; :meth:`NamespaceHosts.close` kills
        whatever of an isolated host is still running, children included."""
        return subprocess.Popen([*self.prefix(), *command], **popen_kwargs)

    def outside(self, path: str | os.PathLike[str]) -> Path:
        """The path through which this process reaches ``path`` as the host sees it: for an
        isolated host through the holder's root (``/proc/<holder>/root/...``, which resolves
        in the host's mounts, its /dev/shm included); otherwise ``path`` itself.  For reading
        files: shared memory mapped through it is the host's, but a client cannot connect
        through it (the driver names its files by their paths inside the host)."""
        if self.holder is None:
            return Path(path)
        return Path(f"/proc/{self.holder.pid}/root") / Path(path).relative_to("/")


class NamespaceHosts:
    """``count`` hosts on a bridge; see the module docstring."""

    def __init__(self, count: int, *, net: int | None = None, isolated: bool = False,
                 shared_segment: bool = False) -> None:
        """``count`` hosts on subnet ``10.<net>.0.0/24`` (default: one picked per run);
        ``isolated``: each with its own /dev/shm and hostname ``sshost<i>-<run>`` (see the
        module docstring; needs ``unshare`` and ``nsenter``); ``shared_segment``: the bridge
        learns no addresses, so it floods every frame to every host, as a hub or a switch
        whose table overflowed does: any host sees the others' traffic
        (:mod:`slipstream.sim.real.attacker` sniffs it), though its kernel still takes only
        what is addressed to it."""
        problem = unavailable()
        if problem is None and isolated:
            missing = [tool for tool in ("unshare", "nsenter") if shutil.which(tool) is None]
            if missing:
                problem = f"isolated hosts need {' and '.join(missing)} (util-linux)"
        if problem is not None:
            raise HostsError(problem)
        run_id = uuid.uuid4().hex[:6]
        self.net = net if net is not None else 100 + int(run_id, 16) % 100
        self.isolated = isolated
        self.shared_segment = shared_segment
        stem = f"{PREFIX}-{os.getpid()}-{run_id}"
        self.bridge_namespace = f"{stem}-br"
        suffix = ISOLATED_SUFFIX if isolated else ""
        self.hosts = [Host(i, f"{stem}-{i}{suffix}", f"{PREFIX}{run_id}v{i}",
                           f"10.{self.net}.0.{i}",
                           hostname=f"sshost{i}-{run_id}" if isolated else None)
                      for i in range(1, count + 1)]
        #: Each driver started here, and whether this object named its directory (only those
        #: are removed at close: a directory the caller gave is the caller's).
        self._drivers: list[tuple[Any, bool]] = []
        self._created: list[str] = []
        #: What set_names made under /etc/netns, removed at close (deepest first).
        self._etc_made: list[Path] = []
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        remove_stale()
        bridge_ns = self.bridge_namespace
        _run("ip", "netns", "add", bridge_ns)
        self._created.append(bridge_ns)
        in_bridge = ("ip", "netns", "exec", bridge_ns)
        _run(*in_bridge, "ip", "link", "add", "br0", "type", "bridge", "mcast_snooping", "0",
             *(("ageing_time", "0") if self.shared_segment else ()))
        _run(*in_bridge, "ip", "link", "set", "br0", "up")
        _run(*in_bridge, "ip", "link", "set", "lo", "up")
        for host in self.hosts:
            _run("ip", "netns", "add", host.namespace)
            self._created.append(host.namespace)
            peer = f"{host.veth}b"
            # Both ends are made in the host's namespace, then one moves to the bridge's.
            _run("ip", "-n", host.namespace, "link", "add", host.veth, "type", "veth",
                 "peer", "name", peer)
            _run("ip", "-n", host.namespace, "link", "set", peer, "netns", bridge_ns)
            _run(*in_bridge, "ip", "link", "set", peer, "master", "br0")
            _run(*in_bridge, "ip", "link", "set", peer, "up")
            host.run("ip", "addr", "add", f"{host.address}/24", "dev", host.veth)
            # A NIC puts datagrams on its wire one by one, whatever a GSO send handed it: so
            # does this veth (the kernel cuts a GSO send before it), and the faults on the
            # link hit datagrams, not whole GSO sends.
            host.run("ip", "link", "set", host.veth, "gso_max_segs", "1")
            host.run("ip", "link", "set", host.veth, "up")
            host.run("ip", "link", "set", "lo", "up")
            host.run("ip", "route", "add", "224.0.0.0/4", "dev", host.veth)
        if self.isolated:  # after the links: until its holder runs, a host is its namespace
            for host in self.hosts:
                host.holder = self._start_holder(host)

    @staticmethod
    def _start_holder(host: Host) -> subprocess.Popen[bytes]:
        """The holder of ``host``: its own mount namespace (propagation private, so nothing
        mounted there reaches the machine) with a tmpfs on /dev/shm, and its own UTS
        namespace with the hostname; returned once both are in place, so that whatever joins
        them sees them.  ``ip netns exec``, ``unshare`` and ``sh`` each exec the next: the pid
        is the one that holds the namespaces."""
        assert host.hostname is not None
        script = (f"mount -t tmpfs -o mode=1777 tmpfs /dev/shm && hostname {host.hostname} "
                  "&& echo ready && exec sleep infinity </dev/null >/dev/null 2>&1")
        # Its own session: a Ctrl-C at the terminal leaves it to close(), which kills what
        # runs in the host first.
        holder = subprocess.Popen(
            ["ip", "netns", "exec", host.namespace, "unshare", "--mount", "--uts",
             "--propagation", "private", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        assert holder.stdout is not None and holder.stderr is not None
        ready = holder.stdout.readline()  # EOF (b"") if it failed before
        if ready.strip() != b"ready":
            holder.kill()
            _, err = holder.communicate()
            raise HostsError(f"cannot isolate host {host.index}: {err.decode().strip()}")
        holder.stdout.close()
        holder.stderr.close()
        return holder

    def __enter__(self) -> NamespaceHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, index: int) -> Host:
        """Host ``index`` (1-based, as the addresses)."""
        return self.hosts[index - 1]

    # -- drivers ---------------------------------------------------------------------------
    def start_driver(self, index: int, directory: str | Path | None = None,
                     **settings: Any) -> MediaDriver:
        """A slipstream driver inside host ``index`` (a :class:`MediaDriver`, stopped by
        :meth:`close` if not before, which also removes what a crashed driver left in a
        directory named here; a ``directory`` the caller gives is never removed).

        On an isolated host its ``directory`` (default: the default driver directory,
        ``/dev/shm/slipstream-<user>``, where ``Client.connect()`` looks when
        ``$SLIPSTREAM_DIR`` is unset) is in the host's own /dev/shm: clients must run inside
        the host, and this process reads its files through :attr:`MediaDriver.view`
        (:meth:`Host.outside`), e.g. ``read_system_counters(driver.view)``; a second driver
        on the same host needs a ``directory`` of its own.  Its files go with the host's
        tmpfs at :meth:`close`."""
        host = self[index]
        if self.isolated:
            path = Path(directory) if directory is not None else \
                control.default_driver_directory()
            driver = MediaDriver.start(path, settings, prefix=host.prefix(),
                                       view=host.outside(path))
            self._drivers.append((driver, False))  # its files go with the host's /dev/shm
            return driver
        path = Path(directory) if directory is not None else (
            Path("/dev/shm") / f"slipstream-{host.namespace}-{uuid.uuid4().hex[:4]}")
        driver = MediaDriver.start(path, settings, prefix=host.prefix())
        self._drivers.append((driver, directory is None))
        return driver

    # -- faults ----------------------------------------------------------------------------
    def drop(self, index: int, *, port: int | None = None, probability: float | None = None,
             burst: tuple[int, int] | None = None, protocol: str = "udp",
             source: int | None = None) -> None:
        """Drop packets of ``protocol`` arriving at host ``index`` (to ``port``, or any; from
        host ``source``, or any): at random with ``probability``, or ``burst=(length,
        every)``: ``length`` consecutive packets out of every ``every``."""
        ensure_iptables()
        host = self[index]
        match = ["-p", protocol] + (["--dport", str(port)] if port is not None else [])
        if source is not None:
            match += ["-s", self[source].address]
        if probability is not None:
            host.run("iptables", "-A", "INPUT", *match, "-m", "statistic", "--mode", "random",
                     "--probability", f"{probability}", "-j", "DROP")
        if burst is not None:
            length, every = burst
            for k in range(length):
                host.run("iptables", "-A", "INPUT", *match, "-m", "statistic", "--mode", "nth",
                         "--every", str(every), "--packet", str(k), "-j", "DROP")

    def clear_faults(self, index: int) -> None:
        """Remove every iptables rule of host ``index``."""
        if shutil.which("iptables") is not None:
            self[index].run("iptables", "-F", "INPUT", check=False)

    def rate_limit(self, index: int, mbit: float, burst_kb: int = 64,
                   latency_ms: int = 50) -> None:
        """Limit what host ``index`` sends to ``mbit`` Mbit/s (a tc tbf on its veth)."""
        self[index].run("tc", "qdisc", "replace", "dev", self[index].veth, "root", "tbf",
                        "rate", f"{mbit}mbit", "burst", f"{burst_kb}kb", "latency",
                        f"{latency_ms}ms")

    def partition(self, a: int, b: int) -> None:
        """Cut every datagram between hosts ``a`` and ``b`` (both ways) until :meth:`heal`."""
        ensure_iptables()
        for one, other in ((a, b), (b, a)):
            self[one].run("iptables", "-A", "INPUT", "-s", self[other].address, "-j", "DROP")

    def heal(self, a: int, b: int) -> None:
        for one, other in ((a, b), (b, a)):
            self[one].run("iptables", "-D", "INPUT", "-s", self[other].address, "-j", "DROP",
                          check=False)

    def unplug(self, index: int) -> None:
        """Take host ``index`` off the network (its veth down), as a host that disappears."""
        self[index].run("ip", "link", "set", self[index].veth, "down")

    # -- names -----------------------------------------------------------------------------
    def set_names(self, index: int, names: Mapping[str, str]) -> None:
        """Host ``index``'s own hosts file holds ``names`` (host name -> address) beside
        ``localhost``: ``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` bind-mounts
        over /etc/hosts for the processes it starts from then on (a driver started after the
        first call).  A later call rewrites the file in place (truncated and written, the same
        inode), so the bind mount of a process already running sees the new names at its next
        lookup, as a name's record that changes.  Not for isolated hosts (their processes
        join the holder's mounts, made before).  Removed at :meth:`close`."""
        host = self[index]
        if host.isolated:
            raise HostsError("set_names is for hosts that are namespaces alone (not isolated)")
        etc = Path("/etc/netns")
        folder = etc / host.namespace
        for made in (etc, folder):
            if not made.exists():
                made.mkdir(mode=0o755)
                self._etc_made.insert(0, made)
        path = folder / "hosts"
        text = "127.0.0.1\tlocalhost\n::1\tlocalhost\n" + "".join(
            f"{address}\t{name}\n" for name, address in names.items())
        if not path.exists():
            self._etc_made.insert(0, path)
        with open(path, "r+" if path.exists() else "w") as file:  # in place: same inode
            file.truncate(0)
            file.write(text)

    # -- cleanup ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the drivers, remove the namespaces (with their veths and rules)."""
        for driver, named_here in self._drivers:
            with contextlib.suppress(Exception):
                driver.stop()
            if named_here:
                shutil.rmtree(driver.directory, ignore_errors=True)
        self._drivers.clear()
        # Whatever still runs in an isolated host (its holder too) goes before its namespace:
        # with the last of them goes its mount namespace, and the tmpfs with it.
        for host in self.hosts:
            if host.holder is not None:
                holder, host.holder = host.holder, None
                _kill_processes_in(host.namespace)
                with contextlib.suppress(ProcessLookupError):
                    holder.kill()
                holder.wait()
        for namespace in reversed(self._created):
            _run("ip", "netns", "del", namespace, check=False)
        self._created.clear()
        for made in self._etc_made:  # deepest first; /etc/netns only if made here and empty
            with contextlib.suppress(OSError):
                if made.is_dir():
                    made.rmdir()
                else:
                    made.unlink()
        self._etc_made.clear()


@contextlib.contextmanager
def namespace_hosts(count: int, **kwargs: Any) -> Iterator[NamespaceHosts]:
    """``with namespace_hosts(3) as hosts: ...``."""
    hosts = NamespaceHosts(count, **kwargs)
    try:
        yield hosts
    finally:
        hosts.close()
