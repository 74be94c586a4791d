"""The states of a network stream's two ends and what may follow what: one table each.

A network publication (:class:`~slipstream.daemon.streams.publication.NetworkPublication`) and
a publication image (:class:`~slipstream.daemon.streams.image.PublicationImage`) change state
only in their ``_transition``, by :func:`next_state` of their table; an event the table does
not have in the current state is a :class:`~slipstream.client.errors.LocalProtocolError`
(h11's rule: the transitions are a table, not scattered ifs).  The objects decide when each
event happens, and what a state changes of theirs.

The network publication::

    ACTIVE --close()--> DRAINING --all sent, or no receivers--> LINGER
    LINGER --linger timeout, or EOS-flagged SM (unicast)--> DONE

The publication image::

    INIT --first subscriber--> ACTIVE
    INIT/ACTIVE --no packet for image_liveness_timeout, EOS rebuilt, or last subscriber
                  removed--> DRAINING          (SMs now carry EOS 0x40)
    ACTIVE --left behind: what it lacks left the sender's resend window--> DRAINING
                 (it ends where its data ends; see PublicationImage._check_left_behind)
    DRAINING --subscribers consumed everything and 5 SM timeouts passed (left behind:
               at once)--> LINGER
    LINGER --no subscribers, or image_liveness_timeout--> DONE
"""

from __future__ import annotations

import enum
from typing import TypeVar

from slipstream.client.errors import LocalProtocolError


class PublicationState(enum.Enum):
    ACTIVE = "active"
    DRAINING = "draining"
    LINGER = "linger"
    DONE = "done"


#: (state, event) -> next state of a network publication.
PUBLICATION_TRANSITIONS: dict[tuple[PublicationState, str], PublicationState] = {
    (PublicationState.ACTIVE, "close"): PublicationState.DRAINING,
    (PublicationState.DRAINING, "drained"): PublicationState.LINGER,
    (PublicationState.LINGER, "linger_expired"): PublicationState.DONE,
    (PublicationState.LINGER, "unicast_eos"): PublicationState.DONE,
}


class ImageState(enum.Enum):
    INIT = "init"
    ACTIVE = "active"
    DRAINING = "draining"
    LINGER = "linger"
    DONE = "done"


_S = ImageState
#: (state, event) -> next state of a publication image.
IMAGE_TRANSITIONS: dict[tuple[ImageState, str], ImageState] = {
    (_S.INIT, "subscriber_added"): _S.ACTIVE,
    (_S.INIT, "liveness_timeout"): _S.DRAINING,
    (_S.INIT, "end_of_stream"): _S.DRAINING,
    (_S.ACTIVE, "liveness_timeout"): _S.DRAINING,
    (_S.ACTIVE, "end_of_stream"): _S.DRAINING,
    (_S.ACTIVE, "no_subscribers"): _S.DRAINING,
    (_S.DRAINING, "drained"): _S.LINGER,
    (_S.LINGER, "done"): _S.DONE,
}

State = TypeVar("State", PublicationState, ImageState)


def next_state(transitions: dict[tuple[State, str], State], state: State, event: str) -> State:
    """The state ``event`` leads to from ``state`` by ``transitions``; LocalProtocolError if
    the table does not allow it."""
    try:
        return transitions[state, event]
    except KeyError:
        raise LocalProtocolError(f"{event!r} is not allowed in state {state.name}") from None
