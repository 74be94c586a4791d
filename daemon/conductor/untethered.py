"""The untethered check (``tether=false``), one for every kind of stream a subscriber can hold
back: an IPC log, a network publication's spies, a network image (Aeron's
``checkUntetheredSubscriptions`` of IpcPublication, NetworkPublication and PublicationImage).

On the conductor's timer each stream hands its links and their positions to
:func:`check_untethered`, with an :class:`UntetheredStream` that says where the stream is, its
window, and how a link of it unlinks and links anew.  The states and timers are
:class:`~slipstream.daemon.streams.tether.Tether`'s, the window's end is
:func:`~slipstream.daemon.streams.tether.untethered_window_end`; what is done about them (the
counters, the log lines, the client's UNAVAILABLE_IMAGE, resting again when the counters are
full) is here, once.  Positions in bytes, times in monotonic ns.

The network's streams call it from here too (:class:`NetworkUntethered`): a network
publication's spies and an image's subscriptions; an IPC publication calls it itself
(:meth:`~slipstream.daemon.conductor.ipc.IpcPublication.check_untethered`).  All of it runs on
the conductor's thread; a network link is unlinked and linked anew through the part that owns
it (:mod:`.network_spies`: the sender lets the spy's position go or takes it;
:mod:`.network_receive`: the receiver does the image's), each by a command to its agent.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol

import attrs

from slipstream.client.channel import Channel
from slipstream.client.counters import CountersFile, CountersFullError, SystemCounter
from slipstream.daemon._network import lib as network
from slipstream.daemon.conductor import messages
from slipstream.daemon.conductor.messages import ClientMessage, Outgoing
from slipstream.daemon.conductor.network_records import (
    NetworkSubscription,
    _ImageEntry,
    _PublicationEntry,
    _ReceiveEndpointEntry,
)
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.streams.tether import (
    S,
    Tether,
    TetherablePosition,
    TetherState,
    untethered_window_end,
)

log = logging.getLogger(__name__)


class ImageLinks(Protocol):
    """What the check asks of the part that owns the links of subscriptions to images (the
    receive side, :class:`~slipstream.daemon.conductor.network_receive.ReceiveSide`)."""

    def link(self, image_entry: _ImageEntry, subscription: NetworkSubscription,
             position: int, now_ns: int, *, handed_over: bool) -> ClientMessage: ...

    def unlink(self, image_entry: _ImageEntry,
               link: TetherablePosition[NetworkSubscription]) -> None: ...


class SpyLinks(Protocol):
    """What the check asks of the part that owns the spies' links to publications
    (:class:`~slipstream.daemon.conductor.network_spies.SpySubscriptions`)."""

    def link_spy(self, entry: _PublicationEntry, spy: NetworkSubscription,
                 now_ns: int) -> ClientMessage: ...

    def unlink_spy(self, entry: _PublicationEntry,
                   link: TetherablePosition[NetworkSubscription], *,
                   tell: bool = False) -> Outgoing: ...


@attrs.frozen(eq=False)
class UntetheredStream(Generic[S]):
    """One stream as the untethered check sees it, at one look.

    ``name`` is how the log names it ("IPC stream 7", "publication 12", "image 9");
    ``image_registration_id`` and ``stream_id`` are its image's, as the client knows them.
    ``head`` is where the stream is: the top of its window and the end of the range a
    subscriber left behind loses (an IPC log's producer position, a publication's ``snd-pos``,
    an image's fastest subscriber); ``window`` its term (or receiver) window.  ``unlink``
    stops a link's position holding the stream and frees its counter (now, or once the agent
    let go of its cell); ``relink`` links a subscription anew where the stream has it rejoin,
    returning its AVAILABLE_IMAGE, or None if the subscription no longer takes the stream (it
    may raise :class:`CountersFullError`)."""

    name: str
    image_registration_id: int
    stream_id: int
    head: int
    window: int
    unlink: Callable[[TetherablePosition[S]], object]
    relink: Callable[[S], ClientMessage | None]


def check_untethered(stream: UntetheredStream[S],
                     positions: Iterable[tuple[TetherablePosition[S], int]],
                     resting: list[TetherablePosition[S]], counters: CountersFile,
                     now_ns: int) -> Outgoing:
    """Run the tethers of ``stream``'s links at ``positions`` (link, its position; tethered
    links are passed over) and of its ``resting`` links, as of ``now_ns``; returns the
    messages for the clients.

    A link left behind now (LINGER) counts ``UNTETHERED_SKIPS`` and the bytes it skips, and
    its client is told its image is gone with the range it lost (from its position to
    ``head``).  One whose linger ended (RESTING) is unlinked and joins ``resting``.  One done
    resting leaves ``resting`` and is linked anew; if the counters have no room for it, that
    counts an error and it rests again for another resting timeout, not at once."""
    out: Outgoing = []
    window_end = untethered_window_end(stream.head, stream.window)
    for link, position in positions:
        if link.tether is None:
            continue
        entered = link.tether.check(position, window_end, now_ns)
        if entered is TetherState.LINGER:
            subscription = link.subscription
            counters.add(SystemCounter.UNTETHERED_SKIPS)
            counters.add(SystemCounter.UNTETHERED_SKIPPED_BYTES, stream.head - position)
            log.info("untethered subscription %d of %s left behind at %d (the stream at %d)",
                     subscription.registration_id, stream.name, position, stream.head)
            out.append((subscription.client_key, messages.unavailable_image(
                image_registration_id=stream.image_registration_id,
                subscription_registration_id=subscription.registration_id,
                stream_id=stream.stream_id, lost=(position, stream.head))))
        elif entered is TetherState.RESTING:
            stream.unlink(link)
            resting.append(link)
    for link in list(resting):
        tether = link.tether
        if tether is None or not tether.rested(now_ns):
            continue
        resting.remove(link)
        try:
            available = stream.relink(link.subscription)
        except CountersFullError as e:  # the driver goes on; so does the subscription
            counters.add(SystemCounter.ERRORS)
            log.error("cannot link untethered subscription %d to %s again: %s; trying again "
                      "after its resting timeout", link.subscription.registration_id,
                      stream.name, e)
            tether.rest_again(now_ns)
            resting.append(link)
            continue
        if available is not None:
            out.append(available)
    return out


def tether_for(channel: Channel, settings: DriverSettings, now_ns: int) -> Tether | None:
    """A subscription's tether as it links, ACTIVE from ``now_ns``: an untethered one's
    (``tether=false`` in ``channel``), None for a tethered one."""
    return Tether.of(channel, settings, now_ns) if channel.tether is False else None


class NetworkUntethered:
    """The untethered check of the network's streams, on the conductor's timer: each network
    publication's spies (:meth:`check_untethered_spies`) and each image's subscriptions
    (:meth:`check_untethered_images`).  It unlinks and links anew through the parts that own
    the links, which ask the agents: the spies' (the sender) and the receive side's (the
    receiver)."""

    def __init__(self, *, counters: CountersFile, publications: dict[int, _PublicationEntry],
                 receive_endpoints: dict[tuple[Any, ...], _ReceiveEndpointEntry],
                 subscriptions: dict[int, NetworkSubscription],
                 spy_subscriptions: SpyLinks, receive_side: ImageLinks) -> None:
        self.counters = counters
        self.publications = publications
        self._receive_endpoints = receive_endpoints
        self.subscriptions = subscriptions
        self._spy_subscriptions = spy_subscriptions
        self._receive_side = receive_side

    def check_untethered_images(self, now_ns: int) -> Outgoing:
        """Aeron's untethered subscriptions of network images (``tether=false``;
        PublicationImage.checkUntetheredSubscriptions), on the conductor's timer.  An image's
        head is its fastest subscriber, its window the receiver window
        congestion control gives it now (a sample of what the receiver sets): one left behind
        loses its image, with the range it skips (from its position to the fastest's); it rejoins
        where the image's slowest subscriber is, with a new image."""
        out: Outgoing = []
        for endpoint in self._receive_endpoints.values():
            for image_entry in endpoint.images.values():
                if not image_entry.lingering and (
                        image_entry.resting
                        or any(link.tether is not None for link in image_entry.links)):
                    out.extend(self._check_untethered_links(image_entry, now_ns))
        return out

    def _check_untethered_links(self, image_entry: _ImageEntry, now_ns: int) -> Outgoing:
        image = image_entry.image
        positions = self._image_positions(image_entry)
        return check_untethered(
            UntetheredStream(f"image {image_entry.registration_id}",
                             image_entry.registration_id, image.stream_id,
                             max((p for _, p in positions), default=image.rcv_pos),
                             image.window,
                             functools.partial(self._receive_side.unlink, image_entry),
                             functools.partial(self._rejoin_rested, image_entry, now_ns)),
            positions, image_entry.resting, self.counters, now_ns)

    def _image_positions(self, image_entry: _ImageEntry
                         ) -> list[tuple[TetherablePosition[NetworkSubscription], int]]:
        """Each link of the image with its subscriber's position (within the image's
        ``rcv-hwm``)."""
        hwm = image_entry.image.rcv_hwm
        return [(link, network.ss_subscriber_position_bounded(
            self.counters.get(link.counter_id), hwm)) for link in image_entry.links]

    def _rejoin_rested(self, image_entry: _ImageEntry, now_ns: int,
                       subscription: NetworkSubscription) -> ClientMessage | None:
        """A resting subscription of ``image_entry`` links again at its join position (Aeron's:
        the slowest subscriber's, at most rcv-pos); None if the subscription went."""
        if self.subscriptions.get(subscription.registration_id) is not subscription:
            return None
        join = min([image_entry.image.rcv_pos,
                    *(p for _, p in self._image_positions(image_entry))])
        return self._receive_side.link(image_entry, subscription, join, now_ns, handed_over=True)

    def check_untethered_spies(self, now_ns: int) -> Outgoing:
        """Aeron's untethered spies (``tether=false``; NetworkPublication
        .checkUntetheredSubscriptions), on the conductor's timer.  A publication's head is
        ``snd-pos``, its window the term window: a spy left behind loses its image, with the
        range it skips (from its position to snd-pos); it rejoins at snd-pos with a new image.
        Only while the publication is open."""
        out: Outgoing = []
        for entry in self.publications.values():
            if entry.closing or not (entry.resting_spies
                                     or any(k.tether is not None for k in entry.spies)):
                continue
            publication = entry.publication
            sender_position = publication.sender_position
            out.extend(check_untethered(
                UntetheredStream(f"publication {entry.registration_id} (a spy)",
                                 entry.registration_id, publication.stream_id, sender_position,
                                 publication.term_window_length,
                                 functools.partial(self._spy_subscriptions.unlink_spy, entry),
                                 functools.partial(self._spy_subscriptions.link_spy, entry,
                                                   now_ns=now_ns)),
                [(link, network.ss_subscriber_position_bounded(
                    self.counters.get(link.counter_id), sender_position))
                 for link in entry.spies if link.tether is not None],
                entry.resting_spies, self.counters, now_ns))
        return out
