"""An attacker with a raw socket (run inside a test host, as root): it knows everything about
an encrypted stream but its key (both addresses and ports, the session, the stream, the
initial term) and spoofs each end to the other, at ``rate`` datagrams a second of each kind
for ``seconds``:

* as the publisher, to the subscriber: plain DATA frames of the session across the window,
  plain heartbeats far ahead, and DATA sealed under a key of its own;
* as the subscriber, to the publisher: plain SMs of a zero window and of a huge one, NAKs of
  a whole term, ERRs naming the stream.

IPv4 with IP_HDRINCL (the kernel fills in the IP checksum; the UDP checksum is 0: none).
Prints the datagrams it sent.

    python tests/spoofer.py PUB_IP PUB_PORT SUB_IP SUB_PORT SESSION STREAM TERM_ID RATE SECONDS
"""

from __future__ import annotations

import os
import socket
import struct
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

TERM = 64 * 1024


def udp(source: tuple[str, int], destination: tuple[str, int], payload: bytes,
        ident: int) -> bytes:
    length = 8 + len(payload)
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + length, ident & 0xFFFF, 0, 64,
                         socket.IPPROTO_UDP, 0, socket.inet_aton(source[0]),
                         socket.inet_aton(destination[0]))
    return header + struct.pack("!HHHH", source[1], destination[1], length, 0) + payload


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
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
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
            sock.sendto(udp(publisher, subscriber, payload, n), subscriber)
        for payload in to_publisher:
            sock.sendto(udp(subscriber, publisher, payload, n), publisher)
        sent += len(to_subscriber) + len(to_publisher)
        n += 1
        pause = start + n / per_second - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    print(sent, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
