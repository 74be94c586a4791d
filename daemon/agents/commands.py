"""What the conductor can ask the network agents to do: one frozen record per operation, and
the two proxies that queue them (Aeron's ``aeron_driver_sender_proxy`` and
``aeron_driver_receiver_proxy``).

The conductor's thread calls a proxy method; the proxy puts the command's record on its
agent's queue and wakes the network thread; the agent runs it at its next Python pass
(:meth:`~slipstream.daemon.agents.agent.Agent.on_command`, one dispatch per agent), with that
pass's ``now``, in the order the conductor queued them.  Nothing but these records crosses
from the conductor's thread to an agent's.  A command that the conductor must hear has run
answers with an event (:mod:`slipstream.daemon.media.events`: "the command's answer").

The proxies' methods have Aeron's names where Aeron has the operation (``on_add_endpoint``,
``on_add_publication``, ``on_add_destination``, ``on_add_publication_image``, ...), a plain
domain name otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import attrs

from slipstream.client.channel import Channel
from slipstream.daemon.agents.endpoints import ReceiveEndpoint, SendEndpoint
from slipstream.daemon.media.events import ImageRequested
from slipstream.daemon.media.receive_channel import ReceiveChannel
from slipstream.daemon.media.send_channel import SendChannel
from slipstream.daemon.protocol.types import Address
from slipstream.daemon.streams.image import PublicationImage
from slipstream.daemon.streams.publication import NetworkPublication


# -- either agent -----------------------------------------------------------------------------
@attrs.frozen(eq=False)
class SetPressureStep:
    """The pressure governor's step (daemon/pressure/governor.py) for every stream."""

    step: int


# -- the sender's -----------------------------------------------------------------------------
@attrs.frozen(eq=False)
class AddSendEndpoint:
    """Serve ``endpoint`` (a new one, or one revived before its removal ran)."""

    endpoint: SendEndpoint


@attrs.frozen(eq=False)
class RemoveSendEndpoint:
    """Drop ``endpoint`` and its destinations; answered by ``EndpointRemoved(generation)``."""

    endpoint: SendEndpoint
    generation: int


@attrs.frozen(eq=False)
class AddPublication:
    """Send ``publication`` through ``endpoint``."""

    endpoint: SendEndpoint
    publication: NetworkPublication


@attrs.frozen(eq=False)
class ClosePublication:
    """The publication's last publisher went, or the drain ends it: it sends what its log
    holds, then EOS, then lingers (``wait_for_spies=False``: the linger does not wait for its
    spies, as the drain's ending)."""

    publication: NetworkPublication
    wait_for_spies: bool = True


@attrs.frozen(eq=False)
class StopCredit:
    """The drain: the publication's pub-lmt rises no more."""

    publication: NetworkPublication


@attrs.frozen(eq=False)
class AddSendDestination:
    """A manual multi-destination-cast endpoint sends to ``address`` too."""

    channel: SendChannel
    address: Address


@attrs.frozen(eq=False)
class RemoveSendDestination:
    """A manual multi-destination-cast endpoint no longer sends to ``address``."""

    channel: SendChannel
    address: Address


@attrs.frozen(eq=False)
class CheckDestinations:
    """Which of a manual multi-destination-cast endpoint's destinations sent no status message
    within ``timeout_ns``: answered by ``DestinationsSilent``."""

    channel: SendChannel
    timeout_ns: int


@attrs.frozen(eq=False)
class ResolutionChange:
    """The name of ``endpoint``'s peer resolved to ``address`` now: a unicast endpoint sends
    there from now on (Aeron's ``onResolutionChange``: its socket connects anew)."""

    endpoint: SendEndpoint
    address: Address


@attrs.frozen(eq=False)
class AddSpy:
    """A spy reads ``publication`` from ``position_cell`` (its sub-pos counter's cell, cffi
    ``int64_t *``); answered by ``SpyLinked(registration_id)``, the publication's, whether or
    not it was taken."""

    publication: NetworkPublication
    position_cell: Any
    registration_id: int


@attrs.frozen(eq=False)
class RemoveSpy:
    """The spy of ``position_cell`` stops holding ``publication``; answered by
    ``SpyUnlinked(counter_id)``, whether or not it was there."""

    publication: NetworkPublication
    position_cell: Any
    counter_id: int


SenderCommand = (SetPressureStep | AddSendEndpoint | RemoveSendEndpoint | AddPublication
                 | ClosePublication | StopCredit | AddSendDestination | RemoveSendDestination
                 | CheckDestinations | ResolutionChange | AddSpy | RemoveSpy)


