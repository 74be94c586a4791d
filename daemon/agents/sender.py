"""The sender agent: every network publication's data path, control input and timers.

Its C half (``ss_agent_do_work``, see :mod:`slipstream.daemon.agents.agent`), per duty cycle:
for each publication ``ss_send_data`` sends the committed frames that flow control allows,
straight from the log (retransmissions first); the send endpoints' sockets are read by the
status-poll rule, NAKs answered there in C; a connected publication that takes offers has
its pub-lmt moved and its log cleaned there, and a unicast one's heartbeats sent, its SMs read
into snd-lmt and its receiver's liveness timed.  Its Python half (:meth:`Sender.do_python_work`)
runs when due: the status messages, RTTMs, ERRs and delayed NAKs C leaves go to the
endpoint's :class:`SendChannel` dispatcher, and the sans-I/O core (:class:`NetworkPublication`)
runs its timers (SETUP, retransmits, flow control, and those C does not keep) and, for a
publication whose pub-lmt C does not move, the publisher limit once snd-pos reached its next
step.

The agent is single-threaded: the driver's network thread (or the simulator) runs it; the
conductor hands it work through a :class:`~slipstream.daemon.agents.commands.SenderProxy`
(:meth:`Sender.on_command` runs each) and hears back through ``on_event``
(:mod:`slipstream.daemon.media.events`: ``PublicationDone``, its log and counters may go;
``SpiesReleased``, a closed publication's spies read it all; ...).
"""

from __future__ import annotations

from collections.abc import Callable

from slipstream.client.layout import NO_DEADLINE
from slipstream.daemon._network import lib as network
from slipstream.daemon.agents.agent import Agent
from slipstream.daemon.agents.commands import (
    AddPublication,
    AddSendDestination,
    AddSendEndpoint,
    AddSpy,
    CheckDestinations,
    ClosePublication,
    RemoveSendDestination,
    RemoveSendEndpoint,
    RemoveSpy,
    ResolutionChange,
    SenderCommand,
    SetPressureStep,
    StopCredit,
)
from slipstream.daemon.agents.endpoints import SendEndpoint
from slipstream.daemon.media import send_point
from slipstream.daemon.media.events import (
    DestinationsSilent,
    EndpointRemoved,
    PublicationDone,
    PublicationRejected,
    RetargetFailed,
    SenderEvent,
    SpiesReleased,
    SpyLinked,
    SpyUnlinked,
)
from slipstream.daemon.media.send_point import send_publication_frames
from slipstream.daemon.streams.publication import NetworkPublication


