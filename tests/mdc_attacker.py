"""An attacker of a dynamic multi-destination-cast publication, run by
tests/test_mdc_validation_hosts.py inside its attacker host (``Host.popen``): it knows only the
publication's control address(es) and sends setup-eliciting status messages there (session 0,
as a joining receiver does).  Prints one JSON line when done.

    python tests/mdc_attacker.py own CONTROL[,CONTROL...] STREAM SECONDS RATE [--answer]

From its own address (a UDP socket on port 40200): RATE status messages a second to each
control address for SECONDS, while it counts what comes back, per control address (the
publisher's send endpoint sends from it): datagrams, bytes, and the bytes of DATA frames that
carry a message.  ``--answer``: it also does what a receiver does with a heartbeat or DATA of a
session it has no image of, and asks for that session's SETUP (so it completes validation from
its own address, as any honest receiver there would).

    python tests/mdc_attacker.py spoof CONTROL STREAM SECONDS RATE VICTIM PORTS [ALSO_HOST:PORT]

Through a raw socket (``IPPROTO_RAW``, the IP header its own): RATE status messages a second
for SECONDS, each from ``VICTIM`` and one of PORTS source ports (40300 onwards, in turn), so
that what the publisher answers goes to the victim; every eighth from ``ALSO_HOST:PORT``
instead when given (a joined receiver's address, spoofed).
"""

from __future__ import annotations

import json
import select
import socket
import sys
import time

from slipstream.client.frames import Data, Heartbeat, StatusMessage, decode_datagram
from slipstream.client.layout import SM_SEND_SETUP_FLAG
from slipstream.sim.real.attacker import RawSender

OWN_PORT = 40200
SPOOF_FIRST_PORT = 40300
RECEIVER_ID = 0x5EED


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def own(controls: list[tuple[str, int]], stream_id: int, seconds: float, rate: float,
        answer: bool) -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", OWN_PORT))
    sock.setblocking(False)
    join = StatusMessage(0, stream_id, 0, 0, 0, RECEIVER_ID, SM_SEND_SETUP_FLAG).encode()
    stats = {f"{h}:{p}": {"sent_bytes": 0, "received_bytes": 0, "datagrams": 0,
                          "data_bytes": 0} for h, p in controls}
    asked: dict[tuple[int, int], float] = {}  # (session, stream) -> when it last asked
    start = time.monotonic()
    next_send = start
    while (now := time.monotonic()) - start < seconds:
        if now >= next_send:
            for control in controls:
                sock.sendto(join, control)
                stats[f"{control[0]}:{control[1]}"]["sent_bytes"] += len(join)
            next_send += 1 / rate
        readable, _, _ = select.select([sock], [], [], max(0.0, min(0.01, next_send - now)))
        if not readable:
            continue
        while True:
            try:
                data, source = sock.recvfrom(65536)
            except BlockingIOError:
                break
            entry = stats.get(f"{source[0]}:{source[1]}")
            if entry is None:
                continue
            entry["datagrams"] += 1
            entry["received_bytes"] += len(data)
            frames = decode_datagram(data)
            if not isinstance(frames, list):
                continue
            for frame in frames:
                if isinstance(frame, Data):
                    entry["data_bytes"] += len(frame.payload)
                key = (frame.session_id, frame.stream_id) if isinstance(
                    frame, Heartbeat | Data) else None
                # As a receiver: one request a session per 0.2 s (its pending-setup time).
                if answer and key is not None and now - asked.get(key, -1.0) > 0.2:
                    asked[key] = now
                    ask = StatusMessage(*key, 0, 0, 0, RECEIVER_ID, SM_SEND_SETUP_FLAG).encode()
                    sock.sendto(ask, source)
                    entry["sent_bytes"] += len(ask)
    return stats


def spoof(control: tuple[str, int], stream_id: int, seconds: float, rate: float, victim: str,
          ports: int, also: tuple[str, int] | None) -> dict:
    raw = RawSender()
    join = StatusMessage(0, stream_id, 0, 0, 0, RECEIVER_ID, SM_SEND_SETUP_FLAG).encode()
    sent = {"victim_bytes": 0, "victim_messages": 0, "also_messages": 0}
    start = time.monotonic()
    k = 0
    while time.monotonic() - start < seconds:
        if also is not None and k % 8 == 7:
            raw.send(also, control, join)
            sent["also_messages"] += 1
        else:
            source = (victim, SPOOF_FIRST_PORT + k % ports)
            raw.send(source, control, join)
            sent["victim_bytes"] += len(join)
            sent["victim_messages"] += 1
        k += 1
        delay = start + k / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    raw.close()
    return sent


def main(argv: list[str]) -> None:
    mode, control, stream_id, seconds, rate = argv[:5]
    if mode == "own":
        result = own([_address(c) for c in control.split(",")], int(stream_id),
                     float(seconds), float(rate), "--answer" in argv[5:])
    else:
        also = _address(argv[7]) if len(argv) > 7 else None
        result = spoof(_address(control), int(stream_id), float(seconds), float(rate),
                       argv[5], int(argv[6]), also)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
