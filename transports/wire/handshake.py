"""The peer handshake: mutual authentication with the deployment secret (core/secret.py), before
anything else is exchanged on a connection. Three fixed-size messages, so no parser runs on what
an unauthenticated peer sends:

    connector -> MAGIC + nonce_c                                    (5 + 32 bytes)
    listener  -> nonce_l + HMAC(auth, "listener"  | transport | nonce_c | nonce_l)   (32 + 32)
    connector ->           HMAC(auth, "connector" | transport | nonce_c | nonce_l)   (32)

Each side proves it knows the secret over a nonce the other just chose, so a recorded handshake
replays to nothing; the role label keeps a listener's proof from being reflected back as a
connector's. A listener answers a wrong magic with nothing; a connector that fails the check gets
no further byte (no record, no descriptor); a listener that fails it is dropped by the connector.

Then both ends seal the channel with keys derived from the secret and both nonces (secret.py
`session_keys`, seal.py), so the three messages bind what follows: a relay that forwards them
unchanged ends up between two ends whose records it can neither read nor alter.
"""

from __future__ import annotations

import secrets

from kvfence.transports.core.secret import MAC_BYTES, NONCE_BYTES, AuthenticationFailed, DeploymentSecret
from kvfence.transports.wire.channel import Channel

MAGIC = b"KVFA\x01"  # protocol name and version of the handshake


async def authenticate_as_connector(channel: Channel, secret: DeploymentSecret, transport: str) -> None:
    """Run the handshake from the connecting side, then seal `channel`; AuthenticationFailed when
    the listener does not prove the secret (the caller closes the connection; nothing was sent but
    nonces)."""
    connector_nonce = secrets.token_bytes(NONCE_BYTES)
    async with channel.send_lock:
        await channel.send_clear(MAGIC + connector_nonce)
    answer = await channel.recv_clear(NONCE_BYTES + MAC_BYTES)
    listener_nonce, mac = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not secret.proves(mac, "listener", transport, connector_nonce, listener_nonce):
        raise AuthenticationFailed("the peer did not prove the deployment secret")
    async with channel.send_lock:
        await channel.send_clear(secret.proof("connector", transport, connector_nonce, listener_nonce))
        to_listener, to_connector = secret.session_keys(transport, connector_nonce, listener_nonce)
        channel.seal(to_listener, to_connector)


async def authenticate_as_listener(channel: Channel, secret: DeploymentSecret, transport: str) -> None:
    """Run the handshake from the listening side, then seal `channel`; AuthenticationFailed when
    the connector does not speak it or does not prove the secret (the caller closes the connection)."""
    hello = await channel.recv_clear(len(MAGIC) + NONCE_BYTES)
    if hello[:len(MAGIC)] != MAGIC:
        raise AuthenticationFailed("the peer does not speak the kvfence handshake")
    connector_nonce, listener_nonce = hello[len(MAGIC):], secrets.token_bytes(NONCE_BYTES)
    async with channel.send_lock:
        await channel.send_clear(listener_nonce + secret.proof("listener", transport, connector_nonce, listener_nonce))
    mac = await channel.recv_clear(MAC_BYTES)
    if not secret.proves(mac, "connector", transport, connector_nonce, listener_nonce):
        raise AuthenticationFailed("the peer did not prove the deployment secret")
    to_listener, to_connector = secret.session_keys(transport, connector_nonce, listener_nonce)
    async with channel.send_lock:
        channel.seal(to_connector, to_listener)
