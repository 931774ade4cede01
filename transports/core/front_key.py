"""The front end's signing key: the one credential workers do not hold.

Every process of a deployment holds the deployment secret (core/secret.py): it authenticates peers,
seals connections and signs registrations, so any holder can act as a member. What only a front end
may do is signed with an Ed25519 key that only front ends hold (`--front-key-file`); workers hold
its public half (`--front-public-key-file`) and verify:

- capabilities: a push's capability is the front end's signature over what the push may do (the
  transfer id, the destination lease and pages, the token and page counts, the nonce and the
  receiver's incarnation), minted where the transfer is planned (scheduler/transfer.py) and checked
  by the receiver before it arms the transfer and before it admits the push
  (transports/core/receiver_state.py). A worker host can verify one but cannot make one.
- control connections: the front end signs the control handshake's transcript (both nonces, both
  ephemeral keys: transports/wire/handshake.py), so a worker takes steps only from a holder of
  the private key.

Each use signs under its own label, so a signature made for one is never valid for the other. When
both workers live in the front end's process, a fresh key is generated per process.
"""

from __future__ import annotations

import array
import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvfence.transports.base import TransferManifest

log = logging.getLogger(__name__)

SIGNATURE_BYTES = 64  # Ed25519
CAPABILITY_LABEL = b"kvfence push capability v2\0"
CONTROL_LABEL = b"kvfence front end control v1\0"


def capability_message(manifest: TransferManifest, dst_pages: Sequence[int], receiver_incarnation: str) -> bytes:
    """What a capability signs. OverflowError or TypeError for pages no planner could name."""
    fields = "\0".join((manifest.transfer_id, manifest.lease, manifest.nonce, receiver_incarnation,
                        str(manifest.num_tokens), str(manifest.num_pages), ""))
    return CAPABILITY_LABEL + fields.encode() + array.array("q", dst_pages).tobytes()


def _read(path: str | os.PathLike[str], flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None


class FrontPublicKey:
    """What a worker holds: verifies the front end's signatures."""

    __slots__ = ("_key",)

    def __init__(self, key: Ed25519PublicKey) -> None:
        self._key = key

    def __repr__(self) -> str:
        return f"FrontPublicKey({self.fingerprint})"

    @property
    def fingerprint(self) -> str:
        """The key's first 8 bytes in hex, for logs and `kvfence front-key`."""
        return self.raw()[:8].hex()

    def raw(self) -> bytes:
        return self._key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def pem(self) -> bytes:
        return self._key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> FrontPublicKey:
        """The public key in PEM file `path`; ValueError naming the file when it is not one."""
        data = _read(path, "--front-public-key-file")
        try:
            key = serialization.load_pem_public_key(data)
        except ValueError:
            key = None
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError(f"--front-public-key-file {path}: not an Ed25519 public key in PEM (make a pair with: "
                             f"kvfence front-key)")
        return cls(key)

    def verifies(self, signature: bytes, message: bytes) -> bool:
        try:
            self._key.verify(signature, message)
        except InvalidSignature:
            return False
        return True

    def capability_ok(self, manifest: TransferManifest, dst_pages: Sequence[int], receiver_incarnation: str) -> bool:
        """Whether `manifest.capability` is the front end's signature of this push into `dst_pages`
        of that receiver incarnation."""
        try:
            message = capability_message(manifest, dst_pages, receiver_incarnation)
            signature = bytes.fromhex(manifest.capability)
        except (OverflowError, TypeError, ValueError):  # pages no planner could have named, or no hex
            return False
        return len(signature) == SIGNATURE_BYTES and self.verifies(signature, message)

    def control_ok(self, signature: bytes, transcript: bytes) -> bool:
        """Whether `signature` is the front end's over this control handshake's transcript."""
        return self.verifies(signature, CONTROL_LABEL + transcript)


class FrontKey:
    """What a front end holds: signs capabilities and control handshakes; `repr` never shows it."""

    __slots__ = ("_key", "public")

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public = FrontPublicKey(key.public_key())

    def __repr__(self) -> str:
        return f"FrontKey(<hidden>, public {self.public.fingerprint})"

    @classmethod
    def generate(cls) -> FrontKey:
        """A fresh key, for a deployment that lives in one process, or for `kvfence front-key`."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> FrontKey:
        """The private key in PEM file `path`; ValueError naming the file when it is not one; a
        file others may read is logged."""
        data = _read(path, "--front-key-file")
        mode = Path(path).stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("--front-key-file %s can be read by other users (mode %o); chmod 600 it",
                        path, stat.S_IMODE(mode))
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError):
            key = None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"--front-key-file {path}: not an unencrypted Ed25519 private key in PEM (make a pair "
                             f"with: kvfence front-key)")
        return cls(key)

    def write(self, key_path: str | os.PathLike[str], public_path: str | os.PathLike[str]) -> None:
        """Write the private key (PEM, mode 600) and its public half; ValueError when either file
        exists (a front key is never overwritten)."""
        for path in (key_path, public_path):
            if Path(path).exists():
                raise ValueError(f"{path} exists; remove it or choose another path (a front key is never overwritten)")
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.pem())
        Path(public_path).write_bytes(self.public.pem())

    def pem(self) -> bytes:
        return self._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption())

    def capability(self, manifest: TransferManifest, dst_pages: Sequence[int], receiver_incarnation: str) -> str:
        """The capability of a push of `manifest` into `dst_pages` of that receiver incarnation (hex)."""
        return self._key.sign(capability_message(manifest, dst_pages, receiver_incarnation)).hex()

    def sign_control(self, transcript: bytes) -> bytes:
        """The front end's signature over a control handshake's transcript."""
        return self._key.sign(CONTROL_LABEL + transcript)
