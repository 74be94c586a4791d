"""Which UDP channels share, and what a second user of a shared thing must ask for.

Channels that name the same endpoint address (and interface) share one endpoint
(:func:`endpoint_key`); publishers of the same endpoint, stream and session share one
publication, unless exclusive (``add_exclusive_publication``: a publication of its own, with
its own session, :func:`check_session_free`).  A second publisher of a shared publication
(IPC or UDP) or a second subscription on a receive endpoint already open cannot ask for
another log shape, session, watermarks, flow or send-rate control, or image and socket
parameters than it has (Aeron's publication parameter match): the checks here raise a
ChannelError that names the part.  The
:class:`~slipstream.daemon.conductor.network.NetworkConductor` and the IPC side of the
:class:`~slipstream.daemon.conductor.conductor.DriverConductor` call them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from slipstream.client.channel import Channel
from slipstream.client.errors import ChannelError
from slipstream.client.logbuffer import LogBuffer
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.media.destinations import ALL_DESTINATIONS, TABLE_MODES
from slipstream.daemon.pressure.episodes import BackPressureEpisodes
from slipstream.daemon.protocol.params import PublicationParams, SocketParams, SubscriptionParams
from slipstream.daemon.protocol.types import Address


def destination_of(channel: Channel, *, sending: bool = True) -> Address:
    """The endpoint as an IP literal and port (DNS, once, here); ChannelError when it is
    missing or has no port.  ``sending`` (a publication's, or a spy's): a
    multi-destination-cast channel (``control-mode=manual`` or ``dynamic``) has none, its
    datagrams go to :data:`ALL_DESTINATIONS` of its endpoint, and an endpoint= beside the
    control mode is refused by name."""
    if sending and channel.control_mode in TABLE_MODES:
        if channel.endpoint is not None:
            raise ChannelError(str(channel), "endpoint",
                               f"a control-mode={channel.control_mode} channel sends to the "
                               f"destinations its publication adds (manual), that join it "
                               f"(dynamic) or to the response subscription that asks (response), "
                               f"not to an endpoint: leave endpoint= out (a subscription names "
                               f"its own endpoint and control=)")
        return ALL_DESTINATIONS
    if channel.is_response:  # a response subscription
        return response_bind_address(channel)
    address = channel.endpoint_address()
    if address is None or channel.endpoint is None:
        raise ChannelError(str(channel), "endpoint",
                           "a UDP channel needs endpoint=host:port (a publication without one "
                           "is control-mode=manual or dynamic multi-destination-cast)")
    if not channel.endpoint.port:
        raise ChannelError(str(channel), "endpoint", "the endpoint needs a port")
    return str(address), channel.endpoint.port


def response_bind_address(channel: Channel) -> Address:
    """Where a response subscription (``control-mode=response|control=SERVER:PORT``)
    receives: ``interface=``'s address and port, else any address of the control address's
    IP version, and a port the system picks (0).  Its server's response publication learns
    the address from the status messages sent from there (docs/CHANNELS.md §7.6), so it
    names no endpoint of its own.  ChannelError names ``endpoint`` (given) or ``control``
    (missing)."""
    if channel.endpoint is not None:
        raise ChannelError(str(channel), "endpoint",
                           "a response subscription (control-mode=response) receives on a "
                           "port of its own, which its server learns from the status messages "
                           "it sends to control=: leave endpoint= out")
    if channel.control is None or not channel.control.port:
        raise ChannelError(str(channel), "control",
                           "a response subscription needs its server's response control "
                           "address and port (control=HOST:PORT), where the response "
                           "publication is bound")
    interface = channel.interface
    if interface is not None and interface.ip is not None:
        return str(interface.ip), interface.port or 0
    control_ip = channel.control.ip
    return ("::" if control_ip is not None and control_ip.version == 6 else "0.0.0.0"), 0


def endpoint_key(channel: Channel, address: Address) -> tuple[Any, ...]:
    """Channels that name the same address (and interface) share one endpoint; those of one
    multi-destination-cast control mode and control address (and interface) share one, and
    its destinations (as Aeron's send channel endpoints, by the channel's canonical form); so
    do the response publications of one control address (each with a table of its own), and
    the response subscriptions of one (docs/CHANNELS.md §7.6)."""
    interface = str(channel.interface) if channel.interface is not None else ""
    if address == ALL_DESTINATIONS or channel.is_response:
        control = str(channel.control) if channel.control is not None else ""
        return ("control-mode", channel.control_mode, control, interface)
    return (address, interface)


def send_endpoint_key(channel: Channel, address: Address) -> tuple[Any, ...]:
    """The send endpoint a publication's channel uses: its :func:`endpoint_key`'s, and for
    a unicast or multicast one its key (``key=``) too: a plain publication and one keyed
    ``NAME`` to the same address each have an endpoint (a socket) of their own, each of one
    key, so a publication of one key never holds an address against another key's (an
    archive answers callers of several keys at addresses they name).  A multi-destination-
    cast or response endpoint, bound to its control address, has one key for all: a channel
    of another is refused (:func:`check_same_key`)."""
    bound = address == ALL_DESTINATIONS or channel.is_response
    return (endpoint_key(channel, address), None if bound else channel.key)


def check_same_log(channel: Channel, log_buffer: LogBuffer, session_id: int,
                   stream_id: int) -> None:
    """A second publisher of a shared publication (IPC or UDP) cannot ask for another log
    shape or session (Aeron's publication parameter match): ChannelError names the part."""
    for part, asked, actual in (("term-length", channel.term_length, log_buffer.term_length),
                                ("mtu", channel.mtu, log_buffer.mtu),
                                ("session-id", channel.session_id, session_id)):
        if asked is not None and asked != actual:
            raise ChannelError(str(channel), part,
                               f"{asked} differs from the existing publication's {actual} on "
                               f"stream {stream_id}")


def check_session_free(channel: Channel, sessions: Iterable[int], stream_id: int) -> None:
    """A new publication (an exclusive one, or a shared one with none to join) that asks for
    its session (``session-id=``) may not take one an open publication of its stream has
    there (the same endpoint, or aeron:ipc): two logs of one session and stream would reach
    the same subscribers as one stream (Aeron's ``checkForSessionClash``).  ``sessions``: the
    open publications' session ids.  ChannelError names ``session-id``."""
    if channel.session_id is not None and channel.session_id in set(sessions):
        raise ChannelError(str(channel), "session-id",
                           f"{channel.session_id} is the session of an open publication of "
                           f"stream {stream_id} here (an exclusive publication has its own): "
                           f"give another, or leave session-id out to draw a free one")


def check_same_watermarks(channel: Channel, episodes: BackPressureEpisodes,
                          stream_id: int) -> None:
    """A second publisher of a shared publication cannot ask for other watermarks: the
    episodes are the stream's.  ChannelError names the part."""
    if channel.watermarks is not None and channel.watermarks != episodes.watermarks:
        high, low = episodes.watermarks
        raise ChannelError(str(channel), "watermarks",
                           f"{channel.watermarks[0]}/{channel.watermarks[1]} differs from the "
                           f"existing publication's {high}/{low} on stream {stream_id}")


def check_same_control(channel: Channel, existing: Channel, settings: DriverSettings,
                       stream_id: int) -> None:
    """A second publisher of a shared publication cannot ask for another flow control
    (``fc=``), send-rate control (``rc=``) or durability (``durable=``) than the stream has:
    the sender runs one of each per publication.  Only what it asks for is compared (with the
    defaults resolved), so a publisher that names none joins any.  ChannelError names the part."""
    asked = PublicationParams.for_network(channel, settings)
    actual = PublicationParams.for_network(existing, settings)
    for part, given, mine, theirs, shown in (
            ("fc", channel.fc, asked.flow_control, actual.flow_control, existing.fc),
            ("rc", channel.rc, asked.rate_control, actual.rate_control, existing.rc),
            ("durable", channel.durable, asked.durable, actual.durable, existing.durable)):
        if given is not None and mine != theirs:
            raise ChannelError(str(channel), part,
                               f"{given} differs from the existing publication's "
                               f"{shown if shown is not None else 'default'} on stream "
                               f"{stream_id}")


#: What a subscription's URI may set for its endpoint's images and socket: (URI key, Channel
#: field, the resolved value's attribute of SubscriptionParams or SocketParams).
_RECEIVE_PARAMS: Final = (("reliable", "reliable", "reliable"), ("group", "group", "group"),
                          ("gtag", "gtag", "group_tag"),
                          ("rcv-wnd", "rcv_wnd", "receiver_window_length"),
                          ("nak-delay", "nak_delay_ns", "nak_delay_ns"),
                          ("sparse", "sparse", "sparse"), ("cc", "cc", "congestion_control"),
                          ("rejoin", "rejoin", "rejoin"),
                          ("max-term-length", "max_term_length", "image_term_length_max"),
                          ("so-rcvbuf", "so_rcvbuf", "so_rcvbuf"))


def check_same_receive_params(channel: Channel, existing: Channel,
                              settings: DriverSettings) -> None:
    """A subscription on a receive endpoint that is already open cannot ask for other image or
    socket parameters than the endpoint's first subscription gave it: its images and socket
    are made with those.  Only what it asks for is compared (with the defaults resolved), so a
    subscription that names none joins any endpoint.  ChannelError names the key."""
    asked = (SubscriptionParams.resolve(channel, settings), SocketParams.resolve(channel, settings))
    actual = (SubscriptionParams.resolve(existing, settings),
              SocketParams.resolve(existing, settings))
    for key, field, resolved in _RECEIVE_PARAMS:
        if getattr(channel, field) is None:
            continue
        holder = 0 if hasattr(asked[0], resolved) else 1
        mine, theirs = getattr(asked[holder], resolved), getattr(actual[holder], resolved)
        if mine != theirs:
            raise ChannelError(str(channel), key,
                               f"{_shown(mine)} differs from {_shown(theirs)}, what this "
                               f"endpoint's images and socket are made with (from {existing}, "
                               f"its first subscription); slipstream makes them once per "
                               f"endpoint: subscribe on another endpoint, or ask for the same")


def check_same_key(channel: Channel, endpoint_key_name: str | None, existing: Channel) -> None:
    """A channel on an endpoint that is already open must be as encrypted as it is, under
    the same key (``key=``): an endpoint seals and opens every datagram, or none, so a
    stream that is encrypted is encrypted on every endpoint it uses.  ChannelError names
    ``key``."""
    if channel.key == endpoint_key_name:
        return
    actual = "plain" if endpoint_key_name is None else f"encrypted with key {endpoint_key_name}"
    raise ChannelError(str(channel), "key",
                       f"{'none' if channel.key is None else channel.key} differs from this "
                       f"endpoint's (it is {actual}, from {existing}): an endpoint seals every "
                       f"datagram or none, so a stream is encrypted on every endpoint it uses, "
                       f"with one key; use another endpoint, or the same key=")


def _shown(value: object) -> str:
    if value is None:
        return "unset"
    return str(value).lower() if isinstance(value, bool) else str(value)
