"""The sender agent: every network publication's data path, control input and timers.

Per duty cycle (:meth:`Sender.do_work`), for each send endpoint: the status messages, NAKs,
RTTMs and ERRs waiting at its transport go to its :class:`SendChannel` dispatcher; then for
each publication one C call (``ss_send_data``, through the transport) sends the committed
frames that flow control allows, straight from the log, and the sans-I/O core
(:class:`NetworkPublication`) runs when one of its timers is due: SETUP, heartbeats,
retransmits, flow control, the publisher limit.

The agent is single-threaded: the driver's network thread (or the simulator) calls
:meth:`Sender.do_work`; the conductor hands it work with :meth:`Sender.submit` and hears back
through ``on_event`` (:class:`PublicationDone`: its log and counters may go).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs

from slipstream.client.layout import NO_DEADLINE
from slipstream.daemon.agents.agent import Agent
from slipstream.daemon.media.send_channel import SendChannel
from slipstream.daemon.protocol.types import Datagram
from slipstream.daemon.streams.publication import NetworkPublication


class SendTransport(Protocol):
    """How a send endpoint meets its network: a UDP socket (``daemon/media/udp.py``) or the
    simulator's virtual network."""

    def attach(self, publication: NetworkPublication) -> None:
        """Point the publication's C data path at this transport (socket, destination)."""
        ...

    def send_data(self, publication: NetworkPublication, now_ns: int) -> int:
        """Send what the publication's data path has ready; returns datagrams sent."""
        ...

    def send(self, datagrams: list[Datagram]) -> None:
        """Send control frames now (retransmissions go through :meth:`send_data`)."""
        ...

    def receive(self, channel: SendChannel, now_ns: int) -> int:
        """Hand every waiting control datagram to ``channel``; returns how many there were."""
        ...

    def close(self) -> None: ...


@attrs.define(eq=False)
class SendEndpoint:
    """A send channel (its publications' dispatcher) and the transport it sends through."""

    channel: SendChannel
    transport: SendTransport


@attrs.frozen(eq=False)
class PublicationDone:
    """A publication finished (drained and lingered): its log and counters may go."""

    endpoint: SendEndpoint
    publication: NetworkPublication


class Sender(Agent[SendEndpoint]):
    """The sender agent.  See the module docstring."""

    def __init__(self, *, on_event: Callable[[PublicationDone], None],
                 status_poll_ratio: int = 1) -> None:
        """``status_poll_ratio``: read control input every this many busy duty cycles of
        Aeron's (2 datagrams each), i.e. after twice as many datagrams."""
        super().__init__()
        self.status_poll_ratio = status_poll_ratio
        self._datagrams_to_status_poll = 0
        self._publications: list[tuple[NetworkPublication, SendEndpoint]] = []
        self._on_event = on_event

    # -- commands (run on the agent's thread) -----------------------------------------------
    def add_publication(self, endpoint: SendEndpoint, publication: NetworkPublication) -> None:
        endpoint.transport.attach(publication)
        endpoint.channel.add_publication(publication)
        self._publications.append((publication, endpoint))

    @property
    def publications(self) -> list[NetworkPublication]:
        return [publication for publication, _ in self._publications]

    # -- duty cycle -------------------------------------------------------------------------
    def do_work(self, now_ns: int) -> int:
        """One duty cycle; returns the amount of work done (0: idle)."""
        work = self._run_commands(now_ns)
        sent_total = 0
        for publication, endpoint in self._publications:
            sent = endpoint.transport.send_data(publication, now_ns)
            if sent > 0:
                publication.on_data_sent(now_ns)
                sent_total += sent
        # Control input every cycle that sent nothing, else every status_poll_ratio cycles of
        # Aeron's (2 datagrams each): aeron_driver_sender_do_work.  Each read is a system call,
        # but a status message or NAK read late stalls the stream: our cycles send up to 64
        # datagrams, so count datagrams, not cycles.
        self._datagrams_to_status_poll -= sent_total
        if not sent_total or self._datagrams_to_status_poll <= 0:
            self._datagrams_to_status_poll = 2 * self.status_poll_ratio
            for endpoint in self.endpoints:
                work += endpoint.transport.receive(endpoint.channel, now_ns)
            # The NAKs just read were answered with retransmissions queued on their
            # publications: they go now, not a cycle of new data later (a gap pins the
            # receiver's window until it is repaired).
            for publication, endpoint in self._publications:
                if publication.c.retransmit_count:
                    sent = endpoint.transport.send_data(publication, now_ns)
                    if sent > 0:
                        publication.on_data_sent(now_ns)
                        work += sent
        work += sent_total
        done = None
        for publication, endpoint in self._publications:
            transport = endpoint.transport
            if publication.due(now_ns):
                out = publication.datagrams_to_send(now_ns)
                if out:
                    transport.send(out)
                    work += len(out)
                if publication.is_done:
                    done = [*(done or []), (publication, endpoint)]
        if done:
            for publication, endpoint in done:
                self._publications.remove((publication, endpoint))
                endpoint.channel.remove_publication(publication)
                self._on_event(PublicationDone(endpoint, publication))
            work += len(done)
        return work

    def has_data_ready(self) -> bool:
        """Whether a publication has committed data that flow control lets out (what the
        next duty cycle would send)."""
        return any(p.has_data_ready() for p, _ in self._publications)

    def prepare_to_park(self) -> bool:
        """The thread is about to park: ask every publisher to ring the doorbell on new data
        (the log's driver-waiters word), then look once more; False when there is work after
        all.  Call :meth:`unpark` after the park (or instead of it)."""
        for publication, _ in self._publications:
            self._arm(publication.log.driver_waiters())
        return not self.has_commands and not self.has_data_ready()

    def unpark(self) -> None:
        """After a park: also read control input at the next duty cycle."""
        super().unpark()
        self._datagrams_to_status_poll = 0

    def next_deadline_ns(self) -> int:
        """When a duty cycle is next due with no input or new data (NO_DEADLINE: none)."""
        if self.has_commands:
            return 0
        return min((p.next_due_ns for p, _ in self._publications), default=NO_DEADLINE)
