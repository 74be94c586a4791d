"""DriverProxy: the commands a client sends its driver (Aeron's ``DriverProxy``).

Each command is one message on the client's control socket (:mod:`.control` defines them and
their checks), under a correlation id of its own that the driver's answer carries back.  The
proxy only sends: the client conductor (:mod:`.conductor`) waits for the answers, which the
driver events adapter (:mod:`.driver_events`) reads from the same socket.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from typing import Any

import zmq

from slipstream.client import control


class DriverProxy:
    """Sends commands on ``socket`` (a zmq DEALER connected to the driver's conductor); each
    method returns the correlation id the driver's answer will carry."""

    def __init__(self, socket: zmq.Socket[Any]) -> None:
        self._socket = socket
        self._correlation_ids = itertools.count(1)

    def _send(self, message: dict[str, Any], flags: int = 0) -> int:
        correlation_id = next(self._correlation_ids)
        message["correlation_id"] = correlation_id
        self._socket.send(control.encode(message), flags)
        return correlation_id

    def connect(self) -> int:
        """CONNECT: this process's client, of this protocol version."""
        return self._send({"type": control.CONNECT, "version": control.PROTOCOL_VERSION,
                           "pid": os.getpid(), "process": control.process_token()})

    def add_publication(self, command: str, channel: str, stream_id: int) -> int:
        """ADD_PUBLICATION or ADD_EXCLUSIVE_PUBLICATION (``command``)."""
        return self._send({"type": command, "channel": channel, "stream_id": stream_id})

    def add_subscription(self, channel: str, stream_id: int) -> int:
        return self._send({"type": control.ADD_SUBSCRIPTION, "channel": channel,
                           "stream_id": stream_id})

    def add_counter(self, type_id: int, label: str, key: bytes) -> int:
        return self._send({"type": control.ADD_COUNTER, "type_id": type_id, "label": label,
                           "key": key.hex()})

    def destination(self, command: str, registration_id: int, endpoint_channel: str) -> int:
        """ADD_DESTINATION, REMOVE_DESTINATION, ADD_RCV_DESTINATION or
        REMOVE_RCV_DESTINATION (``command``) of the resource ``registration_id``."""
        return self._send({"type": command, "registration_id": registration_id,
                           "channel": endpoint_channel})

    def remove(self, command: str, registration_id: int) -> int:
        """REMOVE_PUBLICATION, REMOVE_SUBSCRIPTION or REMOVE_COUNTER (``command``)."""
        return self._send({"type": command, "registration_id": registration_id})

    def remove_now(self, command: str, registration_id: int) -> int | None:
        """:meth:`remove` without waiting for room on the socket: from the events' reader,
        which may not block.  None when it could not be sent."""
        with contextlib.suppress(zmq.ZMQError):
            return self._send({"type": command, "registration_id": registration_id},
                              zmq.NOBLOCK)
        return None

    def close_client(self) -> int:
        """CLOSE_CLIENT: the driver frees everything of this client."""
        return self._send({"type": control.CLOSE_CLIENT})
