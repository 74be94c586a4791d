"""What a stream is made with: its channel URI's values, else the driver's settings.

Every "the URI's value if it names one, else the setting" choice of the driver is made here,
once, as the stream is added (Aeron's PublicationParams and SubscriptionParams).  The rest of
the driver reads the frozen parameters and never looks at the URI or the settings for these
values again.  Group semantics are decided by :func:`has_group_semantics` only.

Units: lengths and windows in bytes, times in ns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import attrs

from slipstream.client import strategy_grammar
from slipstream.client.channel import Channel, DurableSpec
from slipstream.client.errors import ChannelError
from slipstream.client.logbuffer import (
    check_mtu,
    check_term_length,
    max_message_length,
    term_count,
)
from slipstream.daemon.config import RECEIVE_BUFFER_RULE, SEND_BUFFER_RULE, DriverSettings

T = TypeVar("T")

#: The congestion control of a subscription whose URI names none (Aeron's default).
DEFAULT_CONGESTION_CONTROL = "static"

#: Control modes whose channels carry one stream to many receivers (multi-destination-cast).
_GROUP_CONTROL_MODES = ("dynamic", "manual")


def has_group_semantics(channel: Channel) -> bool:
    """Whether a stream on ``channel`` is one-to-many: multicast NAK backoff, the retransmit
    pool, the GROUP flag in SETUP.  The URI's ``group=`` decides when given; otherwise a
    multicast or multi-destination-cast channel is a group (on the receiving side, so is a
    stream whose SETUP carries the GROUP flag: :meth:`SubscriptionParams.image_is_group`).

    May resolve the endpoint's name (:meth:`Channel.endpoint_address`): call it on a channel
    whose names the conductor has resolved.
    """
    return _group_semantics(channel.group, _is_multicast_or_mdc(channel))


def _is_multicast_or_mdc(channel: Channel) -> bool:
    return channel.is_multicast or channel.control_mode in _GROUP_CONTROL_MODES


def _group_semantics(asked: bool | None, inferred: bool) -> bool:
    return inferred if asked is None else asked


@attrs.frozen
class StrategyOptions:
    """A strategy's own options, resolved: the fields of its URI grammar that its interface's
    parameters do not carry, each the URI's value, else the grammar's default (None when it
    declares none), in the grammar's order."""

    items: tuple[tuple[str, Any], ...] = ()

    def __getitem__(self, field: str) -> Any:
        for name, value in self.items:
            if name == field:
                return value
        raise KeyError(field)

    def get(self, field: str, default: Any = None) -> Any:
        value = dict(self.items).get(field)
        return default if value is None else value


@attrs.frozen
class FlowControlParams:
    """A publication's flow-control strategy (``fc=``, else the settings) and its arguments:
    the interface's (each the URI's, else the setting) and the strategy's own."""

    name: str  # a registered strategy: slipstream.daemon.flow.registry.FLOW_CONTROLS
    group_tag: int  # tagged: the receivers that count
    group_min_size: int  # min, tagged: receivers required before the sender moves
    receiver_timeout_ns: int  # min, tagged: how long a silent receiver still counts
    options: StrategyOptions = StrategyOptions()
    #: min, tagged: how long a new receiver is heard before it may hold the sender back.
    admission_interval_ns: int = 0


@attrs.frozen
class RateControlParams:
    """A publication's send-rate adaptation (``rc=``): the strategy, the thresholds its
    receivers signal at (percent of their window, ascending) and the window within which
    the sender takes the strongest signal as one (ns), which its announcements carry; and
    the strategy's own options."""

    name: str  # a registered strategy: slipstream.daemon.flow.registry.RATE_CONTROLS
    thresholds: tuple[int, ...]
    window_ns: int
    options: StrategyOptions = StrategyOptions()


#: NAK-strength's defaults (docs/FLOW.md): the thresholds receivers signal at and the sender's
#: window.
DEFAULT_RATE_THRESHOLDS = strategy_grammar.NAK_STRENGTH_THRESHOLDS
DEFAULT_RATE_WINDOW_NS = strategy_grammar.NAK_STRENGTH_WINDOW_NS


