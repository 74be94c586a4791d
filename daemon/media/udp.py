"""UDP transports: the driver's sockets for its send and receive channel endpoints.

This is the I/O shell of the network stack (the sans-I/O core never sees a socket):

* a **send endpoint** (one per channel address a publication sends to) sends DATA and
  retransmissions through the C data path (``ss_send_data``: ``sendmmsg`` of iovecs into the
  log, runs of equal datagrams as one GSO send) and the Python half's control frames
  through the same send point in C (:mod:`~slipstream.daemon.media.send_point`), and receives
  the status messages, NAKs and RTTMs that come back with ``recvmmsg`` in C.  Unicast: bound
  to ``control=``, else to ``interface=`` (its port, if it names one: Aeron's local address),
  else to an ephemeral port, and connected to the endpoint.  Multicast (docs/CHANNELS.md
  §7.2): bound to the control group (data group + 1, same port) which it joins, sending to the
  data group;
* a **receive endpoint** (one per address subscribed to) receives with ``recvmmsg`` in C, which
  validates every frame and inserts DATA into the images' logs; the rest goes up to the
  :class:`ReceiveChannel`.  Unicast: bound to the endpoint.  Multicast: bound to the data group,
  joined on the interface, status messages and NAKs sent to the control group;
* a **multi-destination subscription's** receive endpoint (``control-mode=manual``,
  :class:`~slipstream.daemon.media.receive_destinations.MultiDestinationReceiveTransport`,
  which the simulator shares): no socket of its own, a receive socket
  (:class:`UdpReceiveTransport`) per destination its subscriptions add, each read by its own
  C receiver into the one channel's images; what Python sends leaves through the destination
  it names (``Datagram.via``).

Every datagram leaves through a channel endpoint's send in C with the UDP transport binding
below it (sendmmsg on the socket); these transports open the sockets and point the C halves
at them, and never send themselves.

Sockets are non-blocking; ``SO_RCVBUF``/``SO_SNDBUF`` come from the URI (``so-rcvbuf``,
``so-sndbuf``) or the settings, and a kernel that grants less than asked is logged once,
naming ``net.core.rmem_max``/``wmem_max``.  ``interface=`` sets ``IP_MULTICAST_IF`` and the
interface of the group membership; TTL from ``ttl=`` or ``socket_multicast_ttl``; multicast
loop is on, so drivers on one host hear each other.  IPv4 and IPv6 unicast, IPv4 multicast.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import logging
import os
import socket
import struct
import weakref
from typing import Final

from slipstream.client.channel import Channel
from slipstream.client.counters import CountersFile, SystemCounter
from slipstream.client.errors import ChannelError
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.media import interfaces, names, send_point
from slipstream.daemon.media.destinations import (
    MULTI_DESTINATION_MODES,
    DestinationTable,
    ip_version_of,
)
from slipstream.daemon.media.interfaces import InterfaceAddress
from slipstream.daemon.media.receive_channel import ReceiveChannel
from slipstream.daemon.media.receive_destinations import MultiDestinationReceiveTransport
from slipstream.daemon.media.sealing import KeyRing, Sealing
from slipstream.daemon.media.send_channel import SendChannel
from slipstream.daemon.protocol.params import SocketParams
from slipstream.daemon.protocol.types import Address, Datagram, address_of, sockaddr
from slipstream.daemon.streams.publication import NetworkPublication

log = logging.getLogger("slipstream.driver")

#: Datagrams per recvmmsg on a receive endpoint, and the buffer for each: the largest UDP
#: payload a frame may have (docs/PROTOCOL.md §2.1: MTU at most 65504).
RECEIVE_BATCH: Final = 32
RECEIVE_BUFFER_LENGTH: Final = 65536
#: A send endpoint only receives control frames (at most 1063 bytes, an ERR).
CONTROL_BATCH: Final = 16
CONTROL_BUFFER_LENGTH: Final = 2048
#: Datagrams for Python per receive call, in receive buffers (a pool of batch x this): a buffer
#: the kernel coalesced (UDP_GRO) holds datagrams of one source, and those not data of a known
#: image are few (SETUPs, RTTMs, and a new session's data, which goes up once per buffer).
TO_PYTHON_PER_BUFFER: Final = 16
#: Source addresses a receiver keeps decoded (a NAK or SM per lost datagram or window comes
#: from the same few peers); past this many the cache starts again.
MAX_SOURCES_CACHED: Final = 1024

#: linux/udp.h; Python's socket module names neither (the data path sets UDP_SEGMENT in C).
UDP_SEGMENT: Final = 103
UDP_GRO: Final = 104
_warned_buffers: set[tuple[str, int, int]] = set()


class UdpTransports:
    """The driver's :class:`~slipstream.daemon.conductor.network.NetworkTransports`."""

    def __init__(self, settings: DriverSettings, counters: CountersFile) -> None:
        self.settings = settings
        self.counters = counters
        #: Encrypted channels' keys (key=NAME) and their endpoints' contexts.
        self.keys = KeyRing(settings.keys_dir, counters)
        self._next_reload_ns = 0

    def _sealing(self, channel: Channel) -> Sealing | None:
        return (None if channel.key is None
                else self.keys.sealing_for(str(channel), channel.key))

    def open_send(self, channel: Channel, destination: Address) -> UdpSendTransport:
        return UdpSendTransport(self.settings, self.counters, channel, destination,
                                sealing=self._sealing(channel))

    def open_receive(self, channel: Channel, bind: Address) -> UdpReceiveTransport:
        return UdpReceiveTransport(self.settings, self.counters, channel, bind,
                                   sealing=self._sealing(channel))

    def open_multi_destination_receive(self, channel: Channel
                                       ) -> MultiDestinationReceiveTransport:
        if channel.key is not None:
            raise ChannelError(str(channel), "key", "a multi-destination subscription "
                                                    "(control-mode=manual) is not encrypted "
                                                    "yet: leave key= out")
        return MultiDestinationReceiveTransport()

    def reload_keys(self, now_ns: int) -> None:
        """Every ``keys_reload_interval``: the key files in use read again if they changed
        (the conductor's timer)."""
        if now_ns >= self._next_reload_ns:
            self._next_reload_ns = now_ns + self.settings.keys_reload_interval
            self.keys.reload()

    def local_addresses(self) -> list[InterfaceAddress]:
        """This host's interface addresses (``getifaddrs``)."""
        return interfaces.local_addresses()


