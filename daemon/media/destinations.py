"""A multi-destination-cast send endpoint's destinations (Aeron's destination tracker), sans-I/O.

A channel with ``control-mode=manual`` or ``control-mode=dynamic`` has no one endpoint: its send
endpoint sends every datagram (data, retransmissions, heartbeats, SETUP) to each destination of
its :class:`DestinationTable` (docs/PROTOCOL.md §7.4).  A response publication
(``control-mode=response``, §7.6) has a table of its own with at most one destination.

* **manual**: the publication's ``add_destination`` / ``remove_destination`` change the list;
  nothing else does, and a destination stays until it is removed.
* **dynamic**: a receiver joins by sending status messages to the endpoint's control address
  (its subscription names it with ``control=``); the source of each one that names a stream of
  the endpoint is a destination, until none has come from there for
  :data:`DESTINATION_TIMEOUT_NS`.
* **response**: the client's response subscription sends a setup-eliciting status message
  naming the response publication's session to the control address; its source is the one
  destination (:meth:`DestinationTable.learn_response_destination`), kept until a later one
  replaces it or the publication goes.

This module decides which destinations exist (the policy, per status message and timer);
the fan-out is the C half's: the send channel endpoint's send (``ss_send_channel_send``,
daemon/network_endpoints.c) sends every datagram, the Python half's included, to each
destination of the table (``ss_destination_list_t``), which this object writes, on the
sender's thread.  Units: ns.
"""

from __future__ import annotations

import enum
import ipaddress
from typing import Any, Final

import attrs

from slipstream.client.channel import Channel
from slipstream.client.layout import NO_DEADLINE
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon.protocol.types import Address, sockaddr

#: A dynamic destination with no status message for this long is dropped (Aeron's
#: ``DESTINATION_TIMEOUT``, 5 s).
DESTINATION_TIMEOUT_NS: Final = 5_000_000_000

#: The address a publication of such an endpoint gives its control frames (SETUP, RTTM,
#: heartbeats sent from Python): its endpoint's send in C sends them to every destination
#: (daemon/media/send_point.py).
ALL_DESTINATIONS: Final[Address] = ("0.0.0.0", 0)


class ControlMode(enum.Enum):
    MANUAL = "manual"
    DYNAMIC = "dynamic"
    #: A response publication's own table (docs/PROTOCOL.md §7.6): one destination, the
    #: source of the latest setup-eliciting status message naming its session (its client's
    #: response subscription), as Aeron's response publication keeps its endpoint address.
    RESPONSE = "response"


#: The ``control-mode=`` values of a multi-destination-cast channel.
MULTI_DESTINATION_MODES: Final = frozenset((ControlMode.MANUAL.value, ControlMode.DYNAMIC.value))
#: The control modes whose publications send to a table (:data:`ALL_DESTINATIONS`), not to
#: an endpoint: the multi-destination-cast endpoint's, or a response publication's own.
TABLE_MODES: Final = MULTI_DESTINATION_MODES | {ControlMode.RESPONSE.value}


def ip_version_of(channel: Channel) -> int:
    """The IP version (4 or 6) of a multi-destination-cast endpoint's socket and so of its
    destinations: its ``control=`` address's, else ``interface=``'s, else 4 (resolved
    channels: IP literals)."""
    local = channel.control if channel.control is not None else channel.interface
    ip = local.ip if local is not None else None
    return ip.version if ip is not None else 4


def can_send_to(address: Address, ip_version: int) -> bool:
    """Whether a dynamic destination may be ``address``: a unicast host of the socket's IP
    version and a port (a status message's source could be anything: port 0, a group, the
    broadcast address, which no send reaches or every one would)."""
    try:
        ip = ipaddress.ip_address(address[0])
    except ValueError:
        return False
    return (ip.version == ip_version and 0 < address[1] < 65536 and not ip.is_multicast
            and not ip.is_unspecified and str(ip) != "255.255.255.255")


@attrs.define(eq=False)
class _Destination:
    address: Address
    last_seen_ns: int  # dynamic: its last status message


