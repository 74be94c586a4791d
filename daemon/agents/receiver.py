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

import logging
from collections.abc import Callable

from slipstream.client.layout import NO_DEADLINE
from slipstream.daemon.agents.agent import Agent
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
from slipstream.daemon.pressure.governor import STATUS_INTERVAL_FACTOR

log = logging.getLogger("slipstream.driver")


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

    def on_command(self, command: ReceiverCommand, now_ns: int) -> None:
        """Run one of the conductor's commands (see their records)."""
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
                self.set_pressure_step(step)
            case _:
                raise TypeError(f"not a receiver command: {command!r}")

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

    def remove_endpoint(self, endpoint: ReceiveEndpoint, now_ns: int | None = None) -> None:
        """Stop using ``endpoint``.  With ``now_ns``, first send what its images have due: the
        last subscription's images have just gone DRAINING, and their EOS-flagged status
        message tells each sender at once that this receiver left (a min or tagged group, or
        a unicast publication, would otherwise wait for its receiver timeout)."""
        try:
            if now_ns is not None and endpoint in self.endpoints:
                channel = endpoint.channel
                out = channel.datagrams_to_send(now_ns)
                if out:
                    endpoint.transport.send(out)
                for event in channel.poll_events():  # an image that went: its owner frees it
                    self._on_event(event)
        finally:  # a farewell that fails still lets the endpoint go (and its owner close it)
            super().remove_endpoint(endpoint)

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

    def set_pressure_step(self, step: int) -> None:
        """The governor's step: from step 2 every image's status-message interval widens."""
        self._status_interval_factor = STATUS_INTERVAL_FACTOR if step >= 2 else 1
        for endpoint in self.endpoints:
            endpoint.channel.set_status_interval_factor(self._status_interval_factor)

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
        the C half does not run: see the module), and the events for the conductor."""
        work = 0
        try:
            work += self._run_commands(now_ns)
            for endpoint in self.endpoints:
                channel = endpoint.channel
                work += endpoint.transport.dispatch(channel, now_ns)
                out = channel.datagrams_to_send(now_ns)
                if out:
                    endpoint.transport.send(out)
                    work += len(out)
                for event in channel.poll_events():
                    self._on_event(event)
                    work += 1
        finally:
            # Also after a failure: an image whose ImageDone went to the conductor may lose
            # its log at any moment, and the C half must no longer see it.
            self._sync_c(lambda: min((e.channel.python_deadline_ns()
                                      for e in self.endpoints),
                                     default=NO_DEADLINE))
        return work

    def _virtual_members(self) -> bool:
        return any(e.channel.reads_without_sockets for e in self.endpoints)

    def _c_view(self) -> tuple[list, list, list]:
        return ([r for e in self.endpoints for r in e.channel.socket_receivers],
                [image.c for e in self.endpoints for image in e.channel.images.values()], [])
