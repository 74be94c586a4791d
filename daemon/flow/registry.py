"""The flow-control, congestion-control and rate-control strategies by their URI names
(``fc=``, ``cc=``, ``rc=``), and the choice of one for a stream from its resolved
parameters."""

from __future__ import annotations

from typing import Final

from slipstream.daemon.flow.congestion_control import CongestionControl
from slipstream.daemon.flow.cubic import CubicCongestionControl
from slipstream.daemon.flow.flow_control import FlowControl
from slipstream.daemon.flow.max_multicast import MaxMulticastFlowControl
from slipstream.daemon.flow.min_multicast import MinMulticastFlowControl
from slipstream.daemon.flow.rate_control import NakStrengthRateControl
from slipstream.daemon.flow.static_window import StaticWindowCongestionControl
from slipstream.daemon.flow.tagged_multicast import TaggedMulticastFlowControl
from slipstream.daemon.flow.unicast import UnicastFlowControl
from slipstream.daemon.protocol.params import PublicationParams, SubscriptionParams

#: Every flow-control strategy, by the name ``fc=`` and the settings use.
FLOW_CONTROLS: Final[dict[str, type[FlowControl]]] = {
    cls.name: cls for cls in (UnicastFlowControl, MaxMulticastFlowControl,
                              MinMulticastFlowControl, TaggedMulticastFlowControl)}

#: Every congestion-control strategy this driver carries, by the name ``cc=`` uses.
CONGESTION_CONTROLS: Final[dict[str, type[CongestionControl]]] = {
    cls.name: cls for cls in (StaticWindowCongestionControl, CubicCongestionControl)}

#: Every send-rate adaptation, by the name ``rc=`` uses.
RATE_CONTROLS: Final[dict[str, type[NakStrengthRateControl]]] = {
    cls.name: cls for cls in (NakStrengthRateControl,)}


def flow_control_for(params: PublicationParams) -> FlowControl:
    """The flow-control strategy of a network publication with ``params``."""
    assert params.flow_control is not None, "an IPC publication has no flow control"
    return FLOW_CONTROLS[params.flow_control.name].from_params(params.flow_control)


def congestion_control_for(params: SubscriptionParams, term_length: int, sender_mtu: int,
                           now_ns: int = 0) -> CongestionControl:
    """The congestion-control strategy of an image made at ``now_ns`` with ``params``,
    ``term_length`` and the sender's MTU; ValueError for a name no strategy is registered
    under (the URI grammar takes only registered names: tests/test_params.py)."""
    try:
        strategy = CONGESTION_CONTROLS[params.congestion_control]
    except KeyError:
        raise ValueError(f"no congestion control {params.congestion_control!r}: this driver "
                         f"carries {', '.join(CONGESTION_CONTROLS)}") from None
    return strategy.from_params(params, term_length, sender_mtu, now_ns)


def rate_control_for(params: PublicationParams, now_ns: int,
                     sender_position: int) -> NakStrengthRateControl | None:
    """The send-rate adaptation of a network publication with ``params`` (None without
    ``rc=``), starting at ``sender_position``."""
    if params.rate_control is None:
        return None
    return RATE_CONTROLS[params.rate_control.name](
        params.rate_control, mtu=params.mtu, now_ns=now_ns, sender_position=sender_position)
