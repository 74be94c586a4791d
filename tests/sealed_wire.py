"""What anyone holding a piece of an encrypted channel can do with its datagrams, done by
the tests themselves from docs/CHANNELS.md §7.8 and independent libraries (pyca/cryptography,
the ``noiseprotocol`` package), not through the driver's C: open a sealed datagram with its
sender's traffic secret, and play one end of the handshake; and the tests' keys.  Shared by
the tests of encrypted channels."""

from __future__ import annotations

import struct

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from noise.connection import NoiseConnection

from slipstream.client.layout import (
    EXT_HEADER,
    EXT_TYPE_SEALED,
    HANDSHAKE_ANSWER_EPHEMERAL_FIELD,
    HANDSHAKE_INIT_EPHEMERAL_FIELD,
    SEALED_EPOCH_BITS,
    SEALED_HEADER,
    SEALED_HEADER_LENGTH,
)

NOISE_NAME = b"Noise_NNpsk0_25519_AESGCM_SHA256"
#: Two keys of the tests' encrypted channels (32 bytes each): neither opens what the other sealed.
KEY_A = bytes(range(32))
KEY_B = bytes(range(100, 132))


def ext_type(datagram: bytes) -> int:
    """A slipstream extension datagram's type (3 sealed, 4-6 the handshake's)."""
    return EXT_HEADER.unpack_from(datagram)[5]


def prologue(key_id: int, exchange_id: int, asked: int) -> bytes:
    """The handshake's Noise prologue: the INIT's clear fields."""
    return b"slipstream handshake v1" + bytes([key_id]) + struct.pack("<QQ", exchange_id, asked)


def traffic_key(secret: bytes, sender_id: int, epoch: int) -> tuple[bytes, bytes]:
    """A sender's AEAD key and IV for an epoch, from its traffic secret."""
    out = HKDF(hashes.SHA256(), 44, struct.pack("<QQ", sender_id, epoch),
               b"slipstream sealed datagram v2").derive(secret)
    return out[:32], out[32:]


def nonce(iv: bytes, counter: int) -> bytes:
    """A sealed datagram's nonce: the IV XOR the counter, big-endian in its last 8 bytes."""
    return bytes(a ^ b for a, b in zip(iv, bytes(4) + counter.to_bytes(8, "big"), strict=True))


def open_sealed(sealed: bytes, secret: bytes) -> bytes:
    """A sealed datagram opened with ``secret`` taken as its sender's traffic secret
    (cryptography's InvalidTag when it is not)."""
    assert ext_type(sealed) == EXT_TYPE_SEALED
    sender_id, counter = SEALED_HEADER.unpack_from(sealed)[7:9]
    key, iv = traffic_key(secret, sender_id, counter >> SEALED_EPOCH_BITS)
    return AESGCM(key).decrypt(nonce(iv, counter), sealed[SEALED_HEADER_LENGTH:],
                               sealed[:SEALED_HEADER_LENGTH])


def initiator(psk: bytes, key_id: int, exchange_id: int, asked: int = 0) -> NoiseConnection:
    """A Noise initiator holding the channel's key, its INIT's message written."""
    noise = NoiseConnection.from_name(NOISE_NAME)
    noise.set_as_initiator()
    noise.set_psks(psk=psk)
    noise.set_prologue(prologue(key_id, exchange_id, asked))
    noise.start_handshake()
    noise.write_message(b"")
    return noise


def read_captured_answer(psk: bytes, init: bytes, answer: bytes) -> bytes:
    """What a holder of the key gets from a captured INIT and its ANSWER: it reads the INIT
    (its tag is the key's) as a responder would, then tries the ANSWER as the initiator with
    an ephemeral key of its own (the INIT's private half is in no capture).  Raises
    cryptography's InvalidTag: the answer's payload needs that private half."""
    key_id = EXT_HEADER.unpack_from(init)[2]
    exchange_id, asked = struct.unpack_from("<QQ", init, 16)
    responder = NoiseConnection.from_name(NOISE_NAME)
    responder.set_as_responder()
    responder.set_psks(psk=psk)
    responder.set_prologue(prologue(key_id, exchange_id, asked))
    responder.start_handshake()
    responder.read_message(init[HANDSHAKE_INIT_EPHEMERAL_FIELD:])  # the key's tag verifies
    return initiator(psk, key_id, exchange_id, asked).read_message(
        answer[HANDSHAKE_ANSWER_EPHEMERAL_FIELD:])
