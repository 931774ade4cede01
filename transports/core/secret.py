"""The deployment secret: the credential every member of a deployment holds, for the mutual
authentication of peers, the keys that seal their connections, and signed registrations.

Every process of one deployment holds the same secret (generated per process when both workers
live in it; read from `--transport-secret-file` when they do not). It never crosses the wire.
Three keys are derived from it, one per use, so a MAC made for one purpose is never valid for
another.

Peer authentication: each side proves it knows the secret by `proof(role, transport, nonce_c,
nonce_l)`, an HMAC over a nonce the other side just chose, so a recorded exchange replays to
nothing; the role label keeps a listener's proof from being reflected back as a connector's. The
exchange over a connection is wire/handshake.py's; the in-process transport makes the same proofs
without a wire.

Session keys: once a handshake succeeds, both ends derive the keys that seal the rest of the
connection (wire/seal.py) by HKDF-SHA256 from the session key and the handshake's X25519 shared
secret, salted with both sides' contributions and bound to the transport label: one key per
direction, fresh for every connection, known to nobody but the two ends, so a relay that forwarded
the handshake can neither read nor write what follows, even one that holds the secret.

Registrations: a worker's etcd registration carries a MAC over its key and value
(app/remote/membership.py), so a front end dials only workers of its own deployment.

Every holder of the secret can do all of the above, so what only a front end may do (mint a push's
capability, drive a worker over its control channel) is signed with a key workers do not hold
(core/front_key.py).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from pathlib import Path

from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

log = logging.getLogger(__name__)

SECRET_MIN_BYTES = 32
NONCE_BYTES = 32
EPHEMERAL_BYTES = 32  # an X25519 public key, and the shared secret
PART_BYTES = NONCE_BYTES + EPHEMERAL_BYTES  # what each side of a handshake contributes
MAC_BYTES = 32  # HMAC-SHA256
SESSION_KEY_BYTES = 32  # AES-256-GCM, one key per direction


class AuthenticationFailed(ConnectionError):
    """The peer did not prove that it holds the deployment secret."""


class DeploymentSecret:
    """The secret of one deployment; `repr` never shows it."""

    __slots__ = ("_auth_key", "_registration_key", "_session_key")

    def __init__(self, secret: bytes) -> None:
        if len(secret) < SECRET_MIN_BYTES:
            raise ValueError(f"a deployment secret needs at least {SECRET_MIN_BYTES} bytes, got {len(secret)}; "
                             f"make one with: head -c 32 /dev/urandom | base64 > secret && chmod 600 secret")
        self._auth_key = hmac.digest(secret, b"kvfence peer authentication v1", hashlib.sha256)
        self._session_key = hmac.digest(secret, b"kvfence session keys v1", hashlib.sha256)
        self._registration_key = hmac.digest(secret, b"kvfence registration v1", hashlib.sha256)

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

    def session_keys(self, transport: str, connector_part: bytes, listener_part: bytes,
                     shared: bytes) -> tuple[bytes, bytes]:
        """The keys sealing the connection whose handshake exchanged these contributions (each a
        nonce and an ephemeral key) and reached the ephemeral `shared` secret: (connector to
        listener, listener to connector)."""
        if len(connector_part) != PART_BYTES or len(listener_part) != PART_BYTES or len(shared) != EPHEMERAL_BYTES:
            raise ValueError(f"a handshake contributes {PART_BYTES} bytes a side and shares {EPHEMERAL_BYTES}")
        keys = HKDF(SHA256(), 2 * SESSION_KEY_BYTES, salt=connector_part + listener_part,
                    info=b"kvfence session v2|" + transport.encode()).derive(self._session_key + shared)
        return keys[:SESSION_KEY_BYTES], keys[SESSION_KEY_BYTES:]

    # -- membership ------------------------------------------------------------------------
    def registration_mac(self, key: bytes, value: bytes) -> str:
        """The MAC a worker puts beside its registration `value` under etcd `key` (hex)."""
        return hmac.digest(self._registration_key, len(key).to_bytes(4, "big") + key + value, hashlib.sha256).hex()

    def registration_ok(self, mac: str, key: bytes, value: bytes) -> bool:
        return hmac.compare_digest(mac.encode(), self.registration_mac(key, value).encode())