# -- the receiver's ---------------------------------------------------------------------------
@attrs.frozen(eq=False)
class AddReceiveEndpoint:
    """Serve ``endpoint`` (a new one, or one revived before its removal ran)."""

    endpoint: ReceiveEndpoint


@attrs.frozen(eq=False)
class RemoveReceiveEndpoint:
    """Its images tell their senders this receiver left, then the endpoint and its
    multi-destination ``destinations`` (their indexes) go, and its mds-destinations counter
    (``destinations_cell``, cffi ``int64_t *``, or None) reads 0; answered by
    ``EndpointRemoved(generation)`` whatever the farewell did."""

    endpoint: ReceiveEndpoint
    destinations: tuple[int, ...]
    destinations_cell: Any
    generation: int


@attrs.frozen(eq=False)
class SetInterest:
    """The sessions of ``stream_id`` that the subscriptions at ``channel`` want (None: all;
    empty: none): Aeron's on_add_subscription, on_remove_subscription and their
    by-session forms in one."""

    channel: ReceiveChannel
    stream_id: int
    sessions: frozenset[int] | None


@attrs.frozen(eq=False)
class AddPublicationImage:
    """``channel`` takes ``image``, which the conductor made for its request."""

    channel: ReceiveChannel
    image: PublicationImage


@attrs.frozen(eq=False)
class RejectImage:
    """The conductor could not make the image ``request`` asked for: its sender hears why;
    ``lasting``: whether the cause lasts (a refusal again soon cools down longer)."""

    request: ImageRequested
    reason: str
    lasting: bool


@attrs.frozen(eq=False)
class AddSubscriber:
    """A subscriber reads ``image`` from ``position_cell`` (its sub-pos counter's cell)."""

    image: PublicationImage
    position_cell: Any


@attrs.frozen(eq=False)
class RemoveSubscriber:
    """The subscriber of ``position_cell`` no longer holds ``image`` back."""

    image: PublicationImage
    position_cell: Any


@attrs.frozen(eq=False)
class SetResponseSession:
    """A request image tells its client's driver the session of the response publication
    made for it (RSP_SETUP) until ``session_id`` is None."""

    image: PublicationImage
    session_id: int | None


@attrs.frozen(eq=False)
class AddReceiveDestination:
    """A multi-destination subscription's endpoint receives through ``transport`` (opened
    by the conductor for ``address``) as destination ``index``; ``control``: a multicast
    destination's control address.  Then its mds-destinations counter reads ``count``.  If
    it cannot, the transport is closed and ``ReceiveDestinationFailed`` answers."""

    endpoint: ReceiveEndpoint
    index: int
    transport: Any
    control: Address | None
    address: Address
    destinations_cell: Any
    count: int


@attrs.frozen(eq=False)
class RemoveReceiveDestination:
    """Destination ``index`` of a multi-destination subscription's endpoint goes; its socket
    is closed unless an add of the same destination took it back (``removed``)."""

    endpoint: ReceiveEndpoint
    index: int
    removed: RemovedDestination
    destinations_cell: Any
    count: int


@attrs.frozen(eq=False)
class ControlResolutionChange:
    """The ``control=`` name of a dynamic multi-destination-cast receiver's endpoint resolved
    to ``address`` now: it joins there from now on (Aeron's receiver ``onResolutionChange``)."""

    channel: ReceiveChannel
    address: Address


ReceiverCommand = (SetPressureStep | AddReceiveEndpoint | RemoveReceiveEndpoint | SetInterest
                   | AddPublicationImage | RejectImage | AddSubscriber | RemoveSubscriber
                   | SetResponseSession | AddReceiveDestination | RemoveReceiveDestination
                   | ControlResolutionChange)


@attrs.define(eq=False)
class RemovedDestination:
    """A removed destination's socket, which the receiver's thread closes once it detached
    it, unless an add of the same destination took it back first (under ``lock``): the one
    object both threads hold, and only through its two methods."""

    transport: Any
    channel: Channel
    lock: threading.Lock = attrs.Factory(threading.Lock)
    closed: bool = False
    reclaimed: bool = False

    def reclaim(self) -> Any | None:
        """The socket, for the destination added again (None: closed already; the
        conductor's thread)."""
        with self.lock:
            if self.closed:
                return None
            self.reclaimed = True
            return self.transport

    def close(self) -> None:
        """Close the socket unless it was taken back (on the receiver's thread)."""
        with self.lock:
            if not self.reclaimed:
                self.closed = True
                self.transport.close()


# -- the proxies ------------------------------------------------------------------------------
Command = TypeVar("Command")


