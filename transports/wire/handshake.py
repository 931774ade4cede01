"""The peer handshake: mutual authentication with the deployment secret (core/secret.py) and an
ephemeral key exchange, before anything else is exchanged on a connection. Three fixed-size
messages, so no parser runs on what an unauthenticated peer sends:

    connector -> MAGIC + nonce_c + X25519 key_c                                     (5 + 32 + 32)
    listener  -> nonce_l + key_l + HMAC(auth, "listener"  | label | c | l)          (32 + 32 + 32)
    connector ->                   HMAC(auth, "connector" | label | c | l)          (32)
                 [+ Ed25519(front end, label | c | l), on a control connection]     (+ 64)

(c = nonce_c + key_c, l = nonce_l + key_l: what each side contributed.) Each side proves it knows
the secret over a nonce the other just chose, so a recorded handshake replays to nothing; the role
label keeps a listener's proof from being reflected back as a connector's. A listener answers a
wrong magic with nothing; a connector that fails the check gets no further byte (no record, no
descriptor); a listener that fails it is dropped by the connector.

Then both ends seal the channel (seal.py) with keys derived from the secret, both contributions and
the X25519 shared secret (secret.py `session_keys`). A relay that forwards the messages unchanged
ends up between two ends whose records it can neither read nor alter; and since the shared secret
is known only to the two ends, neither can another holder of the deployment secret (a worker host)
that watches or relays the connection.

A control connection also proves the front end's key (core/front_key.py): the worker, which holds
only its public half, takes steps only over a connection whose connector signed this handshake's
transcript, so a worker host cannot pose as a front end, and a relay that swapped either ephemeral
key breaks the signature.

With the sealing guard off (`sealed=False`, app/serve/guards.py: only a server assembled in code, to
measure what sealing costs) the handshake still authenticates both ends, under a label of its own
(so an unsealed end never pairs with a sealed one), and the channel then carries the same records
in clear (seal.py `in_clear`).

`KVFENCE_KEYLOG_FILE` (debugging only, like TLS's SSLKEYLOGFILE): when set, each end appends the
keys of every connection it seals to that file, so a capture of its traffic can be opened.
"""

from __future__ import annotations

import logging
import os
import secrets

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from kvfence.transports.core.front_key import SIGNATURE_BYTES, FrontKey, FrontPublicKey
from kvfence.transports.core.secret import MAC_BYTES, NONCE_BYTES, PART_BYTES, AuthenticationFailed, DeploymentSecret
from kvfence.transports.wire.channel import Channel

log = logging.getLogger(__name__)

MAGIC = b"KVFA\x02"  # protocol name and version of the handshake
KEYLOG_ENV = "KVFENCE_KEYLOG_FILE"
_keylog_warned: set[str] = set()


def opening(part: bytes) -> bytes:
    """The connector's first message."""
    return MAGIC + part


def contribution() -> tuple[bytes, X25519PrivateKey]:
    """A fresh nonce and ephemeral key: (what is sent, the private key)."""
    key = X25519PrivateKey.generate()
    return secrets.token_bytes(NONCE_BYTES) + key.public_key().public_bytes_raw(), key


def shared_secret(mine: X25519PrivateKey, theirs: bytes) -> bytes:
    """The X25519 shared secret with the other side's contribution; AuthenticationFailed for a key
    no honest peer sends (one of low order)."""
    try:
        return mine.exchange(X25519PublicKey.from_public_bytes(theirs[NONCE_BYTES:]))
    except ValueError:
        raise AuthenticationFailed("the peer sent an unusable ephemeral key") from None


def transcript(label: str, connector_part: bytes, listener_part: bytes) -> bytes:
    """What the front end signs on a control connection."""
    return label.encode() + b"\0" + connector_part + listener_part


def labelled(label: str, sealed: bool) -> str:
    """The label a handshake proves: an unsealed channel's is its own, so it never pairs with a sealed one."""
    return label if sealed else f"{label} unsealed"


