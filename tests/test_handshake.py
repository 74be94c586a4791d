"""The handshake of encrypted channels (daemon/network_crypto.c through
slipstream.daemon.media.sealing; docs/CHANNELS.md §7.8): Noise_NNpsk0_25519_AESGCM_SHA256
with the channel's key as the pre-shared key.  No sockets: each context's outbox is handed
to the other, losing, repeating, reordering or forging what a test says.

An independent implementation (the ``noiseprotocol`` package, over pyca/cryptography) plays
one end against the C one, so the exchange is Noise's and nothing of its own; and the test
then reads the C endpoint's datagrams with the traffic secret it was given, by
docs/PROTOCOL.md's derivation alone.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from noise.connection import NoiseConnection
from sealed_wire import (
    KEY_A,
    KEY_B,
    NOISE_NAME,
    nonce,
    open_sealed,
    prologue,
    read_captured_answer,
    traffic_key,
)

from slipstream.client.counters import CountersFile, SystemCounter
from slipstream.client.layout import (
    EXT_HEADER,
    EXT_MAGIC,
    EXT_TYPE_HANDSHAKE_ANSWER,
    EXT_TYPE_HANDSHAKE_CONFIRM,
    EXT_TYPE_HANDSHAKE_INIT,
    EXT_TYPE_SEALED,
    EXT_VERSION,
    HANDSHAKE_ANSWER,
    HANDSHAKE_ANSWER_LENGTH,
    HANDSHAKE_CONFIRM_LENGTH,
    HANDSHAKE_INIT,
    HANDSHAKE_INIT_LENGTH,
    HANDSHAKE_INIT_TIMESTAMP_FIELD,
    HDR_TYPE_EXT,
    SEALED_HEADER,
    SEALED_HEADER_LENGTH,
)
from slipstream.daemon._network import lib as network
from slipstream.daemon.media.sealing import Sealing
from slipstream.daemon.protocol.types import sockaddr

KEY_ID = 1
PUBLISHER = sockaddr(("10.0.0.1", 40001))
SUBSCRIBER = sockaddr(("10.0.0.2", 40002))
#: How often an unanswered INIT goes again (network_crypto.c's RETRY_MS), and a little more.
RETRY_S = 0.13
AWAITING = network.SS_OPEN_AWAITING_HANDSHAKE
REFUSED = network.SS_OPEN_HANDSHAKE_REFUSED
TAKEN = network.SS_OPEN_HANDSHAKE


@pytest.fixture
def counters(tmp_path: Path) -> CountersFile:
    return CountersFile.create(tmp_path / "counters.dat", 512)


def endpoint(counters: CountersFile | None = None, key: bytes = KEY_A) -> Sealing:
    sealing = Sealing("k", counters)
    sealing.set_keys([(KEY_ID, key)])
    return sealing


def deliver(source: Sealing, at: bytes, target: Sealing) -> list[int]:
    """Everything in ``source``'s outbox (``source`` at address ``at``) to ``target``: the
    verdicts."""
    return [target.open(datagram, at) for datagram, _ in source.take_handshakes()]


def kind(datagram: bytes) -> int:
    return EXT_HEADER.unpack_from(datagram)[5]


def entries(payload: bytes) -> list[tuple[int, int, bytes]]:
    """A handshake payload's (sender id, the counter its session begins at, secret)s."""
    return [struct.unpack_from("<QQ32s", payload, at) for at in (0, 48)]


def header(length: int, ext_type: int, exchange_id: int) -> bytes:
    return EXT_HEADER.pack(length, 0, KEY_ID, HDR_TYPE_EXT, EXT_MAGIC, ext_type,
                           EXT_VERSION) + struct.pack("<Q", exchange_id)


