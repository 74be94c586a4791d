"""The receiver agent: every receive endpoint's input, images and timers.

Per duty cycle (:meth:`Receiver.do_work`): the commands the conductor submitted, then for each
receive endpoint the datagrams waiting at its transport go to its
:class:`~slipstream.daemon.media.receive_channel.ReceiveChannel` (the C data path inserts
DATA; Python sees SETUP, RTTM and the rest), the channel's images run their timers (status
messages, NAKs, liveness) and its events go to the conductor.  The driver's network thread
and the simulator run it.

Units: times in ns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs

from slipstream.client.layout import NO_DEADLINE
from slipstream.daemon.agents.agent import Agent
from slipstream.daemon.media.receive_channel import ReceiveChannel, ReceiverEvent
from slipstream.daemon.protocol.types import Datagram


class ReceiveTransport(Protocol):
    """How a receive endpoint meets its network: a UDP socket (``daemon/media/udp.py``) or the
    simulator's virtual network."""

    def receive(self, channel: ReceiveChannel, now_ns: int) -> int:
        """Hand every waiting datagram to ``channel``; returns how many there were."""
        ...

    def send(self, datagrams: list[Datagram]) -> None:
        """Send control frames (SMs, NAKs, ...) now."""
        ...

    def close(self) -> None: ...


@attrs.define(eq=False)
class ReceiveEndpoint:
    """A receive channel and the transport it receives through."""

    channel: ReceiveChannel
    transport: ReceiveTransport


class Receiver(Agent[ReceiveEndpoint]):
    """The receiver agent: every receive endpoint's input, images and timers.

    Single-threaded: the driver's network thread (or the simulator) calls :meth:`do_work`;
    other threads hand it work with :meth:`submit`; its events (an image requested, unavailable
    or done) go to the ``on_event`` callback it was given.
    """

    def __init__(self, *, on_event: Callable[[ReceiverEvent], None]) -> None:
        super().__init__()
        self._on_event = on_event

    def do_work(self, now_ns: int) -> int:
        """One duty cycle; returns the amount of work done (0: idle)."""
        work = self._run_commands(now_ns)
        for endpoint in self.endpoints:
            channel = endpoint.channel
            work += endpoint.transport.receive(channel, now_ns)
            if channel.images or channel.next_deadline_ns() <= now_ns:
                out = channel.datagrams_to_send(now_ns)
                if out:
                    endpoint.transport.send(out)
                    work += len(out)
            for event in channel.poll_events():
                self._on_event(event)
                work += 1
        return work

    def prepare_to_park(self) -> bool:
        """The thread is about to park: ask every image's subscribers to ring the doorbell
        once they reach the position where a status message would be due (the log's wake
        position and driver-waiters word), then look once more; False when they are there
        already.  Call :meth:`unpark` after the park (or instead of it)."""
        may_park = not self.has_commands
        for endpoint in self.endpoints:
            for image in endpoint.channel.images.values():
                due = image.status_message_due_position()
                image.log.set_driver_wake_position(due)
                self._arm(image.log.driver_waiters())
                if image.subscriber_count and image.min_subscriber_position() >= due:
                    may_park = False
        return may_park

    def next_deadline_ns(self) -> int:
        """When a duty cycle is next due with no input (NO_DEADLINE: none)."""
        if self.has_commands:
            return 0
        return min((e.channel.next_deadline_ns() for e in self.endpoints), default=NO_DEADLINE)
