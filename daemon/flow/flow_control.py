"""The flow-control interface (docs/DRIVER.md §5): how status messages move a publication's
sender limit (``snd-lmt``).

One small class per strategy behind this interface (the h2 ``windows.py`` model), each in its
own module, declaring its URI grammar (``uri``) and whether C may take its status messages
(``c_fast_path``), and registering itself at the bottom of its module
(:func:`register_flow_control`); :mod:`slipstream.daemon.flow.registry` chooses one per
publication from its parameters (``fc=`` or the driver settings).

Units: positions, windows and lengths in bytes; times in ns.
"""

from __future__ import annotations

import abc
from typing import ClassVar, Self

from slipstream.client.frames import ErrorFrame, StatusMessage
from slipstream.client.layout import NO_DEADLINE
from slipstream.client.logbuffer import compute_position
from slipstream.daemon.flow.strategy import Strategy, registrar
from slipstream.daemon.protocol.params import FlowControlParams
from slipstream.daemon.protocol.types import Address


class FlowControl(Strategy):
    """A sender's flow-control strategy: maps status messages and time to the sender limit.

    The publication calls it from the sender's duty cycle only; a strategy keeps its own
    state (receivers, timers) and never sends anything.  Its declarations
    (:class:`~slipstream.daemon.flow.strategy.Strategy`): ``uri``, the ``fc=`` grammar; the
    options it takes beyond the interface's (group tag, group size, receiver timeout) reach
    it as ``params.options``.
    """

    uri_key = "fc"
    #: A NAK's resend covers at most the receiver window times this (per strategy).
    retransmit_window_multiple: ClassVar[int]
    #: It keeps a set of receivers (min, tagged): the publication then has an
    #: ``fc-receivers`` counter holding :meth:`receiver_count`.
    tracks_receivers: ClassVar[bool] = False
    #: The C half may take this strategy's status messages itself (``on_status_message`` in
    #: daemon/network_receiver.c runs the unicast rule, ``max(limit, position + window)``,
    #: for a publication's one receiver): a strategy whose rule is exactly that says so.
    c_fast_path: ClassVar[bool] = False

    def __init__(self) -> None:
        #: The last receiver window seen in an SM (bytes); bounds retransmissions.
        self.receiver_window = 0
        #: snd-pos as the publication last told it (bytes): it sets it before each SM and
        #: idle pass (min and tagged admission read it).
        self.sender_position = 0

    @classmethod
    @abc.abstractmethod
    def from_params(cls, params: FlowControlParams) -> Self:
        """The strategy for a publication with ``params`` (``params.options``: its own)."""

    # -- events --------------------------------------------------------------------------
    @abc.abstractmethod
    def on_status_message(self, sm: StatusMessage, source: Address, sender_limit: int,
                          initial_term_id: int, position_bits: int, now_ns: int) -> int:
        """The new sender limit after ``sm`` from ``source`` (never an S-flagged SM: those
        go to :meth:`on_trigger_send_setup`)."""

    def on_idle(self, now_ns: int, sender_limit: int, sender_position: int,
                is_eos: bool) -> int:
        """The sender limit after time passed (at each pass of the sender's timers).  Unchanged
        unless the strategy tracks receivers: min and tagged give their minimum itself, which
        may be below ``sender_limit`` (a newcomer joined behind); the C data path sends
        nothing while snd-lmt is at or below snd-pos."""
        return sender_limit

    def on_setup(self, now_ns: int, sender_limit: int) -> None:
        """A SETUP was sent with ``sender_limit`` in force."""

    def on_setup_frame(self, position: int, now_ns: int) -> None:
        """A SETUP naming ``position`` (where a receiver that takes it joins) went out: the
        publication's own or a dynamic MDC destination's probe."""

    def on_trigger_send_setup(self, sm: StatusMessage, source: Address, now_ns: int) -> None:
        """An S-flagged SM (a receiver wants SETUP) arrived."""

    def on_error(self, err: ErrorFrame, now_ns: int) -> None:
        """A receiver rejected the image (ERR frame)."""

    # -- queries -------------------------------------------------------------------------
    def heeds_rate_signal(self, group_tag: int | None) -> bool:
        """Whether a NAK-strength rate signal from a receiver tagged ``group_tag`` (None:
        untagged; a signal carries its receiver's ``gtag=``) may slow the sender: any, unless
        the strategy holds the sender to a group of receivers and leaves the others behind
        (``fc=tagged``)."""
        return True

    def has_required_receivers(self) -> bool:
        """Part of the publication's "connected" status: enough receivers are known."""
        return True

    def receiver_count(self) -> int:
        """How many receivers the strategy holds the sender to (0 for one that tracks none)."""
        return 0

    def retransmission_lookahead(self, mtu: int) -> int:
        """The most one NAK's resend may cover, bytes: the receiver window x the strategy's
        multiple, or MTU x it before any SM (aeron_flow_control_calculate_retransmission_length;
        the retransmit handler also stops at the term's end)."""
        lookahead = self.receiver_window * self.retransmit_window_multiple
        return lookahead if lookahead > 0 else mtu * self.retransmit_window_multiple

    def next_deadline_ns(self) -> int:
        """The next time :meth:`on_idle` may change something (a receiver timeout)."""
        return NO_DEADLINE

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"


#: Registers a FlowControl class under its ``fc=`` name (a strategy module calls it at its
#: bottom); returns the class.
register_flow_control = registrar(FlowControl)


def sm_limit(sm: StatusMessage, initial_term_id: int, position_bits: int) -> int:
    """The position up to which ``sm`` invites data: its consumption position plus its
    receiver window (bytes)."""
    position = compute_position(sm.consumption_term_id, sm.consumption_term_offset,
                                position_bits, initial_term_id)
    return position + sm.receiver_window