class _Proxy(Generic[Command]):
    """What both proxies do with a command: queue it on the agent, then wake its thread."""

    def __init__(self, enqueue: Callable[[Command], None], wake: Callable[[], None]) -> None:
        """``enqueue``: the agent's queue (thread-safe); ``wake``: wakes its thread."""
        self._enqueue = enqueue
        self._wake = wake

    def _send(self, command: Command) -> None:
        self._enqueue(command)
        self._wake()


class SenderProxy(_Proxy[SenderCommand]):
    """The conductor's handle on the sender (Aeron's aeron_driver_sender_proxy): each method
    queues one command and wakes the network thread.  The conductor's thread only."""

    def on_add_endpoint(self, endpoint: SendEndpoint) -> None:
        self._send(AddSendEndpoint(endpoint))

    def on_remove_endpoint(self, endpoint: SendEndpoint, generation: int) -> None:
        self._send(RemoveSendEndpoint(endpoint, generation))

    def on_add_publication(self, endpoint: SendEndpoint,
                           publication: NetworkPublication) -> None:
        self._send(AddPublication(endpoint, publication))

    def on_close_publication(self, publication: NetworkPublication, *,
                             wait_for_spies: bool = True) -> None:
        self._send(ClosePublication(publication, wait_for_spies))

    def on_stop_credit(self, publication: NetworkPublication) -> None:
        self._send(StopCredit(publication))

    def on_add_destination(self, channel: SendChannel, address: Address) -> None:
        self._send(AddSendDestination(channel, address))

    def on_remove_destination(self, channel: SendChannel, address: Address) -> None:
        self._send(RemoveSendDestination(channel, address))

    def on_check_destinations(self, channel: SendChannel, timeout_ns: int) -> None:
        self._send(CheckDestinations(channel, timeout_ns))

    def on_resolution_change(self, endpoint: SendEndpoint, address: Address) -> None:
        self._send(ResolutionChange(endpoint, address))

    def on_add_spy(self, publication: NetworkPublication, position_cell: Any,
                   registration_id: int) -> None:
        self._send(AddSpy(publication, position_cell, registration_id))

    def on_remove_spy(self, publication: NetworkPublication, position_cell: Any,
                      counter_id: int) -> None:
        self._send(RemoveSpy(publication, position_cell, counter_id))

    def on_pressure_step(self, step: int) -> None:
        self._send(SetPressureStep(step))


class ReceiverProxy(_Proxy[ReceiverCommand]):
    """The conductor's handle on the receiver (Aeron's aeron_driver_receiver_proxy): each
    method queues one command and wakes the network thread.  The conductor's thread only."""

    def on_add_endpoint(self, endpoint: ReceiveEndpoint) -> None:
        self._send(AddReceiveEndpoint(endpoint))

    def on_resolution_change(self, channel: ReceiveChannel, address: Address) -> None:
        self._send(ControlResolutionChange(channel, address))

    def on_remove_endpoint(self, endpoint: ReceiveEndpoint, destinations: tuple[int, ...],
                           destinations_cell: Any, generation: int) -> None:
        self._send(RemoveReceiveEndpoint(endpoint, destinations, destinations_cell,
                                         generation))

    def on_set_interest(self, channel: ReceiveChannel, stream_id: int,
                        sessions: frozenset[int] | None) -> None:
        self._send(SetInterest(channel, stream_id, sessions))

    def on_add_publication_image(self, channel: ReceiveChannel,
                                 image: PublicationImage) -> None:
        self._send(AddPublicationImage(channel, image))

    def on_reject_image(self, request: ImageRequested, reason: str, lasting: bool) -> None:
        self._send(RejectImage(request, reason, lasting))

    def on_add_subscriber(self, image: PublicationImage, position_cell: Any) -> None:
        self._send(AddSubscriber(image, position_cell))

    def on_remove_subscriber(self, image: PublicationImage, position_cell: Any) -> None:
        self._send(RemoveSubscriber(image, position_cell))

    def on_set_response_session(self, image: PublicationImage, session_id: int | None) -> None:
        self._send(SetResponseSession(image, session_id))

    def on_add_destination(self, endpoint: ReceiveEndpoint, index: int, transport: Any,
                           control: Address | None, address: Address, destinations_cell: Any,
                           count: int) -> None:
        self._send(AddReceiveDestination(endpoint, index, transport, control, address,
                                         destinations_cell, count))

    def on_remove_destination(self, endpoint: ReceiveEndpoint, index: int,
                              removed: RemovedDestination, destinations_cell: Any,
                              count: int) -> None:
        self._send(RemoveReceiveDestination(endpoint, index, removed, destinations_cell,
                                            count))

    def on_pressure_step(self, step: int) -> None:
        self._send(SetPressureStep(step))
