"""DriverEventsAdapter: reads what the driver sends a client and hands each message to the
client conductor (Aeron's ``DriverEventsAdapter`` and ``DriverEventsListener``).

The driver answers commands (CONNECTED, PUBLICATION_READY, ..., ERROR, by correlation id) and
tells of events (images available and unavailable, back-pressure episodes, a receiver's
refusal of a publication's image, this client timed out, the driver shutting down) on the
client's control socket.  The adapter decodes them and calls the listener,
:class:`~slipstream.client.conductor.ClientConductor`, under the client's lock; an event the
listener fails to apply is logged, never raised: the thread that reads them carries every
later event too.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import zmq

from slipstream.client import control
from slipstream.client.errors import DriverNotRunningError

log = logging.getLogger("slipstream.client")


class DriverEventsListener(Protocol):
    """What the adapter hands the driver's messages to (the client conductor)."""

    @property
    def closed(self) -> bool:
        """The client's close() ran (a handler may run it): nothing more is read then."""
        ...

    def on_response(self, message: dict[str, Any]) -> None:
        """The answer to a command (its ``correlation_id``)."""
        ...

    def on_available_image(self, message: dict[str, Any]) -> None: ...
    def on_unavailable_image(self, message: dict[str, Any]) -> None: ...
    def on_back_pressure_episode(self, message: dict[str, Any]) -> None: ...
    def on_publication_refused(self, message: dict[str, Any]) -> None: ...

    def on_client_timeout(self) -> None:
        """The driver timed this client out."""
        ...

    def on_driver_shutdown(self, reason: str) -> None: ...


class DriverEventsAdapter:
    """Reads ``socket`` (the client's control socket) for ``listener``."""

    def __init__(self, socket: zmq.Socket[Any], listener: DriverEventsListener) -> None:
        self._socket = socket
        self._listener = listener
        #: AVAILABLE_IMAGE events read so far, of any subscription: an answer that says
        #: ``images_following`` is complete once this count reaches it.
        self.images_seen = 0

    def receive(self) -> None:
        """Read every waiting message and hand each on (the caller holds the client's lock),
        until none is left or a handler closed the client.  Raises zmq's errors of the
        socket itself (closed under it)."""
        listener = self._listener
        while True:
            try:
                frame = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = control.decode(frame)
            except ValueError:
                log.warning("ignored a malformed message from the driver")
                continue
            kind = message.get("type")
            if kind in (control.AVAILABLE_IMAGE, control.UNAVAILABLE_IMAGE):
                try:
                    if kind == control.AVAILABLE_IMAGE:
                        self.images_seen += 1
                        listener.on_available_image(message)
                    else:
                        listener.on_unavailable_image(message)
                except DriverNotRunningError as e:  # it stopped as it announced the image
                    log.warning("could not apply %s: %s", kind, e)
                except Exception:  # this thread carries the driver's events: it must not die
                    log.exception("could not apply %s", kind)
            elif kind == control.BACK_PRESSURE_EPISODE:
                listener.on_back_pressure_episode(message)
            elif kind == control.PUBLICATION_REFUSED:
                listener.on_publication_refused(message)
            elif kind == control.CLIENT_TIMEOUT:
                listener.on_client_timeout()
            elif kind == control.DRIVER_SHUTDOWN:
                reason = message.get("reason")
                listener.on_driver_shutdown(reason if isinstance(reason, str)
                                            else "the driver stopped")
            else:
                listener.on_response(message)
            if listener.closed:  # a handler closed the client: read nothing more
                return
