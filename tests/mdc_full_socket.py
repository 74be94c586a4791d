"""A multi-destination-cast stream through a send socket that fills: run by tests/test_mdc.py
in a network namespace of its own (``unshare -n``), whose loopback this rate-limits with
``tbf``, so that a publication sending to many destinations finds its socket full again and
again (plain loopback never fills it).  One sending driver, one receiving driver with a
receive endpoint per destination (each its own receiver of fc=min).  Prints one JSON line:
what each endpoint got, and the sender's counters.

    unshare -n python tests/mdc_full_socket.py DESTINATIONS MESSAGES
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from helpers import NETWORK_SETTINGS, Collector, counters_of, stream, wait_for

from slipstream.client import Client
from slipstream.daemon.driver import MediaDriver

RATE = "200mbit"
SIZE = 1300


def main(destinations: int, messages: int) -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", RATE,
                    "burst", "64kb", "latency", "50ms"], check=True)
    directories = [Path("/dev/shm") / f"slipstream-mdc-{uuid.uuid4().hex[:12]}"
                   for _ in range(2)]
    with contextlib.ExitStack() as stack:
        sender, receiver = (stack.enter_context(MediaDriver.launch(directory=d,
                                                                   **NETWORK_SETTINGS))
                            for d in directories)
        publishing = stack.enter_context(Client.connect(sender.directory))
        receiving = stack.enter_context(Client.connect(receiver.directory))
        ports = [41000 + i for i in range(destinations)]
        subscriptions = [receiving.add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{port}|rcv-wnd=256k|so-rcvbuf=4m", 5)
            for port in ports]
        publication = publishing.add_publication(
            "aeron:udp?control-mode=manual|term-length=1m|fc=min|so-sndbuf=256k", 5)
        for port in ports:
            publication.add_destination(f"aeron:udp?endpoint=127.0.0.1:{port}")
        wait_for(lambda: all(s.images for s in subscriptions) and publication.is_connected,
                 timeout=20, what="every destination joined")
        collectors = [Collector(s) for s in subscriptions]
        try:
            stream(publication, collectors, messages, lambda _: SIZE, timeout=60)
        finally:
            counters = counters_of(sender)
            print(json.dumps({
                "received": [len(c.seen) for c in collectors],
                "in_order": [c.seen == list(range(len(c.seen))) and c.torn == 0
                             for c in collectors],
                "counters": {k: counters[k] for k in ("SHORT_SENDS", "SEND_ERRORS",
                                                     "BYTES_SENT", "RETRANSMITS_SENT")}}))
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
