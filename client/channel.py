"""Channel URIs (docs/CHANNELS.md §7): ``aeron:ipc[?...]``, ``aeron:udp?k=v|...``, ``aeron-spy:``.

:func:`parse_channel` turns a URI into one immutable, typed :class:`Channel`, or raises
:class:`~slipstream.client.errors.ChannelError` naming the offending part.  Parsing does no I/O:
host names are only resolved when :meth:`Channel.endpoint_address` (or ``is_multicast`` /
``control_group``, which use it) is called.

Field names follow the URI keys with ``-`` turned into ``_`` (``term-length`` →
``term_length``); durations are in ns and end in ``_ns`` (``linger`` → ``linger_ns``); sizes are
in bytes.  ``None`` means "not in the URI: use the driver's default".  Two exceptions: ``tags``
fills ``channel_tag``/``entity_tag``, and ``session-id=tag:N`` fills ``session_id_tag``.

Decisions that differ from Aeron, on purpose:

* Unknown keys raise (Aeron ignores them): a typo such as ``lingr=0`` silently ignored costs a
  user far more than an error.  Known Aeron keys slipstream does not implement (``ats``, the
  timestamp offsets, ``response-endpoint``) raise too, saying so.  Keys that only mean something
  to the network (``endpoint``, ``fc``, ``rcv-wnd``, ...) raise on ``aeron:ipc``.
* Duplicate keys, keys without ``=value`` and empty values raise (Aeron keeps one silently).
* ``mtu`` must be above 32 (Java's rule; C accepts 32, which leaves no room for payload).
* Booleans are exactly ``true`` or ``false``; integers are decimal.

The strategies' values (``fc=``, ``cc=``, ``rc=``) are parsed and checked by their grammars
(:mod:`slipstream.client.strategy_grammar`), which the strategies declare.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
import socket
from collections.abc import Callable
from typing import Any, Final

import attrs

from slipstream.client.errors import ChannelError
from slipstream.client.layout import (
    FRAME_ALIGNMENT,
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    MAX_UDP_PAYLOAD_LENGTH,
    PRIORITY_MAX,
    PRIORITY_MIN,
    SEALED_MTU_MAX,
    SEALED_OVERHEAD,
    TERM_MAX_LENGTH,
    TERM_MIN_LENGTH,
    max_message_length,
)
from slipstream.client.strategy_grammar import (
    RECEIVER_TIMEOUT_RANGE_NS as RECEIVER_TIMEOUT_RANGE_NS,  # the setting's range too
)
from slipstream.client.strategy_grammar import (
    SHIPPED,
    BadValue,
    CongestionControlSpec,
    FlowControlSpec,
    RateControlSpec,
    format_ns,
    parse_duration_in,
    parse_int,
    parse_size_in,
    parse_strategy,
    split_options,
)

# The value parsers the URI's keys share with the strategies' options.
_Bad, _int, _size, _duration, _format_ns, _options = (
    BadValue, parse_int, parse_size_in, parse_duration_in, format_ns, split_options)

MAX_URI_LENGTH: Final = 4095  # characters: Aeron's limit (docs/CHANNELS.md §7.1)
SPY_PREFIX: Final = "aeron-spy:"
SCHEME: Final = "aeron:"

CONTROL_MODES: Final = ("manual", "dynamic", "response")
#: The control mode of response channels (docs/CHANNELS.md §7.6).
RESPONSE_CONTROL_MODE: Final = CONTROL_MODES[2]
# The shipped strategies' names (the settings' choices): fc=, cc= and rc= take these and any
# strategy registered since (strategy_grammar.grammars).  RECEIVER_TIMEOUT_RANGE_NS, fc=min
# and tagged's t: and the setting flow_control_receiver_timeout, is strategy_grammar's.
CONGESTION_CONTROLS: Final = tuple(g.name for g in SHIPPED if g.key == "cc")
FLOW_CONTROLS: Final = tuple(g.name for g in SHIPPED if g.key == "fc")
# The ranges a URI key shares with the driver setting it overrides (daemon/config.py): a value
# means the same and is refused the same in either place.
#: nak-delay= and nak_unicast_delay, ns.
NAK_DELAY_RANGE_NS: Final = (0, 1_000_000_000)
#: linger= and the untethered timeouts, and their settings, ns: a log is kept at most an hour.
TIMEOUT_RANGE_NS: Final = (0, 3_600_000_000_000)
#: rcv-wnd= and rcv_initial_window_length, bytes.
RECEIVER_WINDOW_RANGE: Final = (64, 1 << 30)
#: pub-wnd= and the publication window settings, bytes (0: half a term).
PUBLICATION_WINDOW_RANGE: Final = (0, 1 << 30)
#: so-rcvbuf= / so-sndbuf= and socket_so_rcvbuf / socket_so_sndbuf, bytes (0: the kernel's).
SOCKET_BUFFER_RANGE: Final = (0, 1 << 30)
#: Aeron's older name of ``tagged`` (PreferredMulticastFlowControl), taken as it.
FLOW_CONTROL_ALIASES: Final = {alias: g.name for g in SHIPPED if g.key == "fc"
                               for alias in g.aliases}
RATE_CONTROLS: Final = tuple(g.name for g in SHIPPED if g.key == "rc")
#: What an offer does when the stream has no credit (docs/BACKPRESSURE.md); without ``policy``
#: it returns Aeron's codes.
POLICIES: Final = ("block", "drop-newest", "error", "rate-limit")

_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\Z")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


# -- value types -----------------------------------------------------------------------------


@attrs.frozen
class HostPort:
    """``host[:port][/prefix_length]``.

    ``host`` is a name (lowercased) or an IP literal in its normal form, IPv6 without brackets.
    ``port`` 0 means an ephemeral port; whether that makes sense (a subscription may bind to
    port 0, a publication cannot send to it) is for the conductor to decide.
    ``prefix_length`` is only used by ``interface``.
    """

    host: str
    port: int | None = None
    prefix_length: int | None = None

    @property
    def ip(self) -> IPAddress | None:
        """The host as an address when it is an IP literal, else None (a name)."""
        try:
            return ipaddress.ip_address(self.host)
        except ValueError:
            return None

    def __str__(self) -> str:
        text = f"[{self.host}]" if ":" in self.host else self.host
        if self.port is not None:
            text += f":{self.port}"
        if self.prefix_length is not None:
            text += f"/{self.prefix_length}"
        return text


@attrs.frozen
class PolicySpec:
    """The ``policy`` parameter, a publication's answer to back pressure (docs/BACKPRESSURE.md),
    applied by the client (the driver ignores it):

    * ``block[,timeout:10s]``: an offer waits for credit, then raises ``BackPressuredError``;
    * ``drop-newest``: an offer without credit is dropped and counted, and returns at once;
    * ``error``: an offer without credit raises ``BackPressuredError`` at once;
    * ``rate-limit,messages:N[,bytes:B][,burst:10ms][,when-empty:wait|refuse][,timeout:10s]``:
      a token bucket of N messages/s and B bytes/s (either may be left out) holding ``burst``
      of each; an offer that finds it empty waits (or, ``when-empty:refuse``, returns
      BACK_PRESSURED); back pressure then waits as ``block`` does.

    Fields are None when not given: the client's defaults."""

    name: str
    timeout_ns: int | None = None
    messages_per_s: int | None = None
    bytes_per_s: int | None = None
    burst_ns: int | None = None
    refuse: bool = False

    def __str__(self) -> str:
        parts = [self.name]
        if self.messages_per_s is not None:
            parts.append(f"messages:{self.messages_per_s}")
        if self.bytes_per_s is not None:
            parts.append(f"bytes:{self.bytes_per_s}")
        if self.burst_ns is not None:
            parts.append(f"burst:{_format_ns(self.burst_ns)}")
        if self.refuse:
            parts.append("when-empty:refuse")
        if self.timeout_ns is not None:
            parts.append(f"timeout:{_format_ns(self.timeout_ns)}")
        return ",".join(parts)


