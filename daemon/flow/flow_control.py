"""Sender flow-control strategies (PROTOCOL.md §4): how status messages move ``snd-lmt``.

One small class per strategy behind one interface (the h2 ``windows.py`` model), chosen per
channel by :func:`flow_control_for` from the URI ``fc=`` or the driver settings.

Every strategy maps (status messages, time) to the sender limit, a position in bytes:

* ``on_status_message(sm, source, sender_limit, initial_term_id, position_bits, now_ns)``
  returns the new sender limit for an SM (not S-flagged: those go to
  ``on_trigger_send_setup``).
* ``on_idle(now_ns, sender_limit, sender_position, is_eos)`` runs when the sender had nothing
  to send; it expires silent receivers (min/tagged) and returns the limit.
* ``on_setup(now_ns, sender_limit)`` is told when a SETUP goes out (min/tagged join guard).
* ``on_error(err, now_ns)`` forgets the receiver of an ERR frame.
* ``has_required_receivers()`` is part of the publication's "connected" status.
* ``retransmission_lookahead(mtu)`` caps a NAK's resend.
* ``next_deadline_ns()`` is the next time ``on_idle`` may change something (receiver timeout).

Units: positions, windows and lengths in bytes; times in ns.
"""

from __future__ import annotations

from slipstream.client.channel import Channel
from slipstream.client.frames import ErrorFrame, StatusMessage
from slipstream.client.logbuffer import compute_position
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.protocol.types import NO_DEADLINE, Address

# Resend at most receiver_window * multiple per NAK (aeron_flow_control.h
# AERON_{UNICAST,MAX,MIN}_FLOW_CONTROL_RETRANSMIT_RECEIVER_WINDOW_MULTIPLE).
UNICAST_RETRANSMIT_WINDOW_MULTIPLE = 16
MAX_RETRANSMIT_WINDOW_MULTIPLE = 4
MIN_RETRANSMIT_WINDOW_MULTIPLE = 16


class FlowControl:
    """Base strategy: unicast semantics.  Subclasses override what differs."""

    name = "base"
    retransmit_window_multiple = UNICAST_RETRANSMIT_WINDOW_MULTIPLE

    def __init__(self) -> None:
        #: The last receiver window seen in an SM (bytes); bounds retransmissions.
        self.receiver_window = 0

    # -- events --------------------------------------------------------------------------
    def on_status_message(self, sm: StatusMessage, source: Address, sender_limit: int,
                          initial_term_id: int, position_bits: int, now_ns: int) -> int:
        """The new sender limit after ``sm``: ``max(limit, sm position + window)``."""
        self.receiver_window = sm.receiver_window
        position = compute_position(sm.consumption_term_id, sm.consumption_term_offset,
                                    position_bits, initial_term_id)
        return max(sender_limit, position + sm.receiver_window)

    def on_idle(self, now_ns: int, sender_limit: int, sender_position: int,
                is_eos: bool) -> int:
        """The sender limit after time passed with nothing to send (unchanged by default)."""
        return sender_limit

    def on_setup(self, now_ns: int, sender_limit: int) -> None:
        """A SETUP was sent with ``sender_limit`` in force."""

    def on_trigger_send_setup(self, sm: StatusMessage, source: Address, now_ns: int) -> None:
        """An S-flagged SM (a receiver wants SETUP) arrived."""

    def on_error(self, err: ErrorFrame, now_ns: int) -> None:
        """A receiver rejected the image (ERR frame)."""

    # -- queries -------------------------------------------------------------------------
    def has_required_receivers(self) -> bool:
        return True

    def retransmission_lookahead(self, mtu: int) -> int:
        """The most one NAK's resend may cover, bytes: the receiver window x the strategy's
        multiple, or MTU x it before any SM (aeron_flow_control_calculate_retransmission_length;
        the retransmit handler also stops at the term's end)."""
        lookahead = self.receiver_window * self.retransmit_window_multiple
        return lookahead if lookahead > 0 else mtu * self.retransmit_window_multiple

    def next_deadline_ns(self) -> int:
        return NO_DEADLINE

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"


