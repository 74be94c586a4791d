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

Everything is removed by :meth:`close` (a context manager), and namespaces of an earlier run
that died are removed by the next (they carry this module's prefix).  Needs root, ``ip`` and,
for :meth:`drop`, ``iptables`` (:func:`ensure_iptables` installs Debian's when missing).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import attrs

#: Namespaces of these hosts are ``ssh-<creator pid>-<run>-<i>`` (and ``...-br``); their veths
#: ``ssh<run>v<i>`` (interface names have at most 15 characters).
PREFIX: Final = "ssh"


class HostsError(RuntimeError):
    """The hosts cannot be made here (not root, no ``ip``, ...): the message says why."""


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True)
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
            _run("ip", "netns", "del", name, check=False)
        except PermissionError:
            pass


@attrs.define
class Host:
    """One test host: its namespace, veth and address."""

    index: int
    namespace: str
    veth: str
    address: str

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``command`` inside the host's namespace."""
        return _run("ip", "netns", "exec", self.namespace, *command, check=check)


class NamespaceHosts:
    """``count`` hosts on a bridge; see the module docstring."""

    def __init__(self, count: int, *, net: int | None = None) -> None:
        problem = unavailable()
        if problem is not None:
            raise HostsError(problem)
        run_id = uuid.uuid4().hex[:6]
        self.net = net if net is not None else 100 + int(run_id, 16) % 100
        stem = f"{PREFIX}-{os.getpid()}-{run_id}"
        self.bridge_namespace = f"{stem}-br"
        self.hosts = [Host(i, f"{stem}-{i}", f"{PREFIX}{run_id}v{i}", f"10.{self.net}.0.{i}")
                      for i in range(1, count + 1)]
        #: Each driver started here, and whether this object named its directory (only those
        #: are removed at close: a directory the caller gave is the caller's).
        self._drivers: list[tuple[Any, bool]] = []
        self._created: list[str] = []
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
        _run(*in_bridge, "ip", "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
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

    def __enter__(self) -> NamespaceHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, index: int) -> Host:
        """Host ``index`` (1-based, as the addresses)."""
        return self.hosts[index - 1]

    # -- drivers ---------------------------------------------------------------------------
    def start_driver(self, index: int, directory: str | Path | None = None,
                     **settings: Any) -> Any:
        """A slipstream driver inside host ``index`` (a :class:`MediaDriver`, stopped by
        :meth:`close` if not before, which also removes what a crashed driver left in a
        directory named here; a ``directory`` the caller gives is never removed)."""
        from slipstream.daemon.driver import MediaDriver

        path = Path(directory) if directory is not None else (
            Path("/dev/shm") / f"slipstream-{self[index].namespace}-{uuid.uuid4().hex[:4]}")
        driver = MediaDriver.start(path, settings, netns=self[index].namespace)
        self._drivers.append((driver, directory is None))
        return driver

    # -- faults ----------------------------------------------------------------------------
    def drop(self, index: int, *, port: int | None = None, probability: float | None = None,
             burst: tuple[int, int] | None = None, protocol: str = "udp") -> None:
        """Drop packets of ``protocol`` arriving at host ``index`` (to ``port``, or any): at
        random with ``probability``, or ``burst=(length, every)``: ``length`` consecutive
        packets out of every ``every``."""
        ensure_iptables()
        host = self[index]
        match = ["-p", protocol] + (["--dport", str(port)] if port is not None else [])
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

    # -- cleanup ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the drivers, remove the namespaces (with their veths and rules)."""
        for driver, named_here in self._drivers:
            with contextlib.suppress(Exception):
                driver.stop()
            if named_here:
                shutil.rmtree(driver.directory, ignore_errors=True)
        self._drivers.clear()
        for namespace in reversed(self._created):
            _run("ip", "netns", "del", namespace, check=False)
        self._created.clear()


@contextlib.contextmanager
def namespace_hosts(count: int, **kwargs: Any) -> Iterator[NamespaceHosts]:
    """``with namespace_hosts(3) as hosts: ...``."""
    hosts = NamespaceHosts(count, **kwargs)
    try:
        yield hosts
    finally:
        hosts.close()
