"""The network side's records, and what its parts share: the conductor's entries for send and
receive endpoints, network publications, subscriptions and images; the transports it opens
endpoints with; resolving a channel's names; allocating a stream's counters.

The parts (:mod:`.network_send`, :mod:`.network_receive`, :mod:`.network_spies`,
:mod:`.untethered`, :mod:`.network_drain`) keep these records in the dictionaries
:class:`~slipstream.daemon.conductor.network.NetworkConductor` makes and hands each of them;
all of it runs on the conductor's thread.  A record holds an agent's objects (its endpoint, its
publication or image), whose fields belong to the agent's thread but those
:mod:`slipstream.daemon.streams.ownership` gives the conductor.  Names with an underscore are
the network side's own: its modules (and tests) share them; nothing else in the driver uses
them.

Units: times in ns, sizes in bytes.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import attrs

from slipstream.client.channel import Channel
from slipstream.client.counters import CountersFile, CounterType
from slipstream.client.logbuffer import LogBuffer
from slipstream.daemon.agents.commands import RemovedDestination
from slipstream.daemon.agents.endpoints import (
    ReceiveEndpoint,
    ReceiveTransport,
    SendEndpoint,
    SendTransport,
)
from slipstream.daemon.conductor.resources import StreamInterest
from slipstream.daemon.media import interfaces, names
from slipstream.daemon.media.events import EndpointRemoved
from slipstream.daemon.media.interfaces import InterfaceAddress
from slipstream.daemon.pressure.episodes import BackPressureEpisodes, LogReadings
from slipstream.daemon.protocol.types import Address
from slipstream.daemon.streams.image import PublicationImage
from slipstream.daemon.streams.publication import NetworkPublication
from slipstream.daemon.streams.tether import TetherablePosition


class NetworkTransports(Protocol):
    """Opens the transports of channel endpoints (may raise OSError, e.g. a port in use)."""

    def open_send(self, channel: Channel, destination: Address) -> SendTransport:
        """A transport sending to ``destination`` (the endpoint, or the multicast data group)
        and receiving the control frames that come back."""
        ...

    def open_receive(self, channel: Channel, bind: Address) -> ReceiveTransport:
        """A transport receiving at ``bind`` (the endpoint, or the multicast data group)."""
        ...

    def open_multi_destination_receive(self, channel: Channel) -> ReceiveTransport:
        """A multi-destination subscription's endpoint (``control-mode=manual``): no socket of
        its own; each destination is a transport of :meth:`open_receive`, which the receiver's
        thread hands it (``add_destination``, ``remove_destination``).  The driver's and the
        simulator's are one class (:mod:`slipstream.daemon.media.receive_destinations`)."""
        ...

    def reload_keys(self, now_ns: int) -> None:
        """Read the key files of the encrypted channels in use again when they changed, at
        most every ``keys_reload_interval`` (called on the conductor's timer)."""
        ...

    def local_addresses(self) -> Sequence[InterfaceAddress]:
        """This host's interface addresses, which ``interface=ADDRESS/PREFIX`` chooses among
        (:mod:`slipstream.daemon.media.interfaces`); may raise OSError.  Called on the
        conductor's thread as such a channel is added."""
        ...