class UnicastFlowControl(FlowControl):
    """One receiver: ``snd_lmt = max(snd_lmt, position + window)`` (aeron_unicast_flow_control)."""

    name = "unicast"


class MaxMulticastFlowControl(FlowControl):
    """Multicast default: the fastest receiver sets the pace; slower ones recover by NAK or
    fall behind (aeron_max_multicast_flow_control).  Same rule as unicast, smaller resend cap."""

    name = "max"
    retransmit_window_multiple = MAX_RETRANSMIT_WINDOW_MULTIPLE


class _Receiver:
    __slots__ = ("last_position_plus_window", "receiver_id", "source", "time_of_last_sm_ns")

    def __init__(self, receiver_id: int, limit: int, now_ns: int, source: Address) -> None:
        self.receiver_id = receiver_id
        self.last_position_plus_window = limit
        self.time_of_last_sm_ns = now_ns
        self.source = source


class MinMulticastFlowControl(FlowControl):
    """The slowest live receiver sets the pace (aeron_min_flow_control.c, ``fc=min``).

    Keeps ``receiver_id -> (position + window, time of last SM)``.  ``snd_lmt = max(snd_lmt,
    min over receivers)`` once at least ``group_min_size`` receivers are known (before that the
    limit stays and the publication is not connected).  A receiver is forgotten after
    ``receiver_timeout_ns`` without an SM, on an EOS SM and on an ERR naming it.

    Join protection (PROTOCOL.md §4): after an S-flagged SM, the limit at the next SETUP caps
    the computed limit until a new receiver is added or one receiver timeout passes, so a
    newcomer can join before the window moves on.
    """

    name = "min"
    retransmit_window_multiple = MIN_RETRANSMIT_WINDOW_MULTIPLE

    def __init__(self, *, receiver_timeout_ns: int, group_min_size: int = 0) -> None:
        super().__init__()
        self.receiver_timeout_ns = receiver_timeout_ns
        self.group_min_size = group_min_size
        self.receivers: dict[int, _Receiver] = {}
        self._setup_requested = False
        self._last_setup_limit: int | None = None
        self._last_setup_deadline_ns = 0

    def _matches(self, sm: StatusMessage) -> bool:
        return True

    def _min_limit(self) -> int | None:
        if not self.receivers:
            return None
        return min(r.last_position_plus_window for r in self.receivers.values())

    def _limit(self, sender_limit: int, now_ns: int) -> int:
        if not self.receivers or len(self.receivers) < self.group_min_size:
            return sender_limit
        limit = self._min_limit()
        assert limit is not None
        if self._last_setup_limit is not None:
            if now_ns - self._last_setup_deadline_ns < 0:
                limit = min(limit, max(sender_limit, self._last_setup_limit))
            else:
                self._last_setup_limit = None
        return max(sender_limit, limit)

    def on_status_message(self, sm: StatusMessage, source: Address, sender_limit: int,
                          initial_term_id: int, position_bits: int, now_ns: int) -> int:
        if not self._matches(sm):
            return self._limit(sender_limit, now_ns)
        self.receiver_window = sm.receiver_window
        position = compute_position(sm.consumption_term_id, sm.consumption_term_offset,
                                    position_bits, initial_term_id)
        limit = position + sm.receiver_window
        if sm.is_eos:
            self.receivers.pop(sm.receiver_id, None)
            return self._limit(sender_limit, now_ns)
        receiver = self.receivers.get(sm.receiver_id)
        if receiver is not None:
            receiver.last_position_plus_window = limit
            receiver.time_of_last_sm_ns = now_ns
            receiver.source = source
        else:
            current = self._min_limit()
            # A newcomer far behind would stall everyone: accept it only within one window
            # of the current minimum (aeron_min_flow_control_strategy_process_sm).
            if current is None or limit >= current - sm.receiver_window:
                self.receivers[sm.receiver_id] = _Receiver(sm.receiver_id, limit, now_ns, source)
                self._last_setup_limit = None
        return self._limit(sender_limit, now_ns)

    def on_idle(self, now_ns: int, sender_limit: int, sender_position: int,
                is_eos: bool) -> int:
        timeout = self.receiver_timeout_ns
        expired = [rid for rid, r in self.receivers.items()
                   if now_ns - (r.time_of_last_sm_ns + timeout) > 0]
        for rid in expired:
            del self.receivers[rid]
        return self._limit(sender_limit, now_ns)

    def on_trigger_send_setup(self, sm: StatusMessage, source: Address, now_ns: int) -> None:
        if self._matches(sm):
            self._setup_requested = True

    def on_setup(self, now_ns: int, sender_limit: int) -> None:
        if self._setup_requested and self.receivers:
            self._setup_requested = False
            self._last_setup_limit = sender_limit
            self._last_setup_deadline_ns = now_ns + self.receiver_timeout_ns

    def on_error(self, err: ErrorFrame, now_ns: int) -> None:
        self.receivers.pop(err.receiver_id, None)

    def has_required_receivers(self) -> bool:
        return len(self.receivers) >= self.group_min_size

    def next_deadline_ns(self) -> int:
        if not self.receivers:
            return NO_DEADLINE
        oldest = min(r.time_of_last_sm_ns for r in self.receivers.values())
        return oldest + self.receiver_timeout_ns + 1


