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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Generic

import attrs

from slipstream.client.counters import CountersFile, CountersFullError, SystemCounter
from slipstream.daemon.conductor import messages
from slipstream.daemon.conductor.messages import ClientMessage, Outgoing
from slipstream.daemon.streams.tether import (
    S,
    TetherablePosition,
    TetherState,
    untethered_window_end,
)

log = logging.getLogger(__name__)


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
