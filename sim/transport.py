"""Virtual transports: the simulator's stand-in for the driver's UDP sockets
(``daemon/media/udp.py``).

A driver in the simulator is the real conductor and the real sender and receiver agents; only
the transports they send and receive through are virtual.  Every datagram leaves through the
same channel endpoints' sends in C as a socket's (``daemon/network_endpoints.c``: the data
path's ``ss_send_data``, the Python half's frames through
:mod:`~slipstream.daemon.media.send_point`, a multi-destination-cast table's fan-out), with no
socket (``fd = -1``) and the simulator's transport binding below them
(``ss_virtual_binding``), which hands each datagram with its destination to the transport
(:meth:`_VirtualTransport.put_datagram`) and so onto the virtual network, from its address.  A
receive transport hands each arriving datagram to the receive channel's C dispatch
(``ss_receiver_on_datagram``), exactly as the socket path does after ``recvmmsg``.  Arrivals
queue until the host's next service pass, which the transport schedules (``host.wake()``).

A multi-destination subscription's endpoint (``control-mode=manual``) is the driver's own
(:class:`~slipstream.daemon.media.receive_destinations.MultiDestinationReceiveTransport`):
each destination is a :class:`VirtualReceiveTransport` bound to its address (or joined to
its group) whose arrivals go through that destination's C receiver, and the status messages
and NAKs of each path leave from the destination's address.  Response channels
(docs/CHANNELS.md §7.6) need of a network that a receive transport bound to port 0 takes a
port of the host's picking (a response subscription's, whose server learns it from the
status messages sent from there), which it does.
"""

from __future__ import annotations

import errno
import ipaddress
import weakref
from collections import deque
from typing import Final, Protocol

from slipstream.client.channel import Channel
from slipstream.client.errors import ChannelError
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.media import send_point
from slipstream.daemon.media.destinations import TABLE_MODES, DestinationTable
from slipstream.daemon.media.interfaces import IFF_MULTICAST, IFF_UP, InterfaceAddress
from slipstream.daemon.media.receive_channel import ReceiveChannel
from slipstream.daemon.media.receive_destinations import MultiDestinationReceiveTransport
from slipstream.daemon.media.send_channel import SendChannel
from slipstream.daemon.protocol.types import Address, Datagram
from slipstream.daemon.streams.publication import NetworkPublication
from slipstream.sim.network import Network, is_multicast


class TransportWorld(Protocol):
    """What the transports use of the simulation their host is in
    (:class:`~slipstream.sim.runner.Simulation`)."""

    network: Network
    settings: DriverSettings


class TransportHost(Protocol):
    """What the transports use of their host (:class:`~slipstream.sim.host.SimHost`): its
    address, its incarnation (each takes new ephemeral ports), its simulation, and its wake
    when a datagram arrives."""

    ip: str
    incarnation: int

    @property
    def sim(self) -> TransportWorld: ...

    def wake(self) -> None: ...


#: The prefix of the simulated hosts' network, 10.0.0.0/16 (sim/scenario.py's host_ip).
SIM_PREFIX: Final = 16

#: The first ephemeral port a host's send transports use; each incarnation takes a new one.
SEND_PORT_BASE: Final = 50000
#: The first port a receive transport bound to port 0 (a response subscription's) takes;
#: each incarnation takes new ones.
RECEIVE_PORT_BASE: Final = 55000
#: Ephemeral ports of each kind per incarnation.
PORTS_PER_INCARNATION: Final = 100


#: A UDP socket's send buffer when socket_so_sndbuf is 0: Linux's net.core.wmem_default.
DEFAULT_SO_SNDBUF = 212_992