def _strategy_values(key: str, name: str, spec: strategy_grammar.StrategySpec | None,
                     interface: Mapping[str, Any]) -> tuple[dict[str, Any], StrategyOptions]:
    """The values of strategy ``key=name`` (``spec``: the URI's, if it names one): those of
    the ``interface``'s fields (field -> the driver's value) and its own options, each the
    URI's value, else its grammar's default, else (the interface's) the driver's."""
    grammar = strategy_grammar.grammar_of(key, name)
    declared = grammar.defaults() if grammar is not None else {}
    given = spec.values if spec is not None else {}

    def value(field: str, fallback: Any) -> Any:
        for candidate in (given.get(field), declared.get(field)):
            if candidate is not None:
                return candidate
        return fallback

    common = {field: value(field, default) for field, default in interface.items()}
    own = tuple((field, value(field, None)) for field in declared if field not in interface)
    return common, StrategyOptions(own)


@attrs.frozen
class PublicationParams:
    """One publication's parameters (IPC or UDP).

    ``session_id`` and ``initial_term_id`` are None when the URI leaves them to the driver;
    ``initial_term_count`` and ``initial_term_offset`` place a log that starts elsewhere than
    its first term (``init-term-id``, ``term-id``, ``term-offset``).  The network-only fields
    (``group``, ``signal_eos``, ``setup_ttl``, ``max_resend``, ``flow_control``,
    ``rate_control``, ``priority``) hold their defaults for IPC.
    """

    term_length: int
    mtu: int
    term_window_length: int  # the publisher's window: pub-wnd, else the setting, <= term/2
    linger_timeout_ns: int
    sparse: bool
    session_id: int | None
    initial_term_id: int | None
    initial_term_count: int
    initial_term_offset: int
    group: bool = False
    signal_eos: bool = True
    setup_ttl: int = 0  # the TTL field of SETUP frames (the URI's ttl, 0 without)
    max_resend: int = 1
    flow_control: FlowControlParams | None = None
    rate_control: RateControlParams | None = None  # rc=, else none
    priority: int = 0  # priority=: its band in the sender (docs/BACKPRESSURE.md)
    #: ssc= (Aeron's spies-simulate-connection): its spies connect it as receivers would.
    spies_simulate_connection: bool = False
    #: A request publication's (response-correlation-id= without control-mode=response):
    #: its SETUP carries SEND_RESPONSE, and the RSP_SETUP its image's driver answers names
    #: this response subscription's registration id (docs/CHANNELS.md §7.6).
    sends_response_setup: bool = False
    #: response-correlation-id= (None without): a request publication's response
    #: subscription, or a response publication's request image (their registration ids).
    response_correlation_id: int | None = None
    #: durable=TAG/N (None without): which receivers' status messages make a message
    #: durable, and how many of them (daemon/streams/durable.py).
    durable: DurableSpec | None = None
    #: A tagged receiver silent this long stops counting toward durable= (ns): the flow
    #: control receiver timeout (``flow_control_receiver_timeout``, 5 s).
    durable_receiver_timeout_ns: int = 0

    @classmethod
    def for_network(cls, channel: Channel, settings: DriverSettings) -> PublicationParams:
        """The parameters of a UDP publication on ``channel`` (its names resolved).
        ChannelError names the key whose value the driver cannot use."""
        term_length = channel.term_length or settings.term_buffer_length
        mtu = channel.mtu or settings.mtu_length
        group = has_group_semantics(channel)
        spec = channel.fc
        name = spec.name if spec is not None else (
            settings.multicast_flow_control if group else settings.unicast_flow_control)
        flow_control, flow_control_options = _strategy_values("fc", name, spec, {
            "group_tag": settings.flow_control_group_tag,
            "group_min_size": settings.flow_control_group_min_size,
            "receiver_timeout_ns": settings.flow_control_receiver_timeout})
        rate_control = None
        if channel.rc is not None:
            rate, rate_options = _strategy_values("rc", channel.rc.name, channel.rc, {
                "thresholds": DEFAULT_RATE_THRESHOLDS, "window_ns": DEFAULT_RATE_WINDOW_NS})
            rate_control = RateControlParams(channel.rc.name, **rate, options=rate_options)

        so_sndbuf = channel.so_sndbuf or settings.socket_so_sndbuf
        if so_sndbuf and mtu > so_sndbuf:  # the setting's rule (mtu_length), for the URI
            raise ChannelError(str(channel), "so-sndbuf" if channel.so_sndbuf else "mtu",
                               f"mtu {mtu} is more than so-sndbuf {so_sndbuf}: "
                               f"{SEND_BUFFER_RULE.why}")

        return cls(
            **_log_shape(channel, term_length, mtu),
            term_window_length=_term_window_length(
                term_length, channel.pub_wnd or settings.publication_term_window_length),
            linger_timeout_ns=_or(channel.linger_ns, settings.publication_linger_timeout),
            sparse=_or(channel.sparse, settings.term_buffer_sparse_file),
            group=group,
            signal_eos=_or(channel.eos, True),
            setup_ttl=channel.ttl or 0,
            max_resend=channel.max_resend or settings.max_resend,
            flow_control=FlowControlParams(
                name=name, **flow_control, options=flow_control_options,
                admission_interval_ns=settings.flow_control_admission_interval),
            rate_control=rate_control,
            priority=channel.priority or 0,
            spies_simulate_connection=channel.ssc is True,
            sends_response_setup=(channel.response_correlation_id is not None
                                  and not channel.is_response),
            response_correlation_id=channel.response_correlation_id,
            durable=channel.durable,
            durable_receiver_timeout_ns=settings.flow_control_receiver_timeout)

    @classmethod
    def for_ipc(cls, channel: Channel, settings: DriverSettings) -> PublicationParams:
        """The parameters of an IPC publication on ``channel``; ChannelError names the key."""
        term_length = channel.term_length or settings.ipc_term_buffer_length
        mtu = channel.mtu or settings.ipc_mtu_length
        return cls(
            **_log_shape(channel, term_length, mtu),
            term_window_length=_term_window_length(
                term_length, channel.pub_wnd or settings.ipc_publication_term_window_length),
            linger_timeout_ns=_or(channel.linger_ns, settings.publication_linger_timeout),
            sparse=_or(channel.sparse, settings.term_buffer_sparse_file))


