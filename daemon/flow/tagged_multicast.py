"""Tagged multicast flow control (``fc=tagged``): min flow control over a tagged group."""

from __future__ import annotations

from typing import Self

from slipstream.daemon.flow.min_multicast import MinMulticastFlowControl
from slipstream.daemon.protocol.params import FlowControlParams


class TaggedMulticastFlowControl(MinMulticastFlowControl):
    """Min flow control over the receivers whose SM carries ``group_tag`` (``fc=tagged``,
    also ``fc=preferred``); untagged or other-tagged receivers never hold the sender back (nor
    do their NAK-strength signals slow it, under ``rc=``), and while none carrying the tag is
    known (and the group minimum is 0) the sender follows every SM as ``max`` does."""

    name = "tagged"

    def __init__(self, *, group_tag: int, receiver_timeout_ns: int,
                 group_min_size: int = 0) -> None:
        super().__init__(receiver_timeout_ns=receiver_timeout_ns, group_min_size=group_min_size)
        self.group_tag = group_tag

    @classmethod
    def from_params(cls, params: FlowControlParams) -> Self:
        return cls(group_tag=params.group_tag, receiver_timeout_ns=params.receiver_timeout_ns,
                   group_min_size=params.group_min_size)

    def counts_receiver_tag(self, group_tag: int | None) -> bool:
        return group_tag == self.group_tag
