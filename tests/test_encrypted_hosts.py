"""An encrypted stream between test hosts (network namespaces on a bridge, a real driver in
each) while a third host spoofs each end to the other with a raw socket (tests/spoofer.py):
forged DATA, heartbeats and DATA sealed under another key as the publisher; forged SMs, NAKs
and ERRs as the subscriber.  Every message arrives once, in order, the publisher keeps its
rate, and both drivers count what they dropped (docs/PROTOCOL.md §7.8).

Needs root and iproute2 (CI runs as root); without root these tests skip, except under
CI=true, where they fail.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import NETWORK_SETTINGS, Collector, counters_of, wait_for

from slipstream.client import Client

pytestmark = pytest.mark.timeout(180)

PORT = 40131  # the subscriber's endpoint, on host 2
CONTROL_PORT = 40132  # the publisher's socket, on host 1 (control= pins it)
RATE = 4_000  # the publisher's messages a second
COUNT = 12_000
SPOOF_RATE = 1_000  # of each of the attacker's seven kinds of datagram, a second
SPOOFER = Path(__file__).with_name("spoofer.py")


def paced(publication, collector: Collector, count: int, first: int) -> float:
    """``count`` 1 KiB messages offered at RATE a second while the collector reads; the
    seconds the publisher took to offer them all."""
    start = time.monotonic()
    for i in range(first, first + count):
        due = start + (i - first) / RATE
        while time.monotonic() < due:
            collector.poll()
        while publication.offer(i.to_bytes(4, "little") + bytes(1016)
                                + i.to_bytes(4, "little")) < 0:
            collector.poll()
    elapsed = time.monotonic() - start
    wait_for(lambda: collector.poll() >= 0 and len(collector.seen) >= first + count,
             timeout=30, what="every message read")
    return elapsed


@pytest.mark.parametrize("hosts", [3], indirect=True)
def test_a_spoofing_host_changes_nothing_on_an_encrypted_stream(hosts, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o750)
    (keys / "k.key").write_text(f"1 {bytes(range(32)).hex()}\n")
    (keys / "k.key").chmod(0o640)
    settings = {**NETWORK_SETTINGS, "keys_dir": str(keys)}
    publisher = hosts.start_driver(1, **settings)
    subscriber = hosts.start_driver(2, **settings)
    one, two = hosts[1].address, hosts[2].address
    with Client.connect(publisher.directory) as a, Client.connect(subscriber.directory) as b:
        subscription = b.add_subscription(f"aeron:udp?endpoint={two}:{PORT}|key=k", 5)
        publication = a.add_publication(
            f"aeron:udp?endpoint={two}:{PORT}|control={one}:{CONTROL_PORT}|key=k", 5)
        wait_for(lambda: publication.is_connected and subscription.images, timeout=15,
                 what="the stream connected")
        collector = Collector(subscription)
        quiet = paced(publication, collector, COUNT, 0)
        before = counters_of(publisher), counters_of(subscriber)
        attacker = hosts[3].popen(
            sys.executable, str(SPOOFER), one, str(CONTROL_PORT), two, str(PORT),
            str(publication.session_id), "5", str(publication.initial_term_id),
            str(SPOOF_RATE), str(COUNT / RATE + 1), stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(0.5)  # the attack is under way
            attacked = paced(publication, collector, COUNT, COUNT)
            spoofed = int(attacker.communicate(timeout=30)[0])
        finally:
            if attacker.poll() is None:
                attacker.kill()
        collector.assert_exactly(2 * COUNT)
        assert publication.is_connected
    after = counters_of(publisher), counters_of(subscriber)

    def added(side: int, name: str) -> int:
        return after[side][name] - before[side][name]

    assert spoofed >= 7 * SPOOF_RATE * COUNT / RATE * 0.8
    # The publisher's rate: what the attack added to the time its offers took.
    assert attacked <= quiet * 1.1, (quiet, attacked)
    # The forged datagrams that arrived (a few are lost on the way, as any datagram) were
    # dropped before anything read them, and counted.
    assert added(0, "CRYPTO_PLAIN_DROPS") >= 0.8 * spoofed * 4 / 7
    assert added(1, "CRYPTO_PLAIN_DROPS") >= 0.8 * spoofed * 2 / 7
    assert added(1, "CRYPTO_AUTH_DROPS") >= 0.8 * spoofed / 7
    assert added(0, "NAK_MESSAGES_RECEIVED") == added(0, "RETRANSMITS_SENT") == 0
    assert added(0, "ERRORS") == added(1, "ERRORS") == 0
    assert added(1, "FLOW_CONTROL_OVER_RUNS") == 0
