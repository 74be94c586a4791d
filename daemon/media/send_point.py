"""The Python half's door to the one send point: the channel endpoints' sends in C
(``daemon/network_endpoints.c``), through which every datagram the driver sends leaves.

The C half's data, retransmissions, heartbeats, NAKs and status messages leave there; so do
the frames the Python half makes (SETUP, RTTM, rate announcements, heartbeats, and an
image's NAKs, status messages and ERRs), handed over here once per frame.  Behind the send
channel endpoint's send sits its destination list (a multi-destination-cast table, a response
publication's learned destination: :mod:`slipstream.daemon.media.destinations` decides what
is in it), so a frame to the endpoint goes to every destination without Python looping over
them; below it a transport binding makes the system call: the UDP socket's, or the virtual
binding, which hands each datagram with its destination to a :class:`VirtualPort` (the
simulator's network, ``sim/transport.py``).  A transport attaches a publication or a receiver
to its socket, binding and destinations with :func:`attach_publication` and
:func:`attach_receiver`.
"""

from __future__ import annotations

import errno
import functools
from collections.abc import Iterable
from typing import Any, Protocol

from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.media.destinations import ALL_DESTINATIONS, DestinationTable
from slipstream.daemon.protocol.types import Address, Datagram, address_of, sockaddr
from slipstream.daemon.streams.publication import NetworkPublication

#: Addresses kept as struct sockaddr (a frame goes to the same few peers again and again).
_SOCKADDRS_CACHED = 1024


@functools.lru_cache(maxsize=_SOCKADDRS_CACHED)
def _sockaddr(address: Address) -> bytes:
    return sockaddr(address)


@functools.lru_cache(maxsize=_SOCKADDRS_CACHED)
def _address(raw: bytes) -> Address:
    return address_of(raw)


class VirtualPort(Protocol):
    """Where the virtual binding puts what a transport without a socket sends: a virtual
    network's end, from the transport's address."""

    #: ``network_ffi.new_handle(self)``, kept alive by the port: the binding's context.
    binding_handle: Any

    def put_datagram(self, address: Address, data: bytes) -> None:
        """One datagram to ``address`` (``data`` is the port's to keep)."""
        ...


#: What a VirtualPort raised inside the virtual binding, which cffi cannot raise through C:
#: :func:`raise_port_errors` raises it in the Python caller of the C send.  Only the
#: simulator's single thread sends through the virtual binding.
_port_errors: list[BaseException] = []


def _keep_port_error(_type: type, value: BaseException, _traceback: Any) -> int:
    _port_errors.append(value)
    return -1  # ss_virtual_datagram's "not taken": the C send fails the datagram


def raise_port_errors() -> None:
    """Raise the first exception a :class:`VirtualPort` raised in the C sends since the last
    call (the others are dropped with it); nothing if none did."""
    if _port_errors:
        error = _port_errors[0]
        _port_errors.clear()
        raise error


@network_ffi.def_extern(onerror=_keep_port_error)
def ss_virtual_datagram(context, address, address_length: int, data, length: int) -> int:
    """The virtual binding (``ss_virtual_binding``): one datagram a channel endpoint's send
    sent, ``length`` bytes at ``data`` to the struct sockaddr at ``address``, goes to its
    :class:`VirtualPort` (``context``), copied (it may be a view of a log, which moves on
    while the datagram is in flight)."""
    port: VirtualPort = network_ffi.from_handle(context)
    port.put_datagram(_address(bytes(network_ffi.buffer(address, address_length))),
                      bytes(network_ffi.buffer(data, length)))
    return length


def attach_publication(publication: NetworkPublication, *, fd: int,
                       table: DestinationTable | None = None, connected: bool = False,
                       virtual: VirtualPort | None = None) -> None:
    """Point ``publication``'s C half at its send endpoint: socket ``fd`` (-1: none, the
    virtual binding's ``virtual`` port takes what it sends; else the UDP binding), and where
    the endpoint sends: each destination of ``table`` (a multi-destination-cast endpoint's),
    else the connected peer (``connected``, or a response publication, whose own table its
    endpoint's channel gives it), else the publication's destination."""
    c = publication.c
    c.fd = fd
    _bind(c, virtual)
    if table is not None:
        c.destinations = table.c
    elif connected or publication.destination == ALL_DESTINATIONS:
        c.destination_length = 0
    else:
        raw = _sockaddr(publication.destination)
        c.destination = raw
        c.destination_length = len(raw)


def retarget_publication(publication: NetworkPublication, address: Address) -> None:
    """``publication``'s endpoint sends to ``address`` now, where it sent to its destination
    (a unicast endpoint whose peer's name resolved anew): its C half's destination moves
    there; a connected socket's C half has none (its transport connects anew instead)."""
    c = publication.c
    if c.destinations == network_ffi.NULL and c.destination_length > 0:
        raw = _sockaddr(address)
        c.destination = raw
        c.destination_length = len(raw)


def attach_receiver(receiver: Any, *, virtual: VirtualPort | None = None) -> None:
    """Send a receive endpoint's frames (``receiver``: cffi ``ss_receiver_t *``) through its
    socket (``receiver.fd``), or to the ``virtual`` port."""
    _bind(receiver, virtual)


def _bind(c: Any, virtual: VirtualPort | None) -> None:
    if virtual is None:
        c.binding = network_ffi.NULL  # the UDP binding
        c.binding_context = network_ffi.NULL
    else:
        c.binding = network.ss_virtual_binding()
        c.binding_context = virtual.binding_handle


def send_publication_frames(publication: NetworkPublication,
                            datagrams: Iterable[Datagram]) -> None:
    """The Python half's frames of ``publication`` through its send endpoint's send: one to
    the publication's destination goes where the endpoint sends its data (each destination
    of its table), another to its own address.  C counts what it sends and notes a failure
    for the transport's ``on_notice``."""
    c = publication.c
    destination = publication.destination
    for datagram in datagrams:
        with network_ffi.from_buffer(datagram.data) as frame:
            if datagram.address == destination:
                network.ss_send_channel_send_frame(c, frame, len(frame), network_ffi.NULL, 0)
            else:
                raw = _sockaddr(datagram.address)
                network.ss_send_channel_send_frame(c, frame, len(frame), raw, len(raw))
    raise_port_errors()


def send_receiver_frames(receiver: Any, datagrams: Iterable[Datagram]
                         ) -> list[tuple[Address, int]]:
    """Frames of a receive endpoint (``receiver``: cffi ``ss_receiver_t *``) through its
    send, each to its address.  C counts the bytes sent and full sockets; returns the
    other failures, ``(address, errno)``, for the transport to count and log."""
    failed = []
    for datagram in datagrams:
        raw = _sockaddr(datagram.address)
        with network_ffi.from_buffer(datagram.data) as frame:
            if network.ss_receive_channel_send_frame(receiver, frame, len(frame), raw,
                                                     len(raw)) < 0:
                code = network_ffi.errno
                if code != errno.EAGAIN:
                    failed.append((datagram.address, code))
    raise_port_errors()
    return failed


def destinations_of(publication: NetworkPublication) -> list[Address]:
    """Where ``publication``'s send endpoint sends its data, as its C half holds it: each
    destination of its table, else its destination (none when connected)."""
    c = publication.c
    if c.destinations != network_ffi.NULL:
        table = c.destinations
        return [address_of(network_ffi.buffer(table.entries[i].address,
                                              table.entries[i].length))
                for i in range(table.count)]
    if c.destination_length > 0:
        return [address_of(network_ffi.buffer(c.destination, c.destination_length))]
    return []