class _EndpointState(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"  # the agent was asked to remove it; a new user may still revive it


@attrs.define(eq=False)
class _SendEndpointEntry:
    key: tuple[Any, ...]
    endpoint: SendEndpoint
    #: The channel that opened it; its key= (an encrypted endpoint's) binds every later user.
    channel: Channel
    publications: int = 0
    state: _EndpointState = _EndpointState.OPEN
    generation: int = 0
    #: A multi-destination-cast endpoint's mdc-destinations counter.
    destinations_counter_id: int | None = None
    #: control-mode=manual: its destinations as the conductor added them (the sender's
    #: table follows by command; only the conductor changes a manual table).
    manual_destinations: dict[Address, str] = attrs.Factory(dict)
    #: Those of them given by host name, resolved again while silent, by address.
    named_destinations: dict[Address, _NamedDestination] = attrs.Factory(dict)
    #: The destinations the sender last found silent (DestinationsSilent), whole.
    silent_destinations: frozenset[Address] = frozenset()


@attrs.define(eq=False)
class _NamedDestination:
    """A manual multi-destination-cast destination added by host name
    (``endpoint=NAME:PORT``): where its endpoint sends to it now."""

    endpoint: _SendEndpointEntry
    address: Address
    name: str


@attrs.define(eq=False)
class _PublicationEntry:
    """A network publication as the conductor tracks it (the object itself is the sender's)."""

    registration_id: int
    key: tuple[Any, ...]
    channel: Channel
    publication: NetworkPublication
    endpoint: _SendEndpointEntry
    log: LogBuffer
    counter_ids: list[int]
    publisher_limit_id: int
    episodes: BackPressureEpisodes
    drops_counter_id: int
    readings: LogReadings  # what the episodes are sampled from
    #: durable=: the ids of its pub-durable and durable-rcv counters (None without).
    durable_counter_ids: tuple[int, int] | None = None
    publisher_refs: int = 0
    closing: bool = False
    #: Spy subscriptions reading its log (Aeron's spy links), and how many of them the sender
    #: has not taken yet (the publication's spy hold stays at their join positions until then).
    spies: list[TetherablePosition[NetworkSubscription]] = attrs.Factory(list)
    spy_joins_pending: int = 0
    #: Untethered spies left behind, resting until they rejoin (their tethers RESTING).
    resting_spies: list[TetherablePosition[NetworkSubscription]] = attrs.Factory(list)
    #: Spies that want it but found the counters full as it was made: linked on the
    #: conductor's timer once there is room (:meth:`.SpySubscriptions.link_missed_spies`).
    missed_spies: list[NetworkSubscription] = attrs.Factory(list)
    #: A response publication's request image, while that sends RSP_SETUP (until this
    #: publication is connected: :meth:`.network_send.SendSide.check_response_connections`).
    response_image: PublicationImage | None = None
    #: Refusals its receivers answered its SETUPs with (ERR frames), and when its publishers
    #: were last told of one (ns; :meth:`.network_send.SendSide.on_publication_rejected`).
    refusals: int = 0
    refusal_told_ns: int = -(1 << 62)


@attrs.define(eq=False)
class NetworkSubscription(StreamInterest):
    """A client's subscription to a UDP channel."""

    registration_id: int
    client_id: int
    client_key: bytes
    channel: Channel
    stream_id: int
    endpoint: _ReceiveEndpointEntry | None = None
    #: A spy's (``aeron-spy:``): the key of the send endpoint whose publications it reads.
    spied_key: tuple[Any, ...] | None = None
    #: A response subscription's (``control-mode=response``): the session of the response
    #: publication its server made for it, as an RSP_SETUP named it; it takes no session
    #: before that (Aeron's response subscription waits outside the receiver until then).
    response_session_id: int | None = None

    def wants(self, session_id: int, stream_id: int) -> bool:
        if self.channel.is_response:
            return stream_id == self.stream_id and session_id == self.response_session_id
        return super().wants(session_id, stream_id)


@attrs.define(eq=False)
class _ImageEntry:
    registration_id: int
    image: PublicationImage
    log: LogBuffer
    counter_ids: list[int]
    source: Address
    links: list[TetherablePosition[NetworkSubscription]] = attrs.Factory(list)
    lingering: bool = False
    #: Untethered subscriptions left behind, resting until they rejoin (their tethers
    #: RESTING).
    resting: list[TetherablePosition[NetworkSubscription]] = attrs.Factory(list)


@attrs.define(eq=False)
class _ReceiveEndpointEntry:
    key: tuple[Any, ...]
    endpoint: ReceiveEndpoint
    subscriptions: list[NetworkSubscription] = attrs.Factory(list)
    images: dict[int, _ImageEntry] = attrs.Factory(dict)  # by image (id of the object)
    state: _EndpointState = _EndpointState.OPEN
    generation: int = 0
    #: A multi-destination subscription's (control-mode=manual): its destinations, by
    #: address, with each one's slot in its images' paths, and its mds-destinations counter.
    destinations: dict[Address, int] = attrs.Factory(dict)
    destinations_counter_id: int | None = None
    #: Each destination's socket (its transport) and the channel it was opened for.
    sockets: dict[Address, tuple[Any, Channel]] = attrs.Factory(dict)
    #: Destinations removed whose socket the receiver's thread may not have closed yet: an
    #: add of the same address takes the socket back rather than find its port in use.
    removing: dict[Address, RemovedDestination] = attrs.Factory(dict)


_Entry = TypeVar("_Entry", "_SendEndpointEntry", "_ReceiveEndpointEntry")


class EndpointsByChannel(Generic[_Entry]):
    """One side's endpoint entries by their agent's channel object (the :class:`SendChannel`
    or :class:`ReceiveChannel` an agent's event names), so an event finds its entry in O(1)
    however many endpoints there are.  An entry is in it from its creation until
    :func:`_close_endpoint`; its key may change meanwhile (a name resolved anew), its
    channel object does not."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}

    def add(self, entry: _Entry) -> None:
        self._entries[id(entry.endpoint.channel)] = entry

    def remove(self, entry: _Entry) -> None:
        if self._entries.get(id(entry.endpoint.channel)) is entry:
            del self._entries[id(entry.endpoint.channel)]

    def get(self, channel: object) -> _Entry | None:
        """The entry whose agent's channel is ``channel`` (this very object), or None."""
        entry = self._entries.get(id(channel))
        return entry if entry is not None and entry.endpoint.channel is channel else None

    def clear(self) -> None:
        self._entries.clear()


def _start_closing(entry: _SendEndpointEntry | _ReceiveEndpointEntry) -> int:
    """``entry``'s agent is to drop its endpoint: it is CLOSING, in a new generation, which
    is returned for the command (the agent's :class:`EndpointRemoved` names it back)."""
    entry.state = _EndpointState.CLOSING
    entry.generation += 1
    return entry.generation


def _is_removed_by(entry: _SendEndpointEntry | _ReceiveEndpointEntry,
                   event: EndpointRemoved) -> bool:
    """Whether ``event`` ends ``entry``: it is still CLOSING in the generation the event
    names, not revived by a new user since."""
    return entry.state is _EndpointState.CLOSING and entry.generation == event.generation


def _close_endpoint(entry: _SendEndpointEntry | _ReceiveEndpointEntry,
                    endpoints: dict[tuple[Any, ...], Any], by_channel: EndpointsByChannel[Any],
                    name_watch: names.NameWatch[Any], counters: CountersFile) -> None:
    """The agent dropped ``entry``'s endpoint: its socket closes, it leaves ``endpoints``
    (its side's, by key), ``by_channel`` and ``name_watch``, and its mds-destinations counter
    is freed."""
    entry.endpoint.transport.close()
    endpoints.pop(entry.key, None)
    by_channel.remove(entry)
    name_watch.unwatch(entry)
    if entry.destinations_counter_id is not None:
        counters.free(entry.destinations_counter_id)


def _allocate_subscriber_position(counters: CountersFile, subscription: NetworkSubscription,
                                  stream_id: int, session_id: int, position: int) -> int:
    """The sub-pos counter of ``subscription`` on the stream's session ``session_id``,
    reading ``position`` (bytes); its id.  CountersFullError if the file has no room."""
    return counters.allocate(
        CounterType.SUBSCRIBER_POSITION,
        f"sub-pos: {subscription.channel} stream={stream_id} "
        f"session={session_id} sub={subscription.registration_id}",
        registration_id=subscription.registration_id, session_id=session_id,
        stream_id=stream_id, owner_id=subscription.client_id, initial_value=position)


def _resolved(channel: Channel, name_cache: names.NameCache,
              local_addresses: Callable[[], Sequence[InterfaceAddress]]) -> Channel:
    """The channel with the names in its endpoint and interface replaced by IP literals, as
    the channel is added (:mod:`slipstream.daemon.media.names`: the driver's resolver
    answered for them before the command came here, so this looks them up in
    ``name_cache``): nothing on this thread resolves, nor anything downstream.  An interface
    given as a subnet (``interface=10.1.2.0/24``) becomes the address of the local interface
    in it, chosen among ``local_addresses()`` (the transports':
    :mod:`slipstream.daemon.media.interfaces`), so channels that name one interface either
    way share its endpoints; that lists the host's interfaces here, on the conductor's
    thread, for each such channel.  On a unicast channel a wildcard subnet
    (``interface=0.0.0.0/0``, ``[::]/0``) stays the wildcard, without its prefix, and lists
    nothing (as Aeron's ``UdpChannel.parse``: any local address)."""
    for part, host in names.names_of(channel):
        address = name_cache.lookup(channel, part, host)
        hostport = getattr(channel, part)
        channel = attrs.evolve(channel, **{part: attrs.evolve(hostport, host=address)})
    interface = channel.interface
    if interface is not None and interface.prefix_length is not None:
        ip = interface.ip
        if ip is not None and ip.is_unspecified and not channel.is_multicast:
            local = interface.host
        else:
            subnet = ipaddress.ip_network(f"{interface.host}/{interface.prefix_length}",
                                          strict=False)
            local = interfaces.address_in_subnet(channel, "interface", subnet,
                                                 local_addresses)
        channel = attrs.evolve(channel, interface=attrs.evolve(interface, host=local,
                                                               prefix_length=None))
    return channel


def _label_of(setup: Any, source: Address) -> str:
    return (f"session {setup.session_id} stream {setup.stream_id} from "
            f"{source[0]}:{source[1]}")
