"""Max multicast flow control (``fc=max``, the default of multicast channels)."""

from __future__ import annotations

from slipstream.client import strategy_grammar
from slipstream.daemon.flow.flow_control import register_flow_control
from slipstream.daemon.flow.unicast import UnicastFlowControl

# (aeron_flow_control.h AERON_MAX_FLOW_CONTROL_RETRANSMIT_RECEIVER_WINDOW_MULTIPLE)
MAX_RETRANSMIT_WINDOW_MULTIPLE = 4


class MaxMulticastFlowControl(UnicastFlowControl):
    """The fastest receiver sets the pace; slower ones recover by NAK or fall behind
    (aeron_max_multicast_flow_control).  The unicast rule, with a smaller resend cap."""

    uri = strategy_grammar.MAX
    retransmit_window_multiple = MAX_RETRANSMIT_WINDOW_MULTIPLE
    # Its receivers are a multicast group's, and C takes the SMs of one receiver only.
    c_fast_path = False


register_flow_control(MaxMulticastFlowControl)