def test_one_round_trip_gives_each_end_the_others_session(counters) -> None:
    """The subscriber hears the publisher's datagram, asks (INIT); the answer gives it the
    publisher's session, so its next datagram opens; the CONFIRM gives the publisher the
    subscriber's, so its status messages open there with no exchange of their own."""
    publisher, subscriber = endpoint(), endpoint(counters)
    assert subscriber.open(publisher.seal(b"setup"), PUBLISHER) == AWAITING
    [(init, to)] = subscriber.take_handshakes()
    assert to == PUBLISHER and len(init) == HANDSHAKE_INIT_LENGTH == 88
    assert kind(init) == EXT_TYPE_HANDSHAKE_INIT
    assert HANDSHAKE_INIT.unpack_from(init)[8] == 0  # unicast: the peer's sessions, any id
    assert publisher.open(init, SUBSCRIBER) == TAKEN
    [(answer, to)] = publisher.take_handshakes()
    assert to == SUBSCRIBER and len(answer) == HANDSHAKE_ANSWER_LENGTH == 168
    assert subscriber.open(answer, PUBLISHER) == TAKEN
    assert subscriber.open(publisher.seal(b"data"), PUBLISHER) == b"data"
    [(confirm, _)] = subscriber.take_handshakes()
    assert len(confirm) == HANDSHAKE_CONFIRM_LENGTH == 136
    assert publisher.open(confirm, SUBSCRIBER) == TAKEN
    assert publisher.open(subscriber.seal(b"sm"), SUBSCRIBER) == b"sm"
    assert publisher.take_handshakes() == subscriber.take_handshakes() == []
    assert counters.get(SystemCounter.CRYPTO_AWAITING_HANDSHAKE_DROPS) == 1
    assert counters.get(SystemCounter.CRYPTO_HANDSHAKES) == 1


def test_the_exchange_is_noise_nnpsk0_as_an_independent_implementation_makes_it() -> None:
    """The ``noiseprotocol`` package as the initiator (a subscriber), the C endpoint as the
    responder: the C answer reads there, its secrets open the C endpoint's datagrams by the
    documented derivation, and the package's CONFIRM gives the C endpoint a session that
    opens what the test seals with its own secret."""
    publisher = endpoint()
    exchange_id = 0x1122334455667788
    initiator = NoiseConnection.from_name(NOISE_NAME)
    initiator.set_as_initiator()
    initiator.set_psks(psk=KEY_A)
    initiator.set_prologue(prologue(KEY_ID, exchange_id, 0))
    initiator.start_handshake()
    message = initiator.write_message(struct.pack("<Q", int(time.time() * 1000)))  # its clock
    init = header(HANDSHAKE_INIT_LENGTH, EXT_TYPE_HANDSHAKE_INIT, exchange_id) \
        + struct.pack("<Q", 0) + message
    assert publisher.open(init, SUBSCRIBER) == TAKEN
    [(answer, _)] = publisher.take_handshakes()
    payload = initiator.read_message(HANDSHAKE_ANSWER.unpack_from(answer)[8]
                                     + answer[24 + 32:])
    assert initiator.handshake_finished
    (current, floor, secret), (following, next_floor, _) = entries(payload)
    sealed = publisher.seal(b"frames of the stream")
    assert SEALED_HEADER.unpack_from(sealed)[7:9] == (current, floor)
    assert open_sealed(sealed, secret) == b"frames of the stream"
    assert following >> 32 == (current >> 32) + network.SS_CRYPTO_SENDER_ID_LIFETIME_S
    assert next_floor == 0
    # The initiator's own sessions, in Noise's first transport message.
    own_id = (int(time.time()) << 32) | 0xABCDEF
    own_secret = bytes(range(100, 132))
    confirm_payload = struct.pack("<QQ32s", own_id, 7, own_secret) + bytes(48)
    confirm = header(HANDSHAKE_CONFIRM_LENGTH, EXT_TYPE_HANDSHAKE_CONFIRM, exchange_id) \
        + initiator.encrypt(confirm_payload)
    assert publisher.open(confirm, SUBSCRIBER) == TAKEN
    key, iv = traffic_key(own_secret, own_id, 0)
    for counter, verdict in ((7, b"sm"), (6, AWAITING)):  # from 7 on, as the CONFIRM said
        clear = SEALED_HEADER.pack(SEALED_HEADER_LENGTH + 2 + 16, 0, KEY_ID, HDR_TYPE_EXT,
                                   EXT_MAGIC, EXT_TYPE_SEALED, EXT_VERSION, own_id, counter)
        mine = clear + AESGCM(key).encrypt(nonce(iv, counter), b"sm", clear)
        assert publisher.open(mine, SUBSCRIBER) == verdict


