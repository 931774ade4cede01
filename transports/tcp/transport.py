"""`TcpTransport`: KV pages over plain TCP (loopback or LAN), no extra dependencies.

Every endpoint listens (it can receive); `pair(peer)` opens one connection from this endpoint to
the peer's listener, runs the mutual authentication of wire/handshake.py (a peer without the deployment
secret gets nothing more, not even the pairing record), and exchanges Hello/HelloReply: the
listener refuses a different transport or
any byte-defining record mismatch, and the connecting side re-checks the reply (record, and that
the peer's incarnation is the one it was told about). Pushes then flow connector -> listener on
that connection, several at once (see tcp/send.py). Protocol: tcp/wire.py; byte moving:
wire/channel.py; listening, dialing and the Hello exchange: wire/listening.py.

Digests: a push whose manifest carries digests is verified against those; one whose manifest has
none (`digests=[]`) is verified against the digests the sender computes, per page, over exactly
the bytes it sent (with the paired algorithm).

A pool that is not on the CPU is staged through host memory (core/staging.py; `stage_through_host`).

A lost connection fails its pushes with "peer_lost"; the next push to that peer dials it again
(the same address and incarnation, with backoff: wire/redial.py) and, while that fails, returns
"peer_lost" at once. `health()` is False while a paired connection is down.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from anyio.abc import TaskGroup

from kvfence.transports.base import EndpointInfo, PairingRecord, Peer, TransferManifest, TransferResult
from kvfence.transports.core.pool_bytes import DEFAULT_STAGE_CHUNK_BYTES
from kvfence.transports.core.front_key import FrontPublicKey
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.tcp.receive import serve_connection
from kvfence.transports.tcp.send import SenderConnection
from kvfence.transports.tcp.wire import MAX_HELLO, Frame
from kvfence.transports.wire.channel import Channel
from kvfence.transports.wire.listening import ListeningEndpoint
from kvfence.transports.wire.messages import Ping
from kvfence.transports.wire.pending import DEFAULT_MAX_UNAUTHENTICATED
from kvfence.transports.wire.redial import Redial


class TcpPeer(Peer):
    """`dialed`: what `pair` was given (the address dialed again to re-pair); `info`: what the
    peer answered; `connection`: the current connection to it."""

    def __init__(self, owner: TcpTransport, dialed: EndpointInfo, info: EndpointInfo,
                 connection: SenderConnection) -> None:
        self.owner = owner
        self.dialed = dialed
        self.info = info
        self.connection = connection
        self.redial = Redial(f"tcp peer {dialed.address}")


async def _ping(channel: Channel) -> None:
    """A keep-alive frame, unless a push is streaming (its bytes keep the connection alive)."""
    if not channel.send_lock.locked():
        async with channel.send_lock:
            await channel.send_frame(Ping())


class TcpTransport(ListeningEndpoint):
    name: ClassVar[str] = "tcp"
    _messages: ClassVar[Any] = Frame
    _max_hello_bytes: ClassVar[int] = MAX_HELLO

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: DeploymentSecret, front_key: FrontPublicKey,
                 handshake_timeout_s: float = 10.0, keepalive_s: float = 30.0, max_connections: int = 64,
                 max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
                 stage_through_host: bool | None = None,
                 stage_chunk_bytes: int = DEFAULT_STAGE_CHUNK_BYTES, sealed: bool = True,
                 capabilities: bool = True) -> None:
        """`host`/`port`: where it listens (loopback unless told otherwise; 0: an ephemeral port).
        `secret`, `handshake_timeout_s`, `keepalive_s`, `max_connections`, `max_unauthenticated`,
        `sealed`: see ListeningEndpoint; `capabilities`: see Endpoint (False only with the guard
        off, app/serve/guards.py)."""
        super().__init__(host, port, secret=secret, front_key=front_key, handshake_timeout_s=handshake_timeout_s,
                         keepalive_s=keepalive_s, max_connections=max_connections,
                         max_unauthenticated=max_unauthenticated, sealed=sealed, capabilities=capabilities,
                         stage_through_host=stage_through_host, stage_chunk_bytes=stage_chunk_bytes)
        self._peers: dict[str, SenderConnection] = {}  # by peer address
        self._accepted: set[Channel] = set()

    async def start(self, task_group: TaskGroup, memory: torch.Tensor, record: PairingRecord) -> EndpointInfo:
        """Register the pool, listen on host:port (0: ephemeral) and serve in `task_group`."""
        self._register(memory, record)
        self._listen(record)
        try:
            await task_group.start(self._serve)
        except BaseException:
            self._close_sockets()
            raise
        return self.info

    def _stop_serving(self) -> None:
        self._close_sockets()

    async def _serve_connection(self, channel: Channel) -> None:
        _, receiver = self._started()
        self._accepted.add(channel)
        try:
            await serve_connection(channel, receiver, lambda: self._answer_hello(channel),
                                   lambda: self._keep_alive(channel, lambda: _ping(channel), "receiving connection"))
        finally:
            self._accepted.discard(channel)

    async def pair(self, peer: EndpointInfo) -> Peer:
        """Connect to `peer`, authenticate both ways and pair. PairingRefused on any mismatch
        (either side's verdict); AuthenticationFailed (a ConnectionError) when the peer does not
        prove the deployment secret; OSError (ConnectionError) when unreachable or not speaking
        this protocol (a listener that refused us just closes); TimeoutError when the handshake stalls."""
        connection, info = await self._connect(peer)
        return TcpPeer(self, peer, info, connection)

    async def _connect(self, peer: EndpointInfo) -> tuple[SenderConnection, EndpointInfo]:
        """Dial and pair `peer` (see `pair`); the running connection and the peer's info."""
        channel, reply = await self._dial(peer)
        try:
            connection = SenderConnection(channel, reply.info)
            self._serving_group().start_soon(connection.run)
            self._keep_alive(channel, lambda: _ping(channel), "sending connection")
        except BaseException:
            channel.close()
            raise
        if (old := self._peers.pop(peer.address, None)) is not None:
            old.lose("peer_lost")
        self._peers[peer.address] = connection
        return connection, reply.info

    async def _current(self, peer: TcpPeer) -> SenderConnection:
        """The peer's connection, re-paired first when it was lost (redial.py's backoff; a lost one
        is returned when re-pairing is not due or fails, and its pushes fail "peer_lost")."""
        if not peer.connection.alive and not self._closed:
            if (reopened := await peer.redial.attempt(lambda: self._connect(peer.dialed))) is not None:
                peer.connection = reopened[0]
        return peer.connection

    async def push(self, peer: Peer, manifest: TransferManifest, src_pages: list[int],
                   dst_pages: list[int]) -> TransferResult:
        """Send the pages and return the receiver's verdict ("cancelled" when `cancel` stopped
        it, "peer_lost" / "transport_closed" when the connection went away first). ValueError
        on bad arguments or a peer not paired by this endpoint."""
        pool_bytes = self._check_push(manifest, src_pages, dst_pages)
        if not isinstance(peer, TcpPeer) or peer.owner is not self:
            raise ValueError("push to a peer this tcp endpoint did not pair with")
        out = self._outgoing.add(manifest.transfer_id)
        try:
            connection = await self._current(peer)
            return await connection.push(out, pool_bytes, manifest, list(src_pages), list(dst_pages))
        finally:
            self._outgoing.remove(out)

    async def health(self) -> bool:
        """The listener is up and serving, and every paired connection is alive."""
        return self._serving() and all(c.alive for c in self._peers.values())

    async def aclose(self) -> None:
        """Fail everything pending ("transport_closed"), stop the tasks, close every socket."""
        if self._close_once():
            self._fail_pending()
            if self._tg is not None:  # _serve closes the sockets on its way out
                self._tg.cancel_scope.cancel()
            else:
                self._close_sockets()
        if self._tg is not None:
            await self._stopped.wait()

    def _close_sockets(self) -> None:
        for connection in self._peers.values():
            connection.lose("transport_closed")
        for channel in list(self._accepted):
            channel.close()
        self._close_listener()
