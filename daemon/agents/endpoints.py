"""A network agent's endpoints: a channel's dispatcher and the transport it meets the
network through (a UDP socket, ``daemon/media/udp.py``, or the simulator's virtual network).
The conductor makes them, hands them to the sender and the receiver in commands
(:mod:`slipstream.daemon.agents.commands`), and each agent runs its endpoints' transports and
dispatchers in its duty cycle."""

from __future__ import annotations

from typing import Protocol

import attrs

from slipstream.daemon.media.receive_channel import ReceiveChannel
from slipstream.daemon.media.send_channel import SendChannel
from slipstream.daemon.protocol.types import Address, Datagram
from slipstream.daemon.streams.publication import NetworkPublication


class SendTransport(Protocol):
    """How a send endpoint meets its network: a UDP socket (``daemon/media/udp.py``) or the
    simulator's virtual network."""

    def attach(self, publication: NetworkPublication) -> None:
        """Point the publication's C half at this transport (socket, binding, destinations:
        :func:`~slipstream.daemon.media.send_point.attach_publication`); every datagram it
        sends, the Python half's too, leaves through its endpoint's send in C."""
        ...

    def room(self, publication: NetworkPublication, now_ns: int) -> int:
        """A transport without a socket (the simulator's): how many more datagrams it takes
        now (-1: any number).  With a socket the agent's C half sends."""
        ...

    def room_ready_ns(self, publication: NetworkPublication, now_ns: int) -> int:
        """A transport without a socket: when it takes a datagram again (``now_ns``: now)."""
        ...

    def attach_channel(self, channel: SendChannel) -> None:
        """Give ``channel``'s C dispatch this transport's socket and receive buffers (fd -1:
        none, the datagrams come through :meth:`receive`)."""
        ...

    def receive(self, channel: SendChannel, now_ns: int) -> int:
        """Hand every waiting control datagram to ``channel`` (a transport without a socket);
        returns how many there were."""
        ...

    def dispatch(self, channel: SendChannel, now_ns: int) -> int:
        """Hand the datagrams the C half left for Python to ``channel``; returns how many."""
        ...

    def on_notice(self, publication: NetworkPublication) -> None:
        """The C data path failed to send, or the path refused GSO: log it once."""
        ...

    def retarget(self, address: Address) -> bool:
        """A unicast endpoint's peer is at ``address`` now (its name resolved there): every
        datagram of its publications goes there from now on, and what comes back from there
        is heard.  Whether it does (False: it could not, and sends where it did)."""
        ...

    def close(self) -> None: ...


@attrs.define(eq=False)
class SendEndpoint:
    """A send channel (its publications' dispatcher) and the transport it sends through."""

    channel: SendChannel
    transport: SendTransport


class ReceiveTransport(Protocol):
    """How a receive endpoint meets its network: a UDP socket (``daemon/media/udp.py``) or the
    simulator's virtual network."""

    def attach_channel(self, channel: ReceiveChannel) -> None:
        """Give ``channel``'s C receiver this transport's socket and receive buffers (fd -1:
        none, the datagrams come through :meth:`receive`)."""
        ...

    def receive(self, channel: ReceiveChannel, now_ns: int) -> int:
        """Hand every waiting datagram to ``channel`` (a transport without a socket); returns
        how many there were."""
        ...

    def dispatch(self, channel: ReceiveChannel, now_ns: int) -> int:
        """Hand the datagrams the C half left for Python to ``channel``; returns how many."""
        ...

    def send(self, datagrams: list[Datagram]) -> None:
        """Send control frames (SMs, NAKs, ...) now."""
        ...

    def close(self) -> None: ...


@attrs.define(eq=False)
class ReceiveEndpoint:
    """A receive channel and the transport it receives through."""

    channel: ReceiveChannel
    transport: ReceiveTransport
