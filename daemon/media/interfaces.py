"""This host's interface addresses, and the one an ``interface=ADDRESS/PREFIX`` names.

Aeron's subnet form of ``interface=`` (``interface=10.1.2.0/24``) names the local interface
that has an address in that subnet; the channel then sends, binds and joins from that address
(``InterfaceSearchAddress`` and ``UdpChannel.findInterface`` in Aeron's Java driver,
``aeron_find_interface`` in its C driver).  :func:`address_in_subnet` makes the same choice:
among the interfaces that are up and can multicast (or are the loopback) and have an address
in the subnet, not the loopback before the loopback, then the one whose own network is the
narrowest (the longest prefix), then the kernel's order; its first address in the subnet.
IPv6 link-local addresses (fe80::/10) are left out, and a subnet within fe80::/10 is refused:
such an address means something only with its interface's scope (``fe80::1%eth0``), which a
channel's address does not carry, and binding one without it fails (EINVAL).

The addresses come from the C library's ``getifaddrs`` (netlink: every address of every
interface, IPv4 and IPv6, with its netmask and the interface's flags), called through
``ctypes`` by :func:`local_addresses`: Python's standard library lists interface names
(``socket.if_nameindex``) but not their addresses, ``/proc`` lists IPv6 addresses only
(``/proc/net/if_inet6``), and the ``SIOCGIFCONF`` ioctl misses secondary IPv4 addresses.  The
choice takes the addresses as an argument: the network conductor gets them from its
transports (``NetworkTransports.local_addresses``), the real driver's calling
:func:`local_addresses`, the simulator's giving the simulated host's own address.  So a real
driver lists its interfaces on the conductor's thread, inside the conductor's cycle, each time
a channel whose ``interface=`` is a subnet is added (a netlink dump: about half a millisecond);
the network thread never does.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
from collections.abc import Callable, Sequence
from typing import Final

import attrs

from slipstream.client.channel import Channel
from slipstream.client.errors import ChannelError

#: net/if.h
IFF_UP: Final = 0x1
IFF_LOOPBACK: Final = 0x8
IFF_MULTICAST: Final = 0x1000

#: IPv6 link-local unicast: an address here needs its interface's scope to be bound.
LINK_LOCAL_V6: Final = ipaddress.IPv6Network("fe80::/10")


@attrs.frozen
class InterfaceAddress:
    """One address of one interface: ``address`` with its network (the netmask's prefix)."""

    name: str
    flags: int  # IFF_*
    address: ipaddress.IPv4Interface | ipaddress.IPv6Interface  # address/prefix

    @property
    def is_loopback(self) -> bool:
        return bool(self.flags & IFF_LOOPBACK)

    @property
    def usable(self) -> bool:
        """Up, and able to multicast or the loopback (Aeron's ``findInterface`` test)."""
        return bool(self.flags & IFF_UP) and bool(self.flags & (IFF_MULTICAST | IFF_LOOPBACK))

    def __str__(self) -> str:
        state = ("down" if not self.flags & IFF_UP else "up" if self.usable
                 else "up, no multicast")
        return f"{self.name} {self.address} ({state})"


class _SockAddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [  # struct ifaddrs, <ifaddrs.h>
    ("next", ctypes.POINTER(_IfAddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_SockAddr)),
    ("netmask", ctypes.POINTER(_SockAddr)),
    ("broadaddr_or_dstaddr", ctypes.POINTER(_SockAddr)),
    ("data", ctypes.c_void_p),
]

# Where the address bytes sit in a sockaddr_in and a sockaddr_in6 (<netinet/in.h>).
_ADDRESS_AT: Final = {socket.AF_INET: (4, 4), socket.AF_INET6: (8, 16)}  # offset, length


def _packed(sockaddr: ctypes._Pointer[_SockAddr]) -> tuple[int, bytes] | None:
    """(family, address bytes) of an AF_INET or AF_INET6 sockaddr, else None."""
    if not sockaddr:
        return None
    family = sockaddr.contents.family
    if family not in _ADDRESS_AT:
        return None
    offset, length = _ADDRESS_AT[family]
    return family, ctypes.string_at(ctypes.addressof(sockaddr.contents) + offset, length)


def local_addresses() -> list[InterfaceAddress]:
    """Every IPv4 and IPv6 address of this host's interfaces, in the kernel's order.
    OSError when the C library cannot list them."""
    libc = ctypes.CDLL(None, use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"getifaddrs: {os.strerror(code)}")
    found = []
    try:
        entry = head
        while entry:
            item = entry.contents
            address, netmask = _packed(item.addr), _packed(item.netmask)
            if address is not None:
                prefix = (int.from_bytes(netmask[1], "big").bit_count()
                          if netmask is not None and netmask[0] == address[0]
                          else len(address[1]) * 8)
                found.append(InterfaceAddress(
                    (item.name or b"").decode(errors="replace"), item.flags,
                    ipaddress.ip_interface((address[1], prefix))))
            entry = item.next
    finally:
        libc.freeifaddrs(head)
    return found


def address_in_subnet(channel: Channel, part: str, subnet: ipaddress.IPv4Network
                      | ipaddress.IPv6Network,
                      addresses: Callable[[], Sequence[InterfaceAddress]]) -> str:
    """The local address the subnet form ``part=ADDRESS/PREFIX`` of ``channel`` names (see the
    module docstring), as an IP literal; ``addresses()`` lists this host's (called once, and
    not for a subnet refused outright).  ChannelError naming ``part`` for a link-local IPv6
    subnet, when the host's addresses cannot be listed (OSError), or when no usable interface
    has an address in ``subnet`` other than a link-local one, listing the host's addresses."""
    if isinstance(subnet, ipaddress.IPv6Network) and subnet.subnet_of(LINK_LOCAL_V6):
        raise ChannelError(str(channel), part,
                           f"{subnet} is IPv6 link-local: an address there needs its "
                           f"interface's scope (fe80::1%eth0), which a channel's address does "
                           f"not carry; name a subnet of one of the interface's global or "
                           f"unique-local addresses")
    try:
        listed_addresses = list(addresses())
    except OSError as e:
        raise ChannelError(str(channel), part,
                           f"cannot list this host's interfaces to find {subnet}: "
                           f"{e.strerror or e}") from None
    # Each interface by its first address in the subnet, as Aeron's filterBySubnet.
    first: dict[str, tuple[int, InterfaceAddress]] = {}
    for i, a in enumerate(listed_addresses):
        if (a.address.version == subnet.version and a.address.ip in subnet
                and not (a.address.version == 6 and a.address.ip in LINK_LOCAL_V6)):
            first.setdefault(a.name, (i, a))
    candidates = [(not a.is_loopback, a.address.network.prefixlen, -i, a)
                  for i, a in first.values() if a.usable]
    if not candidates:
        listed = ", ".join(str(a) for a in listed_addresses) or "none"
        left_out = " other than a link-local one" if subnet.version == 6 else ""
        raise ChannelError(str(channel), part,
                           f"no interface of this host that is up and can multicast (or is the "
                           f"loopback) has an address in {subnet}{left_out}; its addresses: "
                           f"{listed}")
    return str(max(candidates, key=lambda c: c[:3])[3].address.ip)
