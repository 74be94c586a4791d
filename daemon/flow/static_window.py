"""Static window congestion control (``cc=static``, the default): a fixed receiver window."""

from __future__ import annotations

from typing import Self

from slipstream.client import strategy_grammar
from slipstream.daemon.flow.congestion_control import (
    CongestionControl,
    register_congestion_control,
)
from slipstream.daemon.protocol.params import SubscriptionParams


class StaticWindowCongestionControl(CongestionControl):
    """The window is the receive channel's (``rcv-wnd=``, else the setting) capped at half a
    term, and never changes (the receiver refuses a sender whose MTU it cannot hold): the image
    sends status messages by the 25 % rule and its timer only, and measures no round trips."""

    uri = strategy_grammar.STATIC
    is_static = True

    def __init__(self, window_length: int) -> None:
        self.window_length = window_length

    @classmethod
    def from_params(cls, params: SubscriptionParams, term_length: int, sender_mtu: int,
                    now_ns: int = 0) -> Self:
        return cls(min(params.receiver_window_length, term_length // 2))

    def initial_window_length(self) -> int:
        return self.window_length

    def max_window_length(self) -> int:
        return self.window_length

    def on_track_rebuild(self, now_ns: int, *, consumption_position: int,
                         last_sm_position: int, hwm_position: int,
                         rebuild_start_position: int, rebuild_end_position: int,
                         loss_found: bool) -> tuple[bool, int]:
        return False, self.window_length


register_congestion_control(StaticWindowCongestionControl)
