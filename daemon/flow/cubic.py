"""CUBIC congestion control (``cc=cubic``): the receiver window grown and cut as Aeron's
CubicCongestionControl does (docs/DRIVER.md §4.5; RFC 8312's window function in units of
the sender's MTU).

The window is ``cwnd`` datagrams of the sender's MTU, at most ``max_cwnd`` (the static window
over the MTU).  It starts at ``min(10, max_cwnd)`` with ``w_max = max_cwnd``:

* a rebuild pass that finds loss sets ``w_max = cwnd``, cuts ``cwnd`` by ``B`` (to at least 1)
  and forces a status message;
* otherwise, at most once per update interval (the initial round trip), ``cwnd`` follows the
  cubic ``w_max + C (t - K)^3`` of the time since the last loss, ``K = cbrt(w_max B / C)``,
  truncated toward zero and capped at ``max_cwnd``; in TCP mode at least what TCP Reno would
  have grown to (RFC 8312 §4.2; Aeron only below ``w_max``);
* a window of one datagram forces a status message as soon as the subscribers consumed past
  the last one, so the sender is not left waiting for the status timer.

With ``cubic_measure_rtt`` the image measures the round trip (a REPLY-flagged RTTM every
4 x the last round trip), which TCP mode's growth uses.  Units: ns, bytes, datagrams.
"""

from __future__ import annotations

import math
from typing import Self

from slipstream.client import strategy_grammar
from slipstream.client.layout import NO_DEADLINE
from slipstream.daemon.flow.congestion_control import (
    CongestionControl,
    register_congestion_control,
)
from slipstream.daemon.flow.strategy import StrategyCounter
from slipstream.daemon.protocol.params import SubscriptionParams
from slipstream.daemon.protocol.types import Address

#: Aeron's CUBIC constants: the scaling C, the decrease B, the initial window (datagrams) and
#: the round trips between measurements.
C = 0.4
B = 0.2
INITIAL_CWND = 10
RTT_TIMEOUT_MULTIPLE = 4


class CubicCongestionControl(CongestionControl):
    """One image's CUBIC window.  See the module docstring."""

    uri = strategy_grammar.CUBIC
    #: As Aeron's: the last round trip measured (ns; 0 until an RTTM's echo came back) and
    #: the window (bytes).
    counters = (
        StrategyCounter("rcv-cc-cubic-rtt", "slipstream_image_cubic_rtt_seconds",
                        "The round trip a cc=cubic image measured last (0: none yet)",
                        read=lambda cc: cc.rtt_ns if cc.rtt_measurements else 0, scale=1e-9),
        StrategyCounter("rcv-cc-cubic-wnd", "slipstream_image_cubic_window_bytes",
                        "CUBIC's window in a cc=cubic image (its SMs may say less while "
                        "cleaning lags)",
                        read=lambda cc: cc.cwnd * cc.mtu),
    )

    def __init__(self, *, max_window_length: int, mtu: int, initial_rtt_ns: int,
                 measure_rtt: bool, tcp_mode: bool, now_ns: int = 0) -> None:
        self.mtu = mtu
        self.max_cwnd = max(1, max_window_length // mtu)
        self.cwnd = min(INITIAL_CWND, self.max_cwnd)
        self.w_max = self.max_cwnd
        self.k = math.cbrt(self.w_max * B / C)
        self.initial_rtt_ns = initial_rtt_ns
        self.rtt_ns = initial_rtt_ns
        self.window_update_timeout_ns = initial_rtt_ns  # Aeron sets it once, from the initial
        self.rtt_timeout_ns = RTT_TIMEOUT_MULTIPLE * initial_rtt_ns
        self.measure_rtt = measure_rtt
        self.tcp_mode = tcp_mode
        self.last_loss_ns = now_ns
        self.last_update_ns = now_ns
        self.last_rtt_ns: int | None = None  # when the last RTTM went
        self.rtt_measurements = 0  # echoes of its RTTMs that came back
        self.losses = 0

    @classmethod
    def from_params(cls, params: SubscriptionParams, term_length: int, sender_mtu: int,
                    now_ns: int = 0) -> Self:
        return cls(max_window_length=min(params.receiver_window_length, term_length // 2),
                   mtu=sender_mtu, initial_rtt_ns=params.cubic_initial_rtt_ns,
                   measure_rtt=params.cubic_measure_rtt, tcp_mode=params.cubic_tcp_mode,
                   now_ns=now_ns)

    def initial_window_length(self) -> int:
        return self.cwnd * self.mtu

    def max_window_length(self) -> int:
        return self.max_cwnd * self.mtu

    def on_track_rebuild(self, now_ns: int, *, consumption_position: int,
                         last_sm_position: int, hwm_position: int,
                         rebuild_start_position: int, rebuild_end_position: int,
                         loss_found: bool) -> tuple[bool, int]:
        force_sm = False
        if loss_found:
            self.losses += 1
            self.w_max = self.cwnd
            self.k = math.cbrt(self.w_max * B / C)
            self.cwnd = max(1, int(self.cwnd * (1 - B)))
            self.last_loss_ns = now_ns
            force_sm = True
        elif (self.cwnd < self.max_cwnd
              and now_ns > self.last_update_ns + self.window_update_timeout_ns):
            since_loss_s = (now_ns - self.last_loss_ns) / 1e9
            cwnd = min(self.max_cwnd, self.w_max + int(C * (since_loss_s - self.k) ** 3))
            if self.tcp_mode:
                # RFC 8312 §4.2: wherever TCP Reno would be ahead.  (Aeron looks only below
                # w_max: a window cut to one datagram, whose w_max is then 1, never grew
                # while losses kept coming, and its stream starved beside another.)
                reno = int(self.w_max * (1 - B)
                           + (3 * B / (2 - B)) * since_loss_s / (self.rtt_ns / 1e9))
                cwnd = max(cwnd, reno)
            self.cwnd = max(1, min(self.max_cwnd, cwnd))
            self.last_update_ns = now_ns
        elif self.cwnd == 1 and consumption_position > last_sm_position:
            force_sm = True
        return force_sm, self.cwnd * self.mtu

    def should_measure_rtt(self, now_ns: int) -> bool:
        return self.measure_rtt and (self.last_rtt_ns is None
                                     or now_ns > self.last_rtt_ns + self.rtt_timeout_ns)

    def on_rtt_measurement_sent(self, now_ns: int) -> None:
        self.last_rtt_ns = now_ns

    def on_rtt_measurement(self, now_ns: int, rtt_ns: int, source: Address) -> None:
        self.last_rtt_ns = now_ns  # the next measurement a timeout after this answer
        self.rtt_ns = max(1, rtt_ns)
        self.rtt_measurements += 1
        self.rtt_timeout_ns = RTT_TIMEOUT_MULTIPLE * max(rtt_ns, self.initial_rtt_ns)

    def next_deadline_ns(self) -> int:
        if not self.measure_rtt:
            return NO_DEADLINE
        return 0 if self.last_rtt_ns is None else self.last_rtt_ns + self.rtt_timeout_ns + 1

    def __repr__(self) -> str:
        return (f"<CubicCongestionControl cwnd={self.cwnd}/{self.max_cwnd} w_max={self.w_max} "
                f"rtt={self.rtt_ns} ns>")


register_congestion_control(CubicCongestionControl)