class TaggedMulticastFlowControl(MinMulticastFlowControl):
    """Min flow control over the receivers whose SM carries ``group_tag`` (``fc=tagged``);
    untagged or other-tagged receivers never hold the sender back."""

    name = "tagged"

    def __init__(self, *, group_tag: int, receiver_timeout_ns: int,
                 group_min_size: int = 0) -> None:
        super().__init__(receiver_timeout_ns=receiver_timeout_ns, group_min_size=group_min_size)
        self.group_tag = group_tag

    def _matches(self, sm: StatusMessage) -> bool:
        return sm.group_tag == self.group_tag

    def on_error(self, err: ErrorFrame, now_ns: int) -> None:
        if err.group_tag is None or err.group_tag == self.group_tag:
            self.receivers.pop(err.receiver_id, None)


def has_group_semantics(channel: Channel) -> bool:
    """Multicast or MDC (dynamic/manual control mode): NAK backoff, retransmit pool, GROUP
    flag in SETUP (aeron_udp_channel_has_group_semantics); URI ``group=`` overrides."""
    if channel.group is not None:
        return channel.group
    return channel.is_multicast or channel.control_mode in ("dynamic", "manual")


def flow_control_for(channel: Channel, settings: DriverSettings) -> FlowControl:
    """The strategy for a publication on ``channel``: URI ``fc=`` first, else the settings'
    ``unicast_flow_control`` / ``multicast_flow_control`` (multicast and MDC)."""
    spec = channel.fc
    group = has_group_semantics(channel)
    name = spec.name if spec is not None else (
        settings.multicast_flow_control if group else settings.unicast_flow_control)
    timeout = (spec.receiver_timeout_ns if spec is not None and spec.receiver_timeout_ns
               is not None else settings.flow_control_receiver_timeout)
    min_size = (spec.group_min_size if spec is not None and spec.group_min_size is not None
                else settings.flow_control_group_min_size)
    if name == "unicast":
        return UnicastFlowControl()
    if name == "max":
        return MaxMulticastFlowControl()
    if name == "min":
        return MinMulticastFlowControl(receiver_timeout_ns=timeout, group_min_size=min_size)
    if name == "tagged":
        tag = (spec.group_tag if spec is not None and spec.group_tag is not None
               else settings.flow_control_group_tag)
        return TaggedMulticastFlowControl(group_tag=tag, receiver_timeout_ns=timeout,
                                          group_min_size=min_size)
    raise ValueError(f"unknown flow control {name!r}")
