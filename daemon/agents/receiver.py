"""The receiver agent: every receive endpoint's input, images and timers.

Its C half (``ss_agent_do_work``, see :mod:`slipstream.daemon.agents.agent`), per duty cycle:
each endpoint's socket is read, every frame checked and DATA inserted into its image's log
(rcv-pos follows data that arrives in order); for a reliable unicast image with static
congestion control it also runs the rebuild pass (the gaps, their NAK timers, the NAKs, the
loss report), sends the status messages (the 25 % rule's and the timer's), cleans the log
and keeps the liveness timer.  Its Python half
(:meth:`Receiver.do_python_work`) runs when due: the commands the conductor queued (its
:class:`~slipstream.daemon.agents.commands.ReceiverProxy`; :meth:`Receiver.on_command`), the
datagrams left for Python (SETUP, RTTM, a new session's data) go to the
:class:`~slipstream.daemon.media.receive_channel.ReceiveChannel`, the images run what C does
not (end of stream, a liveness timeout once it came, and the whole rebuild pass, SMs,
cleaning and liveness of the other images), and the events go to the conductor.  The
driver's network thread and the simulator run it.

Units: times in ns.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.agents.agent import Agent, DueTimers
from slipstream.daemon.agents.commands import (
    AddPublicationImage,
    AddReceiveDestination,
    AddReceiveEndpoint,
    AddSubscriber,
    ControlResolutionChange,
    ReceiverCommand,
    RejectImage,
    RemoveReceiveDestination,
    RemoveReceiveEndpoint,
    RemoveSubscriber,
    SetInterest,
    SetPressureStep,
    SetResponseSession,
)
from slipstream.daemon.agents.endpoints import ReceiveEndpoint
from slipstream.daemon.media.events import (
    EndpointRemoved,
    ReceiveDestinationFailed,
    ReceiverEvent,
)
from slipstream.daemon.media.receive_channel import ignore_member_change
from slipstream.daemon.pressure.governor import STATUS_INTERVAL_FACTOR

log = logging.getLogger("slipstream.driver")

#: The reasons for which a pass visits only the members the C half listed as due.
DUE_MEMBERS = network.SS_DUE_INPUT | network.SS_DUE_IMAGE


class Receiver(Agent[ReceiveEndpoint, ReceiverCommand]):
    """The receiver agent: every receive endpoint's input, images and timers.

    Single-threaded: the driver's network thread runs it (its C half in the thread's C loop,
    then :meth:`do_python_work`), or the simulator through :meth:`do_work`; the conductor
    queues it commands (:meth:`on_command` runs each); its events (an image requested,
    unavailable or done, ...) go to the ``on_event`` callback it was given.
    """

    def __init__(self, *, on_event: Callable[[ReceiverEvent], None]) -> None:
        super().__init__(is_sender=False)
        self._on_event = on_event
        self._status_interval_factor = 1
        #: Each endpoint's Python deadline as its last pass left it.
        self._deadlines: DueTimers[ReceiveEndpoint] = DueTimers()
        #: Each endpoint by id of its channel (the commands name channels).
        self._endpoint_of: dict[int, ReceiveEndpoint] = {}
        #: The endpoints the commands of the pass under way touched, by id, or None once one
        #: touched what no endpoint holds alone (see _touch).
        self._touched: dict[int, ReceiveEndpoint] | None = None

    def on_command(self, command: ReceiverCommand, now_ns: int) -> bool | None:
        """Run one of the conductor's commands (see their records); False: it changed no
        stream's rules or timers (see :meth:`Agent.on_command`)."""
        self._touch(command)
        match command:
            case AddPublicationImage(channel, image):
                channel.add_image(image)
            case RejectImage(request, reason, lasting):
                request.channel.reject_image(request, now_ns, reason, lasting=lasting)
            case AddSubscriber(image, position_cell):
                image.add_subscriber_position(position_cell)
            case RemoveSubscriber(image, position_cell):
                image.remove_subscriber_position(position_cell)
            case SetInterest(channel, stream_id, sessions):
                channel.set_interest(stream_id, sessions)
            case SetResponseSession(image, session_id):
                image.set_response_session(session_id, now_ns)
            case AddReceiveDestination():
                self._add_destination(command)
            case RemoveReceiveDestination(endpoint, index, removed, cell, count):
                endpoint.transport.remove_destination(endpoint.channel, index, close=False)
                removed.close()
                if cell is not None:
                    cell[0] = count
            case AddReceiveEndpoint(endpoint):
                self.add_endpoint(endpoint)
            case ControlResolutionChange(channel, address):
                channel.move_control(address, now_ns)
            case RemoveReceiveEndpoint():
                self._remove_endpoint(command, now_ns)
            case SetPressureStep(step):
                return self.set_pressure_step(step)
            case _:
                raise TypeError(f"not a receiver command: {command!r}")
        return None

    def _touch(self, command: ReceiverCommand) -> None:
        """Note the one endpoint whose streams ``command`` changes (an endpoint added, its
        interest, an image added or refused), which its pass then visits with those the C
        half listed as due, not every endpoint; any other command makes the pass visit all."""
        if self._touched is None:
            return
        match command:
            case AddReceiveEndpoint(endpoint):
                touched: ReceiveEndpoint | None = endpoint
            case AddPublicationImage(channel, _) | SetInterest(channel, _, _):
                touched = self._endpoint_of.get(id(channel))
            case RejectImage(request, _, _):
                touched = self._endpoint_of.get(id(request.channel))
            case _:
                touched = None
        if touched is None:
            self._touched = None
        else:
            self._touched[id(touched)] = touched

    def _add_destination(self, command: AddReceiveDestination) -> None:
        endpoint, transport = command.endpoint, command.transport
        try:
            endpoint.transport.add_destination(endpoint.channel, command.index, transport,
                                               command.control)
        except BaseException:
            transport.close()  # the conductor forgets it (ReceiveDestinationFailed)
            # Not a destination after all: a later add of it is no duplicate (the
            # conductor's thread takes it out, as it put it in).
            self._on_event(ReceiveDestinationFailed(endpoint.channel, command.address,
                                                    command.index))
            raise
        if command.destinations_cell is not None:
            command.destinations_cell[0] = command.count

    def _remove_endpoint(self, command: RemoveReceiveEndpoint, now_ns: int) -> None:
        endpoint = command.endpoint
        try:
            self.remove_endpoint(endpoint, now_ns)
        finally:  # its socket, logs and counters are freed whatever the farewell did
            try:  # after the farewell, which leaves through the destinations
                for index in command.destinations:
                    endpoint.transport.remove_destination(endpoint.channel, index)
                if command.destinations_cell is not None:
                    command.destinations_cell[0] = 0
            finally:
                self._on_event(EndpointRemoved(endpoint.channel, command.generation))

    def add_endpoint(self, endpoint: ReceiveEndpoint) -> None:
        endpoint.transport.attach_channel(endpoint.channel)
        endpoint.channel.set_status_interval_factor(self._status_interval_factor)
        super().add_endpoint(endpoint)
        self._endpoint_of[id(endpoint.channel)] = endpoint
        channel = endpoint.channel
        for receiver in channel.socket_receivers:
            self._member_added(self._receivers, receiver, endpoint)
        for image in channel.images.values():
            self._member_added(self._images, image.c, endpoint)
        if channel.reads_without_sockets:  # the simulator's
            self._has_virtual_io = True
        channel.on_member_change = functools.partial(self._on_member_change, endpoint)

    def _on_member_change(self, endpoint: ReceiveEndpoint, member: object, image: bool,
                          added: bool) -> None:
        """``endpoint``'s channel added or removed ``member`` (cffi): an image's
        ``ss_image_t *``, or a destination's ``ss_receiver_t *`` (see
        :attr:`ReceiveChannel.on_member_change`); the C half's view follows."""
        if not image and member.fd < 0:  # type: ignore[attr-defined]  # the simulator's
            if added:
                self._has_virtual_io = True
            else:  # whether any member has no socket is looked at anew
                self._members_changed = True
        elif added:
            self._member_added(self._images if image else self._receivers, member, endpoint)
        else:
            self._member_removed(self._images if image else self._receivers, member)

    def remove_endpoint(self, endpoint: ReceiveEndpoint, now_ns: int | None = None) -> None:
        """Stop using ``endpoint``.  With ``now_ns``, first send what its images have due: the
        last subscription's images have just gone DRAINING, and their EOS-flagged status
        message tells each sender at once that this receiver left (a min or tagged group, or
        a unicast publication, would otherwise wait for its receiver timeout)."""
        try:
            if now_ns is not None and self.serves(endpoint):
                channel = endpoint.channel
                out = channel.datagrams_to_send(now_ns)
                if out:
                    endpoint.transport.send(out)
                for event in channel.poll_events():  # an image that went: its owner frees it
                    self._on_event(event)
        finally:  # a farewell that fails still lets the endpoint go (and its owner close it)
            served = self.serves(endpoint)
            super().remove_endpoint(endpoint)
            if served:
                channel = endpoint.channel
                channel.on_member_change = ignore_member_change
                self._members_removed(self._receivers, endpoint)
                self._members_removed(self._images, endpoint)
                self._deadlines.forget(endpoint)
                if channel.reads_without_sockets:  # the simulator's
                    self._members_changed = True
            if self._endpoint_of.get(id(endpoint.channel)) is endpoint:
                del self._endpoint_of[id(endpoint.channel)]

    def leave(self, now_ns: int) -> None:
        """The driver stops: every image of every endpoint tells its sender that this
        receiver left, and the endpoints are dropped (their owner closes them).  Only with
        the network thread stopped (or from it)."""
        for endpoint in list(self.endpoints):
            # Each step on its own: one image that fails leaves the others' status messages
            # to go, and one endpoint that fails leaves the others'.
            try:
                endpoint.channel.leave(now_ns)
            except Exception:
                log.exception("ending the images of %s failed", endpoint.channel)
            try:
                self.remove_endpoint(endpoint, now_ns)  # drops it whatever the send did
            except Exception:
                log.exception("telling the senders of %s that this receiver leaves failed",
                              endpoint.channel)

    def set_pressure_step(self, step: int) -> bool:
        """The governor's step: from step 2 every image's status-message interval widens (a
        store each, read when its next SM is scheduled: no deadline the halves hold moves).
        Returns False: no step changes a stream's rules or timers, so none costs a pass over
        the streams (:meth:`Agent.on_command`)."""
        factor = STATUS_INTERVAL_FACTOR if step >= 2 else 1
        if factor != self._status_interval_factor:
            self._status_interval_factor = factor
            for endpoint in self.endpoints:
                endpoint.channel.set_status_interval_factor(factor)
        return False

    def _virtual_io(self, now_ns: int) -> tuple[int, bool]:
        """The simulator's endpoints: their datagrams through the same C dispatch."""
        work = 0
        python_input = False
        for endpoint in self.endpoints:
            channel = endpoint.channel
            if channel.reads_without_sockets:
                work += endpoint.transport.receive(channel, now_ns)
                python_input |= channel.has_python_work
        return work, python_input

    def do_python_work(self, now_ns: int) -> int:
        """The Python half (see :class:`~slipstream.daemon.agents.agent.Agent`): commands,
        datagrams for Python (SETUP, RTTM, a new session), the images' Python work (what
        the C half does not run: see the module), and the events for the conductor.

        A pass due for input, images or commands alone (no timer) visits only the endpoints
        the C half listed (``due_members``: an endpoint with input for Python, an image whose
        rule made the pass due) and those its commands touched (:meth:`_touch`: adding a
        stream visits its own endpoint, not every one); any other pass visits every
        endpoint."""
        work, light = 0, False
        visit = self.endpoints
        try:
            due = self.c.due
            listed = self._listed_endpoints()  # the C half's list, before a command moves it
            self._touched = {}
            work, light = self._run_commands(now_ns)
            if light:
                return work
            touched, self._touched = self._touched, None
            if (listed is not None and touched is not None
                    and not due & ~(DUE_MEMBERS | network.SS_DUE_COMMANDS)):
                listed.update(touched)
                visit = self._in_order(listed.values())
            self.streams_visited = sum(len(e.channel.images) for e in visit)
            for endpoint in visit:
                channel = endpoint.channel
                work += endpoint.transport.dispatch(channel, now_ns)
                out = channel.datagrams_to_send(now_ns)
                if out:
                    endpoint.transport.send(out)
                    work += len(out)
                for event in channel.poll_events():
                    self._on_event(event)
                    work += 1
        except BaseException:
            # A member may have come or gone halfway: the C half's view is made anew.
            self._members_changed = True
            raise
        finally:
            # Also after a failure: an image whose ImageDone went to the conductor may lose
            # its log at any moment, and the C half must no longer see it.
            if not light:
                self._sync_c(lambda: self._python_deadline_ns(visit))
        return work

    def _listed_endpoints(self) -> dict[int, ReceiveEndpoint] | None:
        """The endpoints of the members the C half listed as due, by id; None when its list
        is not the current view's (the simulator's endpoints without sockets have their
        input outside it): then the pass visits every endpoint."""
        c = self.c
        receivers, images = self._receivers.owners, self._images.owners
        if (self._members_changed or self._has_virtual_io or c.due_members == network_ffi.NULL
                or len(receivers) != c.endpoint_count or len(images) != c.image_count):
            return None
        listed: dict[int, ReceiveEndpoint] = {}
        first_image = c.endpoint_count
        members = c.due_members
        for k in range(c.due_members_count):
            member = members[k]
            endpoint = receivers[member] if member < first_image else images[member - first_image]
            listed[id(endpoint)] = endpoint
        return listed

    def _python_deadline_ns(self, visited: list[ReceiveEndpoint]) -> int:
        """The Python half's next deadline: the visited endpoints' anew, the others' as their
        last pass left them (nothing but their own pass moves them)."""
        deadlines = self._deadlines
        if visited is self.endpoints:
            deadlines.clear()
        for endpoint in visited:
            if self.serves(endpoint):  # not one that went during the pass
                deadlines.set(endpoint, endpoint.channel.python_deadline_ns())
        return deadlines.earliest()

    def _virtual_members(self) -> bool:
        return any(e.channel.reads_without_sockets for e in self.endpoints)

    def _c_view(self) -> tuple[list, list, list]:
        receivers: list = []
        images: list = []
        for endpoint in self.endpoints:
            channel = endpoint.channel
            receivers += [(receiver, endpoint) for receiver in channel.socket_receivers]
            images += [(image.c, endpoint) for image in channel.images.values()]
        return receivers, images, []