class VirtualTransports:
    """The :class:`~slipstream.daemon.conductor.network.NetworkTransports` of one simulated
    host incarnation."""

    def __init__(self, host: TransportHost) -> None:
        self.host = host
        self.send_transports: list[VirtualSendTransport] = []
        self.receive_transports: list[VirtualReceiveTransport] = []
        self._ephemeral = 0  # receive ports bound to port 0 so far

    def _ephemeral_port(self, base: int, index: int) -> int:
        """Port ``index`` of this incarnation's ephemeral ports from ``base``.  Raises OSError
        (as a socket out of ports does) past :data:`PORTS_PER_INCARNATION` of them, where the
        next incarnation's begin (a late datagram to the old one would reach the new), or
        past 65535."""
        port = base + PORTS_PER_INCARNATION * self.host.incarnation + index
        if index >= PORTS_PER_INCARNATION or port > 65535:
            raise OSError(errno.EADDRNOTAVAIL,
                          f"host {self.host.ip} has no ephemeral port left in its incarnation "
                          f"{self.host.incarnation} ({PORTS_PER_INCARNATION} from {base})")
        return port

    @staticmethod
    def _plain(channel: Channel) -> None:
        if channel.key is not None:
            raise ChannelError(str(channel), "key", "the simulator carries no encrypted "
                                                    "channels (their sealing needs a socket "
                                                    "endpoint): leave key= out")

    def open_send(self, channel: Channel, destination: Address) -> VirtualSendTransport:
        self._plain(channel)
        port = self._ephemeral_port(SEND_PORT_BASE, len(self.send_transports))
        transport = VirtualSendTransport(self.host, (self.host.ip, port), channel)
        self.send_transports.append(transport)
        return transport

    def open_receive(self, channel: Channel, bind: Address) -> VirtualReceiveTransport:
        """A receive transport at ``bind``; any address (``0.0.0.0``, ``::``) is the host's,
        and port 0 an ephemeral one (a response subscription's, docs/CHANNELS.md §7.6)."""
        self._plain(channel)
        host, port = bind
        if ipaddress.ip_address(host).is_unspecified:
            host = self.host.ip
        if port == 0:
            self._ephemeral += 1
            port = self._ephemeral_port(RECEIVE_PORT_BASE, self._ephemeral)
        transport = VirtualReceiveTransport(self.host, (host, port))
        self.receive_transports.append(transport)
        return transport

    def open_multi_destination_receive(self, channel: Channel
                                       ) -> MultiDestinationReceiveTransport:
        """The driver's multi-destination receive endpoint; each destination it is handed is
        one of :meth:`open_receive`."""
        return MultiDestinationReceiveTransport()

    def reload_keys(self, now_ns: int) -> None:
        """Nothing: the simulator has no keys (:meth:`_plain`)."""

    def local_addresses(self) -> list[InterfaceAddress]:
        """The simulated host's one interface: its address in the simulator's network
        (10.0.0.0/16), up and able to multicast; never the real machine's."""
        return [InterfaceAddress("sim0", IFF_UP | IFF_MULTICAST,
                                 ipaddress.ip_interface(f"{self.host.ip}/{SIM_PREFIX}"))]


class _VirtualTransport:
    def __init__(self, host: TransportHost, address: Address) -> None:
        self.host = host
        self.address = address  # what datagrams from here carry as their source
        self.inbox: deque[tuple[bytes, Address]] = deque()
        self._joined: list[Address] = []
        self._bound: Address | None = None
        #: The virtual binding's context (send_point.VirtualPort): this transport.
        self.binding_handle = network_ffi.new_handle(self)

    def _listen(self, address: Address) -> None:
        network = self.host.sim.network
        if is_multicast(address[0]):
            network.join(address, self.host.ip, self._arrive)
            self._joined.append(address)
        else:
            network.bind(address, self._arrive)
            self._bound = address

    def put_datagram(self, address: Address, data: bytes) -> None:
        """What this transport sent (the virtual binding's), onto the network from here."""
        self.host.sim.network.send(self.address, address, data)

    def _arrive(self, data: bytes, source: Address, _now_ns: int) -> None:
        self.inbox.append((data, source))
        self.host.wake()

    def dispatch(self, channel: object, now_ns: int) -> int:
        """Nothing waits in C for Python: :meth:`receive` handed everything over."""
        return 0

    def close(self) -> None:
        network = self.host.sim.network
        if self._bound is not None:
            network.unbind(self._bound)
            self._bound = None
        for group in self._joined:
            network.leave(group, self.host.ip)
        self._joined = []
        self.inbox.clear()


