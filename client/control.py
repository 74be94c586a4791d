"""The control plane between clients and the driver conductor (DESIGN.md principle 4).

A pyzmq ROUTER socket in the driver directory (``ipc://<dir>/conductor.sock``) takes client
commands; each client holds one DEALER.  Messages are single JSON frames with a ``type``;
requests carry a ``correlation_id`` that the answer repeats.  This is never on the data path:
it creates resources and announces images.  Clients keep alive through a heartbeat counter
(as in Aeron): a timestamp the client writes into the counters file and the driver reads, so
staying alive costs neither a message nor a wake-up of the driver.

Commands (client → driver): CONNECT, ADD_PUBLICATION, REMOVE_PUBLICATION,
ADD_SUBSCRIPTION, REMOVE_SUBSCRIPTION, CLOSE_CLIENT.
Answers and events (driver → client): CONNECTED, PUBLICATION_READY, SUBSCRIPTION_READY,
OPERATION_SUCCESS, ERROR, AVAILABLE_IMAGE, UNAVAILABLE_IMAGE, CLIENT_TIMEOUT.
"""

from __future__ import annotations

import getpass
import json
from pathlib import Path
from typing import Any

PROTOCOL_VERSION = 2

CONDUCTOR_SOCKET = "conductor.sock"
COUNTERS_FILE = "counters.dat"
LOCK_FILE = "driver.lock"
PUBLICATIONS_DIR = "publications"
IMAGES_DIR = "images"

# Commands.
CONNECT = "CONNECT"
ADD_PUBLICATION = "ADD_PUBLICATION"
REMOVE_PUBLICATION = "REMOVE_PUBLICATION"
ADD_SUBSCRIPTION = "ADD_SUBSCRIPTION"
REMOVE_SUBSCRIPTION = "REMOVE_SUBSCRIPTION"
CLOSE_CLIENT = "CLOSE_CLIENT"

# Answers and events.
CONNECTED = "CONNECTED"
PUBLICATION_READY = "PUBLICATION_READY"
SUBSCRIPTION_READY = "SUBSCRIPTION_READY"
OPERATION_SUCCESS = "OPERATION_SUCCESS"
ERROR = "ERROR"
AVAILABLE_IMAGE = "AVAILABLE_IMAGE"
UNAVAILABLE_IMAGE = "UNAVAILABLE_IMAGE"
CLIENT_TIMEOUT = "CLIENT_TIMEOUT"

# Error codes carried by ERROR.
ERR_GENERIC = "generic"
ERR_INVALID_CHANNEL = "invalid_channel"
ERR_UNKNOWN_PUBLICATION = "unknown_publication"
ERR_UNKNOWN_SUBSCRIPTION = "unknown_subscription"
ERR_UNKNOWN_CLIENT = "unknown_client"
ERR_RESOURCE = "resource"
ERR_UNSUPPORTED = "unsupported"


def default_driver_directory() -> Path:
    """``/dev/shm/slipstream-<user>``: tmpfs, so mapped log buffers never touch a disk.  The
    driver's default ``dir`` and the client's fallback when ``$SLIPSTREAM_DIR`` is unset."""
    return Path("/dev/shm") / f"slipstream-{getpass.getuser()}"


def conductor_endpoint(directory: str | Path) -> str:
    """The zmq endpoint of the conductor for a driver directory."""
    return f"ipc://{Path(directory) / CONDUCTOR_SOCKET}"


def encode(message: dict[str, Any]) -> bytes:
    """One message as a JSON frame."""
    return json.dumps(message, separators=(",", ":")).encode()


def decode(frame: bytes) -> dict[str, Any]:
    """Parse a JSON frame; raises ``ValueError`` when it is not a message object."""
    message = json.loads(frame)
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ValueError("a control message is a JSON object with a string 'type'")
    return message
