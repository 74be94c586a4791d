"""Sealed datagrams of encrypted channels (daemon/network_crypto.c through
slipstream.daemon.media.sealing; docs/CHANNELS.md §7.8): the codec, the
anti-replay window, two keys at once, and the key files' checks.  No sockets: one context
seals, another opens, as two endpoints would."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sealed_wire import KEY_A, KEY_B

from slipstream.client.channel import parse_channel
from slipstream.client.errors import ChannelError
from slipstream.client.frames import Sealed, decode
from slipstream.client.layout import (
    HANDSHAKE_INIT_LENGTH,
    SEALED_COUNTER_FIELD,
    SEALED_EPOCH_BITS,
    SEALED_HEADER,
    SEALED_MTU_MAX,
    SEALED_OVERHEAD,
    SEALED_SENDER_ID_FIELD,
)
from slipstream.daemon._network import lib as network
from slipstream.daemon.media.sealing import KeyFileError, KeyRing, Sealing, read_key_file
from slipstream.daemon.protocol.types import sockaddr

#: The window's span: RFC 6479's bitmap (4096 counters) less a word.
WINDOW = 4096 - 64


#: Two endpoints' addresses, as a datagram's source.
HOST_A = sockaddr(("10.0.0.1", 40001))
HOST_B = sockaddr(("10.0.0.2", 40002))


def shake(sender: Sealing, receiver: Sealing, at: bytes = HOST_A) -> None:
    """The handshake two endpoints exchange when ``receiver`` (at HOST_B) first hears
    ``sender`` (at ``at``): its first datagram is not opened, the exchange runs to its end."""
    assert receiver.open(sender.seal(b""), at) == network.SS_OPEN_AWAITING_HANDSHAKE
    pump(sender, receiver, at)


def pump(a: Sealing, b: Sealing, at: bytes = HOST_A) -> None:
    """Every handshake datagram either endpoint (``a`` at ``at``, ``b`` at HOST_B) sends,
    delivered, until neither has more."""
    moved = True
    while moved:
        moved = False
        for source, address, target in ((a, at, b), (b, HOST_B, a)):
            for datagram, _ in source.take_handshakes():
                target.open(datagram, address)
                moved = True


def pair(sender_keys: list[tuple[int, bytes]], receiver_keys: list[tuple[int, bytes]]
         ) -> tuple[Sealing, Sealing]:
    """Two endpoints with these keys that exchanged a handshake."""
    sender, receiver = Sealing("test", None), Sealing("test", None)
    sender.set_keys(sender_keys)
    receiver.set_keys(receiver_keys)
    shake(sender, receiver)
    return sender, receiver


@given(st.binary(max_size=2000))
def test_a_sealed_datagram_opens_to_its_frames_once(plain: bytes) -> None:
    sender, receiver = pair([(1, KEY_A)], [(1, KEY_A)])
    sealed = sender.seal(plain)
    assert len(sealed) == len(plain) + SEALED_OVERHEAD
    if len(plain) >= 16:
        assert plain not in sealed  # the frames travel encrypted
    assert receiver.open(sealed) == plain
    assert receiver.open(sealed) == network.SS_OPEN_REPLAY


@settings(max_examples=300)
@given(st.binary(min_size=1, max_size=300), st.data())
def test_any_change_to_a_sealed_datagram_makes_it_fail_to_open(plain: bytes, data) -> None:
    """A flipped bit anywhere (the clear header is associated data), a cut at either end, or
    bytes added: none of it opens."""
    sender, receiver = pair([(1, KEY_A)], [(1, KEY_A)])
    sealed = bytearray(sender.seal(plain))
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "drop-front"]))
    if how == "flip":
        at = data.draw(st.integers(0, len(sealed) - 1))
        sealed[at] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        del sealed[data.draw(st.integers(0, len(sealed) - 1)):]
    elif how == "extend":
        sealed += data.draw(st.binary(min_size=1, max_size=64))
    else:
        del sealed[:data.draw(st.integers(1, len(sealed)))]
    # (A changed sender id may also read as one past its lifetime, a replay, or as one with no
    # session; a changed type byte as a handshake datagram, refused.)
    assert receiver.open(bytes(sealed)) in (network.SS_OPEN_PLAIN, network.SS_OPEN_FAILED,
                                            network.SS_OPEN_UNKNOWN_KEY, network.SS_OPEN_REPLAY,
                                            network.SS_OPEN_AWAITING_HANDSHAKE,
                                            network.SS_OPEN_HANDSHAKE_REFUSED)


@pytest.mark.parametrize(("seconds_ago", "opens"), [
    (0, True), (100, True),  # within the lifetime and the clock skew allowed
    (network.SS_CRYPTO_SENDER_ID_MAX_AGE_S + 5, False),  # a recording: no sender uses it now
    (-network.SS_CRYPTO_CLOCK_SKEW_S - 5, False),  # from a clock too far ahead
])
def test_a_sender_id_past_its_lifetime_never_opens_even_at_an_endpoint_with_its_session(
        seconds_ago: int, opens: bool) -> None:
    """Freshness: a sender id carries the second it was drawn, senders draw a new one each
    lifetime, and every endpoint refuses an id older than that (plus the clock skew allowed),
    before it looks for a session: a recording of it is refused everywhere."""
    sender, receiver = pair([(1, KEY_A)], [(1, KEY_A)])
    sealed = sender.seal(b"x" * 40)
    network.ss_crypto_set_clock_offset(receiver.c, seconds_ago)  # it arrives that much later
    result = receiver.open(sealed)
    if opens:
        assert result == b"x" * 40
    else:
        assert result == network.SS_OPEN_REPLAY


def test_a_sender_draws_a_new_id_once_its_own_is_past_its_lifetime() -> None:
    """A sender id older than its lifetime gives way to the next one at the next seal (its
    counter from 0), drawn ahead: a receiver holds it from the handshake and opens it at
    once."""
    sender, receiver = pair([(1, KEY_A)], [(1, KEY_A)])
    first = sender.seal(b"y" * 16)
    second = sender.seal(b"y" * 16)
    lifetime = network.SS_CRYPTO_SENDER_ID_LIFETIME_S
    network.ss_crypto_set_clock_offset(sender.c, lifetime)  # a lifetime later
    network.ss_crypto_set_clock_offset(receiver.c, lifetime)
    third = sender.seal(b"y" * 16)

    def sender_id(sealed: bytes) -> int:
        return int.from_bytes(sealed[SEALED_SENDER_ID_FIELD:SEALED_SENDER_ID_FIELD + 8], "little")

    def counter(sealed: bytes) -> int:
        return int.from_bytes(sealed[SEALED_COUNTER_FIELD:SEALED_COUNTER_FIELD + 8], "little")

    # (Counter 0 went in the handshake.)
    assert sender_id(first) == sender_id(second) and (counter(first), counter(second)) == (1, 2)
    assert sender_id(third) != sender_id(first) and counter(third) == 0
    assert (sender_id(third) >> 32) - (sender_id(first) >> 32) in (lifetime, lifetime + 1)
    assert receiver.open(third) == b"y" * 16
    assert receiver.open(first) == b"y" * 16  # still within its id's age, and unseen


@given(st.permutations(list(range(64))), st.integers(1, 2**62))
def test_the_window_opens_each_counter_once_in_any_order(order: list[int], base: int) -> None:
    """Datagrams reordered within the window each open once; every repeat is a replay."""
    sender, receiver = pair([(1, KEY_A)], [(1, KEY_A)])
    sealed = {}
    for i in range(64):
        network.ss_crypto_set_counter(sender.c, base + i * 37)
        sealed[i] = sender.seal(i.to_bytes(4, "little"))
    for i in order:
        assert receiver.open(sealed[i]) == i.to_bytes(4, "little")
    for i in order:
        assert receiver.open(sealed[i]) == network.SS_OPEN_REPLAY


def test_a_counter_below_the_window_is_refused_even_unseen() -> None:
    sender, receiver = pair([(1, KEY_A)], [(1, KEY_A)])
    network.ss_crypto_set_counter(sender.c, 10)
    old = sender.seal(b"old")
    late = sender.seal(b"late")  # counter 11
    network.ss_crypto_set_counter(sender.c, 10 + WINDOW)
    assert receiver.open(sender.seal(b"new")) == b"new"
    assert receiver.open(old) == network.SS_OPEN_REPLAY
    assert receiver.open(late) == b"late"  # just within: unseen, so it opens


def test_a_counter_moves_forward_only() -> None:
    """Counters never repeat under one sender id: setting one below the next is refused."""
    sender = Sealing("test", None)
    sender.set_keys([(1, KEY_A)])
    assert network.ss_crypto_set_counter(sender.c, 100) == 0
    assert network.ss_crypto_set_counter(sender.c, 99) == -1
    sealed = sender.seal(b"x")
    assert int.from_bytes(sealed[SEALED_COUNTER_FIELD:SEALED_COUNTER_FIELD + 8], "little") == 100


def test_a_sender_crosses_an_epoch_and_its_datagrams_still_open() -> None:
    """Every 2^23 datagrams a sender derives a new AEAD key; a late datagram of the epoch
    before still opens (once)."""
    sender, receiver = pair([(1, KEY_A)], [(1, KEY_A)])
    network.ss_crypto_set_counter(sender.c, (1 << SEALED_EPOCH_BITS) - 3)
    sealed = [sender.seal(bytes([i]) * 40) for i in range(6)]
    for i in (0, 1, 3, 4, 2, 5):
        assert receiver.open(sealed[i]) == bytes([i]) * 40
    assert all(receiver.open(s) == network.SS_OPEN_REPLAY for s in sealed)


def test_a_receiver_holding_two_keys_opens_either_and_refuses_a_third() -> None:
    """Mid-rotation: the receiver seals (and starts handshakes) with the new key; one peer
    still seals with the old one, another holds only the new one."""
    receiver = Sealing("test", None)
    receiver.set_keys([(2, KEY_B), (1, KEY_A)])
    old, new, other = Sealing("t", None), Sealing("t", None), Sealing("t", None)
    old.set_keys([(1, KEY_A), (2, KEY_B)])
    new.set_keys([(2, KEY_B)])
    other.set_keys([(3, KEY_A)])
    shake(old, receiver)
    shake(new, receiver, sockaddr(("10.0.0.3", 40003)))
    assert receiver.open(old.seal(b"a")) == b"a"
    assert receiver.open(new.seal(b"b")) == b"b"
    assert receiver.open(other.seal(b"c")) == network.SS_OPEN_UNKNOWN_KEY


def test_the_same_key_id_with_other_key_bytes_gets_no_session_and_never_opens() -> None:
    """The handshake fails at the peer (its INIT's tag), so no datagram of it opens."""
    sender, receiver = pair([(1, KEY_B)], [(1, KEY_A)])
    assert receiver.open(sender.seal(b"forged"), HOST_A) == network.SS_OPEN_AWAITING_HANDSHAKE
    init = receiver.take_handshakes()
    assert [len(d) for d, _ in init] == [HANDSHAKE_INIT_LENGTH] or init == []
    for datagram, _ in init:
        assert sender.open(datagram, HOST_B) == network.SS_OPEN_HANDSHAKE_REFUSED
    assert sender.take_handshakes() == []


def test_a_plain_frame_at_an_encrypted_endpoint_is_a_plain_drop() -> None:
    _, receiver = pair([(1, KEY_A)], [(1, KEY_A)])
    heartbeat = bytes(32)
    assert receiver.open(heartbeat) == network.SS_OPEN_PLAIN


def test_a_forged_datagram_does_not_evict_a_sender_it_names() -> None:
    """A forged datagram with a known sender id and a fresh counter fails, and the sender's
    window is as it was: its next datagram opens, its last one is still a replay."""
    sender, receiver = pair([(1, KEY_A)], [(1, KEY_A)])
    first = sender.seal(b"one")
    assert receiver.open(first) == b"one"
    forged = bytearray(sender.seal(b"two"))
    forged[-1] ^= 1
    assert receiver.open(bytes(forged)) == network.SS_OPEN_FAILED
    assert receiver.open(first) == network.SS_OPEN_REPLAY
    assert receiver.open(sender.seal(b"three")) == b"three"


def test_a_restarted_sender_has_a_new_id_so_its_counters_start_again_safely() -> None:
    first, receiver = pair([(1, KEY_A)], [(1, KEY_A)])
    second = Sealing("test", None)
    second.set_keys([(1, KEY_A)])
    shake(second, receiver, sockaddr(("10.0.0.3", 40003)))
    a, b = first.seal(b"x"), second.seal(b"x")
    id_a = SEALED_HEADER.unpack_from(a)[7]
    id_b = SEALED_HEADER.unpack_from(b)[7]
    assert id_a != id_b and a != b
    assert receiver.open(a) == b"x" and receiver.open(b) == b"x"


def test_a_plain_endpoint_decodes_a_sealed_datagram_as_sealed() -> None:
    sender, _ = pair([(7, KEY_A)], [(7, KEY_A)])
    assert decode(sender.seal(b"frames")) == Sealed(7)


# ----------------------------------------------------------------------------- key files


def key_file(directory: Path, name: str, lines: list[str], mode: int = 0o640) -> Path:
    path = directory / f"{name}.key"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(mode)
    return path


def test_a_key_file_gives_its_keys_sealing_key_first(tmp_path: Path) -> None:
    path = key_file(tmp_path, "k", ["# rotation: 2 seals", f"2 {KEY_B.hex()}", "",
                                    f"1 {KEY_A.hex()}  # the old one"])
    assert read_key_file(path) == [(2, KEY_B), (1, KEY_A)]


@pytest.mark.parametrize("lines, mode, cause", [
    ([f"1 {KEY_A.hex()}"], 0o644, "may be read by others"),
    ([f"1 {KEY_A.hex()}"], 0o602, "may be read by others"),
    ([f"1 {KEY_A.hex()[:-2]}"], 0o600, "is not '<id 0-255> <64 hex digits>'"),
    ([f"256 {KEY_A.hex()}"], 0o600, "is not '<id 0-255> <64 hex digits>'"),
    ([f"1 {KEY_A.hex()}", f"1 {KEY_B.hex()}"], 0o600, "key id 1 is given twice"),
    ([f"{i} {KEY_A.hex()}" for i in range(3)], 0o600, "at most 2"),
    (["# nothing"], 0o600, "holds no key"),
])
def test_a_bad_key_file_is_refused_naming_it_and_why(tmp_path: Path, lines: list[str],
                                                     mode: int, cause: str) -> None:
    path = key_file(tmp_path, "k", lines, mode)
    with pytest.raises(KeyFileError, match=cause) as raised:
        read_key_file(path)
    assert str(path) in str(raised.value)


def test_a_link_or_a_directory_is_no_key_file(tmp_path: Path) -> None:
    target = key_file(tmp_path, "real", [f"1 {KEY_A.hex()}"])
    (tmp_path / "link.key").symlink_to(target)
    with pytest.raises(KeyFileError, match="symbolic link"):
        read_key_file(tmp_path / "link.key")
    (tmp_path / "dir.key").mkdir()
    with pytest.raises(KeyFileError, match="not a regular file"):
        read_key_file(tmp_path / "dir.key")
    os.mkfifo(tmp_path / "fifo.key", 0o600)
    with pytest.raises(KeyFileError, match="not a regular file"):
        read_key_file(tmp_path / "fifo.key")


def test_a_key_file_of_another_user_is_refused_naming_its_owner(tmp_path: Path) -> None:
    """Whoever owns a key file can change it: one owned by another user than the driver's
    (or root) is refused, as a key that user could have planted in keys_dir."""
    path = key_file(tmp_path, "k", [f"1 {KEY_A.hex()}"])
    other = 65534 if os.geteuid() != 65534 else 65533
    if os.geteuid() != 0:  # CI runs as root; a test that lacks what it needs fails there
        if os.environ.get("CI") == "true":
            pytest.fail("giving a file to another user needs root")
        pytest.skip("giving a file to another user needs root")
    os.chown(path, other, -1)
    with pytest.raises(KeyFileError, match=f"owned by uid {other}") as raised:
        read_key_file(path)
    assert str(path) in str(raised.value)


def test_the_ring_hands_a_changed_file_to_its_endpoints_and_keeps_keys_when_it_goes_bad(
        tmp_path: Path) -> None:
    key_file(tmp_path, "k", [f"1 {KEY_A.hex()}"])
    ring = KeyRing(str(tmp_path), None)
    endpoint = ring.sealing_for("aeron:udp?endpoint=x:1|key=k", "k")
    peer = Sealing("k", None)
    peer.set_keys([(1, KEY_A), (2, KEY_B)])  # rotation's first step: the new key accepted
    shake(endpoint, peer)
    assert peer.open(endpoint.seal(b"a")) == b"a"
    assert ring.reload() == 0  # unchanged
    path = key_file(tmp_path, "k", [f"2 {KEY_B.hex()}", f"1 {KEY_A.hex()}"])
    assert ring.reload() == 1
    sealed = endpoint.seal(b"b")
    assert sealed[5] == 2 and peer.open(sealed) == b"b"  # the key id is the flags byte
    path.chmod(stat.S_IRUSR | stat.S_IROTH)
    assert ring.reload() == 0  # refused: the old keys stay
    assert peer.open(endpoint.seal(b"c")) == b"c"


# ------------------------------------------------------------------------- the URI key


def test_key_names_a_key_and_is_refused_where_nothing_would_use_it() -> None:
    assert parse_channel("aeron:udp?endpoint=h:1|key=prod.feed-2").key == "prod.feed-2"
    for uri, key, cause in [
            ("aeron:udp?endpoint=h:1|key=../etc/passwd", "key", "is not a key name"),
            ("aeron:udp?endpoint=h:1|key=.hidden", "key", "is not a key name"),
            ("aeron:ipc?key=k", "key", "applies to aeron:udp only"),
            ("aeron-spy:aeron:udp?endpoint=h:1|key=k", "key", "holds the stream in plain text"),
            (f"aeron:udp?endpoint=h:1|key=k|mtu={SEALED_MTU_MAX + 32}", "mtu",
             f"at most {SEALED_MTU_MAX}")]:
        with pytest.raises(ChannelError, match=cause) as raised:
            parse_channel(uri)
        assert raised.value.part == key
    assert SEALED_MTU_MAX + SEALED_OVERHEAD <= 65504
    assert parse_channel(f"aeron:udp?endpoint=h:1|key=k|mtu={SEALED_MTU_MAX}").mtu == SEALED_MTU_MAX


#: A getrandom(2) that fails while `ss_test_no_randomness` is set, preloaded into a driver
#: process of its own (the kernel's call, failing as it does without entropy or under seccomp).
NO_RANDOMNESS = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
#include <sys/types.h>
int ss_test_no_randomness = 0;
ssize_t getrandom(void *buffer, size_t length, unsigned int flags) {
    static ssize_t (*real)(void *, size_t, unsigned int);
    if (ss_test_no_randomness) { errno = EIO; return -1; }
    if (real == NULL)
        real = (ssize_t (*)(void *, size_t, unsigned int))dlsym(RTLD_NEXT, "getrandom");
    return real(buffer, length, flags);
}
"""

ROTATE_WITHOUT_RANDOMNESS = """
import ctypes, json, os, sys
from slipstream.client.counters import CountersFile, SystemCounter
from slipstream.client.layout import SEALED_COUNTER_FIELD, SEALED_SENDER_ID_FIELD
from slipstream.daemon._network import lib as network
from slipstream.daemon.media.sealing import Sealing

no_randomness = ctypes.c_int.in_dll(ctypes.CDLL(os.environ["LD_PRELOAD"]), "ss_test_no_randomness")
def header(sealed):
    return (int.from_bytes(sealed[SEALED_SENDER_ID_FIELD:SEALED_SENDER_ID_FIELD + 8], "little"),
            int.from_bytes(sealed[SEALED_COUNTER_FIELD:SEALED_COUNTER_FIELD + 8], "little"))
counters = CountersFile.create(sys.argv[1], 512)
sender = Sealing("test", counters)
sender.set_keys([(1, bytes(range(32)))])
network.ss_crypto_set_counter(sender.c, 1000)
before = header(sender.seal(b"x"))
# Past its lifetime and its next id's: a new id must be drawn, and no randomness comes.
network.ss_crypto_set_clock_offset(sender.c, 3 * network.SS_CRYPTO_SENDER_ID_LIFETIME_S)
no_randomness.value = 1
during = [header(sender.seal(b"x")) for _ in range(3)]
no_randomness.value = 0
after = header(sender.seal(b"x"))
print(json.dumps([before, during, after, counters.get(SystemCounter.CRYPTO_SEAL_REFUSED)]))
"""


def test_a_sender_without_randomness_keeps_its_id_and_counter_never_reuses_a_nonce(
        tmp_path: Path) -> None:
    """A new sender id is due and getrandom fails: the id in use goes on with its counter
    (the same id from 0 again would repeat its nonces under its key), each such seal counted,
    and the next seal with randomness back draws a new id from 0."""
    compiler = shutil.which("cc")
    assert compiler is not None, "a C compiler (make install builds with one)"
    (tmp_path / "no_randomness.c").write_text(NO_RANDOMNESS)
    shim = tmp_path / "no_randomness.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", shim, tmp_path / "no_randomness.c",
                    "-ldl"], check=True)
    run = subprocess.run([sys.executable, "-c", ROTATE_WITHOUT_RANDOMNESS,
                          str(tmp_path / "counters.dat")], check=True,
                         capture_output=True, text=True,
                         env={**os.environ, "LD_PRELOAD": str(shim)})
    before, during, after, refused = json.loads(run.stdout)
    assert refused == 3  # each seal with no new id drawn
    assert before[1] == 1000
    assert during == [[before[0], 1001], [before[0], 1002], [before[0], 1003]]
    assert after[0] != before[0] and after[1] == 0


def test_rotated_keys_reach_the_sealing_and_the_receiving_side_whichever_goes_first() -> None:
    """Each side of an endpoint (the thread that seals, the one that opens and makes INITs)
    takes over its own copy of keys set since: the receiving side's first use leaves the
    sealing side's new key id to it, and the other way round."""
    for opens_first in (True, False):
        endpoint, peer = Sealing("test", None), Sealing("test", None)
        endpoint.set_keys([(1, KEY_A)])
        peer.set_keys([(2, KEY_B), (1, KEY_A)])
        endpoint.seal(b"")  # both sides in use under key 1
        endpoint.set_keys([(2, KEY_B), (1, KEY_A)])
        if opens_first:  # the receiving side: an INIT of the new key for the peer's datagram
            assert endpoint.open(peer.seal(b""), HOST_A) == network.SS_OPEN_AWAITING_HANDSHAKE
        sealed = endpoint.seal(b"")
        assert SEALED_HEADER.unpack_from(sealed)[2] == 2  # the key id byte: the new sealing key
        if not opens_first:
            assert endpoint.open(peer.seal(b""), HOST_A) == network.SS_OPEN_AWAITING_HANDSHAKE
        [(init, _)] = endpoint.take_handshakes()
        assert init[5] == 2  # the INIT under the new sealing key
        assert peer.open(init, HOST_B) == network.SS_OPEN_HANDSHAKE