class DestinationTable:
    """The destinations of one multi-destination-cast send endpoint, and their C table.

    ``count_cell``: an int64 cell (cffi) that shows how many there are (the endpoint's
    ``mdc-destinations`` counter), or None."""

    def __init__(self, mode: ControlMode, *, ip_version: int = 4,
                 timeout_ns: int = DESTINATION_TIMEOUT_NS, count_cell: Any = None) -> None:
        self.mode = mode
        #: The socket's IP version: what a learned destination must be.
        self.ip_version = ip_version
        self.timeout_ns = timeout_ns
        self._count_cell = count_cell
        self._destinations: dict[Address, _Destination] = {}
        #: What every publication of the endpoint points at (``destinations``).
        self.c = network_ffi.new("ss_destination_list_t *")
        self._entries = network_ffi.new("ss_destination_t[]", 1)
        self.c.entries = self._entries
        self.c.count = 0

    @property
    def addresses(self) -> list[Address]:
        """The destinations, in the order datagrams go to them."""
        return list(self._destinations)

    def __contains__(self, address: object) -> bool:
        return address in self._destinations

    def __len__(self) -> int:
        return len(self._destinations)

    def add(self, address: Address, now_ns: int) -> bool:
        """Send to ``address`` too (manual mode's ``add_destination``); False if it is one
        already."""
        if address in self._destinations:
            return False
        self._destinations[address] = _Destination(address, now_ns)
        self._sync()
        return True

    def remove(self, address: Address) -> bool:
        """Stop sending to ``address``; False if it was not a destination."""
        if self._destinations.pop(address, None) is None:
            return False
        self._sync()
        return True

    def on_status_message(self, source: Address, now_ns: int) -> bool:
        """A status message that names a stream of the endpoint came from ``source``: in
        dynamic mode it is a destination from now (or stays one), if it is an address to
        send to (:func:`can_send_to`).  Returns whether it is new."""
        if self.mode is not ControlMode.DYNAMIC:
            return False
        known = self._destinations.get(source)
        if known is not None:
            known.last_seen_ns = now_ns
            return False
        if not can_send_to(source, self.ip_version):
            return False
        self._destinations[source] = _Destination(source, now_ns)
        self._sync()
        return True

    def learn_response_destination(self, source: Address) -> bool:
        """Response mode: a setup-eliciting status message naming the table's publication came
        from ``source``, its client's response subscription: the one destination from now on
        (a later one replaces it, as a client's address may change behind a NAT).  False,
        and nothing changes, when ``source`` is no address to send to (:func:`can_send_to`)."""
        assert self.mode is ControlMode.RESPONSE
        if not can_send_to(source, self.ip_version):
            return False
        if list(self._destinations) != [source]:
            self._destinations = {source: _Destination(source, 0)}
            self._sync()
        return True

    def clear(self) -> None:
        """No destinations (its endpoint closes)."""
        if self._destinations:
            self._destinations.clear()
            self._sync()

    def expire(self, now_ns: int) -> list[Address]:
        """Dynamic mode: drop the destinations silent for ``timeout_ns``; returns them."""
        if self.mode is not ControlMode.DYNAMIC:
            return []
        gone = [d.address for d in self._destinations.values()
                if now_ns - d.last_seen_ns >= self.timeout_ns]
        for address in gone:
            del self._destinations[address]
        if gone:
            self._sync()
        return gone

    def next_expiry_ns(self) -> int:
        """When :meth:`expire` may next drop one (NO_DEADLINE: never)."""
        if self.mode is not ControlMode.DYNAMIC or not self._destinations:
            return NO_DEADLINE
        return min(d.last_seen_ns for d in self._destinations.values()) + self.timeout_ns

    def _sync(self) -> None:
        """A new C table: the old one is replaced whole, never changed under the data path
        (which reads it on this thread only between calls anyway)."""
        addresses = list(self._destinations)
        entries = network_ffi.new("ss_destination_t[]", max(1, len(addresses)))
        for entry, address in zip(entries, addresses, strict=False):
            raw = sockaddr(address)
            entry.length = len(raw)
            network_ffi.memmove(entry.address, raw, len(raw))
        self._entries = entries
        self.c.entries = entries
        self.c.count = len(addresses)
        if self._count_cell is not None:
            self._count_cell[0] = len(addresses)
