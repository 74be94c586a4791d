"""A multi-destination-cast send endpoint's destinations (Aeron's destination tracker), sans-I/O.

A channel with ``control-mode=manual`` or ``control-mode=dynamic`` has no one endpoint: its send
endpoint sends every datagram (data, retransmissions, heartbeats, SETUP) to each destination of
its :class:`DestinationTable` (docs/CHANNELS.md §7.4).  A response publication
(``control-mode=response``, §7.6) has a table of its own with at most one destination.

* **manual**: the publication's ``add_destination`` / ``remove_destination`` change the list;
  nothing else does, and a destination stays until it is removed.
* **dynamic**: a receiver joins by sending status messages to the endpoint's control address
  (its subscription names it with ``control=``); the source of each one that names a stream of
  the endpoint is first a *candidate*, and a destination once it has proved that it receives
  what is sent to its address (below), until none has come from there for
  :data:`DESTINATION_TIMEOUT_NS`.
* **response**: the client's response subscription sends a setup-eliciting status message
  naming the response publication's session to the control address; its source is the one
  destination (:meth:`DestinationTable.learn_response_destination`), kept until a later one
  replaces it or the publication goes.

Address validation (dynamic mode; RFC 9000 section 8.1's rule, docs/CHANNELS.md §7.4.1).  A
status message's source address can be forged, so a source is not sent the stream on its
word: a candidate is in no C table (the data path never sends to it), and what the endpoint
sends it (the validation probes) is charged against three times the bytes that arrived from it
(:meth:`DestinationTable.may_send`).  Each candidate has a *token*, 32 random bits drawn for it
and sent to its address only, in one of two probes:

* a heartbeat (an empty DATA frame) of the stream whose session id is the token: a receiver
  that takes any session of the stream and has no image of that one asks for its SETUP, a
  setup-eliciting status message naming the token (Aeron's
  ``aeron_data_packet_dispatcher_elicit_setup_from_source``, slipstream's receive channel);
  its image is then made from the SETUP its real session's data elicits once it is a
  destination, where the stream is then;
* an RTTM request whose echo timestamp is the token, to a receiver with an image of the
  session (one whose SMs name it): its reply echoes the token (Aeron's
  ``aeron_data_packet_dispatcher_on_rttm``).  A receiver that takes one session only (and
  ignores the heartbeat) gets that image from a SETUP sent to it alone once it asks again.

Either answer from the candidate's address, naming a receiver id that the candidate's joining
status messages (session 0, setup-eliciting) named, proves that a receiver configured to join,
reading datagrams sent to that address, answered: the candidate becomes a destination of that
receiver (:meth:`DestinationTable.on_token`), and only status messages naming that receiver id
keep it alive.  Any subscriber of the stream answers a probe; one that never asked to join (a
bystander whose address a forger named) answers with its own receiver id, 64 bits the forger
does not see, so it is not validated.  A candidate that has not done so within
``validation_timeout_ns`` is dropped, and at most ``max_candidates`` wait at once (a new one
takes the oldest's place), so forged source addresses cannot grow the table.  ``join``:
when given, only sources within these subnets are heard at all
(:meth:`DestinationTable.admits`).
"""

from __future__ import annotations

import enum
import ipaddress
import random
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs

from slipstream.client.channel import Channel, Subnet
from slipstream.client.layout import NO_DEADLINE
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.protocol.types import Address, sockaddr

#: A dynamic destination with no status message for this long is dropped (Aeron's
#: ``DESTINATION_TIMEOUT``, 5 s).
DESTINATION_TIMEOUT_NS: Final = 5_000_000_000

#: What a dynamic endpoint sends an address that has not proved it receives there, at most,
#: per byte that arrived from it (RFC 9000 section 8.1's anti-amplification limit).
AMPLIFICATION_FACTOR: Final = 3

#: The settings' defaults (a table made without them, as in unit tests).
_DEFAULTS: Final = attrs.fields(DriverSettings)

#: The address a publication of such an endpoint gives its control frames (SETUP, RTTM,
#: heartbeats sent from Python): its endpoint's send in C sends them to every destination
#: (daemon/media/send_point.py).
ALL_DESTINATIONS: Final[Address] = ("0.0.0.0", 0)


class ControlMode(enum.Enum):
    MANUAL = "manual"
    DYNAMIC = "dynamic"
    #: A response publication's own table (docs/CHANNELS.md §7.6): one destination, the
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


def random_tokens(rng: random.Random) -> Callable[[], int]:
    """A source of candidates' tokens (:class:`DestinationTable`'s ``token_source``) that
    draws from ``rng``: 32 random bits each, as an int32 session id other than 0 (a joining
    receiver's).  A driver's ``rng`` is the system's CSPRNG, so a token is unpredictable to
    anyone who does not read what is sent to its candidate's address; the simulator's is
    seeded, so a seeded run sends the same tokens every time."""

    def token() -> int:
        while True:
            value = rng.getrandbits(32) - (1 << 31)
            if value != 0:
                return value

    return token


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


