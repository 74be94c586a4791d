"""A userspace UDP relay that puts the simulator's link faults between real sockets.

This kernel has no netem, so delay, jitter, reordering and duplication on real links come from
here (loss and rate limits may also come from iptables and tc: :mod:`slipstream.sim.real.hosts`).
Each direction of the relay is a :class:`~slipstream.sim.network.Link`: the same fault model,
and the same counters, as the simulator's virtual links, driven by the real clock.

Unicast (``listen`` and ``forward`` are host:port): a peer sends to ``listen``; the relay
forwards to ``forward`` from a socket of that peer's own, and what comes back to that socket
returns to the peer from ``listen``.  So an Aeron publication whose endpoint is ``listen``
talks through the relay to the subscription at ``forward``: DATA and SETUP one way (the *data*
direction), status messages and NAKs the other (the *control* direction).

Multicast (both multicast groups, Aeron's rule: the control group is the data group + 1):
datagrams to the ``listen`` data group go to the ``forward`` data group, and the ``forward``
control group's go to the ``listen`` control group.  ``interface`` picks the interface.

Faults apply to the data direction, the control direction or both (``directions``).
"""

from __future__ import annotations

import contextlib
import heapq
import ipaddress
import random
import selectors
import socket
import threading
import time
from typing import Final

from slipstream.sim.network import Link, LinkFaults, LinkStats

Address = tuple[str, int]
#: A datagram can be up to this long (Aeron's largest MTU).
MAX_DATAGRAM: Final = 65536
DIRECTIONS: Final = ("both", "data", "control")


def _control_group(address: Address) -> Address:
    packed = bytearray(ipaddress.ip_address(address[0]).packed)
    packed[-1] = (packed[-1] + 1) & 0xFF
    return str(ipaddress.ip_address(bytes(packed))), address[1]


def _is_multicast(address: Address) -> bool:
    return ipaddress.ip_address(address[0]).is_multicast


def _is_local(host: str) -> bool:
    """Whether ``host`` (an IPv4 address) is one of this host's: a loopback address, or one
    the kernel routes a datagram to through the local table, with itself as the source (a
    bind() test would pass any address under ip_nonlocal_bind)."""
    if ipaddress.ip_address(host).is_loopback:
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))  # no datagram is sent
        except OSError:
            return False
        return probe.getsockname()[0] == host


def _reaches_itself(listen: Address, forward: Address) -> bool:
    """Whether datagrams sent to ``forward`` would arrive at the socket bound to ``listen``,
    on one port: the same address; a wildcard listen and a forward address of this host; or a
    forward to the wildcard address (delivered locally) and a listen on a loopback address or
    the wildcard."""
    if listen[1] != forward[1]:
        return False
    listen_ip, forward_ip = ipaddress.ip_address(listen[0]), ipaddress.ip_address(forward[0])
    if listen_ip == forward_ip:
        return True
    if forward_ip.is_unspecified:
        return listen_ip.is_loopback
    return listen_ip.is_unspecified and _is_local(forward[0])


