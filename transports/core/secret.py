"""The deployment secret: the proofs of the mutual authentication of transport peers, and push
capabilities.

Every process of one deployment holds the same secret (generated per process when both workers
live in it; read from `--transport-secret-file` when they do not). It never crosses the wire.
Two keys are derived from it, one per use, so a MAC made for one purpose is never valid for the
other.

Peer authentication: each side proves it knows the secret by `proof(role, transport, nonce_c,
nonce_l)`, an HMAC over a nonce the other side just chose, so a recorded exchange replays to
nothing; the role label keeps a listener's proof from being reflected back as a connector's. The
exchange over a connection is wire/handshake.py's; the in-process transport makes the same proofs
without a wire.

A capability is a MAC, minted where a transfer is planned, over what the push may do: the
transfer id, the destination lease, the destination pages, the token count, the nonce and the
receiver's incarnation. The receiver recomputes it with its own incarnation before it arms a
transfer and before it admits a push (transports/core/receiver_state.py), so a push planned for
another lease, other pages, another nonce or an earlier incarnation of the receiver is refused.
"""

from __future__ import annotations

import array
import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

from kvfence.transports.base import TransferManifest

log = logging.getLogger(__name__)

SECRET_MIN_BYTES = 32
NONCE_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256


class AuthenticationFailed(ConnectionError):
    """The peer did not prove that it holds the deployment secret."""


class DeploymentSecret:
    """The secret of one deployment; `repr` never shows it."""

    __slots__ = ("_auth_key", "_capability_key")

    def __init__(self, secret: bytes) -> None:
        if len(secret) < SECRET_MIN_BYTES:
            raise ValueError(f"a deployment secret needs at least {SECRET_MIN_BYTES} bytes, got {len(secret)}; "
                             f"make one with: head -c 32 /dev/urandom | base64 > secret && chmod 600 secret")
        self._auth_key = hmac.digest(secret, b"kvfence peer authentication v1", hashlib.sha256)
        self._capability_key = hmac.digest(secret, b"kvfence push capability v1", hashlib.sha256)

    def __repr__(self) -> str:
        return "DeploymentSecret(<hidden>)"

    @classmethod
    def generate(cls) -> DeploymentSecret:
        """A fresh secret, for a deployment that lives in one process."""
        return cls(secrets.token_bytes(SECRET_MIN_BYTES))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> DeploymentSecret:
        """The secret in `path` (its bytes, surrounding whitespace stripped). ValueError naming
        the file when it cannot be read or is too short; a file others may read is logged."""
        p = Path(path)
        try:
            data = p.read_bytes().strip()
            mode = p.stat().st_mode
        except OSError as e:
            raise ValueError(f"--transport-secret-file {p}: cannot read it ({e.strerror or e})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("--transport-secret-file %s can be read by other users (mode %o); chmod 600 it",
                        p, stat.S_IMODE(mode))
        try:
            return cls(data)
        except ValueError as e:
            raise ValueError(f"--transport-secret-file {p}: {e}") from None

    # -- peer authentication ---------------------------------------------------------------
    def proof(self, role: str, transport: str, connector_nonce: bytes, listener_nonce: bytes) -> bytes:
        """What `role` ("listener" or "connector") sends to prove it holds the secret."""
        message = b"|".join((role.encode(), transport.encode(), connector_nonce, listener_nonce))
        return hmac.digest(self._auth_key, message, hashlib.sha256)

    def proves(self, mac: bytes, role: str, transport: str, connector_nonce: bytes, listener_nonce: bytes) -> bool:
        return hmac.compare_digest(mac, self.proof(role, transport, connector_nonce, listener_nonce))

    # -- capabilities ----------------------------------------------------------------------
    def capability(self, manifest: TransferManifest, dst_pages: Sequence[int], receiver_incarnation: str) -> str:
        """The capability of a push of `manifest` into `dst_pages` of that receiver incarnation (hex)."""
        fields = "\0".join((manifest.transfer_id, manifest.lease, manifest.nonce, receiver_incarnation,
                            str(manifest.num_tokens), str(manifest.num_pages), ""))
        pages = array.array("q", dst_pages).tobytes()  # OverflowError past int64: never a page
        return hmac.digest(self._capability_key, fields.encode() + pages, hashlib.sha256).hex()

    def capability_ok(self, manifest: TransferManifest, dst_pages: Sequence[int], receiver_incarnation: str) -> bool:
        try:
            want = self.capability(manifest, dst_pages, receiver_incarnation)
        except (OverflowError, TypeError):  # pages no planner could have named
            return False
        return hmac.compare_digest(manifest.capability, want)