class Heard(enum.Enum):
    """What a status message's source is to a dynamic table
    (:meth:`DestinationTable.on_status_message`)."""

    #: A validated destination: its status messages go on to the publications.
    DESTINATION = "destination"
    #: A candidate (new, or one still validating): only the validation exchange.
    CANDIDATE = "candidate"
    #: Outside the ``join=`` subnets: dropped.
    OUTSIDE_JOIN = "outside join"
    #: A new source while ``max_candidates`` candidates wait: a candidate now, in the place of
    #: the oldest, which is dropped (a flood of forged sources cannot hold the table full
    #: against a receiver that answers within its round trip).
    REPLACED = "replaced"
    #: From a destination's address, naming a receiver id it did not validate with: neither
    #: keeps it alive nor reaches a publication (a forger keeping a receiver that left).
    UNKNOWN_RECEIVER = "unknown receiver"
    #: A joining SM from a destination's address naming another receiver (one restarted at
    #: the same address): it validates as a candidate does, and on success the destination
    #: is that receiver's; meanwhile its SMs keep nothing alive.
    REJOINING = "rejoining"
    #: No address to send to (:func:`can_send_to`).
    UNSENDABLE = "unsendable"


#: Receiver ids a candidate's joining status messages may name (a forger may add its own;
#: the one its address answers with must be among them).
_RECEIVER_IDS_MAX: Final = 4


@attrs.define(eq=False)
class _Destination:
    address: Address
    last_seen_ns: int  # its last status message (manual: or when it was added)
    #: dynamic: the receiver id it validated with; only its status messages keep it alive
    #: (None: added by the application, or a response table's)
    receiver_id: int | None = None


@attrs.define(eq=False)
class _Candidate:
    """A source not yet validated: what arrived from it and what went to it, bytes."""

    address: Address
    since_ns: int  # when its first status message arrived
    token: int  # the session id (or RTTM echo) only a datagram to its address carried
    bytes_in: int = 0
    bytes_out: int = 0
    status_messages: int = 0  # heard from it
    #: the receiver ids of its joining status messages (session 0, setup-eliciting): what a
    #: receiver configured to join sends; a subscriber that never asked to join (a bystander
    #: whose address a forger names) answers a probe with its own, which is not among them
    receiver_ids: set[int] = attrs.Factory(set)