# -- the channel -----------------------------------------------------------------------------


def resolve_host(host: str) -> str:
    """The IP address of the name ``host`` (blocking: ``socket.getaddrinfo``), its IPv4 one
    when it has both: multicast is IPv4 only here, an ``interface=`` must be IPv4 to join an
    IPv4 group, and the resolver's order of a dual-stack name's answers varies by host
    (``::1`` first for some).  OSError when it does not resolve."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    return str(next((info[4][0] for info in infos if info[0] == socket.AF_INET),
                    infos[0][4][0]))


@attrs.frozen(repr=False)
class Channel:
    """A parsed channel URI.  Build it with :func:`parse_channel`, which validates it.

    Equality and hashing cover the parsed values, not the spelling: ``term-length=64k`` and
    ``term-length=65536`` give equal channels.  ``str()`` is the URI as given, :meth:`canonical`
    a normalised one.
    """

    media: str  # "udp" or "ipc"
    spy: bool = False
    endpoint: HostPort | None = None
    control: HostPort | None = None
    interface: HostPort | None = None
    control_mode: str | None = None
    ttl: int | None = None
    term_length: int | None = None  # bytes
    mtu: int | None = None  # bytes
    rcv_wnd: int | None = None  # bytes
    #: A subscription's longest image term, bytes: a SETUP with a longer term makes no image
    #: (max-term-length=, else image_term_buffer_length_max; docs/PROTOCOL.md §1.3).
    max_term_length: int | None = None
    pub_wnd: int | None = None  # bytes
    so_sndbuf: int | None = None  # bytes
    so_rcvbuf: int | None = None  # bytes
    nak_delay_ns: int | None = None
    linger_ns: int | None = None
    untethered_window_limit_timeout_ns: int | None = None
    untethered_resting_timeout_ns: int | None = None
    eos: bool | None = None
    reliable: bool | None = None
    sparse: bool | None = None
    tether: bool | None = None
    rejoin: bool | None = None
    group: bool | None = None
    ssc: bool | None = None  # spies simulate connection
    session_id: int | None = None
    session_id_tag: int | None = None  # session-id=tag:N
    fc: FlowControlSpec | None = None
    gtag: int | None = None
    durable: DurableSpec | None = None  # durable=TAG/N (a publication's, docs/CHANNELS.md §7.7)
    cc: CongestionControlSpec | None = None
    rc: RateControlSpec | None = None
    policy: PolicySpec | None = None
    watermarks: tuple[int, int] | None = None  # percent of the window: (high, low)
    priority: int | None = None  # the publication's band in the sender (docs/BACKPRESSURE.md)
    max_resend: int | None = None
    init_term_id: int | None = None
    term_id: int | None = None
    term_offset: int | None = None  # bytes
    alias: str | None = None
    channel_tag: int | None = None  # tags=CHANNEL[,ENTITY]
    entity_tag: int | None = None
    stream_id: int | None = None
    response_correlation_id: int | None = None
    # join=: the subnets a dynamic multi-destination-cast publication hears status messages
    # from (docs/CHANNELS.md §7.4.1)
    join: tuple[Subnet, ...] | None = None
    key: str | None = None  # key=NAME: an encrypted channel (docs/CHANNELS.md §7.8)
    uri: str = attrs.field(default="", eq=False)  # as given to parse_channel

    @property
    def is_ipc(self) -> bool:
        return self.media == "ipc"

    @property
    def is_udp(self) -> bool:
        return self.media == "udp"

    @property
    def is_spy(self) -> bool:
        return self.spy

    @property
    def is_response(self) -> bool:
        """``control-mode=response``: a response subscription (a client's) or a response
        publication (a server's), docs/CHANNELS.md §7.6."""
        return self.control_mode == RESPONSE_CONTROL_MODE

    def endpoint_address(self) -> IPAddress | None:
        """The endpoint's IP address, or None without an endpoint.

        A literal is returned as is; a name is resolved with ``socket.getaddrinfo`` on every
        call (blocking DNS), and ``ChannelError`` names ``endpoint`` when that fails.
        """
        if self.endpoint is None:
            return None
        address = self.endpoint.ip
        if address is not None:
            return address
        try:
            return ipaddress.ip_address(resolve_host(self.endpoint.host))
        except OSError as e:
            raise ChannelError(str(self), "endpoint",
                               f"cannot resolve {self.endpoint.host!r}: {e}") from None

    @property
    def is_multicast(self) -> bool:
        """The endpoint is in 224.0.0.0/4 or ff00::/8 (may resolve a name: see endpoint_address)."""
        address = self.endpoint_address()
        return address is not None and address.is_multicast

    @property
    def control_group(self) -> HostPort | None:
        """For multicast, the control group: the data group with its last byte + 1, same port.

        None for other channels.  Raises ``ChannelError`` (``endpoint``) when the data group's
        last byte is even, which parse_channel already catches for literal addresses.
        """
        address = self.endpoint_address()
        if address is None or not address.is_multicast:
            return None
        assert self.endpoint is not None
        return HostPort(_control_group_of(str(self), address), self.endpoint.port)

    def canonical(self) -> str:
        """A normalised URI: keys sorted, one spelling per value (sizes in bytes, durations in
        their largest exact unit of s, ms, us and ns, hosts normalised), still valid for Aeron.
        Equal channels have equal canonical forms, so it serves as a dict key for "same
        channel"; ``parse_channel(c.canonical()) == c``.
        """
        params = []
        for key, param in sorted(_PARAMS.items()):
            text = param.text(self)
            if text is not None:
                params.append(f"{key}={text}")
        prefix = (SPY_PREFIX if self.spy else "") + SCHEME + self.media
        return f"{prefix}?{'|'.join(params)}" if params else prefix

    def __str__(self) -> str:
        return self.uri or self.canonical()

    def __repr__(self) -> str:
        return f"<Channel {self.canonical()}>"


def _control_group_of(uri: str, address: IPAddress) -> str:
    packed = bytearray(address.packed)
    if not packed[-1] & 1:
        raise ChannelError(uri, "endpoint",
                           f"multicast data group {address} must have an odd last byte (the "
                           f"control group is the data group + 1)")
    packed[-1] = (packed[-1] + 1) & 0xFF  # wraps within the byte, as Aeron's C driver does
    return str(ipaddress.ip_address(bytes(packed)))


@attrs.frozen
class DurableSpec:
    """``durable=TAG/N``: a message is durable once ``count`` receivers whose status messages
    carry the group tag ``group_tag`` (their subscriptions' ``gtag=TAG``) have reported a
    consumption position past it (docs/CHANNELS.md §7.7).  ``str()`` is the URI's form."""

    group_tag: int
    count: int

    def __str__(self) -> str:
        return f"{self.group_tag}/{self.count}"


#: The most receivers ``durable=TAG/N`` may require: more than any group a sender tracks.
DURABLE_COUNT_MAX: Final = 1024


def _durable(text: str) -> DurableSpec:
    tag_text, slash, count_text = text.partition("/")
    if not slash:
        # A bare count ("any N receivers") is refused: any subscriber, a monitoring tool's
        # too, would then make a message "durable"; durability is a promise of named
        # receivers (archives), so the tag names them.
        raise _Bad(f"{text!r} is not <group tag>/<receivers>, e.g. durable=7/2: name the "
                   f"receivers that make a message durable by the gtag= of their "
                   f"subscriptions")
    if not tag_text:
        raise _Bad(f"{text!r} has no group tag before '/': durable=<gtag>/<receivers>")
    return DurableSpec(_int64(tag_text), _int(count_text, 1, DURABLE_COUNT_MAX))


# -- value parsers (raise _Bad with the problem; the caller adds the key) ----------------------


def _int32(text: str) -> int:
    return _int(text, INT32_MIN, INT32_MAX)


def _int64(text: str) -> int:
    return _int(text, INT64_MIN, INT64_MAX)


def _bool(text: str) -> bool:
    if text == "true":
        return True
    if text == "false":
        return False
    raise _Bad(f"{text!r} is not true or false")


def _in(parse: Callable[..., int], bounds: tuple[int, int]) -> Callable[[str], int]:
    """``parse`` (_size or _duration) within ``bounds``."""
    return lambda text: parse(text, *bounds)


def _term_length(text: str) -> int:
    value = _size(text, 0, 1 << 62)
    if not (TERM_MIN_LENGTH <= value <= TERM_MAX_LENGTH and value & (value - 1) == 0):
        raise _Bad(f"{value} is not a power of two between 64k and 1g")
    return value


def _mtu(text: str) -> int:
    value = _size(text, 0, 1 << 62)
    if not (FRAME_ALIGNMENT < value <= MAX_UDP_PAYLOAD_LENGTH and value % FRAME_ALIGNMENT == 0):
        raise _Bad(f"{value} is not a multiple of 32 between 64 and {MAX_UDP_PAYLOAD_LENGTH}")
    return value


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise _Bad(f"{text!r} is not {' or '.join(choices)}")
        return text
    return parse


def _text(text: str) -> str:
    return text


#: A key's name (key=NAME): its file is NAME.key in the driver's keys_dir, so no path.
KEY_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def key_name_problem(text: str) -> str | None:
    """Why ``text`` is not a key's name (``key=NAME``: :data:`KEY_NAME`), or None when it is:
    the one wording of that error wherever a key is named."""
    if KEY_NAME.fullmatch(text):
        return None
    return (f"{text!r} is not a key name (letters, digits, '.', '_', '-'; at most 64, the "
            f"first a letter or digit)")


def _key_name(text: str) -> str:
    problem = key_name_problem(text)
    if problem is not None:
        raise _Bad(problem)
    return text


def channel_with_key(channel: str, key: str | None) -> str:
    """``channel`` (a URI) with its ``key=`` replaced by ``key=KEY``, or removed for None:
    the one spelling of "this channel, sealed under that key" (docs/CHANNELS.md §7.8)."""
    media, _, query = channel.partition("?")
    kept = [item for item in query.split("|") if item and not item.startswith("key=")]
    if key is not None:
        kept.append(f"key={key}")
    return f"{media}?{'|'.join(kept)}" if kept else media


def _port(text: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise _Bad(f"port {text!r} is not a number")
    port = int(text)
    if port > 65535:
        raise _Bad(f"port {port} is out of range 0..65535")
    return port


def _host(text: str) -> str:
    """A name or an IPv4 literal (no brackets), normalised."""
    if not text:
        raise _Bad("the host is empty")
    if ":" in text:
        raise _Bad(f"{text!r}: write IPv6 addresses in brackets, e.g. [::1]:40123")
    if not _HOSTNAME.match(text) or len(text) > 253:
        raise _Bad(f"{text!r} is not a host name or IPv4 address")
    try:
        return str(ipaddress.IPv4Address(text))
    except ValueError:
        pass
    if all(label.isdigit() for label in text.split(".")):
        raise _Bad(f"{text!r} is not a valid IPv4 address")
    return text.lower()


def _host_port(text: str, *, port_required: bool, prefix_allowed: bool) -> HostPort:
    prefix_length = None
    if prefix_allowed and "/" in text:
        text, _, prefix_text = text.rpartition("/")
        if not prefix_text.isascii() or not prefix_text.isdigit():
            raise _Bad(f"prefix length {prefix_text!r} is not a number")
        prefix_length = int(prefix_text)
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise _Bad(f"{text!r}: missing ']' after the IPv6 address")
        try:
            address: IPAddress = ipaddress.IPv6Address(text[1:close])
        except ValueError:
            raise _Bad(f"{text[1:close]!r} is not an IPv6 address") from None
        host, rest = str(address), text[close + 1:]
        if rest and not rest.startswith(":"):
            raise _Bad(f"{text!r}: expected ':port' after ']'")
        port_text = rest[1:] if rest else None
    else:
        host_text, colon, port_text_or_empty = text.rpartition(":")
        if not colon:
            host_text, port_text_or_empty = text, ""
        host = _host(host_text)
        port_text = port_text_or_empty if colon else None
    port = None if port_text is None else _port(port_text)
    if port is None and port_required:
        raise _Bad(f"{text!r} has no port; write host:port")
    if prefix_length is not None:
        bits = 128 if ":" in host else 32
        if prefix_length > bits:
            raise _Bad(f"prefix length {prefix_length} is out of range 0..{bits}")
    return HostPort(host, port, prefix_length)


def _address(text: str) -> HostPort:
    return _host_port(text, port_required=True, prefix_allowed=False)


def parse_address(text: str, part: str = "endpoint") -> HostPort:
    """``host:port`` as a channel's ``endpoint`` takes it (an IPv4 address, ``[IPv6]``, or a
    host name, kept as a name); raises :class:`ChannelError` naming ``part``."""
    try:
        return _address(text)
    except _Bad as e:
        raise ChannelError(text, part, str(e)) from None


def _interface(text: str) -> HostPort:
    return _host_port(text, port_required=False, prefix_allowed=True)


def _policy(text: str) -> PolicySpec:
    name, *options = text.split(",")
    if name not in POLICIES:
        raise _Bad(f"{name!r} is not {', '.join(POLICIES[:-1])} or {POLICIES[-1]}")
    forms = {"timeout": "timeout:<duration>"}
    if name == "rate-limit":
        forms.update(messages="messages:<per second>", bytes="bytes:<size per second>",
                     burst="burst:<duration>", **{"when-empty": "when-empty:wait|refuse"})
    elif name != "block" and options:
        raise _Bad(f"{name} takes no options")
    values = _options(options, forms)
    messages = _int(values["messages"], 1, INT32_MAX) if "messages" in values else None
    rate_bytes = _size(values["bytes"], 1, 1 << 40) if "bytes" in values else None
    if name == "rate-limit" and messages is None and rate_bytes is None:
        raise _Bad("rate-limit needs messages:<per second>, bytes:<size per second> or both")
    burst = None
    if "burst" in values:
        burst = _duration(values["burst"])
        if not 1_000 <= burst <= 10_000_000_000:
            raise _Bad(f"burst {values['burst']} is not between 1us and 10s")
    refuse = _choice("wait", "refuse")(values["when-empty"]) == "refuse" \
        if "when-empty" in values else False
    timeout = _duration(values["timeout"]) if "timeout" in values else None
    if timeout == 0 and name == "block":
        raise _Bad("block with timeout:0 waits for nothing: that is policy=error")
    if timeout is not None and refuse:
        raise _Bad("rate-limit with when-empty:refuse never waits: a timeout has nothing to "
                   "time")
    return PolicySpec(name, timeout, messages, rate_bytes, burst, refuse)


def parse_policy(text: str) -> PolicySpec:
    """A ``policy`` value in the URI's form (``"block,timeout:2s"``); ChannelError naming
    ``policy`` when it is bad."""
    try:
        return _policy(text)
    except _Bad as e:
        raise ChannelError(f"policy={text}", "policy", str(e)) from None


def _watermarks(text: str) -> tuple[int, int]:
    high_text, slash, low_text = text.partition("/")
    if not slash:
        raise _Bad(f"{text!r} is not <high percent>/<low percent>, e.g. 100/50")
    high, low = _int(high_text, 1, 100), _int(low_text, 0, 99)
    if low >= high:
        raise _Bad(f"the low watermark {low} % is not below the high one {high} %")
    return high, low


def _format_watermarks(channel: Channel) -> str | None:
    if channel.watermarks is None:
        return None
    return f"{channel.watermarks[0]}/{channel.watermarks[1]}"


def _tags(text: str) -> tuple[int, int | None]:
    channel_text, comma, entity_text = text.partition(",")
    channel_tag = _int(channel_text, 0, INT64_MAX)
    return channel_tag, (_int(entity_text, 0, INT64_MAX) if comma else None)


def _session_id(text: str) -> tuple[int | None, int | None]:
    if text.startswith("tag:"):
        return None, _int(text[4:], 0, INT64_MAX)
    return _int32(text), None


#: A subnet a ``join=`` list names.
Subnet = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_join(text: str) -> tuple[Subnet, ...]:
    """A ``join=`` value (or the ``mdc_join`` setting): subnets separated by commas
    (``10.1.0.0/16,fd00::/8``; a bare address is its own /32 or /128).  BadValue naming the
    bad item otherwise."""
    subnets = []
    for item in text.split(","):
        item = item.strip()
        try:
            subnets.append(ipaddress.ip_network(item, strict=True))
        except ValueError as e:
            raise _Bad(f"{item!r} is not a subnet (ADDRESS/PREFIX, no host bits set): "
                       f"{e}") from None
    return tuple(subnets)


def _format_join(channel: Channel) -> str | None:
    return None if channel.join is None else ",".join(str(each) for each in channel.join)


# -- the parameter table ----------------------------------------------------------------------


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)  # ints (sizes in bytes), strings, HostPort, the *Spec classes


def _format_tags(channel: Channel) -> str | None:
    if channel.channel_tag is None:
        return None
    if channel.entity_tag is None:
        return str(channel.channel_tag)
    return f"{channel.channel_tag},{channel.entity_tag}"


def _format_session_id(channel: Channel) -> str | None:
    if channel.session_id_tag is not None:
        return f"tag:{channel.session_id_tag}"
    return None if channel.session_id is None else str(channel.session_id)


@attrs.frozen
class _Param:
    """How one URI key parses into Channel fields and prints back in canonical()."""

    fields: tuple[str, ...]  # the Channel fields it fills
    parse: Callable[[str], Any]  # the value, or a tuple with one value per field
    udp_only: bool = False
    formatter: Callable[[Channel], str | None] | None = None  # default: the one field's value

    def text(self, channel: Channel) -> str | None:
        if self.formatter is not None:
            return self.formatter(channel)
        value = getattr(channel, self.fields[0])
        if value is None:
            return None
        return _format_ns(value) if self.fields[0].endswith("_ns") else _format_value(value)


def _param(field: str, parse: Callable[[str], Any], udp_only: bool = False) -> _Param:
    return _Param((field,), parse, udp_only)


def _strategy(key: str) -> Callable[[str], Any]:
    """A strategy's value (``fc=min,g:/3``), by the grammars registered for ``key``."""
    return lambda text: parse_strategy(key, text)


# Every key slipstream understands (Aeron's names).  ``udp_only`` keys are rejected on IPC.
_PARAMS: Final[dict[str, _Param]] = {
    "endpoint": _param("endpoint", _address, udp_only=True),
    "control": _param("control", _address, udp_only=True),
    "interface": _param("interface", _interface, udp_only=True),
    "ttl": _param("ttl", lambda t: _int(t, 0, 255), udp_only=True),
    "control-mode": _param("control_mode", _choice(*CONTROL_MODES)),
    "term-length": _param("term_length", _term_length),
    "mtu": _param("mtu", _mtu),
    "rcv-wnd": _param("rcv_wnd", _in(_size, RECEIVER_WINDOW_RANGE), udp_only=True),
    "max-term-length": _param("max_term_length", _term_length, udp_only=True),
    # Their settings' 0 ("half a term", "the kernel's") has no URI spelling: a URI without
    # the key takes the setting.
    "pub-wnd": _param("pub_wnd", _in(_size, (1, PUBLICATION_WINDOW_RANGE[1]))),
    "so-sndbuf": _param("so_sndbuf", _in(_size, (1, SOCKET_BUFFER_RANGE[1])), udp_only=True),
    "so-rcvbuf": _param("so_rcvbuf", _in(_size, (1, SOCKET_BUFFER_RANGE[1])), udp_only=True),
    "nak-delay": _param("nak_delay_ns", _in(_duration, NAK_DELAY_RANGE_NS), udp_only=True),
    "linger": _param("linger_ns", _in(_duration, TIMEOUT_RANGE_NS)),
    "untethered-window-limit-timeout": _param("untethered_window_limit_timeout_ns",
                                              _in(_duration, TIMEOUT_RANGE_NS)),
    "untethered-resting-timeout": _param("untethered_resting_timeout_ns",
                                         _in(_duration, TIMEOUT_RANGE_NS)),
    "eos": _param("eos", _bool),
    "reliable": _param("reliable", _bool),
    "sparse": _param("sparse", _bool),
    "tether": _param("tether", _bool),
    "rejoin": _param("rejoin", _bool),
    "group": _param("group", _bool),
    "ssc": _param("ssc", _bool, udp_only=True),
    "session-id": _Param(("session_id", "session_id_tag"), _session_id,
                         formatter=_format_session_id),
    "fc": _param("fc", _strategy("fc"), udp_only=True),
    "gtag": _param("gtag", _int64, udp_only=True),
    "durable": _param("durable", _durable, udp_only=True),
    "cc": _param("cc", _strategy("cc"), udp_only=True),
    "rc": _param("rc", _strategy("rc"), udp_only=True),
    "policy": _param("policy", _policy),
    "priority": _param("priority", lambda t: _int(t, PRIORITY_MIN, PRIORITY_MAX),
                       udp_only=True),
    "watermarks": _Param(("watermarks",), _watermarks, formatter=_format_watermarks),
    "max-resend": _param("max_resend", lambda t: _int(t, 1, 256), udp_only=True),
    "init-term-id": _param("init_term_id", _int32),
    "term-id": _param("term_id", _int32),
    "term-offset": _param("term_offset", lambda t: _int(t, 0, TERM_MAX_LENGTH)),
    "alias": _param("alias", _text),
    "tags": _Param(("channel_tag", "entity_tag"), _tags, formatter=_format_tags),
    "stream-id": _param("stream_id", _int32),
    "response-correlation-id": _param("response_correlation_id", _int64),
    "join": _Param(("join",), parse_join, udp_only=True, formatter=_format_join),
    "key": _param("key", _key_name, udp_only=True),
}

# The keys only one side of a stream acts on (a publication's sender and flow control, or a
# subscription's images and receive socket).  Given to the other side they are accepted (one
# URI may serve both, as in Aeron applications) and do nothing: the client warns
# (ChannelWarning).
PUBLICATION_ONLY_KEYS: Final = ("fc", "rc", "policy", "priority", "watermarks", "max-resend",
                                "pub-wnd", "linger", "eos", "init-term-id", "term-id",
                                "term-offset", "ssc", "response-correlation-id", "join")
SUBSCRIPTION_ONLY_KEYS: Final = ("cc", "gtag", "rcv-wnd", "nak-delay", "reliable", "tether",
                                 "rejoin", "max-term-length", "untethered-window-limit-timeout",
                                 "untethered-resting-timeout")
# Publication keys refused on a subscription rather than warned of: a subscription that asks
# for them expects something (durable=: that what it reads is safe) no subscription gives.
REFUSED_ON_SUBSCRIPTIONS: Final = ("durable",)


def check_subscription_keys(channel: Channel) -> None:
    """ChannelError naming the first key of :data:`REFUSED_ON_SUBSCRIPTIONS` ``channel``
    gives: the client checks it before asking, the driver again for any client."""
    for key in REFUSED_ON_SUBSCRIPTIONS:
        if _PARAMS[key].text(channel) is not None:
            raise ChannelError(str(channel), key,
                               "is a publication's: it names the receivers whose status "
                               "messages make its messages durable; a subscription is made "
                               "one of them by gtag=")


def keys_for_the_other_side(channel: Channel, *, publication: bool) -> list[str]:
    """The keys of ``channel`` that only the other side acts on: a publication's
    (``publication=False``: given to a subscription) or a subscription's."""
    keys = SUBSCRIPTION_ONLY_KEYS if publication else PUBLICATION_ONLY_KEYS
    return [key for key in keys if _PARAMS[key].text(channel) is not None]


def keys_given(channel: Channel) -> frozenset[str]:
    """The URI keys ``channel`` gives (Aeron's names)."""
    return frozenset(key for key, param in _PARAMS.items() if param.text(channel) is not None)


# Other spellings accepted for a key; canonical() prints the key.
_ALIASES: Final = {"spies-simulate-connection": "ssc"}

# Aeron keys slipstream does not implement: an error says so rather than "unknown".
_UNSUPPORTED: Final = frozenset({
    "ats", "media-rcv-ts-offset", "channel-rcv-ts-offset", "channel-snd-ts-offset",
    "response-endpoint",
})


# -- parse_channel ----------------------------------------------------------------------------


def _split_params(uri: str, query: str) -> dict[str, str]:
    raw: dict[str, str] = {}
    items = query.split("|")
    if len(items) > 1 and items[-1] == "":
        items.pop()  # a trailing '|' is harmless, and Aeron accepts it
    for item in items:
        if not item:
            if query:
                raise ChannelError(uri, "params", "empty parameter ('||' or a leading '|')")
            continue
        key, eq, value = item.partition("=")
        if not eq:
            raise ChannelError(uri, key, "has no '=value'")
        if not key:
            raise ChannelError(uri, "params", f"empty key in {item!r}")
        if not value:
            raise ChannelError(uri, key, "empty value")
        if key in raw:
            raise ChannelError(uri, key, "given twice")
        raw[key] = value
    return raw


def parse_channel(uri: str) -> Channel:
    """Parse and validate a channel URI; raises ``ChannelError`` naming the bad part.

    No I/O: host names stay unresolved (see :meth:`Channel.endpoint_address`).
    """
    if not isinstance(uri, str):
        raise ChannelError(repr(uri), "uri", f"must be a str, not {type(uri).__name__}")
    if len(uri) > MAX_URI_LENGTH:
        raise ChannelError(uri[:64] + "...", "uri",
                           f"{len(uri)} characters exceed the maximum of {MAX_URI_LENGTH}")
    rest = uri
    spy = rest.startswith(SPY_PREFIX)
    if spy:
        rest = rest[len(SPY_PREFIX):]
    if not rest.startswith(SCHEME):
        raise ChannelError(uri, "scheme", "a channel starts with 'aeron:' or 'aeron-spy:aeron:'")
    media, question, query = rest[len(SCHEME):].partition("?")
    if media not in ("udp", "ipc"):
        raise ChannelError(uri, "media", f"{media!r} is not udp or ipc")
    if media == "udp" and not question:
        raise ChannelError(uri, "media", "aeron:udp needs '?' and parameters, e.g. "
                                         "aeron:udp?endpoint=localhost:40123")
    if spy and media != "udp":
        raise ChannelError(uri, "media", "a spy attaches to a UDP publication: "
                                         "aeron-spy:aeron:udp?...")

    values: dict[str, Any] = {}
    for key, text in _split_params(uri, query).items():
        param = _PARAMS.get(_ALIASES.get(key, key))
        if param is None:
            if key in _UNSUPPORTED:
                raise ChannelError(uri, key, "is an Aeron parameter slipstream does not support")
            close = difflib.get_close_matches(key, [*_PARAMS, *_ALIASES], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ChannelError(uri, key, f"unknown parameter{hint}")
        if param.udp_only and media == "ipc":
            raise ChannelError(uri, key, "applies to aeron:udp only, not aeron:ipc")
        if param.fields[0] in values:  # ssc and spies-simulate-connection together
            raise ChannelError(uri, key, f"given twice (as {_ALIASES.get(key, key)} too)")
        try:
            parsed = param.parse(text)
        except _Bad as e:
            raise ChannelError(uri, key, str(e)) from None
        if len(param.fields) == 1:
            values[param.fields[0]] = parsed
        else:
            values.update(zip(param.fields, parsed, strict=True))

    channel = Channel(media=media, spy=spy, uri=uri, **values)
    _validate(uri, channel)
    return channel


def check_stream_id(channel: Channel, stream_id: int) -> None:
    """Aeron's rule for ``stream-id=`` (its driver's ``PublicationParams``): the URI's stream
    id, when it has one, is the stream id the channel is added with.  ChannelError naming
    ``stream-id`` and both ids when it is not.  slipstream applies it to subscriptions too
    (Aeron's driver to publications only, and a subscription's was ignored)."""
    if channel.stream_id is not None and channel.stream_id != stream_id:
        raise ChannelError(str(channel), "stream-id",
                           f"{channel.stream_id} does not match the stream id {stream_id} the "
                           f"channel is added with: leave stream-id out, or give the same")


def _validate(uri: str, c: Channel) -> None:
    """The rules that involve several parameters."""
    if c.control_mode == "dynamic" and c.control is None:
        raise ChannelError(uri, "control-mode", "dynamic needs a control address (control=)")
    if c.is_udp and c.endpoint is None and c.control is None and c.channel_tag is None \
            and c.control_mode not in ("manual", "response"):
        raise ChannelError(uri, "endpoint", "aeron:udp needs endpoint, control, tags or "
                                            "control-mode=manual|response")
    if c.join is not None and c.control_mode != "dynamic":
        raise ChannelError(uri, "join", "names who may join a control-mode=dynamic "
                                        "publication; this channel has no such thing")
    if c.is_ipc and c.control_mode not in (None, "response"):
        raise ChannelError(uri, "control-mode", f"{c.control_mode!r} applies to aeron:udp only; "
                                                f"aeron:ipc takes response only")
    if c.endpoint is not None:
        address = c.endpoint.ip
        if address is not None and address.is_multicast:
            _control_group_of(uri, address)  # raises for an even last byte

    given = [c.init_term_id is not None, c.term_id is not None, c.term_offset is not None]
    if any(given) and not all(given):
        missing = next(key for key, present in zip(("init-term-id", "term-id", "term-offset"),
                                                   given, strict=True) if not present)
        raise ChannelError(uri, missing, "init-term-id, term-id and term-offset go together")
    if c.term_offset is not None:
        assert c.init_term_id is not None and c.term_id is not None
        if c.term_offset % FRAME_ALIGNMENT:
            raise ChannelError(uri, "term-offset", f"{c.term_offset} is not a multiple of 32")
        if c.term_length is not None and c.term_offset > c.term_length:
            raise ChannelError(uri, "term-offset",
                               f"{c.term_offset} is beyond term-length {c.term_length}")
        # Positions are term_count << bits: term-id may not lie before init-term-id (int32 wrap).
        if (c.term_id - c.init_term_id) & 0xFFFFFFFF >= 1 << 31:
            raise ChannelError(uri, "term-id",
                               f"{c.term_id} is before init-term-id {c.init_term_id}")
    if c.key is not None and c.spy:
        raise ChannelError(uri, "key", "a spy reads its publication's log, which holds the "
                                       "stream in plain text: leave key= out")
    if c.key is not None and c.mtu is not None and c.mtu > SEALED_MTU_MAX:
        raise ChannelError(uri, "mtu", f"{c.mtu} leaves no room for the {SEALED_OVERHEAD} bytes "
                                       f"sealing adds to each datagram of an encrypted channel: "
                                       f"at most {SEALED_MTU_MAX}")
    if c.mtu is not None and c.term_length is not None:
        max_message = max_message_length(c.term_length)
        if c.mtu > max_message:
            raise ChannelError(uri, "mtu", f"{c.mtu} exceeds the maximum message length "
                                           f"{max_message} of term-length {c.term_length}")