def seal(channel: Channel, secret: DeploymentSecret, label: str, connector_part: bytes, listener_part: bytes,
         shared: bytes, *, as_connector: bool, sealed: bool = True) -> None:
    """Seal `channel` with this handshake's keys (and log them, when `KVFENCE_KEYLOG_FILE` says so);
    with `sealed=False` (the sealing guard off) frame it in clear instead."""
    if not sealed:
        channel.frame_in_clear()
        return
    to_listener, to_connector = secret.session_keys(label, connector_part, listener_part, shared)
    if path := os.environ.get(KEYLOG_ENV):
        _log_keys(path, label, connector_part, to_listener, to_connector)
    if as_connector:
        channel.seal(to_listener, to_connector)
    else:
        channel.seal(to_connector, to_listener)


def _log_keys(path: str, label: str, connector_part: bytes, to_listener: bytes, to_connector: bytes) -> None:
    if path not in _keylog_warned:
        _keylog_warned.add(path)
        log.warning("%s is set: the keys of every sealed connection are written to %s (debugging only)",
                    KEYLOG_ENV, path)
    with open(path, "a") as f:
        f.write(f"{label} {connector_part.hex()} {to_listener.hex()} {to_connector.hex()}\n")


async def authenticate_as_connector(channel: Channel, secret: DeploymentSecret, label: str, *,
                                    front_key: FrontKey | None = None, sealed: bool = True) -> None:
    """Run the handshake from the connecting side, then seal `channel`; AuthenticationFailed when
    the listener does not prove the secret (the caller closes the connection; nothing was sent but
    the contribution). `front_key`: on a control connection, the front end's signing key.
    `sealed=False`: the sealing guard is off (see above)."""
    label = labelled(label, sealed)
    mine, ephemeral = contribution()
    async with channel.send_lock:
        await channel.send_clear(opening(mine))
    answer = await channel.recv_clear(PART_BYTES + MAC_BYTES)
    theirs, mac = answer[:PART_BYTES], answer[PART_BYTES:]
    if not secret.proves(mac, "listener", label, mine, theirs):
        raise AuthenticationFailed("the peer did not prove the deployment secret")
    shared = shared_secret(ephemeral, theirs)
    final = secret.proof("connector", label, mine, theirs)
    if front_key is not None:
        final += front_key.sign_control(transcript(label, mine, theirs))
    async with channel.send_lock:
        await channel.send_clear(final)
        seal(channel, secret, label, mine, theirs, shared, as_connector=True, sealed=sealed)


async def authenticate_as_listener(channel: Channel, secret: DeploymentSecret, label: str, *,
                                   front: FrontPublicKey | None = None, sealed: bool = True) -> None:
    """Run the handshake from the listening side, then seal `channel`; AuthenticationFailed when
    the connector does not speak it, does not prove the secret or (given `front`, the front end's
    public key: a control connection) does not prove the front end's key. `sealed=False`: the
    sealing guard is off (see above)."""
    label = labelled(label, sealed)
    hello = await channel.recv_clear(len(MAGIC) + PART_BYTES)
    if hello[:len(MAGIC)] != MAGIC:
        raise AuthenticationFailed("the peer does not speak the kvfence handshake")
    theirs = hello[len(MAGIC):]
    mine, ephemeral = contribution()
    async with channel.send_lock:
        await channel.send_clear(mine + secret.proof("listener", label, theirs, mine))
    final = await channel.recv_clear(MAC_BYTES + (SIGNATURE_BYTES if front is not None else 0))
    if not secret.proves(final[:MAC_BYTES], "connector", label, theirs, mine):
        raise AuthenticationFailed("the peer did not prove the deployment secret")
    if front is not None and not front.control_ok(final[MAC_BYTES:], transcript(label, theirs, mine)):
        raise AuthenticationFailed("the peer holds the deployment secret but did not prove the front end's key")
    shared = shared_secret(ephemeral, theirs)
    async with channel.send_lock:
        seal(channel, secret, label, theirs, mine, shared, as_connector=False, sealed=sealed)
