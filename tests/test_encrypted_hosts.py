"""An encrypted stream between test hosts (network namespaces on a bridge, a real driver in
each) while a third host spoofs each end to the other with a raw socket (tests/spoofer.py):
forged DATA, heartbeats and DATA sealed under another key as the publisher; forged SMs, NAKs
and ERRs as the subscriber.  Every message arrives once, in order, no offer is held as long as
a receiver's connection timeout, and both drivers count what they dropped (docs/CHANNELS.md
§7.8).  And a third host
on a segment that floods every frame records a keyed stream (tests/wire_capture.py): the
recording holds none of its payloads' bytes, opens nothing replayed to the subscriber's
driver restarted, and opens nothing to the test holding the key once the stream ended.

Needs root and iproute2 (CI runs as root); without root these tests skip, except under
CI=true, where they fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from helpers import NETWORK_SETTINGS, Collector, counters_of, udp_receive_drops, wait_for
from sealed_wire import KEY_A, ext_type, nonce, open_sealed, read_captured_answer
from test_encrypted_streams import write_keys

from slipstream.client import Client, Publication, Subscription
from slipstream.client.counters import DROP_CAUSES
from slipstream.client.layout import (
    EXT_TYPE_HANDSHAKE_ANSWER,
    EXT_TYPE_HANDSHAKE_INIT,
    EXT_TYPE_SEALED,
    SEALED_EPOCH_BITS,
    SEALED_HEADER,
    SEALED_HEADER_LENGTH,
)
from slipstream.daemon.config import load_settings
from slipstream.sim.real.hosts import NamespaceHosts

pytestmark = pytest.mark.timeout(180)

PORT = 40131  # the subscriber's endpoint, on host 2
CONTROL_PORT = 40132  # the publisher's socket, on host 1 (control= pins it)
RATE = 4_000  # the publisher's messages a second
COUNT = 12_000
SPOOF_RATE = 1_000  # of each of the attacker's seven kinds of datagram, a second
#: A publication with no status message for this long counts its receivers gone, s.
CONNECTION_TIMEOUT_S = load_settings(
    env={}, overrides=NETWORK_SETTINGS).publication_connection_timeout / 1e9
SPOOFER = Path(__file__).with_name("spoofer.py")
WIRE_CAPTURE = Path(__file__).with_name("wire_capture.py")


def keyed_stream(a: Client, b: Client, one: str, two: str,
                 stream_id: int) -> tuple[Publication, Subscription]:
    """A ``key=k`` stream from client ``a`` on host ``one`` (its socket at CONTROL_PORT) to
    client ``b`` on host ``two`` (at PORT), connected: (the publication, the subscription)."""
    subscription = b.add_subscription(f"aeron:udp?endpoint={two}:{PORT}|key=k", stream_id)
    publication = a.add_publication(
        f"aeron:udp?endpoint={two}:{PORT}|control={one}:{CONTROL_PORT}|key=k", stream_id)
    wait_for(lambda: publication.is_connected and subscription.images, timeout=15,
             what="the stream connected")
    return publication, subscription


def paced(publication, collector: Collector, count: int, first: int) -> float:
    """``count`` 1 KiB messages offered at RATE a second while the collector reads; the
    longest an offer was refused before it was taken, s."""
    start = time.monotonic()
    longest_hold = 0.0
    for i in range(first, first + count):
        due = start + (i - first) / RATE
        while time.monotonic() < due:
            collector.poll()
        held = time.monotonic()
        while publication.offer(i.to_bytes(4, "little") + bytes(1016)
                                + i.to_bytes(4, "little")) < 0:
            collector.poll()
        longest_hold = max(longest_hold, time.monotonic() - held)
    wait_for(lambda: collector.poll() >= 0 and len(collector.seen) >= first + count,
             timeout=30, what="every message read")
    return longest_hold


@pytest.mark.parametrize("hosts", [3], indirect=True)
def test_a_spoofing_host_changes_nothing_on_an_encrypted_stream(hosts, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    write_keys(keys, "k", [(1, KEY_A)])
    settings = {**NETWORK_SETTINGS, "keys_dir": str(keys)}
    publisher = hosts.start_driver(1, **settings)
    subscriber = hosts.start_driver(2, **settings)
    one, two = hosts[1].address, hosts[2].address
    with Client.connect(publisher.directory) as a, Client.connect(subscriber.directory) as b:
        publication, subscription = keyed_stream(a, b, one, two, 5)
        collector = Collector(subscription)
        paced(publication, collector, COUNT, 0)
        before = counters_of(publisher), counters_of(subscriber)
        unread_before = udp_receive_drops(hosts[2], PORT)
        attacker = hosts[3].popen(
            sys.executable, str(SPOOFER), one, str(CONTROL_PORT), two, str(PORT),
            str(publication.session_id), "5", str(publication.initial_term_id),
            str(SPOOF_RATE), str(COUNT / RATE + 1), stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(0.5)  # the attack is under way
            held_s = paced(publication, collector, COUNT, COUNT)
            spoofed = int(attacker.communicate(timeout=30)[0])
        finally:
            if attacker.poll() is None:
                attacker.kill()
        collector.assert_exactly(2 * COUNT)
        assert publication.is_connected
    after = counters_of(publisher), counters_of(subscriber)
    unread = udp_receive_drops(hosts[2], PORT) - unread_before

    def added(side: int, name: str) -> int:
        return after[side][name] - before[side][name]

    assert spoofed >= 7 * SPOOF_RATE * COUNT / RATE * 0.8
    # No forged control held the publisher: no offer waited as long as a receiver may go
    # silent before it counts as gone (the publisher's rate under such attacks is
    # bench.hostile_floods' figure).
    assert held_s < CONNECTION_TIMEOUT_S, held_s
    # The forged datagrams that arrived (a few are lost on the way, as any datagram) were
    # dropped before anything read them, and counted.
    assert added(0, "CRYPTO_PLAIN_DROPS") >= 0.8 * spoofed * 4 / 7
    assert added(1, "CRYPTO_PLAIN_DROPS") >= 0.8 * spoofed * 2 / 7
    # DATA sealed under the attacker's own key names a sender id no handshake gave.
    assert added(1, "CRYPTO_AWAITING_HANDSHAKE_DROPS") >= 0.8 * spoofed / 7
    # No NAK was forged into a resend.  Real data that the subscriber's kernel dropped
    # unread in the flood (its socket's buffer full: a starved host) is NAKed and resent as
    # any loss is; without such drops no NAK came at all.
    naks, resent = added(0, "NAK_MESSAGES_RECEIVED"), added(0, "RETRANSMITS_SENT")
    assert (naks, resent) == (0, 0) or unread > 0, (naks, resent, unread)
    assert added(0, "ERRORS") == added(1, "ERRORS") == 0
    assert added(1, "FLOW_CONTROL_OVER_RUNS") == 0


def test_a_capture_of_a_keyed_stream_reads_and_opens_nothing_even_with_the_key_later(
        needs_hosts, tmp_path: Path) -> None:
    """A third host records everything on the segment while a keyed stream connects, carries
    1,500 messages and ends.  The recording holds none of the messages' bytes.  Replayed,
    spoofed from the publisher, to the subscriber's driver restarted (the publisher's gone
    with its stream), it makes no image and no session, and every datagram of it is counted
    as refused.  And the test, holding the key file and the recording, tries what any holder
    of the key can: a traffic secret derived from the key (there is none: the secrets are
    random, sent only sealed in the handshake), and the handshake read with the key: the INIT
    opens to it, the ANSWER does not (it needs an ephemeral private key no one kept)."""
    keys = tmp_path / "keys"
    write_keys(keys, "k", [(1, KEY_A)])
    settings = {**NETWORK_SETTINGS, "keys_dir": str(keys)}
    recording = tmp_path / "wire.jsonl"
    count = 1_500
    with NamespaceHosts(3, shared_segment=True) as hosts:
        one, two = hosts[1].address, hosts[2].address
        # One datagram a frame on the link (no GSO run), as the recorder counts them.
        publisher = hosts.start_driver(1, **settings, socket_gso=False)
        subscriber = hosts.start_driver(2, **settings)
        recorder = hosts[3].popen(sys.executable, str(WIRE_CAPTURE), "capture", str(recording),
                                  "60", str(PORT), str(CONTROL_PORT), stdout=subprocess.PIPE,
                                  text=True)
        assert recorder.stdout.readline().strip() == "ready"
        marks = [b"secret-%06d|" % i for i in range(count)]
        with Client.connect(publisher.directory) as a, \
                Client.connect(subscriber.directory) as b:
            publication, subscription = keyed_stream(a, b, one, two, 6)
            collector = Collector(subscription)
            start = time.monotonic()
            for i, mark in enumerate(marks):
                while time.monotonic() < start + i / 2_000:  # a pace the recorder keeps up with
                    collector.poll()
                message = i.to_bytes(4, "little") + mark * 80 + i.to_bytes(4, "little")
                while publication.offer(message) < 0:
                    collector.poll()
            wait_for(lambda: collector.poll() >= 0 and len(collector.seen) >= count,
                     timeout=30, what="every message read")
            collector.assert_exactly(count)
            publication.close()
            time.sleep(0.3)  # the stream's last datagrams on the link
        recording.with_name(recording.name + ".stop").touch()
        recorded = int(recorder.communicate(timeout=30)[0].split()[-1])
        publisher.stop()
        subscriber.stop()
        wire = [(tuple(s), tuple(d), bytes.fromhex(p))
                for s, d, p in map(json.loads, recording.read_text().splitlines())]
        assert recorded == len(wire)
        # Nothing of any message on the wire: not one of its marks, in any datagram.
        everything = b"".join(payload for _, _, payload in wire)
        assert not any(mark in everything for mark in marks)
        to_subscriber = [p for s, d, p in wire if s == (one, CONTROL_PORT) and d == (two, PORT)]
        kinds = [ext_type(p) for p in to_subscriber]
        # The whole stream passed the recorder: a datagram a message, and the handshake.
        # (A recorder on a loaded machine misses a few, as any tap may.)
        assert kinds.count(EXT_TYPE_SEALED) >= 0.9 * count
        assert EXT_TYPE_HANDSHAKE_ANSWER in kinds

        restarted = hosts.start_driver(2, **settings)
        before = counters_of(restarted)
        with Client.connect(restarted.directory) as b:
            subscription = b.add_subscription(f"aeron:udp?endpoint={two}:{PORT}|key=k", 6)
            time.sleep(0.3)  # the endpoint is open
            replayer = hosts[3].popen(sys.executable, str(WIRE_CAPTURE), "replay",
                                      str(recording), one, str(CONTROL_PORT), two, str(PORT),
                                      stdout=subprocess.PIPE, text=True)
            replayed = int(replayer.communicate(timeout=60)[0])
            time.sleep(0.5)
            assert not subscription.images
        after = counters_of(restarted)
        refused = sum(after[c.name] - before[c.name] for c in DROP_CAUSES)
        assert replayed == len(to_subscriber)
        assert 0.9 * replayed <= refused <= replayed  # a full socket buffer counts nothing
        assert after["CRYPTO_AWAITING_HANDSHAKE_DROPS"] - before[
            "CRYPTO_AWAITING_HANDSHAKE_DROPS"] >= 0.9 * kinds.count(EXT_TYPE_SEALED)
        assert after["CRYPTO_HANDSHAKES"] == 0

    # The key, after the stream: no derivation from it opens a datagram of the recording.
    sealed = [p for _, _, p in wire if ext_type(p) == EXT_TYPE_SEALED
              and len(p) == SEALED_HEADER.unpack_from(p)[0]]
    assert len(sealed) >= count
    for datagram in sealed[:200]:
        with pytest.raises(InvalidTag):
            open_sealed(datagram, KEY_A)  # the key taken as a sender's secret
        sender_id, counter = SEALED_HEADER.unpack_from(datagram)[7:9]
        salt = sender_id.to_bytes(8, "little") + (counter >> SEALED_EPOCH_BITS).to_bytes(
            8, "little")
        for info in (b"slipstream sealed datagram v1", b"slipstream sealed datagram v2"):
            # The key as the input of a sender's derivation.
            out = HKDF(hashes.SHA256(), 44, salt, info).derive(KEY_A)
            with pytest.raises(InvalidTag):
                AESGCM(out[:32]).decrypt(nonce(out[32:], counter),
                                         datagram[SEALED_HEADER_LENGTH:],
                                         datagram[:SEALED_HEADER_LENGTH])
    inits = {p[16:24]: p for _, _, p in wire if ext_type(p) == EXT_TYPE_HANDSHAKE_INIT}
    answers = [p for _, _, p in wire if ext_type(p) == EXT_TYPE_HANDSHAKE_ANSWER]
    assert answers and all(a[16:24] in inits for a in answers)
    for answer in answers:
        with pytest.raises(InvalidTag):
            read_captured_answer(KEY_A, inits[answer[16:24]], answer)
