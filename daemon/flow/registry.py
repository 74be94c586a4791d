"""The strategies by their URI names (``fc=``, ``cc=``, ``rc=``), and the choice of one for a
stream from its resolved parameters.

Each strategy module registers its class at its bottom (:func:`register_flow_control`,
:func:`register_congestion_control`, :func:`register_rate_control`), and importing
:mod:`slipstream.daemon.flow` imports every shipped one; the conductor, the streams and the
metrics exporter ask the tables here, and the client's URI grammar takes the grammar each
class declares (:mod:`slipstream.daemon.flow.strategy`).  :func:`unregister` forgets one.
"""

from __future__ import annotations

from typing import Final

from slipstream.daemon.flow import strategy
from slipstream.daemon.flow.congestion_control import (
    CongestionControl,
    register_congestion_control,
)
from slipstream.daemon.flow.flow_control import FlowControl, register_flow_control
from slipstream.daemon.flow.rate_control import RateControl, register_rate_control
from slipstream.daemon.flow.strategy import unregister
from slipstream.daemon.protocol.params import PublicationParams, SubscriptionParams

__all__ = [
    "CONGESTION_CONTROLS",
    "FLOW_CONTROLS",
    "RATE_CONTROLS",
    "congestion_control_for",
    "flow_control_for",
    "rate_control_for",
    "register_congestion_control",
    "register_flow_control",
    "register_rate_control",
    "unregister",
]

#: Every flow-control strategy, by the name ``fc=`` and the settings use.
FLOW_CONTROLS: Final[dict[str, type[FlowControl]]] = strategy.table("fc")
#: Every congestion-control strategy, by the name ``cc=`` uses.
CONGESTION_CONTROLS: Final[dict[str, type[CongestionControl]]] = strategy.table("cc")
#: Every send-rate control, by the name ``rc=`` uses.
RATE_CONTROLS: Final[dict[str, type[RateControl]]] = strategy.table("rc")


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
        strategy_class = CONGESTION_CONTROLS[params.congestion_control]
    except KeyError:
        raise ValueError(f"no congestion control {params.congestion_control!r}: this driver "
                         f"carries {', '.join(CONGESTION_CONTROLS)}") from None
    return strategy_class.from_params(params, term_length, sender_mtu, now_ns)


def rate_control_for(params: PublicationParams, now_ns: int,
                     sender_position: int) -> RateControl | None:
    """The send-rate control of a network publication with ``params`` (None without
    ``rc=``), starting at ``sender_position``."""
    if params.rate_control is None:
        return None
    return RATE_CONTROLS[params.rate_control.name].from_params(
        params.rate_control, mtu=params.mtu, now_ns=now_ns, sender_position=sender_position)
