"""Unicast flow control (``fc=unicast``, the default of unicast channels): one receiver."""

from __future__ import annotations

from typing import Self

from slipstream.client import strategy_grammar
from slipstream.client.frames import StatusMessage
from slipstream.daemon.flow.flow_control import FlowControl, register_flow_control, sm_limit
from slipstream.daemon.protocol.params import FlowControlParams
from slipstream.daemon.protocol.types import Address

# Resend at most receiver_window * multiple per NAK
# (aeron_flow_control.h AERON_UNICAST_FLOW_CONTROL_RETRANSMIT_RECEIVER_WINDOW_MULTIPLE).
UNICAST_RETRANSMIT_WINDOW_MULTIPLE = 16


class UnicastFlowControl(FlowControl):
    """One receiver: ``snd_lmt = max(snd_lmt, position + window)`` (aeron_unicast_flow_control)."""

    uri = strategy_grammar.UNICAST
    retransmit_window_multiple = UNICAST_RETRANSMIT_WINDOW_MULTIPLE
    c_fast_path = True

    @classmethod
    def from_params(cls, params: FlowControlParams) -> Self:
        return cls()

    def on_status_message(self, sm: StatusMessage, source: Address, sender_limit: int,
                          initial_term_id: int, position_bits: int, now_ns: int) -> int:
        """``max(limit, sm position + window)``: the limit never goes back."""
        self.receiver_window = sm.receiver_window
        return max(sender_limit, sm_limit(sm, initial_term_id, position_bits))


register_flow_control(UnicastFlowControl)