class _BatchReceiver:
    """recvmmsg buffers for one socket, in its C receiver (``ss_receiver_t`` fields), which the
    agent's C half reads into; :meth:`dispatch` hands what it left for Python up."""

    def __init__(self, receiver, fd: int, batch: int, buffer_length: int) -> None:
        # receiver: cdata ss_receiver_t *
        self.batch = batch
        self.buffer_length = buffer_length
        self.buffers = network_ffi.new("uint8_t[]", batch * buffer_length)
        self.sources = network_ffi.new("uint8_t[]", batch * network.SS_SOCKADDR_MAX)
        self.source_lengths = network_ffi.new("int32_t[]", batch)
        capacity = batch * TO_PYTHON_PER_BUFFER
        self.pending = network_ffi.new("int32_t[]", 3 * capacity)  # (buffer, offset, length)
        self.view = memoryview(network_ffi.buffer(self.buffers))
        self.source_view = memoryview(network_ffi.buffer(self.sources))
        receiver.batch = batch
        receiver.buffer_length = buffer_length
        receiver.buffers = self.buffers
        receiver.sources = self.sources
        receiver.source_lengths = self.source_lengths
        receiver.to_python_capacity = capacity
        receiver.pending = self.pending
        receiver.pending_count = 0
        receiver.fd = fd
        self._sources: dict[bytes, Address] = {}  # struct sockaddr -> (ip, port)

    def dispatch(self, receiver, now_ns: int, handle) -> int:
        """Every datagram the C half left for Python goes to ``handle(data, source, now_ns)``;
        the C half reads the socket again at its next duty cycle.  Returns how many there
        were."""
        if receiver.failed:
            receiver.failed = 0
            log.warning("receive failed: %s", os.strerror(receiver.last_errno))
        count = receiver.pending_count
        # Taken before they are handled: one that raises must not hold the socket's later
        # datagrams back (the buffers stay as they are until this returns to C).
        receiver.pending_count = 0
        pending = self.pending
        for k in range(0, 3 * count, 3):
            i, start, length = pending[k], pending[k + 1], pending[k + 2]
            source_start = i * network.SS_SOCKADDR_MAX
            raw = bytes(self.source_view[source_start:source_start + self.source_lengths[i]])
            source = self._sources.get(raw)
            if source is None:
                try:
                    source = address_of(raw)
                except (ValueError, struct.error):
                    continue
                if len(self._sources) >= MAX_SOURCES_CACHED:
                    self._sources.clear()
                self._sources[raw] = source
            handle(self.view[start:start + length], source, now_ns)
        return count