@attrs.frozen
class SubscriptionParams:
    """What the images of a receive channel are made with (the channel of its first
    subscription)."""

    reliable: bool  # NAK gaps (else fill them with padding and move on)
    group: bool | None  # the URI's group=, None to infer (see image_is_group)
    multicast_or_mdc: bool  # the channel by itself has group semantics
    group_tag: int | None  # carried in SMs (gtag=, else the setting)
    receiver_window_length: int  # rcv-wnd, else the setting (the image caps it at term/2)
    nak_delay_ns: int  # unicast NAK delay (nak-delay=, else the setting)
    sparse: bool
    #: rejoin= (else true): a session whose image went may come back; with false it never
    #: does while the endpoint has subscriptions of its stream (Aeron's rejoin).
    rejoin: bool
    congestion_control: str  # a registered strategy (cc=, else static)
    #: The longest term an image may have (max-term-length=, else
    #: image_term_buffer_length_max): a SETUP asking for more makes no image.
    image_term_length_max: int
    cubic_initial_rtt_ns: int  # cc=cubic: the settings' cubic_* keys
    cubic_measure_rtt: bool
    cubic_tcp_mode: bool
    #: The congestion control's own options (its cc= grammar's).
    congestion_control_options: StrategyOptions = StrategyOptions()

    @classmethod
    def resolve(cls, channel: Channel, settings: DriverSettings) -> SubscriptionParams:
        """The parameters for images on ``channel`` (its names resolved).  ChannelError
        names the key whose value the driver cannot use."""
        window = channel.rcv_wnd or settings.rcv_initial_window_length
        so_rcvbuf = channel.so_rcvbuf or settings.socket_so_rcvbuf
        if so_rcvbuf and window > so_rcvbuf:  # the setting's rule, for the URI
            raise ChannelError(str(channel), "so-rcvbuf" if channel.so_rcvbuf else "rcv-wnd",
                               f"rcv-wnd {window} is more than so-rcvbuf {so_rcvbuf}: "
                               f"{RECEIVE_BUFFER_RULE.why}")
        congestion_control = (channel.cc.name if channel.cc is not None
                              else DEFAULT_CONGESTION_CONTROL)
        _, congestion_control_options = _strategy_values("cc", congestion_control, channel.cc,
                                                         {})
        return cls(
            reliable=_or(channel.reliable, settings.reliable_stream),
            group=channel.group,
            multicast_or_mdc=_is_multicast_or_mdc(channel),
            group_tag=_or(channel.gtag, settings.receiver_group_tag),
            receiver_window_length=window,
            nak_delay_ns=_or(channel.nak_delay_ns, settings.nak_unicast_delay),
            sparse=_or(channel.sparse, settings.term_buffer_sparse_file),
            rejoin=channel.rejoin is not False,
            congestion_control=congestion_control,
            image_term_length_max=_or(channel.max_term_length,
                                      settings.image_term_buffer_length_max),
            cubic_initial_rtt_ns=settings.cubic_initial_rtt,
            cubic_measure_rtt=settings.cubic_measure_rtt,
            cubic_tcp_mode=settings.cubic_tcp_mode,
            congestion_control_options=congestion_control_options)

    def image_is_group(self, sender_is_group: bool) -> bool:
        """Group semantics of an image whose SETUP says ``sender_is_group``: the rule of
        :func:`has_group_semantics`, from the values resolved here."""
        return _group_semantics(self.group, sender_is_group or self.multicast_or_mdc)