def test_an_init_made_without_the_key_gets_no_answer_and_is_counted(counters) -> None:
    publisher, outsider = endpoint(counters), endpoint(key=KEY_B)
    outsider.open(publisher.seal(b"x"), PUBLISHER)
    [(init, _)] = outsider.take_handshakes()
    assert publisher.open(init, SUBSCRIBER) == REFUSED
    assert publisher.take_handshakes() == []
    assert counters.get(SystemCounter.CRYPTO_HANDSHAKE_FAILED_DROPS) == 1
    assert counters.get(SystemCounter.CRYPTO_HANDSHAKES) == 0


def test_a_replayed_init_gets_the_same_answer_which_opens_nowhere_else(counters) -> None:
    """An INIT again (its answer lost, or a recording): the same answer bytes, at most once
    per 50 ms, which only the holder of the INIT's ephemeral key reads: an endpoint with the
    key that did not send the INIT (a restarted subscriber) counts it as unmatched, and a
    holder of the key cannot read the payload with an ephemeral key of its own."""
    publisher, subscriber = endpoint(counters), endpoint()
    subscriber.open(publisher.seal(b"x"), PUBLISHER)
    [(init, _)] = subscriber.take_handshakes()
    publisher.open(init, SUBSCRIBER)
    [(answer, _)] = publisher.take_handshakes()
    assert publisher.open(init, SUBSCRIBER) == REFUSED  # within 50 ms: limited
    assert counters.get(SystemCounter.CRYPTO_HANDSHAKE_LIMITED_DROPS) == 1
    time.sleep(0.06)
    assert publisher.open(init, SUBSCRIBER) == TAKEN
    [(again, _)] = publisher.take_handshakes()
    assert again == answer
    restarted = endpoint(counters)
    assert restarted.open(answer, PUBLISHER) == REFUSED
    assert counters.get(SystemCounter.CRYPTO_HANDSHAKE_UNMATCHED_DROPS) == 1
    thief = NoiseConnection.from_name(NOISE_NAME)
    thief.set_as_initiator()
    thief.set_psks(psk=KEY_A)
    thief.set_prologue(prologue(KEY_ID, struct.unpack_from("<Q", init, 16)[0], 0))
    thief.start_handshake()
    thief.write_message(b"")
    with pytest.raises(InvalidTag):
        thief.read_message(answer[24:])
    assert subscriber.open(answer, PUBLISHER) == TAKEN  # its own initiator still can


@pytest.mark.parametrize("lost", ["init", "answer", "confirm"])
def test_a_lost_handshake_datagram_is_recovered_by_the_exchange_itself(lost: str) -> None:
    """INIT lost: the publisher's next datagram, a retry interval on, sends it again (the
    same bytes). ANSWER lost: likewise, and the repeated INIT gets the same answer. CONFIRM
    lost: the publisher, hearing the subscriber, asks for its session itself."""
    publisher, subscriber = endpoint(), endpoint()
    assert subscriber.open(publisher.seal(b"1"), PUBLISHER) == AWAITING
    [(init, _)] = subscriber.take_handshakes()
    if lost != "init":
        assert publisher.open(init, SUBSCRIBER) == TAKEN
        [(answer, _)] = publisher.take_handshakes()
        if lost == "confirm":
            assert subscriber.open(answer, PUBLISHER) == TAKEN
            subscriber.take_handshakes()  # the CONFIRM, lost
            assert subscriber.open(publisher.seal(b"2"), PUBLISHER) == b"2"
            assert publisher.open(subscriber.seal(b"sm"), SUBSCRIBER) == AWAITING
            deliver(publisher, PUBLISHER, subscriber)  # its own INIT
            deliver(subscriber, SUBSCRIBER, publisher)  # the answer
            deliver(publisher, PUBLISHER, subscriber)  # its CONFIRM
            assert publisher.open(subscriber.seal(b"sm"), SUBSCRIBER) == b"sm"
            return
    assert subscriber.open(publisher.seal(b"2"), PUBLISHER) == AWAITING
    assert subscriber.take_handshakes() == []  # not before the retry interval
    time.sleep(RETRY_S)
    assert subscriber.open(publisher.seal(b"3"), PUBLISHER) == AWAITING
    [(retry, _)] = subscriber.take_handshakes()
    assert retry == init
    assert publisher.open(retry, SUBSCRIBER) == TAKEN
    [(answer_again, _)] = publisher.take_handshakes()
    if lost == "answer":
        assert answer_again == answer
    assert subscriber.open(answer_again, PUBLISHER) == TAKEN
    assert subscriber.open(publisher.seal(b"4"), PUBLISHER) == b"4"


