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

from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.agents.agent import Agent, DueTimers
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
from slipstream.daemon.pressure.governor import TOP_STEP
from slipstream.daemon.streams.publication import NetworkPublication

#: The reasons for which a pass visits only the members due (see Sender.do_python_work).
DUE_MEMBERS_OR_TIMERS = network.SS_DUE_INPUT | network.SS_DUE_PUBLICATION | network.SS_DUE_TIMER

#: A publication with the endpoint that sends it: one object each, kept as it was added.
Pair = tuple[NetworkPublication, SendEndpoint]


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
        #: Each endpoint's publications, by id of the endpoint.
        self._endpoint_publications: dict[
            int, list[tuple[NetworkPublication, SendEndpoint]]] = {}
        #: Each publication's pair by id of the publication, and each endpoint by id of its
        #: channel (the commands name publications and channels).
        self._pair_of: dict[int, tuple[NetworkPublication, SendEndpoint]] = {}
        self._endpoint_of: dict[int, SendEndpoint] = {}
        #: The members the commands of the pass under way touched, by id (an endpoint, or a
        #: publication's pair), or None once one touched what no member holds alone (see
        #: _touch).
        self._touched: dict[int, SendEndpoint | tuple[NetworkPublication, SendEndpoint]
                            ] | None = None
        #: The endpoints' and publications' Python timers (see _python_deadline_ns).
        self._timers: DueTimers[object] = DueTimers()
        #: The driver drains: each pass publishes every publication's status (publish_status).
        self._credit_stopped = False
        self._on_event = on_event

    # -- commands (run on the agent's thread) -----------------------------------------------
    def on_command(self, command: SenderCommand, now_ns: int) -> bool | None:
        """Run one of the conductor's commands (see their records); False: it changed no
        stream's rules or timers (see :meth:`Agent.on_command`)."""
        self._touch(command)
        match command:
            case AddPublication(endpoint, publication):
                self.add_publication(endpoint, publication)
            case ClosePublication(publication, wait_for_spies):
                publication.close(now_ns, wait_for_spies=wait_for_spies)
            case StopCredit(publication):
                self._credit_stopped = True
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
                changed = self.set_pressure_step(step)
                if changed:  # offers refused or taken again: every publication's status
                    self._touched = None
                return changed
            case _:
                raise TypeError(f"not a sender command: {command!r}")
        return None

    def _touch(self, command: SenderCommand) -> None:
        """Note the members ``command`` changes (a publication added, closed, its spies; an
        endpoint added, retargeted, its destinations), which its pass then visits with those
        the C half listed as due and those whose timer came, not every member.  An endpoint
        removed touches none (it is gone); a governor step touches none unless it changes a
        publication's rules (then see on_command); any other command makes the pass visit
        all."""
        touched = self._touched
        if touched is None:
            return
        match command:
            case AddPublication(endpoint, publication):
                touched[id(endpoint)] = endpoint
                touched[id(publication)] = (publication, endpoint)
                return
            case (ClosePublication(publication, _) | StopCredit(publication)
                  | AddSpy(publication, _, _) | RemoveSpy(publication, _, _)):
                pair = self._pair_of.get(id(publication))
                if pair is not None:
                    touched[id(publication)] = pair
                    return
            case (AddSendDestination(channel, _) | RemoveSendDestination(channel, _)
                  | CheckDestinations(channel, _)):
                endpoint = self._endpoint_of.get(id(channel))
                if endpoint is not None:
                    touched[id(endpoint)] = endpoint
                    return
            case AddSendEndpoint(endpoint) | ResolutionChange(endpoint, _):
                touched[id(endpoint)] = endpoint
                return
            case RemoveSendEndpoint() | SetPressureStep():
                return
        self._touched = None

    def add_endpoint(self, endpoint: SendEndpoint) -> None:
        endpoint.transport.attach_channel(endpoint.channel)
        super().add_endpoint(endpoint)
        self._endpoint_of[id(endpoint.channel)] = endpoint
        self._endpoint_publications.setdefault(id(endpoint), [])
        if endpoint.channel.c.fd >= 0:
            self._member_added(self._receivers, endpoint.channel.c, endpoint)
        else:  # the simulator's
            self._has_virtual_io = True

    def remove_endpoint(self, endpoint: SendEndpoint) -> None:
        super().remove_endpoint(endpoint)
        self._timers.forget(endpoint)
        if self._endpoint_of.get(id(endpoint.channel)) is endpoint:
            del self._endpoint_of[id(endpoint.channel)]
            self._endpoint_publications.pop(id(endpoint), None)
        if endpoint.channel.c.fd >= 0:
            self._member_removed(self._receivers, endpoint.channel.c)
        else:  # the simulator's: whether any member has no socket is looked at anew
            self._members_changed = True


    def add_publication(self, endpoint: SendEndpoint, publication: NetworkPublication) -> None:
        endpoint.transport.attach(publication)
        endpoint.channel.add_publication(publication)
        pair = (publication, endpoint)
        self._publications.append(pair)
        self._pair_of[id(publication)] = pair
        self._place(publication)
        self._endpoint_publications.setdefault(id(endpoint), []).append(pair)
        self._member_added(self._sends, publication.c, pair)
        if publication.c.fd < 0:  # the simulator's
            self._has_virtual_io = True
        publication.apply_pressure_step(self.pressure_step)

    def set_pressure_step(self, step: int) -> bool:
        """The governor's step (daemon/pressure/governor.py): coalescing from step 1, the
        lowest band deferred from step 3, its offers refused at step 4.  Returns whether a
        publication's rules changed (its offers refused or taken again): coalescing and the
        deferral are the C data path's alone, and a step that moves neither visits no
        publication."""
        before, self.pressure_step = self.pressure_step, step
        self.c.defer_lowest_band = int(step >= 3)
        if (before >= 1) == (step >= 1) and (before >= TOP_STEP) == (step >= TOP_STEP):
            return False
        changed = False
        for publication, _ in self._publications:
            changed = publication.apply_pressure_step(step) or changed
        return changed

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
        pairs = self._sends.owners  # the C half's, in its order
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
        control frames for Python, each publication's duties after a send, its timers.

        A pass due for input, publications, timers or commands alone visits only the
        members due: the endpoints the C half listed with input (and, the simulator's, those
        it handed input), the publications it listed (``due_members``: a send that needs
        Python, a notice, a receiver's liveness, a spy), the endpoints and publications whose
        Python timer came (:class:`~slipstream.daemon.agents.agent.DueTimers`), those the
        commands touched (:meth:`_touch`: adding a stream visits that stream and its
        endpoint, not every one), and the publications the endpoints' input made due
        (:meth:`_due_publications`).  Any other pass visits every one."""
        work, light = 0, False
        endpoints, pairs = self.endpoints, self._publications
        visited_all = True
        due_pairs: dict[int, Pair] = {}
        try:
            due = self.c.due
            listed = self._listed_members()  # the C half's list, before a command moves it
            self._touched = {}
            work, light = self._run_commands(now_ns)
            if light:
                return work
            touched, self._touched = self._touched, None
            if (listed is not None and touched is not None and not self._credit_stopped
                    and not due & ~(DUE_MEMBERS_OR_TIMERS | network.SS_DUE_COMMANDS)):
                endpoints, due_pairs = self._due_members(now_ns, listed, touched)
                visited_all = False
            for endpoint in endpoints:
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
            if not visited_all:  # with those the endpoints' input just made due
                pairs = self._due_pairs(endpoints, due_pairs)
            self.streams_visited = len(pairs)
            done = None
            for publication, endpoint in pairs:
                c = publication.c
                refusals = publication.refusals
                if refusals.rejections:
                    self._on_event(PublicationRejected(publication, tuple(refusals.rejections),
                                                       refusals.rejections_unkept))
                    refusals.rejections.clear()
                    refusals.rejections_unkept = 0
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
                for pair in done:
                    publication, endpoint = pair
                    self._publications.remove(pair)
                    del self._pair_of[id(publication)]
                    del self._order[id(publication)]
                    of_endpoint = self._endpoint_publications.get(id(endpoint), [])
                    if pair in of_endpoint:
                        of_endpoint.remove(pair)
                    self._member_removed(self._sends, publication.c)
                    if publication.c.fd < 0:  # the simulator's
                        self._members_changed = True
                    self._timers.forget(publication)
                    endpoint.channel.remove_publication(publication)
                    self._on_event(PublicationDone(publication))
                work += len(done)
        except BaseException:
            # A member may have come or gone halfway: the C half's view is made anew (and
            # the timers this pass took are set again for the members it was to visit).
            self._members_changed = True
            raise
        finally:
            # Also after a failure: a publication whose PublicationDone went to the conductor
            # may lose its log at any moment, and the C half must no longer see it.
            if not light:
                self._sync_c(lambda: self._python_deadline_ns(endpoints, pairs, visited_all))
        return work

    def _listed_members(self) -> tuple[list[SendEndpoint], list[Pair]] | None:
        """The members the C half listed as due (``due_members``): the endpoints and the
        publications' pairs; None when its list is not the current view's (then the pass
        visits every member)."""
        c = self.c
        receivers, sends = self._receivers.owners, self._sends.owners
        if (self._members_changed or c.due_members == network_ffi.NULL
                or len(receivers) != c.endpoint_count or c.image_count
                or len(sends) != c.publication_count):
            return None
        endpoints: list[SendEndpoint] = []
        publications: list[Pair] = []
        first_publication = c.endpoint_count
        listed = c.due_members
        for k in range(c.due_members_count):
            member = listed[k]
            if member >= first_publication:
                publications.append(sends[member - first_publication])
            else:
                endpoints.append(receivers[member])
        return endpoints, publications

    def _due_members(self, now_ns: int, listed: tuple[list[SendEndpoint], list[Pair]],
                     touched: dict[int, SendEndpoint | Pair]
                     ) -> tuple[list[SendEndpoint], dict[int, Pair]]:
        """What a pass due for its members alone visits (see :meth:`do_python_work`): the
        endpoints ``listed`` (by :meth:`_listed_members`), those ``touched`` and those whose
        timer came, in the agent's order; the publications of the same, by id (those the
        endpoints' input makes due join them once it is read: :meth:`_due_pairs`).  A
        member that left the agent meanwhile is not visited."""
        order, pair_of = self._order, self._pair_of
        endpoints: dict[int, SendEndpoint] = {id(e): e for e in listed[0]}
        publications = {id(pair[0]): pair for pair in listed[1]}
        for member in touched.values():
            if isinstance(member, tuple):
                publications[id(member[0])] = member
            else:
                endpoints[id(member)] = member
        for timed in self._timers.take_due(now_ns):
            pair = pair_of.get(id(timed))
            if pair is not None:
                publications[id(timed)] = pair
            elif id(timed) in order:
                endpoints[id(timed)] = timed  # type: ignore[assignment]
        if self._has_virtual_io:  # the simulator's input, handed over outside the C half
            endpoints.update((id(e), e) for e in self.endpoints if e.channel.has_python_work)
        return self._in_order(endpoints.values()), publications

    def _due_pairs(self, endpoints: list[SendEndpoint], publications: dict[int, Pair]
                   ) -> list[Pair]:
        """The publications a pass due for its members alone visits, in the agent's order:
        ``publications`` (by id) and those the ``endpoints``' input made due
        (:meth:`_due_publications`), each still the agent's."""
        for pair in self._due_publications(endpoints):
            publications[id(pair[0])] = pair
        pair_of, order = self._pair_of, self._order
        return sorted((pair_of[key] for key in publications if key in pair_of),
                      key=lambda p: order[id(p[0])])

    def _due_publications(self, endpoints: list[SendEndpoint]) -> list[Pair]:
        """Of the publications of the ``endpoints`` a pass due for its members alone visits,
        those their input made due (a frame for one makes it due at once: ``next_due_ns`` 0,
        where a timer of its own leaves a time); every one of a multi-destination endpoint's
        (its destinations' input may concern them all)."""
        due: list[Pair] = []
        for endpoint in endpoints:
            pairs = self._endpoint_publications.get(id(endpoint), ())
            if endpoint.channel.destinations is not None:
                due.extend(pairs)
            else:
                due.extend(pair for pair in pairs if pair[0].next_due_ns <= 0)
        return due

    def _python_deadline_ns(self, endpoints: list[SendEndpoint],
                            pairs: list[tuple[NetworkPublication, SendEndpoint]],
                            visited_all: bool) -> int:
        """The Python half's next deadline: the visited endpoints' and publications' timers
        anew (every one's after a pass that visited all), the others' as their last visit
        left them (nothing but their own visit, their endpoint's input or a command moves
        them)."""
        timers = self._timers
        if visited_all:
            timers.clear()
        self._members_changed, changed = True, self._members_changed  # until all are set
        for endpoint in endpoints:
            timers.set(endpoint, endpoint.channel.next_deadline_ns())
        for publication, _ in pairs:
            if publication.is_done:
                timers.forget(publication)
            else:
                timers.set(publication, publication.python_deadline_ns())
        self._members_changed = changed
        return timers.earliest()

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
        return ([(e.channel.c, e) for e in self.endpoints if e.channel.c.fd >= 0], [],
                [(pair[0].c, pair) for pair in self._publications])
