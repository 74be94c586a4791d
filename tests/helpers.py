"""Small helpers shared by the test modules (import as ``from helpers import ...``)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

# Short timers so liveness, unblocking and linger show within a test's patience.
FAST_DRIVER_SETTINGS = {
    "client_liveness_timeout": "1s",
    "client_keepalive_interval": "100ms",
    "publication_unblock_timeout": "1500ms",
    "publication_linger_timeout": "500ms",
    "timer_interval": "100ms",
    "ipc_term_buffer_length": "64k",
}


def wait_for(predicate: Callable[[], object], timeout: float = 5.0,
             what: str = "condition") -> None:
    """Poll ``predicate`` every 10 ms until it is true; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s")
        time.sleep(0.01)


def data_datagrams(publication, now_ns: int, budget: int = 64) -> list:
    """What the C data path sends of ``publication`` now (``ss_send_data`` with no socket),
    as Datagrams copied out of its log, as the simulator's transport does.  The caller tells
    the publication (``on_data_sent``), as the sender agent does."""
    from slipstream.daemon._network import ffi as network_ffi
    from slipstream.daemon._network import lib as network
    from slipstream.daemon.protocol_types import Datagram

    spans = network_ffi.new("ss_span_t[]", budget)
    sent = network.ss_send_data(publication.c, now_ns, budget, spans)
    view = publication.log.view
    out = []
    for i in range(max(sent, 0)):
        offset = spans[i].log_offset
        out.append(Datagram(bytes(view[offset:offset + spans[i].length]),
                            publication.destination))
    return out


def free_port() -> int:
    """A UDP port on 127.0.0.1 that nothing is bound to right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
