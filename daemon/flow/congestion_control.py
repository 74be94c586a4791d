"""The congestion-control interface (docs/DRIVER.md §4.5): the receiver window an image
advertises in its status messages, and when to measure the round trip.

Congestion control runs in the receiver's image, as in Aeron: the sender follows the window
the receivers advertise (flow control), and a receiver that sees loss or delay shrinks it.
Each strategy lives in its own module, declares its URI grammar (``uri``), its counters and
whether C runs it (``is_static``), and registers itself at the bottom of its module
(:func:`register_congestion_control`); :mod:`slipstream.daemon.flow.registry` chooses one
per image by its URI name (``cc=``).

Units: positions and windows in bytes; times in ns.
"""

from __future__ import annotations

import abc
from typing import ClassVar, Self

from slipstream.client.layout import NO_DEADLINE
from slipstream.daemon.flow.strategy import Strategy, registrar
from slipstream.daemon.protocol.params import SubscriptionParams
from slipstream.daemon.protocol.types import Address


class CongestionControl(Strategy):
    """One image's receiver window.  The image calls it from the receiver's duty cycle.

    Its declarations (:class:`~slipstream.daemon.flow.strategy.Strategy`): ``uri``, the
    ``cc=`` grammar (its options reach it as ``params.congestion_control_options``);
    ``counters``, kept per image (type PER_IMAGE_INDICATOR, as Aeron's PerImageIndicator) and
    served by the metrics exporter; ``is_static``, its C fast path."""

    uri_key = "cc"
    publishes_counters = True
    #: A fixed window and no round trips: the image asks nothing after the initial window,
    #: and the C half runs a reliable unicast image's rebuild passes and status messages
    #: (its fast path).
    is_static: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def from_params(cls, params: SubscriptionParams, term_length: int, sender_mtu: int,
                    now_ns: int = 0) -> Self:
        """The strategy of an image made at ``now_ns`` with ``params``, terms of
        ``term_length`` bytes and the sender's MTU (its SETUP's)."""

    @abc.abstractmethod
    def initial_window_length(self) -> int:
        """The window of the image's first status message (bytes)."""

    @abc.abstractmethod
    def max_window_length(self) -> int:
        """The largest window it will ever advertise (bytes)."""

    @abc.abstractmethod
    def on_track_rebuild(self, now_ns: int, *, consumption_position: int,
                         last_sm_position: int, hwm_position: int,
                         rebuild_start_position: int, rebuild_end_position: int,
                         loss_found: bool) -> tuple[bool, int]:
        """After a rebuild pass over the image's log: the slowest subscriber is at
        ``consumption_position``, the last SM said ``last_sm_position``, data arrived up to
        ``hwm_position``, and the pass moved the receiver position from
        ``rebuild_start_position`` to ``rebuild_end_position``, finding a gap it had not
        seen before if ``loss_found`` (Aeron's meaning: a loss is heard once, not on every
        pass while it is repaired).  Returns (send a status message now, the window to
        advertise)."""

    def should_measure_rtt(self, now_ns: int) -> bool:
        """Whether the image should send an RTT measurement (RTTM, REPLY-flagged) now."""
        return False

    def on_rtt_measurement_sent(self, now_ns: int) -> None:
        """The image sent the RTTM :meth:`should_measure_rtt` asked for."""

    def on_rtt_measurement(self, now_ns: int, rtt_ns: int, source: Address) -> None:
        """The sender at ``source`` echoed an RTTM: the round trip took ``rtt_ns``."""

    def next_deadline_ns(self) -> int:
        """The next time :meth:`should_measure_rtt` may say yes."""
        return NO_DEADLINE

    def indicator_values(self) -> tuple[int, ...]:
        """The values of its per-image counters (:attr:`counters`) now."""
        return self.counter_values()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} window={self.max_window_length()}>"


#: Registers a CongestionControl class under its ``cc=`` name (a strategy module calls it at its
#: bottom); returns the class.
register_congestion_control = registrar(CongestionControl)
