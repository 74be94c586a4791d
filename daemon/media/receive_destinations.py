"""A multi-destination subscription's receive endpoint (``control-mode=manual``,
docs/CHANNELS.md §7.5; Aeron's ReceiveChannelEndpoint over a MultiRcvDestination).

The endpoint has no socket of its own: each destination its subscriptions add is a receive
transport of its own (a UDP socket, ``daemon/media/udp.py``, or the simulator's virtual one,
``sim/transport.py``), read by a C receiver of its own into the channel's one image table
(:meth:`~slipstream.daemon.media.receive_channel.ReceiveChannel.attach_destination`).  What
the channel's Python half sends leaves through the destination it names (``Datagram.via``):
that destination's transport hands it to its C receiver's send
(:func:`~slipstream.daemon.media.send_point.send_receiver_frames`), from its socket.
The driver and the simulator run this one class; only the destinations' transports differ.
"""

from __future__ import annotations

from typing import Protocol

from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon.media.receive_channel import ReceiveChannel
from slipstream.daemon.protocol.types import Address, Datagram


class DestinationTransport(Protocol):
    """One destination's receive transport: bound to the destination's address (or joined
    to its group), its datagrams read through the C receiver it is given."""

    #: Its socket, which the C half reads; -1: none, its datagrams come through
    #: :meth:`receive_destination` (the simulator's).
    fd: int

    def attach_receiver(self, receiver) -> None:
        """``receiver`` (cffi ``ss_receiver_t *``) reads this transport's datagrams."""
        ...

    def receive_destination(self, channel: ReceiveChannel, index: int, now_ns: int) -> int:
        """A transport without a socket: hand what waits to ``channel`` as destination
        ``index``'s (:meth:`ReceiveChannel.on_datagram`); returns how many there were."""
        ...

    def dispatch_receiver(self, receiver, channel: ReceiveChannel, now_ns: int) -> int:
        """What ``receiver``'s C half left for Python goes to ``channel``; returns how many."""
        ...

    def send(self, datagrams: list[Datagram]) -> None:
        """Through the send of the C receiver it was given (:meth:`attach_receiver`)."""
        ...

    def close(self) -> None: ...


class MultiDestinationReceiveTransport:
    """A multi-destination subscription's receive endpoint (see the module docstring).  The
    conductor opens a destination's transport (``NetworkTransports.open_receive``); the
    receiver's thread attaches and detaches it (:meth:`add_destination`,
    :meth:`remove_destination`)."""

    #: No socket of its own (the network thread polls :attr:`fds`).
    fd = None

    def __init__(self) -> None:
        self._destinations: dict[int, tuple[DestinationTransport, object]] = {}
        #: Moves on with every change of :attr:`fds`: the network thread registers them anew
        #: (a closed socket's number may come back as another's).
        self.generation = 0
        #: Datagrams :meth:`send` dropped: their destination was not attached.
        self.dropped = 0

    @property
    def fds(self) -> list[int]:
        """The destinations' sockets: those their C receivers read (``fd`` >= 0), the one
        word that says whether a destination has a socket (ReceiveChannel asks it too)."""
        return [receiver.fd for _, receiver in self._destinations.values() if receiver.fd >= 0]

    def attach_channel(self, channel: ReceiveChannel) -> None:
        """Nothing to attach until a destination comes (:meth:`add_destination`)."""

    def add_destination(self, channel: ReceiveChannel, index: int,
                        transport: DestinationTransport, control: Address | None) -> None:
        """Receive through ``transport`` (bound to the destination) into ``channel``'s
        images, as destination ``index``; ``control``: a multicast destination's control
        group.  On the receiver's thread."""
        receiver = network_ffi.new("ss_receiver_t *")
        transport.attach_receiver(receiver)
        channel.attach_destination(index, receiver, control)
        self._destinations[index] = (transport, receiver)
        self.generation += 1

    def remove_destination(self, channel: ReceiveChannel, index: int, *,
                           close: bool = True) -> None:
        """Stop receiving through destination ``index`` and close its transport (unless not
        ``close``: its caller closes it, or gives it to the destination added again).  On the
        receiver's thread, whose C half stops reading it before it runs again."""
        entry = self._destinations.pop(index, None)
        channel.detach_destination(index)
        if entry is not None:
            self.generation += 1
            if close:
                entry[0].close()

    def receive(self, channel: ReceiveChannel, now_ns: int) -> int:
        """What waits at the destinations without a socket (the simulator's) goes to
        ``channel``, each datagram through its destination's C receiver; sockets are read by
        the C half.  Returns how many datagrams there were."""
        handled = 0
        for index, (transport, receiver) in list(self._destinations.items()):
            if receiver.fd < 0:
                handled += transport.receive_destination(channel, index, now_ns)
        return handled

    def dispatch(self, channel: ReceiveChannel, now_ns: int) -> int:
        """Each destination's datagrams for Python go to ``channel``, which knows which
        destination they came through (its replies leave through the same)."""
        handled = 0
        try:
            for index, (transport, receiver) in list(self._destinations.items()):
                channel.arrival_destination = index
                handled += transport.dispatch_receiver(receiver, channel, now_ns)
        finally:
            channel.arrival_destination = -1
        return handled

    def send(self, datagrams: list[Datagram]) -> None:
        """Each datagram through the destination it names (``via``).  One whose destination
        is no longer attached (removed since it was queued) or names none is dropped and
        counted (:attr:`dropped`): another destination's transport would send it from an
        address its sender never sent to, past the path it answers."""
        destinations = self._destinations
        for datagram in datagrams:
            entry = destinations.get(datagram.via)
            if entry is None:
                self.dropped += 1
                continue
            entry[0].send([datagram])

    def close(self) -> None:
        for transport, _ in self._destinations.values():
            transport.close()
        self._destinations.clear()