_IP_FAMILIES: Final = {4: socket.AF_INET, 6: socket.AF_INET6}


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET


def _interface_address(channel: Channel) -> str | None:
    """The ``interface=`` host as an IP literal's canonical text, or None when there is none.
    A name was replaced by its address as the channel was added
    (:mod:`slipstream.daemon.media.names`): a transport resolves nothing, and one given a
    name is refused, naming it."""
    if channel.interface is None:
        return None
    host = channel.interface.host
    address = names.ip_literal(host)
    if address is None:
        raise ChannelError(str(channel), "interface",
                           f"{host!r} is a name: it is resolved as its channel is added, "
                           f"never by a transport")
    return address


_AF_UNSPEC_SOCKADDR: Final = struct.pack("=H14x", socket.AF_UNSPEC)


def _disconnect(fd: int) -> None:
    """Dissolve a UDP socket's association (connect to ``AF_UNSPEC``, which Python's
    ``socket.connect`` cannot express): its peer and the source address it chose go."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.connect(fd, _AF_UNSPEC_SOCKADDR, len(_AF_UNSPEC_SOCKADDR)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _new_socket(family: socket.AddressFamily, params: SocketParams) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        for option, asked, name, limit in (
                (socket.SO_RCVBUF, params.so_rcvbuf, "so-rcvbuf", "net.core.rmem_max"),
                (socket.SO_SNDBUF, params.so_sndbuf, "so-sndbuf", "net.core.wmem_max")):
            if not asked:
                continue
            sock.setsockopt(socket.SOL_SOCKET, option, asked)
            granted = sock.getsockopt(socket.SOL_SOCKET, option) // 2  # Linux doubles it
            if granted < asked and (name, asked, granted) not in _warned_buffers:
                _warned_buffers.add((name, asked, granted))
                log.warning("%s: asked for %d bytes, the kernel gave %d: raise %s (sysctl -w "
                            "%s=%d) or ask for less", name, asked, granted, limit, limit, asked)
    except BaseException:
        sock.close()
        raise
    return sock


def _set_multicast(sock: socket.socket, params: SocketParams, channel: Channel,
                   group: str, interface: str | None) -> None:
    """Join ``group`` on ``interface`` and send multicast from it, with TTL and loop."""
    if ipaddress.ip_address(group).version != 4:
        raise ChannelError(str(channel), "endpoint", "IPv6 multicast is not supported yet")
    local = socket.inet_aton(interface or "0.0.0.0")
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                    socket.inet_aton(group) + local)
    if interface is not None:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, local)
    if params.multicast_ttl:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, params.multicast_ttl)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)


def _enable_gro(sock: socket.socket) -> None:
    """Let the kernel hand over runs of datagrams of one flow as one buffer (UDP_GRO): a GSO
    send crosses loopback or a veth whole, and is received in one copy; the data path cuts
    it at the segment size.  A kernel without it (before 5.0) receives datagram by datagram."""
    try:
        sock.setsockopt(socket.IPPROTO_UDP, UDP_GRO, 1)
    except OSError:
        pass


class _UdpTransport:
    def __init__(self, sock: socket.socket, counters: CountersFile) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.counters = counters
        self._errors_logged: set[int] = set()

    def _send_error(self, code: int, address: Address) -> None:
        self.counters.add(SystemCounter.SEND_ERRORS)
        if code not in self._errors_logged:
            self._errors_logged.add(code)
            log.warning("sending to %s:%d failed: %s", address[0], address[1],
                        os.strerror(code))

    def close(self) -> None:
        self.sock.close()


class UdpSendTransport(_UdpTransport):
    """A send endpoint's socket (see the module docstring)."""

    def __init__(self, settings: DriverSettings, counters: CountersFile, channel: Channel,
                 destination: Address, *, sealing: Sealing | None = None) -> None:
        """``sealing``: an encrypted channel's context: every datagram sent sealed, every one
        received opened (None: plain)."""
        self.sealing = sealing
        interface = _interface_address(channel)
        #: Multi-destination-cast: every datagram to each destination of the endpoint's table
        #: (set by attach_channel), none to ``destination`` (ALL_DESTINATIONS).
        self.multi_destination = channel.control_mode in MULTI_DESTINATION_MODES
        # A response endpoint's publications each send to a table of their own (their C
        # halves' destinations: send_point.attach_publication).
        to_tables = self.multi_destination or channel.is_response
        family = (_IP_FAMILIES[ip_version_of(channel)] if to_tables
                  else _family(destination[0]))
        params = SocketParams.resolve(channel, settings)
        sock = _new_socket(family, params)
        try:
            group = channel.control_group
            if to_tables:
                # Bound to control= (where dynamic receivers, and response subscriptions,
                # send their status messages), else to interface=, else anywhere; sends to
                # each destination by address.
                local = channel.control if channel.control is not None else channel.interface
                host = ((channel.control.host if channel.control is not None else interface)
                        or ("::" if family == socket.AF_INET6 else "0.0.0.0"))
                sock.bind((host, (local.port or 0) if local is not None else 0))
                self.connected = False
            elif group is not None:  # multicast: listen on the control group for SMs and NAKs
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((group.host, destination[1]))
                _set_multicast(sock, params, channel, group.host, interface)
                self.connected = False
                if sealing is not None:
                    # Handshakes to the data group: the receivers' sockets are bound to it.
                    sealing.set_handshake_address(sockaddr(destination))
            else:
                # control= pins the local address and port, else interface= (Aeron's
                # localControl and localData addresses).
                local = channel.control if channel.control is not None else channel.interface
                host = (local.host if channel.control is not None else interface) or (
                    "::" if family == socket.AF_INET6 else "0.0.0.0")
                port = (local.port or 0) if local is not None else 0
                sock.bind((host, port))
                sock.connect(destination)  # SMs and NAKs come back to this port
                self.connected = True
        except BaseException:
            sock.close()
            raise
        super().__init__(sock, counters)
        self.gso = int(settings.socket_gso)
        self._gso_refused: weakref.WeakSet[NetworkPublication] = weakref.WeakSet()
        self._control: _BatchReceiver | None = None
        self._destinations: DestinationTable | None = None

    def attach(self, publication: NetworkPublication) -> None:
        send_point.attach_publication(publication, fd=self.fd, table=self._destinations,
                                      connected=self.connected)
        publication.c.gso = self.gso
        publication.c.crypto = self.sealing.c if self.sealing is not None else network_ffi.NULL

    def on_notice(self, publication: NetworkPublication) -> None:
        c = publication.c
        if self.gso and not c.gso and publication not in self._gso_refused:
            self._gso_refused.add(publication)
            log.info("%s: the path refused GSO (%s); sending datagram by datagram", publication,
                     os.strerror(c.last_errno))
        code = c.last_errno
        if code and code not in self._errors_logged and code != errno.ECONNREFUSED:
            self._errors_logged.add(code)
            log.warning("sending %s failed: %s", publication, os.strerror(code))

    def retarget(self, address: Address) -> bool:
        """Connect the socket to ``address`` (Aeron's ``updateEndpoint``): disconnected first
        (``AF_UNSPEC``), so that the kernel chooses the source address for the new route; a
        port the channel did not pin (``control=``, ``interface=HOST:PORT``) may change with
        it, which the receiver learns from the data as any sender's.  Only a connected
        (unicast) endpoint has one peer to move.  Whether the socket sends there now (False:
        the connect failed, no route there yet say, and it sends to its old peer still)."""
        if not self.connected:
            return True
        try:
            previous = self.sock.getpeername()
        except OSError:
            previous = None
        try:
            _disconnect(self.fd)
            self.sock.connect(address)
        except OSError as e:
            self._send_error(e.errno or errno.EINVAL, address)
            # Connected to the old peer again: an unconnected socket would fail every send
            # (EDESTADDRREQ), a stream to the old address at least reaches a receiver there.
            if previous is not None:
                try:
                    self.sock.connect(previous)
                except OSError:
                    pass
            return False
        return True

    def attach_channel(self, channel: SendChannel) -> None:
        """Control frames: NAKs are answered in C (their retransmissions queued on the
        publications); SMs, RTTMs, ERRs and the NAKs C leaves (a retransmit delay, malformed,
        an unknown session) go to ``channel.on_control`` (:meth:`dispatch`).  A
        multi-destination-cast channel's table is where its publications send."""
        self._control = _BatchReceiver(channel.c, self.fd, CONTROL_BATCH, CONTROL_BUFFER_LENGTH)
        channel.c.crypto = self.sealing.c if self.sealing is not None else network_ffi.NULL
        if self.multi_destination:
            assert channel.destinations is not None, "a multi-destination-cast endpoint"
            self._destinations = channel.destinations

    def dispatch(self, channel: SendChannel, now_ns: int) -> int:
        if self._control is None:
            return 0
        taken = self._control.dispatch(channel.c, now_ns, channel.on_control)
        if channel.c.handshake_taken:
            # A receiver may just have got its session, having dropped the SETUP that made it
            # ask (docs/CHANNELS.md §7.8).
            channel.c.handshake_taken = 0
            for publication in channel.publications.values():
                publication.on_peer_handshake(now_ns)
        return taken