def test_a_repeated_or_reordered_answer_changes_nothing(counters) -> None:
    publisher, subscriber = endpoint(), endpoint(counters)
    subscriber.open(publisher.seal(b"1"), PUBLISHER)
    deliver(subscriber, SUBSCRIBER, publisher)
    [(answer, _)] = publisher.take_handshakes()
    assert subscriber.open(answer, PUBLISHER) == TAKEN
    assert subscriber.open(answer, PUBLISHER) == REFUSED
    assert counters.get(SystemCounter.CRYPTO_HANDSHAKE_UNMATCHED_DROPS) == 1
    assert counters.get(SystemCounter.CRYPTO_HANDSHAKES) == 1
    assert subscriber.open(publisher.seal(b"2"), PUBLISHER) == b"2"


def test_a_capture_replayed_to_a_restarted_receiver_opens_nothing_and_is_counted(
        counters) -> None:
    """Everything on the wire from the publisher, handshakes included, recorded; the
    subscriber restarts (a new context with the same key) and gets the recording: nothing
    opens, each datagram counted.  Its own exchange with the live publisher begins its
    session past the recording, so the recording again opens nothing either."""
    publisher, subscriber = endpoint(), endpoint()
    wire = [publisher.seal(b"setup")]
    subscriber.open(wire[0], PUBLISHER)
    deliver(subscriber, SUBSCRIBER, publisher)
    for datagram, _ in publisher.take_handshakes():
        wire.append(datagram)
        subscriber.open(datagram, PUBLISHER)
    deliver(subscriber, SUBSCRIBER, publisher)
    for i in range(200):
        wire.append(publisher.seal(b"message %d" % i))
        assert subscriber.open(wire[-1], PUBLISHER) == b"message %d" % i
    restarted = endpoint(counters)
    verdicts = [restarted.open(datagram, PUBLISHER) for datagram in wire]
    assert verdicts == [AWAITING] + [REFUSED] + [AWAITING] * 200
    assert counters.get(SystemCounter.CRYPTO_AWAITING_HANDSHAKE_DROPS) == 201
    assert counters.get(SystemCounter.CRYPTO_HANDSHAKE_UNMATCHED_DROPS) == 1
    time.sleep(0.06)  # a restart takes longer than the answers' 50 ms per source
    deliver(restarted, SUBSCRIBER, publisher)  # its INIT reached the live publisher
    deliver(publisher, PUBLISHER, restarted)
    assert counters.get(SystemCounter.CRYPTO_HANDSHAKES) == 1
    assert all(restarted.open(datagram, PUBLISHER) == AWAITING for datagram in wire[2:])
    assert restarted.open(publisher.seal(b"live"), PUBLISHER) == b"live"


def test_the_key_and_a_capture_open_nothing_once_the_sessions_are_gone() -> None:
    """Forward secrecy: the test holds the channel's key and everything on the wire, and
    tries what any holder of the key can: the derivation from the key alone (no traffic
    secret is derived from it), and the handshake's keys from the key and the INIT (the
    ANSWER needs an ephemeral private key no capture holds).  Neither opens a datagram."""
    publisher, subscriber = endpoint(), endpoint()
    wire = [publisher.seal(b"setup")]
    subscriber.open(wire[0], PUBLISHER)
    [(init, _)] = subscriber.take_handshakes()
    wire.append(init)
    publisher.open(init, SUBSCRIBER)
    [(answer, _)] = publisher.take_handshakes()
    wire.append(answer)
    subscriber.open(answer, PUBLISHER)
    secret_message = b"the payload no one else reads"
    sealed = publisher.seal(secret_message)
    assert subscriber.open(sealed, PUBLISHER) == secret_message
    for ikm in (KEY_A, init[32:64], answer[24:56]):  # the key, either ephemeral public key
        with pytest.raises(InvalidTag):
            open_sealed(sealed, ikm)
    with pytest.raises(InvalidTag):
        read_captured_answer(KEY_A, init, answer)
    assert secret_message not in b"".join([*wire, sealed])


