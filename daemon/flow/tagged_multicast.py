"""Tagged multicast flow control (``fc=tagged``): min flow control over a tagged group."""

from __future__ import annotations

from typing import Self

from slipstream.client import strategy_grammar
from slipstream.client.frames import StatusMessage
from slipstream.daemon.flow.flow_control import register_flow_control
from slipstream.daemon.flow.min_multicast import MinMulticastFlowControl
from slipstream.daemon.protocol.params import FlowControlParams


class TaggedMulticastFlowControl(MinMulticastFlowControl):
    """Min flow control over the receivers whose SM carries ``group_tag`` (``fc=tagged``,
    also ``fc=preferred``); untagged or other-tagged receivers never hold the sender back (nor
    do their NAK-strength signals slow it, under ``rc=``), and while none carrying the tag is
    known and the group minimum is 0, the sender follows every SM, and heeds every signal, as
    under ``max`` (with a minimum, it waits for the group, and heeds its signals only)."""

    uri = strategy_grammar.TAGGED

    def __init__(self, *, group_tag: int, receiver_timeout_ns: int,
                 group_min_size: int = 0, admission_interval_ns: int = 0) -> None:
        super().__init__(receiver_timeout_ns=receiver_timeout_ns, group_min_size=group_min_size,
                         admission_interval_ns=admission_interval_ns)
        self.group_tag = group_tag

    @classmethod
    def from_params(cls, params: FlowControlParams) -> Self:
        return cls(group_tag=params.group_tag, receiver_timeout_ns=params.receiver_timeout_ns,
                   group_min_size=params.group_min_size,
                   admission_interval_ns=params.admission_interval_ns)

    def _matches(self, sm: StatusMessage) -> bool:
        return sm.group_tag == self.group_tag

    def heeds_rate_signal(self, group_tag: int | None) -> bool:
        # The group's; anyone's while no group member is known and none is required (the
        # sender then follows every SM, as under max, where every signal counts).
        return group_tag == self.group_tag or (not self.receivers and not self.group_min_size)


register_flow_control(TaggedMulticastFlowControl)