class VirtualSendTransport(_VirtualTransport):
    """A send endpoint: an ephemeral address, and for multicast the control group joined.
    A multi-destination-cast endpoint sends to its channel's table, a response endpoint's
    publications each to their own (docs/CHANNELS.md §7.4, §7.6)."""

    def __init__(self, host: TransportHost, address: Address, channel: Channel) -> None:
        if channel.control_mode in TABLE_MODES and channel.control is not None:
            address = (host.ip, channel.control.port or address[1])  # bound to control=
        super().__init__(host, address)
        self._listen(address)
        group = channel.control_group
        if group is not None:
            self._listen((group.host, group.port or 0))
        self._destinations: DestinationTable | None = None
        self._publications: weakref.WeakSet[NetworkPublication] = weakref.WeakSet()

    def attach(self, publication: NetworkPublication) -> None:
        """No socket: the publication's sends go through the simulator's binding, from this
        transport's address."""
        send_point.attach_publication(publication, fd=-1, table=self._destinations,
                                      virtual=self)
        self._publications.add(publication)

    def retarget(self, address: Address) -> bool:
        """The endpoint's publications send to ``address`` from now on (always: a virtual
        endpoint has no socket to connect)."""
        for publication in self._publications:
            send_point.retarget_publication(publication, address)
        return True

    def attach_channel(self, channel: SendChannel) -> None:
        """No socket: the channel's C dispatch stays at fd -1 and arrivals come through
        :meth:`receive`.  A multi-destination-cast channel's table is where its publications
        send (a response endpoint's publications get their own from the channel)."""
        self._destinations = channel.destinations

    def room(self, publication: NetworkPublication, now_ns: int) -> int:
        """How many more datagrams this endpoint's "socket" takes now (-1: any number): a
        send buffer of ``socket_so_sndbuf`` (Linux's default when 0) that the link's queue
        drains at its bandwidth, so a sender behind a bottleneck finds it full, as a real
        socket behind a qdisc does (the fullest link's, with several destinations)."""
        buffer = self.host.sim.settings.socket_so_sndbuf or DEFAULT_SO_SNDBUF
        rooms = []
        for target in send_point.destinations_of(publication):
            backlog = self.host.sim.network.backlog_bytes(self.address[0], target, now_ns)
            if backlog is not None:
                rooms.append(max(0, (buffer - backlog) // publication.c.mtu))
        return min(rooms, default=-1)

    def room_ready_ns(self, publication: NetworkPublication, now_ns: int) -> int:
        """When :meth:`room` is a datagram again (``now_ns``: it is)."""
        buffer = self.host.sim.settings.socket_so_sndbuf or DEFAULT_SO_SNDBUF
        return max((self.host.sim.network.drained_by_ns(
            self.address[0], target, buffer - publication.c.mtu, now_ns)
            for target in send_point.destinations_of(publication)), default=now_ns)

    def on_notice(self, publication: NetworkPublication) -> None:
        """Nothing fails on the virtual network."""

    def receive(self, channel: SendChannel, now_ns: int) -> int:
        inbox = self.inbox
        count = len(inbox)
        while inbox:
            data, source = inbox.popleft()
            channel.on_datagram(data, source, now_ns)
        return count


class VirtualReceiveTransport(_VirtualTransport):
    """A receive endpoint bound to the channel's endpoint (or joined to its data group), or
    one destination of a multi-destination subscription's."""

    #: No socket: the C receivers it is given read nothing by themselves.
    fd = -1

    def __init__(self, host: TransportHost, bind: Address) -> None:
        super().__init__(host, (host.ip, bind[1]))
        self._listen(bind)
        self._receiver = None  # cffi ss_receiver_t *: whose send this transport's frames take

    def attach_channel(self, channel: ReceiveChannel) -> None:
        """No socket: the channel's C dispatch stays at fd -1 and arrivals come through
        :meth:`receive`; its frames leave through the simulator's binding."""
        self.attach_receiver(channel.c)

    def send(self, datagrams: list[Datagram]) -> None:
        """The Python half's frames through the receive endpoint's send (its C receiver's):
        the virtual network takes every one."""
        assert self._receiver is not None, "attached before it sends"
        send_point.send_receiver_frames(self._receiver, datagrams)

    def receive(self, channel: ReceiveChannel, now_ns: int) -> int:
        return self.receive_destination(channel, -1, now_ns)

    def attach_receiver(self, receiver) -> None:
        """``receiver`` (cffi ``ss_receiver_t *``, a destination's) has no socket: its
        images' paths through it send nothing from C, and the Python half sends their
        control frames through :meth:`send`, through the simulator's binding."""
        receiver.fd = -1
        self._receiver = receiver
        send_point.attach_receiver(receiver, virtual=self)

    def receive_destination(self, channel: ReceiveChannel, index: int, now_ns: int) -> int:
        """Every arrival to ``channel`` through destination ``index``'s C receiver (-1: the
        channel's own); returns how many there were."""
        inbox = self.inbox
        count = len(inbox)
        while inbox:
            data, source = inbox.popleft()
            channel.on_datagram(data, source, now_ns, index)
        return count

    def dispatch_receiver(self, receiver, channel: ReceiveChannel, now_ns: int) -> int:
        """Nothing waits in C for Python: :meth:`receive_destination` handed it over."""
        return 0