class Relay:
    """See the module docstring.  ``start()`` runs it on a thread; ``stop()`` ends it;
    ``stats`` counts each direction (offered, delivered, lost, burst_lost, ...)."""

    def __init__(self, listen: Address, forward: Address, faults: LinkFaults, *,
                 directions: str = "both", interface: str | None = None, seed: int = 1) -> None:
        if directions not in DIRECTIONS:
            raise ValueError(f"directions must be one of {DIRECTIONS}, not {directions!r}")
        if _is_multicast(listen) != _is_multicast(forward):
            raise ValueError("listen and forward must both be unicast or both multicast")
        if _reaches_itself(listen, forward):
            raise ValueError(f"listen {listen[0]}:{listen[1]} and forward {forward[0]}:"
                             f"{forward[1]} are the same address: the relay would forward its "
                             f"own datagrams to itself")
        self.listen = listen
        self.forward = forward
        self.interface = interface
        clean = LinkFaults()
        rng = random.Random(seed)
        self.data = Link("listen", "forward", faults if directions != "control" else clean,
                         random.Random(rng.getrandbits(64)))
        self.control = Link("forward", "listen", faults if directions != "data" else clean,
                            random.Random(rng.getrandbits(64)))
        self._selector = selectors.DefaultSelector()
        self._heap: list[tuple[int, int, socket.socket, bytes, Address]] = []
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sockets: list[socket.socket] = []
        self._peers: dict[Address, socket.socket] = {}  # unicast: a socket per peer
        self._multicast = _is_multicast(listen)
        if self._multicast:
            self._open_multicast()
        else:
            self._listen = self._socket(listen)
            self._selector.register(self._listen, selectors.EVENT_READ, None)

    @property
    def stats(self) -> dict[str, LinkStats]:
        return {"data": self.data.stats, "control": self.control.stats}

    # -- sockets ---------------------------------------------------------------------------
    def _socket(self, bind: Address | None, *, group: bool = False) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sockets.append(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        if group:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.interface is not None:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF,
                            socket.inet_aton(self.interface))
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
        if bind is not None:
            sock.bind(bind)
            if group:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                                socket.inet_aton(bind[0])
                                + socket.inet_aton(self.interface or "0.0.0.0"))
        sock.setblocking(False)
        return sock

    def _open_multicast(self) -> None:
        # The relay's own sends never come back to it: it listens on the listen data group
        # and the forward control group, and sends to the other two.
        data_in = self._socket(self.listen, group=True)
        control_in = self._socket(_control_group(self.forward), group=True)
        out = self._socket(None)
        self._selector.register(data_in, selectors.EVENT_READ,
                                ("data", out, self.forward))
        self._selector.register(control_in, selectors.EVENT_READ,
                                ("control", out, _control_group(self.listen)))

    def _peer_socket(self, peer: Address) -> socket.socket:
        sock = self._peers.get(peer)
        if sock is None:
            sock = self._peers[peer] = self._socket(("0.0.0.0", 0))
            sock.connect(self.forward)
            self._selector.register(sock, selectors.EVENT_READ, ("reply", peer))
        return sock

    # -- running ---------------------------------------------------------------------------
    def start(self) -> Relay:
        self._thread = threading.Thread(target=self._run, name="slipstream-relay", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._selector.close()
        for sock in self._sockets:
            sock.close()

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _schedule(self, link: Link, sock: socket.socket, data: bytes,
                  address: Address) -> None:
        now = time.monotonic_ns()
        _reason, arrivals = link.transmit(len(data), now)
        for due in arrivals:
            self._seq += 1
            heapq.heappush(self._heap, (due, self._seq, sock, data, address))

    def _run(self) -> None:
        heap = self._heap
        while not self._stop.is_set():
            timeout = 0.05
            if heap:
                timeout = max(0.0, min(timeout, (heap[0][0] - time.monotonic_ns()) / 1e9))
            for key, _ in self._selector.select(timeout):
                self._read(key.fileobj, key.data)  # type: ignore[arg-type]
            now = time.monotonic_ns()
            while heap and heap[0][0] <= now:
                _, _, sock, data, address = heapq.heappop(heap)
                with contextlib.suppress(OSError):
                    sock.sendto(data, address)

    def _read(self, sock: socket.socket, route: object) -> None:
        for _ in range(64):  # a batch per wake-up, then the queue gets its turn
            try:
                data, source = sock.recvfrom(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # ECONNREFUSED on a peer socket: nobody at forward (yet)
                return
            if route is None:  # unicast, from a peer to listen: the data direction
                peer_socket = self._peer_socket(source)
                self._schedule(self.data, peer_socket, data, self.forward)
            elif route[0] == "reply":  # unicast, back from forward: the control direction
                self._schedule(self.control, self._listen, data, route[1])
            else:
                direction, out, destination = route
                link = self.data if direction == "data" else self.control
                self._schedule(link, out, data, destination)