class UdpReceiveTransport(_UdpTransport):
    """A receive endpoint's socket (see the module docstring)."""

    def __init__(self, settings: DriverSettings, counters: CountersFile, channel: Channel,
                 bind: Address, *, sealing: Sealing | None = None) -> None:
        """``sealing``: as :class:`UdpSendTransport`'s."""
        self.sealing = sealing
        params = SocketParams.resolve(channel, settings)
        sock = _new_socket(_family(bind[0]), params)
        try:
            if ipaddress.ip_address(bind[0]).is_multicast:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(bind)
                _set_multicast(sock, params, channel, bind[0], _interface_address(channel))
                group = channel.control_group
                if sealing is not None and group is not None:
                    # Handshakes to the control group: the sender's socket is bound to it.
                    sealing.set_handshake_address(sockaddr((group.host,
                                                            group.port or bind[1])))
            else:
                sock.bind(bind)
            if settings.socket_gso:
                _enable_gro(sock)
        except BaseException:
            sock.close()
            raise
        super().__init__(sock, counters)
        self._receive: _BatchReceiver | None = None
        self._receiver = None  # cffi ss_receiver_t *: whose send this transport's frames take
        self._loss_threshold = settings.debug_receive_data_loss * (1 << 32) // 1_000_000
        self._loss_seed = settings.debug_receive_data_loss_seed

    def attach_channel(self, channel: ReceiveChannel) -> None:
        """The channel's C receiver reads this socket into these buffers (the agent's C
        half); what it leaves for Python goes to ``channel.on_control`` (:meth:`dispatch`)."""
        self.attach_receiver(channel.c)

    def attach_receiver(self, receiver) -> None:
        """``receiver`` (cffi ``ss_receiver_t *``: a channel's, or a destination's of a
        multi-destination subscription) reads this socket into these buffers."""
        self._receive = _BatchReceiver(receiver, self.fd, RECEIVE_BATCH, RECEIVE_BUFFER_LENGTH)
        self._receiver = receiver
        receiver.crypto = self.sealing.c if self.sealing is not None else network_ffi.NULL
        send_point.attach_receiver(receiver)
        receiver.loss_threshold = min(self._loss_threshold, (1 << 32) - 1)
        receiver.loss_state = self._loss_seed

    def send(self, datagrams: list[Datagram]) -> None:
        """The Python half's frames through the receive endpoint's send (its C receiver's)."""
        assert self._receiver is not None, "attached before it sends"
        for address, code in send_point.send_receiver_frames(self._receiver, datagrams):
            self._send_error(code, address)

    def dispatch(self, channel: ReceiveChannel, now_ns: int) -> int:
        return self.dispatch_receiver(channel.c, channel, now_ns)

    def dispatch_receiver(self, receiver, channel: ReceiveChannel, now_ns: int) -> int:
        """What ``receiver`` left for Python goes to ``channel.on_control``."""
        if self._receive is None:
            return 0
        if receiver.handshake_taken:
            # A publication may just have got this endpoint's session, having dropped the
            # joining SM that made it ask (docs/CHANNELS.md §7.8).
            receiver.handshake_taken = 0
            channel.on_peer_handshake(now_ns)
        return self._receive.dispatch(receiver, now_ns, channel.on_control)

    def receive_destination(self, channel: ReceiveChannel, index: int, now_ns: int) -> int:
        """Nothing: the C half reads this socket (a destination's transport without one
        hands its datagrams over here)."""
        return 0
