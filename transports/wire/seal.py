"""Sealed records: every byte a kvfence connection carries after its handshake.

The handshake (handshake.py) proves the deployment secret both ways over two fresh nonces; both
ends then derive the connection's keys from the secret and those nonces (DeploymentSecret.
session_keys), one per direction, and from then on the byte stream travels only inside records:

    length (4 bytes, big-endian: the plaintext's) | AES-256-GCM ciphertext | tag (16 bytes)

A record's nonce is its sequence number in its direction (4 zero bytes, then 8 bytes big-endian),
counted by both ends and never sent; the length is the associated data. So a record that is
altered, injected, replayed, reordered, dropped, cut short or reflected back to its sender fails
its tag (or, cut short, never completes), and the connection is dropped. A relay that forwarded
the handshake holds neither key: it reads nothing and writes nothing the ends accept.

Records are at most `RECORD_MAX` bytes of plaintext; a longer message spans several. Nothing here
does I/O: `Sealer` and `Opener` turn plaintext into records and back (wire/channel.py moves them).

`Sealer.in_clear()` and `Opener.in_clear()` frame the same records without encrypting or checking
them (a tag of zeros): only for a server whose sealing guard is off (app/serve/guards.py), to measure
what sealing costs.
"""

from __future__ import annotations

import struct
from typing import Self

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvfence.transports.wire.framing import ProtocolError

RECORD_MAX = 256 << 10  # plaintext bytes of one record
HEADER_BYTES = 4
TAG_BYTES = 16
KEY_BYTES = 32  # AES-256
_LEN = struct.Struct(">I")
_NONCE = struct.Struct(">4xQ")
WIRE_MAX = HEADER_BYTES + RECORD_MAX + TAG_BYTES  # bytes of the longest record on the wire


class SealBroken(ProtocolError):
    """A record failed its authentication (altered, injected, replayed, reordered, dropped, or
    sealed with another key): the connection must be dropped."""


def sealed_nbytes(plaintext_nbytes: int) -> int:
    """Bytes on the wire of `plaintext_nbytes` sealed as records of at most RECORD_MAX each."""
    records = max(1, -(-plaintext_nbytes // RECORD_MAX))
    return plaintext_nbytes + records * (HEADER_BYTES + TAG_BYTES)


class _InClear:
    """What stands in for AES-GCM with the sealing guard off: the plaintext as it is, a tag of zeros
    that nobody checks."""

    _TAG = bytes(TAG_BYTES)

    def encrypt_into(self, nonce: bytes, data: bytes | bytearray | memoryview, associated_data: bytes,
                     buf: memoryview) -> int:
        n = len(data)
        buf[:n] = data
        buf[n:n + TAG_BYTES] = self._TAG
        return n + TAG_BYTES

    def decrypt_into(self, nonce: bytes, data: bytes | bytearray | memoryview, associated_data: bytes,
                     buf: memoryview) -> int:
        n = len(data) - TAG_BYTES
        buf[:n] = data[:n]
        return n


class _Direction:
    """One direction of a connection: its key and the number of the next record."""

    __slots__ = ("_aead", "_seq")

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a session key has {KEY_BYTES} bytes, got {len(key)}")
        self._aead: AESGCM | _InClear = AESGCM(key)
        self._seq = 0

    @classmethod
    def in_clear(cls) -> Self:
        """This direction's records unencrypted and unauthenticated: the sealing guard off (app/serve/guards.py)."""
        direction = cls.__new__(cls)
        direction._aead, direction._seq = _InClear(), 0
        return direction


class Sealer(_Direction):
    """One direction's sending half: seals plaintext into records, numbering them."""

    __slots__ = ()

    def seal_into(self, plaintext: bytes | bytearray | memoryview, out: memoryview) -> int:
        """Seal `plaintext` (at most RECORD_MAX bytes) as the next record into the start of `out`;
        the record's length in bytes. `plaintext` is read here, synchronously, and only here."""
        n = len(plaintext)
        if n > RECORD_MAX:
            raise ValueError(f"a record holds at most {RECORD_MAX} bytes, got {n}")
        header = _LEN.pack(n)
        out[:HEADER_BYTES] = header
        k = self._aead.encrypt_into(_NONCE.pack(self._seq), plaintext, header,
                                    out[HEADER_BYTES:HEADER_BYTES + n + TAG_BYTES])
        self._seq += 1
        return HEADER_BYTES + k

    def seal(self, data: bytes | bytearray | memoryview) -> bytearray:
        """All of `data` as consecutive records (one at least, so an empty message is a record too)."""
        view = memoryview(data)
        out = bytearray(sealed_nbytes(len(view)))
        dst = memoryview(out)
        at = 0
        for start in range(0, max(len(view), 1), RECORD_MAX):
            at += self.seal_into(view[start:start + RECORD_MAX], dst[at:])
        return out


class Opener(_Direction):
    """One direction's receiving half: checks and opens records in the order they were sealed."""

    __slots__ = ()

    @property
    def records_opened(self) -> int:
        return self._seq

    @staticmethod
    def body_nbytes(header: bytes | bytearray | memoryview) -> int:
        """Bytes that follow a record's `header` (ciphertext and tag); ProtocolError when the
        header announces more than RECORD_MAX, before anything that long is read."""
        n: int = _LEN.unpack(header)[0]
        if n > RECORD_MAX:
            raise ProtocolError(f"a sealed record of {n} bytes exceeds {RECORD_MAX}")
        return n + TAG_BYTES

    def open_into(self, header: bytes | bytearray | memoryview, body: bytes | bytearray | memoryview,
                  out: memoryview) -> int:
        """Check and decrypt the next record (its `header` and `body`) into the start of `out`;
        the plaintext's length. SealBroken when the record is not the next one this direction's
        key sealed (nothing of it is to be used then)."""
        n = len(body) - TAG_BYTES
        try:
            k = self._aead.decrypt_into(_NONCE.pack(self._seq), body, bytes(header), out[:n])
        except InvalidTag:
            raise SealBroken(f"sealed record {self._seq} failed authentication") from None
        self._seq += 1
        return k