@attrs.frozen
class SocketParams:
    """A UDP endpoint's socket options (0: the kernel's default)."""

    so_rcvbuf: int  # bytes
    so_sndbuf: int  # bytes
    multicast_ttl: int

    @classmethod
    def resolve(cls, channel: Channel, settings: DriverSettings) -> SocketParams:
        """``so-rcvbuf``, ``so-sndbuf`` and ``ttl`` of ``channel``, else the settings."""
        return cls(so_rcvbuf=channel.so_rcvbuf or settings.socket_so_rcvbuf,
                   so_sndbuf=channel.so_sndbuf or settings.socket_so_sndbuf,
                   multicast_ttl=channel.ttl or settings.socket_multicast_ttl)


def _term_window_length(term_length: int, asked: int) -> int:
    """How far offers may run ahead of the sender (or the slowest IPC subscriber): ``asked``
    (``pub-wnd=``, else the setting), capped at half a term, and half a term for 0."""
    half = term_length // 2
    return min(asked, half) if asked else half


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def _log_shape(channel: Channel, term_length: int, mtu: int) -> dict[str, int | None]:
    """Term length, MTU, session and where the log starts, checked: ChannelError names the
    key (``term-length``, ``mtu``) when the URI's value, or the setting, cannot make a log."""
    for key, check, value in (("term-length", check_term_length, term_length),
                              ("mtu", check_mtu, mtu)):
        try:
            check(value)
        except ValueError as e:
            raise ChannelError(str(channel), key, str(e)) from None
    if mtu > max_message_length(term_length):
        raise ChannelError(str(channel), "mtu", f"{mtu} exceeds the maximum message length "
                                                f"{max_message_length(term_length)} of term "
                                                f"length {term_length}")
    if channel.init_term_id is None:
        initial_term_count = initial_term_offset = 0
    else:
        # term-id and term-offset come with init-term-id (parse_channel checks).
        assert channel.term_id is not None and channel.term_offset is not None
        initial_term_count = term_count(channel.term_id, channel.init_term_id)
        initial_term_offset = channel.term_offset
        if initial_term_offset > term_length:
            raise ChannelError(str(channel), "term-offset", f"{initial_term_offset} is beyond "
                                                            f"the term length {term_length}")
    return {"term_length": term_length, "mtu": mtu, "session_id": channel.session_id,
            "initial_term_id": channel.init_term_id, "initial_term_count": initial_term_count,
            "initial_term_offset": initial_term_offset}
