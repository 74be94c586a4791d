"""Every event the network agents (the sender and the receiver) send the conductor, named in
one place (:data:`NetworkEvent`): what the conductor is told, and nothing it must look up on
the agents' objects.

An event carries what the conductor itself made (a publication, an image, a receive or send
channel, a registration or counter id) and values; never a conductor-private record.  The
agents hand them to the conductor's queue (``on_event``), which it drains on its thread
(``NetworkConductor.do_work``).  Most come from a duty cycle (a SETUP, an image's or a
publication's state); those named "the command's answer" are sent by the command that the
conductor queued (:mod:`slipstream.daemon.agents.commands`) once the agent ran it.

The module is in the media layer, below the agents, because the receive channel's dispatcher
(``receive_channel.py``) makes some of them: they name the receive channel they came from by
what their readers use of it, :class:`ImageMaker`.  It is above the send channel's
(``send_channel.py``), which defines the one event it makes, :class:`ResponseSetupArrived`.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from slipstream.client.frames import Setup
from slipstream.client.logbuffer import LogBuffer
from slipstream.daemon.media.send_channel import ResponseSetupArrived, SendChannel
from slipstream.daemon.protocol.types import Address
from slipstream.daemon.reports.loss_report import LossEntry
from slipstream.daemon.streams.image import ImagePositions, PublicationImage
from slipstream.daemon.streams.publication import NetworkPublication


class ImageMaker(Protocol):
    """The receive channel an event names (a
    :class:`~slipstream.daemon.media.receive_channel.ReceiveChannel`, the maker of the image
    events), as the event's readers use it: the conductor makes a requested image there, the
    receiver refuses one there, and both know it by identity."""

    def new_image(self, request: ImageRequested, log: LogBuffer, positions: ImagePositions,
                  now_ns: int, loss_entry: LossEntry | None = None) -> PublicationImage:
        """The image for ``request`` over ``log``, not yet received into."""
        ...

    def reject_image(self, request: ImageRequested, now_ns: int, reason: str, *,
                     lasting: bool = True) -> int | None:
        """``request``'s image is not made; its sender hears why."""
        ...


# -- the receiver's ---------------------------------------------------------------------------
@attrs.frozen(eq=False)
class ImageRequested:
    """A SETUP for a wanted stream: the conductor creates the image's log and counters and
    answers with the receiver's ``on_add_publication_image`` (or ``on_reject_image``)."""

    channel: ImageMaker
    setup: Setup
    source: Address
    #: The destination it came through (a multi-destination subscription's), else -1.
    via: int = -1


@attrs.frozen(eq=False)
class ImageUnavailable:
    """An image ended (EOS consumed, liveness timeout, or no subscribers): it lingers.
    ``lost``: the range of stream positions it lost, as it ended because its subscribers
    were left behind (the image's ``left_behind`` then), else None."""

    channel: ImageMaker
    image: PublicationImage
    lost: tuple[int, int] | None = None


@attrs.frozen(eq=False)
class ImageDone:
    """An image was removed; its log and counters may go."""

    channel: ImageMaker
    image: PublicationImage


@attrs.frozen(eq=False)
class ImageRejected:
    """The receiver refused a SETUP itself (its term is longer than its subscription takes):
    the conductor logs why, since the operator sees only a counter otherwise.  Posted once
    per source per interval (client/notices.py): ``held`` is how many refusals of
    that source since the last were not posted."""

    channel: ImageMaker
    setup: Setup
    source: Address
    reason: str
    held: int = 0


@attrs.frozen(eq=False)
class ReceiveDestinationFailed:
    """The receiver's thread could not attach a destination the conductor opened: it is no
    destination of ``channel``'s endpoint after all (the command's answer)."""

    channel: ImageMaker
    address: Address
    index: int


# -- the sender's -----------------------------------------------------------------------------
@attrs.frozen(eq=False)
class PublicationDone:
    """A publication finished (drained and lingered): its log and counters may go."""

    publication: NetworkPublication


@attrs.frozen(eq=False)
class PublicationRejected:
    """Receivers refused a publication's image (ERR frames): the conductor logs why."""

    publication: NetworkPublication
    rejections: tuple[tuple[Address, str], ...]  # (the receiver's address, its reason)
    unkept: int = 0  # further ERRs of the same pass, whose text was not kept


@attrs.frozen(eq=False)
class SpiesReleased:
    """A closed publication reached LINGER with spies, which have read it all: their images
    may end (Aeron's DriverConductor.cleanupSpies)."""

    publication: NetworkPublication


@attrs.frozen(eq=False)
class SpyLinked:
    """The sender took a spy into publication ``registration_id`` (the command's answer):
    the spy's position holds the log from now on, and the conductor's hold may go."""

    registration_id: int


@attrs.frozen(eq=False)
class SpyUnlinked:
    """The sender dropped a spy's position cell (the command's answer): the spy's sub-pos
    counter ``counter_id`` may be freed."""

    counter_id: int


@attrs.frozen(eq=False)
class DestinationsSilent:
    """A manual multi-destination-cast endpoint's destinations that no status message came
    from within the timeout the conductor asked about (the command's answer), whole."""

    channel: SendChannel
    addresses: frozenset[Address]


@attrs.frozen(eq=False)
class RetargetFailed:
    """A unicast endpoint could not move to ``address`` (the conductor's ResolutionChange:
    its socket did not connect there) and sends to its old peer still: its name is to be
    asked again at the next check."""

    channel: SendChannel
    address: Address


# -- either's ---------------------------------------------------------------------------------
@attrs.frozen(eq=False)
class EndpointRemoved:
    """The agent no longer uses ``channel``'s endpoint (the command's answer): its socket may
    close, unless the conductor revived it since (``generation``: the removal's)."""

    channel: SendChannel | ImageMaker
    generation: int


ReceiverEvent = (ImageRequested | ImageUnavailable | ImageDone | ImageRejected
                 | ReceiveDestinationFailed | EndpointRemoved)
SenderEvent = (PublicationDone | PublicationRejected | SpiesReleased | ResponseSetupArrived
               | SpyLinked | SpyUnlinked | DestinationsSilent | RetargetFailed
               | EndpointRemoved)
NetworkEvent = ReceiverEvent | SenderEvent