class Sender(Agent[SendEndpoint, SenderCommand]):
    """The sender agent.  See the module docstring."""

    def __init__(self, *, on_event: Callable[[SenderEvent], None],
                 max_datagrams_per_send: int = 64, status_poll_ratio: int = 1) -> None:
        """``max_datagrams_per_send``: datagrams one publication sends per duty cycle (one
        sendmmsg); ``status_poll_ratio``: read control input every this many busy duty cycles
        of Aeron's (2 datagrams each), i.e. after twice as many datagrams."""
        super().__init__(is_sender=True, max_datagrams=max_datagrams_per_send,
                         status_poll_ratio=status_poll_ratio)
        #: The pressure governor's step, applied to every publication (set_pressure_step).
        self.pressure_step = 0
        self._publications: list[tuple[NetworkPublication, SendEndpoint]] = []
        self._now_ns = 0  # the simulator's clock at its last virtual I/O
        #: What the C half's publications array holds, in its order (set by _c_view).
        self._c_pairs: list[tuple[NetworkPublication, SendEndpoint]] = []
        self._on_event = on_event

    # -- commands (run on the agent's thread) -----------------------------------------------
    def on_command(self, command: SenderCommand, now_ns: int) -> None:
        """Run one of the conductor's commands (see their records)."""
        match command:
            case AddPublication(endpoint, publication):
                self.add_publication(endpoint, publication)
            case ClosePublication(publication, wait_for_spies):
                publication.close(now_ns, wait_for_spies=wait_for_spies)
            case StopCredit(publication):
                publication.stop_credit()
            case AddSpy(publication, position_cell, registration_id):
                try:
                    publication.add_spy(position_cell)
                finally:  # the conductor's hold goes whatever happened
                    self._on_event(SpyLinked(registration_id))
            case RemoveSpy(publication, position_cell, counter_id):
                try:
                    publication.remove_spy(position_cell)
                finally:  # the counter is freed whatever happened
                    self._on_event(SpyUnlinked(counter_id))
            case AddSendDestination(channel, address):
                assert channel.destinations is not None
                channel.destinations.add(address, now_ns)
            case RemoveSendDestination(channel, address):
                assert channel.destinations is not None
                channel.destinations.remove(address)
            case CheckDestinations(channel, timeout_ns):
                assert channel.destinations is not None
                self._on_event(DestinationsSilent(
                    channel, channel.destinations.silent(now_ns, timeout_ns)))
            case ResolutionChange(endpoint, address):
                if not endpoint.transport.retarget(address):
                    self._on_event(RetargetFailed(endpoint.channel, address))
            case AddSendEndpoint(endpoint):
                self.add_endpoint(endpoint)
            case RemoveSendEndpoint(endpoint, generation):
                if endpoint.channel.destinations is not None:
                    endpoint.channel.destinations.clear()
                self.remove_endpoint(endpoint)
                self._on_event(EndpointRemoved(endpoint.channel, generation))
            case SetPressureStep(step):
                self.set_pressure_step(step)
            case _:
                raise TypeError(f"not a sender command: {command!r}")

    def add_endpoint(self, endpoint: SendEndpoint) -> None:
        endpoint.transport.attach_channel(endpoint.channel)
        super().add_endpoint(endpoint)

    def add_publication(self, endpoint: SendEndpoint, publication: NetworkPublication) -> None:
        endpoint.transport.attach(publication)
        endpoint.channel.add_publication(publication)
        self._publications.append((publication, endpoint))
        publication.apply_pressure_step(self.pressure_step)

    def set_pressure_step(self, step: int) -> None:
        """The governor's step (daemon/pressure/governor.py): coalescing from step 1, the
        lowest band deferred from step 3, its offers refused at step 4."""
        self.pressure_step = step
        self.c.defer_lowest_band = int(step >= 3)
        for publication, _ in self._publications:
            publication.apply_pressure_step(step)

    @property
    def publications(self) -> list[NetworkPublication]:
        return [publication for publication, _ in self._publications]

    # -- duty cycle -------------------------------------------------------------------------
    def _virtual_io(self, now_ns: int) -> tuple[int, bool]:
        """The simulator's endpoints: the C data path sends by the same rules as for sockets
        (the bands, each transport's room) through the virtual binding onto the network, and
        control input is read by the same status-poll rule (``ss_sender_status_poll_due``)."""
        self._now_ns = now_ns
        sent_total = self._send_virtual(now_ns, retransmits_only=False)
        received = 0
        if network.ss_sender_status_poll_due(self.c, sent_total):
            for endpoint in self.endpoints:
                if endpoint.channel.c.fd < 0:
                    received += endpoint.transport.receive(endpoint.channel, now_ns)
            if received:  # NAKs answered: their retransmissions go now
                sent_total += self._send_virtual(now_ns, retransmits_only=True)
        return sent_total + received, any(e.channel.has_python_work for e in self.endpoints)

    def _send_virtual(self, now_ns: int, *, retransmits_only: bool) -> int:
        """``ss_send_virtual`` over the publications without a socket, each given its
        transport's room first."""
        pairs = self._c_pairs
        if not any(publication.c.fd < 0 for publication, _ in pairs):
            return 0
        for publication, endpoint in pairs:
            if publication.c.fd < 0:
                publication.c.virtual_room = endpoint.transport.room(publication, now_ns)
        sent = network.ss_send_virtual(self.c, now_ns, int(retransmits_only))
        send_point.raise_port_errors()
        return max(0, sent)

    def do_python_work(self, now_ns: int) -> int:
        """The Python half (see :class:`~slipstream.daemon.agents.agent.Agent`): commands,
        control frames for Python, each publication's duties after a send, its timers."""
        work = 0
        try:
            work += self._run_commands(now_ns)
            for endpoint in self.endpoints:
                endpoint.channel.has_python_work = False
                work += endpoint.transport.dispatch(endpoint.channel, now_ns)
                if endpoint.channel.challenges:
                    for publication, datagram in endpoint.channel.challenges:
                        send_publication_frames(publication, (datagram,))
                    work += len(endpoint.channel.challenges)
                    endpoint.channel.challenges.clear()
                work += len(endpoint.channel.expire_destinations(now_ns))
                if endpoint.channel.response_setups:
                    for arrived in endpoint.channel.response_setups:
                        self._on_event(arrived)
                    endpoint.channel.response_setups.clear()
            done = None
            for publication, endpoint in self._publications:
                c = publication.c
                if publication.rejections:
                    self._on_event(PublicationRejected(publication,
                                                       tuple(publication.rejections)))
                    publication.rejections.clear()
                if c.notice:
                    c.notice = 0
                    endpoint.transport.on_notice(publication)
                if c.sent_since_python:
                    c.sent_since_python = 0
                    publication.on_data_sent(now_ns)
                if publication.due(now_ns):
                    out = publication.datagrams_to_send(now_ns)
                    if out:
                        send_publication_frames(publication, out)
                        work += len(out)
                    if publication.is_done:
                        done = [*(done or []), (publication, endpoint)]
                if publication.spies_released:
                    publication.spies_released = False
                    self._on_event(SpiesReleased(publication))
                publication.sync_c_half()
                publication.publish_status()
            if done:
                for publication, endpoint in done:
                    self._publications.remove((publication, endpoint))
                    endpoint.channel.remove_publication(publication)
                    self._on_event(PublicationDone(publication))
                work += len(done)
        finally:
            # Also after a failure: a publication whose PublicationDone went to the conductor
            # may lose its log at any moment, and the C half must no longer see it.
            self._sync_c(lambda: min(
                min((p.python_deadline_ns() for p, _ in self._publications),
                    default=NO_DEADLINE),
                min((e.channel.next_deadline_ns() for e in self.endpoints),
                    default=NO_DEADLINE)))
        return work

    def next_deadline_ns(self) -> int:
        """Also when data waits to be sent: at once, or when the rate limit (``rc=``) and the
        governor's coalescing let it go.  The driver's C loop sends such data by itself; the
        simulator's clock must move there (its C half ran before a Python half that may have
        raised or lifted the limit)."""
        deadline = super().next_deadline_ns()
        deferring = self.c.defer_lowest_band
        for publication, endpoint in self._publications:
            c = publication.c
            if deferring and c.priority < 0 and c.retransmit_count <= 0:
                continue  # its new data waits for the governor's word, not for a time
            if network.ss_has_data_ready(c):
                # Retransmissions wait for neither the rate limit nor coalescing (as in C).
                ready = (0 if c.retransmit_count > 0 else
                         max(network.ss_rate_ready_ns(c), network.ss_coalesce_ready_ns(c)))
                if c.fd < 0:
                    # The simulator's socket may be full: data goes when its link drains.
                    ready = max(ready, endpoint.transport.room_ready_ns(publication,
                                                                        self._now_ns))
                deadline = min(deadline, max(0, ready))
        return deadline

    def _virtual_members(self) -> bool:
        return (any(e.channel.c.fd < 0 for e in self.endpoints)
                or any(p.c.fd < 0 for p, _ in self._publications))

    def _c_view(self) -> tuple[list, list, list]:
        self._c_pairs = list(self._publications)  # the C half's publications, in its order
        return ([e.channel.c for e in self.endpoints if e.channel.c.fd >= 0], [],
                [p.c for p, _ in self._c_pairs])