def test_a_sender_moving_to_its_next_id_loses_nothing_and_renews(counters) -> None:
    """A sender id's lifetime ends: the sender seals under the next one, which the
    subscriber got in the handshake, so it opens at once; the subscriber then exchanges
    again (a renewal), so it holds the one after that too, before it is used."""
    publisher, subscriber = endpoint(), endpoint(counters)
    subscriber.open(publisher.seal(b"1"), PUBLISHER)
    deliver(subscriber, SUBSCRIBER, publisher)
    deliver(publisher, PUBLISHER, subscriber)
    deliver(subscriber, SUBSCRIBER, publisher)
    lifetime = network.SS_CRYPTO_SENDER_ID_LIFETIME_S
    for step in (1, 2):
        for context in (publisher, subscriber):
            network.ss_crypto_set_clock_offset(context.c, step * lifetime)
        assert subscriber.open(publisher.seal(b"moved"), PUBLISHER) == b"moved"
        verdicts = deliver(subscriber, SUBSCRIBER, publisher)  # the renewal's INIT
        assert verdicts == [TAKEN]
        deliver(publisher, PUBLISHER, subscriber)
        deliver(subscriber, SUBSCRIBER, publisher)
    assert counters.get(SystemCounter.CRYPTO_AWAITING_HANDSHAKE_DROPS) == 1  # the first only
    assert counters.get(SystemCounter.CRYPTO_HANDSHAKES) == 3


def test_a_multicast_sender_asks_one_receiver_and_others_refuse(counters) -> None:
    """On a multicast group every receiver hears the sender's INIT: it names the receiver's
    sender id, and only that receiver answers."""
    publisher, wanted, other = endpoint(), endpoint(), endpoint(counters)
    publisher.set_handshake_address(sockaddr(("224.0.1.1", 40001)))
    assert publisher.open(wanted.seal(b"sm"), SUBSCRIBER) == AWAITING
    [(init, to)] = publisher.take_handshakes()
    assert to == sockaddr(("224.0.1.1", 40001))
    assert HANDSHAKE_INIT.unpack_from(init)[8] == SEALED_HEADER.unpack_from(wanted.seal(b""))[7]
    assert other.open(init, PUBLISHER) == REFUSED
    assert counters.get(SystemCounter.CRYPTO_HANDSHAKE_UNMATCHED_DROPS) == 1
    assert wanted.open(init, PUBLISHER) == TAKEN
    deliver(wanted, SUBSCRIBER, publisher)
    assert publisher.open(wanted.seal(b"sm"), SUBSCRIBER) == b"sm"