class DestinationTable:
    """The destinations of one multi-destination-cast send endpoint, and their C table.

    ``count_cell``: an int64 cell (cffi) that shows how many there are (the endpoint's
    ``mdc-destinations`` counter), or None."""

    def __init__(self, mode: ControlMode, *, ip_version: int = 4,
                 timeout_ns: int = DESTINATION_TIMEOUT_NS, count_cell: Any = None,
                 join: Sequence[Subnet] = (),
                 max_candidates: int = _DEFAULTS.mdc_candidates_max.default,
                 validation_timeout_ns: int = _DEFAULTS.mdc_validation_timeout.default,
                 token_source: Callable[[], int] | None = None) -> None:
        """``join``: dynamic mode hears only sources within these subnets (empty: any);
        ``max_candidates``: at most this many sources validate at once;
        ``validation_timeout_ns``: a candidate not validated within it is dropped;
        ``token_source``: a candidate's token (an int32 session id, never 0: a joining
        receiver's), unpredictable to anyone who does not read what is sent to its address
        (None: :func:`random_tokens` of the system's CSPRNG; a test gives fixed ones)."""
        self.mode = mode
        #: The socket's IP version: what a learned destination must be.
        self.ip_version = ip_version
        self.timeout_ns = timeout_ns
        self.join = tuple(join)
        self.max_candidates = max_candidates
        self.validation_timeout_ns = validation_timeout_ns
        self._token_source = (token_source if token_source is not None
                              else random_tokens(secrets.SystemRandom()))
        self._count_cell = count_cell
        self._destinations: dict[Address, _Destination] = {}
        self._candidates: dict[Address, _Candidate] = {}
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
        self._candidates.pop(address, None)  # sent to as the application says, from now
        if address in self._destinations:
            return False
        self._destinations[address] = _Destination(address, now_ns)
        self._sync()
        return True

    def heard(self, source: Address, now_ns: int) -> None:
        """Manual mode: a status message came from ``source``; a destination there is in
        contact (:meth:`silent`)."""
        known = self._destinations.get(source)
        if known is not None:
            known.last_seen_ns = now_ns

    def silent(self, now_ns: int, timeout_ns: int) -> frozenset[Address]:
        """Manual mode: the destinations no status message came from within ``timeout_ns``
        (since they were added, for one never heard): a destination given by host name is
        resolved again then (docs/CHANNELS.md §7.4)."""
        return frozenset(d.address for d in self._destinations.values()
                         if now_ns - d.last_seen_ns >= timeout_ns)

    def remove(self, address: Address) -> bool:
        """Stop sending to ``address``; False if it was not a destination."""
        if self._destinations.pop(address, None) is None:
            return False
        self._sync()
        return True

    @property
    def candidates(self) -> list[Address]:
        """The sources validating now, oldest first."""
        return list(self._candidates)

    def is_candidate(self, source: Address) -> bool:
        """Whether ``source`` is validating (a new source, or a destination's address where
        another receiver asked to join)."""
        return source in self._candidates

    def admits(self, source: Address) -> bool:
        """Whether ``source`` is within the ``join=`` subnets (True when there are none)."""
        if not self.join:
            return True
        try:
            ip = ipaddress.ip_address(source[0])
        except ValueError:
            return False
        return any(ip in subnet for subnet in self.join)

    def on_status_message(self, source: Address, now_ns: int, length: int, *,
                          receiver_id: int, joining: bool) -> Heard:
        """Dynamic mode: a status message (``length`` bytes, naming ``receiver_id``;
        ``joining``: session 0, setup-eliciting) that names a stream of the endpoint came
        from ``source``.  A destination's keeps it alive if it names the receiver id the
        destination validated with (else UNKNOWN_RECEIVER); a new source within the
        ``join=`` subnets that is an address to send to becomes a candidate, in the place of
        the oldest when ``max_candidates`` wait (REPLACED); a candidate's adds to what it may
        be sent, and a joining one's receiver id to those its answer may name."""
        assert self.mode is ControlMode.DYNAMIC
        known = self._destinations.get(source)
        if known is not None and (known.receiver_id is None or known.receiver_id == receiver_id):
            known.last_seen_ns = now_ns
            return Heard.DESTINATION
        if known is not None and not (joining or source in self._candidates):
            return Heard.UNKNOWN_RECEIVER
        if not self.admits(source):
            return Heard.OUTSIDE_JOIN
        heard = Heard.CANDIDATE
        candidate = self._candidates.get(source)
        if candidate is None:
            if not can_send_to(source, self.ip_version):
                return Heard.UNSENDABLE
            if len(self._candidates) >= self.max_candidates:
                del self._candidates[next(iter(self._candidates))]
                heard = Heard.REPLACED
            candidate = self._candidates[source] = _Candidate(source, now_ns,
                                                              self._token_source())
        candidate.bytes_in += length
        candidate.status_messages += 1
        if joining and len(candidate.receiver_ids) < _RECEIVER_IDS_MAX:
            candidate.receiver_ids.add(receiver_id)
        return Heard.REJOINING if known is not None else heard

    def token_of(self, candidate: Address) -> int:
        """The token of ``candidate`` (KeyError if it is none)."""
        return self._candidates[candidate].token

    def status_messages_of(self, candidate: Address) -> int:
        """How many status messages came from ``candidate`` (KeyError if it is none)."""
        return self._candidates[candidate].status_messages

    def may_send(self, candidate: Address, length: int) -> bool:
        """Whether ``length`` more bytes may go to ``candidate`` (then charged to it): what
        went to it stays within :data:`AMPLIFICATION_FACTOR` x what arrived from it.  False
        for an address that is no candidate."""
        entry = self._candidates.get(candidate)
        if entry is None or entry.bytes_out + length > AMPLIFICATION_FACTOR * entry.bytes_in:
            return False
        entry.bytes_out += length
        return True

    def on_token(self, source: Address, token: int, now_ns: int, *, receiver_id: int) -> bool:
        """A setup-eliciting status message naming session ``token``, or an RTTM reply echoing
        ``token``, came from ``source`` naming ``receiver_id``: if it is a candidate, that is
        its token, and the receiver id is one its joining status messages named (a receiver
        that asked to join answers with its own; a bystander a forger named, with another),
        it is a destination from now on, of that receiver.  Returns whether it validated."""
        entry = self._candidates.get(source)
        if entry is None or token != entry.token or receiver_id not in entry.receiver_ids:
            return False
        del self._candidates[source]
        # A destination already (a receiver restarted there): it is the new receiver's now.
        self._destinations[source] = _Destination(source, now_ns, receiver_id)
        self._sync()
        return True

    def expire_candidates(self, now_ns: int) -> list[Address]:
        """Drop the candidates that did not validate within ``validation_timeout_ns``;
        returns them."""
        gone = [c.address for c in self._candidates.values()
                if now_ns - c.since_ns >= self.validation_timeout_ns]
        for address in gone:
            del self._candidates[address]
        return gone

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
        self._candidates.clear()
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
        """When :meth:`expire` or :meth:`expire_candidates` may next drop one (NO_DEADLINE:
        never)."""
        if self.mode is not ControlMode.DYNAMIC:
            return NO_DEADLINE
        return min(min((d.last_seen_ns + self.timeout_ns for d in self._destinations.values()),
                       default=NO_DEADLINE),
                   min((c.since_ns + self.validation_timeout_ns
                        for c in self._candidates.values()), default=NO_DEADLINE))

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
