"""An attacker with a raw socket (run inside a test host, as root): it knows everything about
an encrypted stream but its key (both addresses and ports, the session, the stream, the
initial term) and spoofs each end to the other, at ``rate`` datagrams a second of each kind
for ``seconds``:

* as the publisher, to the subscriber: plain DATA frames of the session across the window,
  plain heartbeats far ahead, and DATA sealed under a key of its own;
* as the subscriber, to the publisher: plain SMs of a zero window and of a huge one, NAKs of
  a whole term, ERRs naming the stream.

Its datagrams go through sim/real/attacker.py's RawSender.
Prints the datagrams it sent.

    python tests/spoofer.py PUB_IP PUB_PORT SUB_IP SUB_PORT SESSION STREAM TERM_ID RATE SECONDS
"""

from __future__ import annotations

import os
import sys
import time

from slipstream.client.frames import ErrorFrame, Nak, StatusMessage, heartbeat
from slipstream.client.layout import (
    DATA_HEADER,
    HDR_TYPE_DATA,
    HEADER_LENGTH,
    UNFRAGMENTED,
)
from slipstream.daemon.media.sealing import Sealing
from slipstream.sim.real.attacker import RawSender

TERM = 64 * 1024


def data(session: int, stream: int, term_id: int, term_offset: int) -> bytes:
    body = os.urandom(96)
    return DATA_HEADER.pack(HEADER_LENGTH + len(body), 0, UNFRAGMENTED, HDR_TYPE_DATA,
                            term_offset, session, stream, term_id, 0) + body


def main() -> int:
    (pub_ip, pub_port, sub_ip, sub_port, session, stream, term_id, rate,
     seconds) = sys.argv[1:10]
    publisher, subscriber = (pub_ip, int(pub_port)), (sub_ip, int(sub_port))
    session_id, stream_id, term, per_second = int(session), int(stream), int(term_id), int(rate)
    own = Sealing("attacker", None)
    own.set_keys([(1, os.urandom(32))])  # the stream's key id, another key
    raw = RawSender()
    sent = 0
    start = time.monotonic()
    end = start + float(seconds)
    n = 0
    while time.monotonic() < end:
        offset = (n * 128) % TERM
        to_subscriber = [data(session_id, stream_id, term + n % 3, offset),
                         heartbeat(session_id, stream_id, term + 2, 0),
                         own.seal(data(session_id, stream_id, term, offset))]
        to_publisher = [StatusMessage(session_id, stream_id, term, 0, 0, 7).encode(),
                        StatusMessage(session_id, stream_id, term + 5, 0, 1 << 30, 8).encode(),
                        Nak(session_id, stream_id, term, 0, TERM).encode(),
                        ErrorFrame(session_id, stream_id, 7, 1, "spoofed").encode()]
        for payload in to_subscriber:
            raw.send(publisher, subscriber, payload)
        for payload in to_publisher:
            raw.send(subscriber, publisher, payload)
        sent += len(to_subscriber) + len(to_publisher)
        n += 1
        pause = start + n / per_second - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    raw.close()
    print(sent, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
