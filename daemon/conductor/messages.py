"""The conductor's answers and notices to clients, one builder each, whichever media the
stream uses (the message types and fields are the client's: :mod:`slipstream.client.control`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slipstream.client import control
from slipstream.client.publication import PublicationRefusal
from slipstream.daemon.pressure.episodes import EpisodeEvent

#: One message to one client: the client's key (its control-socket identity) and the message.
ClientMessage = tuple[bytes, dict[str, Any]]
#: What a conductor step sends clients, in order.
Outgoing = list[ClientMessage]


def publication_ready(*, correlation_id: int, registration_id: int,
                      original_registration_id: int, log_file: Path, session_id: int,
                      stream_id: int, publisher_limit_counter_id: int,
                      drops_counter_id: int,
                      durable_counter_ids: tuple[int, int] | None = None) -> dict[str, Any]:
    """A publisher was added: ``registration_id`` is this publisher's,
    ``original_registration_id`` the (shared) publication's; ``drops_counter_id`` is the
    stream's ``pub-drops`` (policy=drop-newest counts there); ``durable_counter_ids``, a
    durable= publication's pub-durable and durable-rcv (absent without)."""
    durable = {} if durable_counter_ids is None else {
        "durable_counter_id": durable_counter_ids[0],
        "durable_receivers_counter_id": durable_counter_ids[1]}
    return {**durable, "type": control.PUBLICATION_READY, "correlation_id": correlation_id,
            "registration_id": registration_id,
            "original_registration_id": original_registration_id, "log_file": str(log_file),
            "session_id": session_id, "stream_id": stream_id,
            "publication_limit_counter_id": publisher_limit_counter_id,
            "drops_counter_id": drops_counter_id}


def back_pressure_episode(registration_id: int, event: EpisodeEvent) -> dict[str, Any]:
    """The publication a client added as ``registration_id`` began or ended a back-pressure
    episode (:class:`~slipstream.daemon.pressure.episodes.EpisodeEvent`)."""
    return {"type": control.BACK_PRESSURE_EPISODE, "registration_id": registration_id,
            "started": event.started, "at_ns": event.at_ns, "depth": event.depth,
            "duration_ns": event.duration_ns, "episodes": event.episodes}


def publication_refused(registration_id: int, refusal: PublicationRefusal) -> dict[str, Any]:
    """A receiver refused the image of the publication a client added as
    ``registration_id`` (:class:`~slipstream.client.publication.PublicationRefusal`):
    its publishers see why the stream does not connect."""
    return {"type": control.PUBLICATION_REFUSED, "registration_id": registration_id,
            "receiver": refusal.receiver, "reason": refusal.reason, "at_ns": refusal.at_ns,
            "refusals": refusal.refusals}


def subscription_ready(correlation_id: int, registration_id: int) -> dict[str, Any]:
    """A subscription was added as ``registration_id``."""
    return {"type": control.SUBSCRIPTION_READY, "correlation_id": correlation_id,
            "registration_id": registration_id}


def counter_ready(correlation_id: int, registration_id: int, counter_id: int) -> dict[str, Any]:
    """A client's counter was allocated: slot ``counter_id``, registered as
    ``registration_id`` (Aeron's ON_COUNTER_READY)."""
    return {"type": control.COUNTER_READY, "correlation_id": correlation_id,
            "registration_id": registration_id, "counter_id": counter_id}


def operation_success(correlation_id: int) -> dict[str, Any]:
    """The command ``correlation_id`` (a removal, a close) is done."""
    return {"type": control.OPERATION_SUCCESS, "correlation_id": correlation_id}


def available_image(*, image_registration_id: int, subscription_registration_id: int,
                    session_id: int, stream_id: int, log_file: Path,
                    subscriber_position_counter_id: int, join_position: int,
                    source_identity: str, channel_key: str | None) -> dict[str, Any]:
    """A subscription has a new image: read ``log_file`` from ``join_position`` and keep the
    position in the counter.  ``channel_key``: the name of the key its stream is sealed
    under on the network (``key=``; None: plain), which a spy's URI cannot say."""
    return {"type": control.AVAILABLE_IMAGE, "correlation_id": image_registration_id,
            "subscription_registration_id": subscription_registration_id,
            "session_id": session_id, "stream_id": stream_id, "log_file": str(log_file),
            "subscriber_position_counter_id": subscriber_position_counter_id,
            "join_position": join_position, "source_identity": source_identity,
            "channel_key": channel_key}


def unavailable_image(*, image_registration_id: int, subscription_registration_id: int,
                      stream_id: int, lost: tuple[int, int] | None = None) -> dict[str, Any]:
    """An image of a subscription is gone (its stream ended, or went silent); ``lost`` is the
    range of stream positions it lost when it went because it was left behind."""
    message = {"type": control.UNAVAILABLE_IMAGE, "correlation_id": image_registration_id,
               "subscription_registration_id": subscription_registration_id,
               "stream_id": stream_id}
    if lost is not None:  # messages are flat: two scalars
        message["lost_from"], message["lost_to"] = lost
    return message


def error(correlation_id: int, code: str, text: str) -> dict[str, Any]:
    """The command ``correlation_id`` failed: ``code`` is one of ``control.ERR_*``."""
    return {"type": control.ERROR, "correlation_id": correlation_id, "code": code,
            "message": text}