@settings(max_examples=400, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_mangled_handshake_datagrams_are_dropped_counted_and_harmless(counters, data) -> None:
    """Any change to a real INIT, ANSWER or CONFIRM (a flipped bit, a cut, bytes added) or
    random bytes under a handshake header: refused and counted, no session made; the real
    exchange completes after."""
    publisher, subscriber = endpoint(counters), endpoint(counters)
    subscriber.open(publisher.seal(b"x"), PUBLISHER)
    [(init, _)] = subscriber.take_handshakes()
    assert publisher.open(init, SUBSCRIBER) == TAKEN
    [(answer, _)] = publisher.take_handshakes()
    which = data.draw(st.sampled_from(["init", "answer", "random"]))
    original = {"init": init, "answer": answer}.get(which)
    if original is None:
        ext_type = data.draw(st.sampled_from([EXT_TYPE_HANDSHAKE_INIT,
                                              EXT_TYPE_HANDSHAKE_ANSWER,
                                              EXT_TYPE_HANDSHAKE_CONFIRM]))
        length = data.draw(st.integers(0, 300))
        mangled = EXT_HEADER.pack(16 + length, 0, KEY_ID, HDR_TYPE_EXT, EXT_MAGIC, ext_type,
                                  EXT_VERSION) + data.draw(st.binary(min_size=length,
                                                                     max_size=length))
    else:
        changed = bytearray(original)
        how = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
        if how == "flip":
            changed[data.draw(st.integers(0, len(changed) - 1))] ^= data.draw(st.integers(1, 255))
        elif how == "truncate":
            del changed[data.draw(st.integers(0, len(changed) - 1)):]
        else:
            changed += data.draw(st.binary(min_size=1, max_size=64))
        mangled = bytes(changed)
    before = sum(counters.get(c) for c in SystemCounter if "CRYPTO" in c.name
                 and "HANDSHAKES" not in c.name)
    target, at = (subscriber, PUBLISHER) if which == "answer" else (publisher, SUBSCRIBER)
    verdict = target.open(mangled, at)
    if verdict == TAKEN:
        pytest.fail(f"a mangled {which} was taken")
    assert verdict < 0
    assert sum(counters.get(c) for c in SystemCounter if "CRYPTO" in c.name
               and "HANDSHAKES" not in c.name) == before + 1
    assert target.take_handshakes() == []
    assert subscriber.open(answer, PUBLISHER) == TAKEN
    deliver(subscriber, SUBSCRIBER, publisher)
    assert subscriber.open(publisher.seal(b"y"), PUBLISHER) == b"y"
    assert publisher.open(subscriber.seal(b"z"), SUBSCRIBER) == b"z"


def test_only_the_same_init_again_gets_the_answer_again(counters) -> None:
    """An INIT answered, then one that differs from it in any byte (its sealed timestamp or
    tag too, where a repeat matched on the exchange id and ephemeral key alone would still
    pass) once the answer may be sent again: no answer, nothing taken; the same bytes again
    get the same answer.  The responder's clock is moved a second on, past the 50 ms an
    answer waits before it goes again, so no rate limit refuses first."""
    publisher, subscriber = endpoint(counters), endpoint()
    subscriber.open(publisher.seal(b"x"), PUBLISHER)
    [(init, _)] = subscriber.take_handshakes()
    assert publisher.open(init, SUBSCRIBER) == TAKEN
    [(answer, _)] = publisher.take_handshakes()
    network.ss_crypto_set_clock_offset(publisher.c, 1)
    sealed_timestamp = range(HANDSHAKE_INIT_TIMESTAMP_FIELD, HANDSHAKE_INIT_LENGTH)
    for at in range(HANDSHAKE_INIT_LENGTH):
        changed = bytearray(init)
        changed[at] ^= 0x01
        failed = counters.get(SystemCounter.CRYPTO_HANDSHAKE_FAILED_DROPS)
        assert publisher.open(bytes(changed), SUBSCRIBER) != TAKEN, f"byte {at} flipped"
        assert publisher.take_handshakes() == []
        if at in sealed_timestamp:  # verified, as any new INIT is, and its tag fails
            assert counters.get(SystemCounter.CRYPTO_HANDSHAKE_FAILED_DROPS) == failed + 1
    assert publisher.open(init, SUBSCRIBER) == TAKEN
    assert publisher.take_handshakes() == [(answer, SUBSCRIBER)]


def test_an_endpoint_answers_at_most_64_new_exchanges_a_second(counters) -> None:
    """Each answer costs an X25519 key and agreement: recorded INITs replayed from many
    spoofed sources, or a crowd of new receivers, get 64 answers a second (and 32 kept at
    once, each for 50 ms at least), the rest counted (and asked again by their initiators'
    retries)."""
    publisher = endpoint(counters)
    inits = []
    for i in range(80):
        receiver = endpoint()
        receiver.open(publisher.seal(b"x"), PUBLISHER)
        [(init, _)] = receiver.take_handshakes()
        inits.append((init, sockaddr((f"10.0.1.{i + 1}", 40000))))
    second = int(time.monotonic())
    while int(time.monotonic()) != second + 1:  # all within one second of the clock
        time.sleep(0.005)
    time.sleep(0.02)  # past the second's start on the C side's coarse clock too
    verdicts, answers = [], []
    for batch in range(3):  # its 32 answer slots are taken again after 50 ms
        for init, source in inits[32 * batch:][:32]:
            verdicts.append(publisher.open(init, source))
            answers += publisher.take_handshakes()  # sent at once, as the data path does
        time.sleep(0.06)
    assert verdicts.count(TAKEN) == 64 and verdicts.count(REFUSED) == 16
    assert counters.get(SystemCounter.CRYPTO_HANDSHAKE_LIMITED_DROPS) == 16
    assert len(answers) == 64


def test_a_multicast_receiver_flooded_with_forged_ids_still_gets_its_session(counters) -> None:
    """A host spoofing the publication's address sends sealed datagrams under ids of its own
    to a multicast group: the receiver's INIT names one, the publication refuses it; once
    that exchange runs out of tries, the next asks for any session of the source, and the
    publication's answer gives the receiver its real session."""
    publisher, receiver = endpoint(), endpoint()
    receiver.set_handshake_address(sockaddr(("224.0.1.2", 40001)))  # its control group
    forger = endpoint(key=KEY_B)

    def forged() -> int:
        return receiver.open(forger.seal(b"forged"), PUBLISHER)

    assert forged() == AWAITING
    [(init, _)] = receiver.take_handshakes()
    assert HANDSHAKE_INIT.unpack_from(init)[8] != 0  # the forged id, named
    assert publisher.open(init, SUBSCRIBER) == REFUSED
    tries, started = 1, time.monotonic()
    while True:  # its tries, each time the flood goes on, then a new exchange
        time.sleep(RETRY_S)
        assert forged() == AWAITING
        sent = receiver.take_handshakes()
        if sent and sent[0][0] != init:
            break
        for again, _ in sent:
            tries += 1
            assert publisher.open(again, SUBSCRIBER) == REFUSED
        assert time.monotonic() < started + 10
    assert tries == 20  # network_crypto.c's RETRIES_MAX
    [(init, _)] = sent
    assert HANDSHAKE_INIT.unpack_from(init)[8] == 0  # any session of the source
    assert publisher.open(init, SUBSCRIBER) == TAKEN
    deliver(publisher, PUBLISHER, receiver)
    assert receiver.open(publisher.seal(b"real"), PUBLISHER) == b"real"


def test_forged_datagrams_from_more_sources_than_slots_delay_no_real_session(counters) -> None:
    """An outsider (no key) sends one sealed datagram from each of 33 sources, more than the
    32 exchanges an endpoint keeps: each takes a slot, the 33rd evicts the oldest, counted.
    The real publisher's next datagram still starts an exchange at once (the oldest waiting
    one gives way), and its session follows."""
    publisher, subscriber = endpoint(), endpoint(counters)
    forger = endpoint(key=KEY_B)
    for port in range(33):
        assert subscriber.open(forger.seal(b"forged"), sockaddr(("10.0.9.9", 50000 + port))) \
            == AWAITING
        assert len(subscriber.take_handshakes()) == 1  # each source asked once
    assert counters.get(SystemCounter.CRYPTO_HANDSHAKE_LIMITED_DROPS) == 1
    assert subscriber.open(publisher.seal(b"setup"), PUBLISHER) == AWAITING
    assert counters.get(SystemCounter.CRYPTO_HANDSHAKE_LIMITED_DROPS) == 2
    [(init, to)] = subscriber.take_handshakes()
    assert to == PUBLISHER and kind(init) == EXT_TYPE_HANDSHAKE_INIT
    assert publisher.open(init, SUBSCRIBER) == TAKEN
    assert deliver(publisher, PUBLISHER, subscriber) == [TAKEN]
    assert subscriber.open(publisher.seal(b"data"), PUBLISHER) == b"data"


def test_an_idle_endpoint_forgets_its_peers_and_its_own_secrets_on_its_tick() -> None:
    """With no datagram arriving or sent, the duty cycle's tick still erases a peer's
    session once its id is past its age, and moves the endpoint off its own id once that is
    past its lifetime: forward secrecy does not wait for traffic."""
    publisher, subscriber = endpoint(), endpoint()
    assert subscriber.open(publisher.seal(b"setup"), PUBLISHER) == AWAITING
    assert deliver(subscriber, SUBSCRIBER, publisher) == [TAKEN]
    assert deliver(publisher, PUBLISHER, subscriber) == [TAKEN]
    own = network.ss_crypto_sender_id(subscriber.c)
    held = publisher.seal(b"held")  # sealed now, opened after the idle spell
    max_age = network.SS_CRYPTO_SENDER_ID_MAX_AGE_S
    network.ss_crypto_set_clock_offset(subscriber.c, max_age - 1)
    network.ss_crypto_tick(subscriber.c)  # the publisher's ids are still within their age
    network.ss_crypto_set_clock_offset(subscriber.c, 0)
    assert subscriber.open(held, PUBLISHER) == b"held"
    network.ss_crypto_set_clock_offset(subscriber.c, max_age + 2)
    network.ss_crypto_tick(subscriber.c)  # idle past the age of both its ids: forgotten
    assert network.ss_crypto_sender_id(subscriber.c) != own  # its own id moved on
    network.ss_crypto_set_clock_offset(subscriber.c, 0)
    assert subscriber.open(publisher.seal(b"after"), PUBLISHER) == AWAITING


def test_an_endpoint_starts_at_most_64_new_exchanges_a_second(counters) -> None:
    """Each exchange an endpoint starts costs it an X25519 key before anything is verified:
    sealed datagrams of new ids from 80 spoofed sources within one second start 64, the rest
    counted; the next second starts exchanges again."""
    subscriber, forger = endpoint(counters), endpoint(key=KEY_B)
    second = int(time.monotonic())
    while int(time.monotonic()) != second + 1:  # all within one second of the clock
        time.sleep(0.005)
    time.sleep(0.02)  # past the second's start on the C side's coarse clock too
    inits = 0
    for i in range(80):
        source = sockaddr((f"10.0.{2 + i // 250}.{1 + i % 250}", 40000))
        assert subscriber.open(forger.seal(b"forged"), source) == AWAITING
        inits += len(subscriber.take_handshakes())
    assert inits == 64
    # The 48 past the 32 kept exchanges each took the oldest's place; the last 16 were refused.
    limited = counters.get(SystemCounter.CRYPTO_HANDSHAKE_LIMITED_DROPS)
    assert limited == 16 + (80 - 32)
    while int(time.monotonic()) == second + 1:
        time.sleep(0.01)
    time.sleep(0.02)
    assert subscriber.open(forger.seal(b"forged"), sockaddr(("10.0.9.1", 40000))) == AWAITING
    assert len(subscriber.take_handshakes()) == 1


def test_a_recorded_init_is_answered_once_and_a_stale_one_never(counters) -> None:
    """An INIT carries its initiator's clock, sealed under the key: replayed after its answer
    is gone (5 s, the clock driven), it is refused, its ephemeral key remembered while its
    time is within the skew allowed; an INIT older than that skew is refused unanswered."""
    publisher, subscriber = endpoint(counters), endpoint()
    assert subscriber.open(publisher.seal(b"setup"), PUBLISHER) == AWAITING
    [(init, _)] = subscriber.take_handshakes()
    assert publisher.open(init, SUBSCRIBER) == TAKEN
    assert len(publisher.take_handshakes()) == 1
    network.ss_crypto_set_clock_offset(publisher.c, 6)  # its answer forgotten (kept 5 s)
    assert publisher.open(publisher.seal(b"sweep"), PUBLISHER) == AWAITING  # a sweep runs
    publisher.take_handshakes()
    assert publisher.open(init, sockaddr(("10.0.0.9", 40009))) == REFUSED  # replayed
    assert publisher.take_handshakes() == []
    assert counters.get(SystemCounter.CRYPTO_HANDSHAKE_UNMATCHED_DROPS) == 1
    network.ss_crypto_set_clock_offset(publisher.c, 0)
    late = endpoint()
    assert late.open(publisher.seal(b"setup"), PUBLISHER) == AWAITING
    [(stale, _)] = late.take_handshakes()  # never delivered, until the skew has passed
    network.ss_crypto_set_clock_offset(publisher.c, network.SS_CRYPTO_CLOCK_SKEW_S + 1)
    assert publisher.open(stale, sockaddr(("10.0.0.8", 40008))) == REFUSED
    assert publisher.take_handshakes() == []
    assert counters.get(SystemCounter.CRYPTO_HANDSHAKE_UNMATCHED_DROPS) == 2
