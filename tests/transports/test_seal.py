"""Sealed records (transports/wire/seal.py) and the session keys they use: what one end seals
the other opens, in order, and nothing else: an altered, injected, replayed, reordered, dropped or
reflected record, or one sealed under another handshake or another deployment, fails."""

from __future__ import annotations

import os

import pytest
from transport_harness import TEST_SECRET

from kvfence.transports.core.secret import EPHEMERAL_BYTES, PART_BYTES, DeploymentSecret
from kvfence.transports.wire.framing import ProtocolError
from kvfence.transports.wire.seal import HEADER_BYTES, RECORD_MAX, TAG_BYTES, Opener, SealBroken, Sealer, sealed_nbytes

NONCES = (os.urandom(PART_BYTES), os.urandom(PART_BYTES))  # each side's nonce and ephemeral key
SHARED = os.urandom(EPHEMERAL_BYTES)  # their X25519 secret


def records(wire: bytes) -> list[bytes]:
    out = []
    while wire:
        n = HEADER_BYTES + Opener.body_nbytes(wire[:HEADER_BYTES])
        out.append(wire[:n])
        wire = wire[n:]
    return out


def open_all(opener: Opener, recs: list[bytes]) -> bytes:
    plain = b""
    for rec in recs:
        out = bytearray(len(rec))
        n = opener.open_into(rec[:HEADER_BYTES], rec[HEADER_BYTES:], memoryview(out))
        plain += bytes(out[:n])
    return plain


def pair(secret: DeploymentSecret = TEST_SECRET) -> tuple[Sealer, Opener]:
    to_listener, _ = secret.session_keys("tcp", *NONCES, SHARED)
    return Sealer(to_listener), Opener(to_listener)


@pytest.mark.parametrize("nbytes", [0, 1, 4095, RECORD_MAX, RECORD_MAX + 1, 3 * RECORD_MAX + 5])
def test_what_is_sealed_opens_to_the_same_bytes_in_records_of_bounded_size(nbytes: int) -> None:
    sealer, opener = pair()
    data = os.urandom(nbytes)
    wire = bytes(sealer.seal(data))
    assert len(wire) == sealed_nbytes(nbytes)
    recs = records(wire)
    assert all(len(r) <= HEADER_BYTES + RECORD_MAX + TAG_BYTES for r in recs)
    assert data[:64] not in wire or nbytes < 16  # ciphertext, not the plaintext
    assert open_all(opener, recs) == data


def message_records() -> list[bytes]:
    sealer, _ = pair()
    return [bytes(sealer.seal(f"message {i}".encode() * 50)) for i in range(4)]


def shorter(record: bytes) -> bytes:
    """The record with its length field one less and its last byte gone."""
    return (int.from_bytes(record[:4], "big") - 1).to_bytes(4, "big") + record[4:-1]


TAMPERED = {
    "flip a ciphertext bit": lambda r: [r[0], r[1][:9] + bytes([r[1][9] ^ 1]) + r[1][10:], *r[2:]],
    "flip a tag bit": lambda r: [r[0], r[1][:-1] + bytes([r[1][-1] ^ 0x80]), *r[2:]],
    "change the length": lambda r: [r[0], shorter(r[1]), *r[2:]],
    "inject a record": lambda r: [r[0], bytes(Sealer(os.urandom(32)).seal(b"injected")), *r[1:]],
    "replay a record": lambda r: [r[0], r[0], *r[1:]],
    "reorder two records": lambda r: [r[0], r[2], r[1], *r[3:]],
    "drop a record": lambda r: [r[0], *r[2:]],
}


@pytest.mark.parametrize("change", TAMPERED)
def test_a_changed_stream_of_records_fails_at_the_first_change(change: str) -> None:
    _, opener = pair()
    recs = TAMPERED[change](message_records())
    assert open_all(opener, recs[:1]) == b"message 0" * 50  # what came before still opens
    with pytest.raises(SealBroken, match="record 1 failed authentication"):
        open_all(opener, recs[1:])


def test_a_record_reflected_back_or_sealed_by_a_stranger_does_not_open() -> None:
    to_listener, to_connector = TEST_SECRET.session_keys("tcp", *NONCES, SHARED)
    record = bytes(Sealer(to_listener).seal(b"hello"))
    with pytest.raises(SealBroken):  # the connector's own record, sent back to it
        open_all(Opener(to_connector), [record])
    stranger, _ = pair(DeploymentSecret.generate())
    with pytest.raises(SealBroken):
        open_all(Opener(to_listener), [bytes(stranger.seal(b"hello"))])


def test_an_announced_length_past_the_bound_is_refused_before_it_is_read() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        Opener.body_nbytes((RECORD_MAX + 1).to_bytes(4, "big"))


def test_session_keys_are_per_direction_and_bound_to_both_contributions_the_shared_secret_label_and_secret() -> None:
    base = TEST_SECRET.session_keys("tcp", *NONCES, SHARED)
    assert base[0] != base[1] and all(len(k) == 32 for k in base)
    assert base == TEST_SECRET.session_keys("tcp", *NONCES, SHARED)  # both ends derive the same
    others = [TEST_SECRET.session_keys("tcp", os.urandom(PART_BYTES), NONCES[1], SHARED),
              TEST_SECRET.session_keys("tcp", NONCES[0], os.urandom(PART_BYTES), SHARED),
              TEST_SECRET.session_keys("tcp", *NONCES, os.urandom(EPHEMERAL_BYTES)),  # without the ephemeral secret
              TEST_SECRET.session_keys("control", *NONCES, SHARED),
              TEST_SECRET.session_keys("tcp", NONCES[1], NONCES[0], SHARED),
              DeploymentSecret.generate().session_keys("tcp", *NONCES, SHARED)]
    keys = {k for pair_ in [base, *others] for k in pair_}
    assert len(keys) == 2 * (1 + len(others))
    with pytest.raises(ValueError, match="contributes"):
        TEST_SECRET.session_keys("tcp", b"short", NONCES[1], SHARED)
