"""What the built-in transports share: pool registration, the receiver half (expect, completion,
cancel), the checks on pairing and push arguments, and, for the ones that listen, the guards of
every accepted connection: a cap on connections, the peer authentication of peer_auth.py inside
the handshake timeout, and the keep-alive of a paired one.

Both built-ins take the pool on any device: one that is not on the CPU (a CUDA pool) is staged
through host memory (staging.py). Their constructors pass `stage_through_host` (None: stage iff the
pool is not on the CPU; True also stages a CPU pool, to test that path) and `stage_chunk_bytes`
(how much of a push the sender stages at once) to `PoolView`."""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import torch
from anyio.abc import TaskGroup, TaskStatus

from kvfence.transports.base import (
    EndpointInfo, PairingRecord, PairingRefused, TransferManifest, TransferResult, Transport,
)
from kvfence.transports.wire.keepalive import keep_alive
from kvfence.transports.core.secret import (AuthenticationFailed, DeploymentSecret, authenticate_as_connector,
                                          authenticate_as_listener)
from kvfence.transports.core.pool_bytes import DEFAULT_STAGE_CHUNK_BYTES, PoolView
from kvfence.transports.core.receiver import PoolReceiver
from kvfence.transports.core.sender_state import OutgoingPushes
from kvfence.transports.wire.channel import Channel
from kvfence.transports.tcp.wire import HelloReply

log = logging.getLogger(__name__)


def pairing_problem(mine: EndpointInfo, theirs: EndpointInfo) -> str | None:
    """Why two endpoints may not pair (transport name or a byte-defining record field), or None."""
    if mine.transport != theirs.transport:
        return f"transport: {mine.transport!r} != {theirs.transport!r}"
    return mine.record.mismatch(theirs.record)


def check_pair(mine: EndpointInfo, peer: EndpointInfo, refusal: str | None, theirs: EndpointInfo) -> None:
    """The pairing verdict on our side once `peer` answered (`refusal`: its reason to refuse, or
    None; `theirs`: the info it answered with): PairingRefused when it refused, its record does not
    match ours, or it is another incarnation than `peer` announced."""
    if refusal is not None:
        raise PairingRefused(f"{peer.address} refused to pair: {refusal}")
    if problem := pairing_problem(mine, theirs):
        raise PairingRefused(f"refusing to pair with {peer.address}: {problem}")
    if theirs.record.incarnation != peer.record.incarnation:
        raise PairingRefused(f"{peer.address} is incarnation {theirs.record.incarnation!r}, "
                             f"not {peer.record.incarnation!r}")


class PoolEndpoint(Transport):
    """Base of the built-in transports. Subclasses implement start/pair/push/health/aclose and
    call `_register` from `start`. `secret`: the deployment's (peer_auth.py); the receiver checks
    every capability with it against this endpoint's incarnation."""

    def __init__(self, *, secret: DeploymentSecret, stage_through_host: bool | None = None,
                 stage_chunk_bytes: int = DEFAULT_STAGE_CHUNK_BYTES) -> None:
        if not isinstance(secret, DeploymentSecret):
            raise TypeError(f"secret must be a DeploymentSecret, not {type(secret).__name__}")
        self.secret = secret
        self.stage_through_host = stage_through_host
        self.stage_chunk_bytes = stage_chunk_bytes
        self._pool: PoolView | None = None
        self._receiver: PoolReceiver | None = None
        self._outgoing = OutgoingPushes()
        self._info: EndpointInfo | None = None
        self._closed = False

    @property
    def info(self) -> EndpointInfo:
        """This endpoint's EndpointInfo (after `start`)."""
        if self._info is None:
            raise RuntimeError(f"{self.name} transport not started")
        return self._info

    def _register(self, memory: torch.Tensor, record: PairingRecord) -> PoolView:
        if self._closed:
            raise RuntimeError(f"{self.name} transport is closed")
        if self._pool is not None:
            raise RuntimeError(f"{self.name} transport already started")
        pool = PoolView(memory, record, stage_through_host=self.stage_through_host,
                        stage_chunk_bytes=self.stage_chunk_bytes)
        secret, incarnation = self.secret, record.incarnation
        self._pool = pool
        self._receiver = PoolReceiver(pool, lambda m, dst: secret.capability_ok(m, dst, incarnation))
        return pool

    def _started(self) -> tuple[PoolView, PoolReceiver]:
        if self._pool is None or self._receiver is None:
            raise RuntimeError(f"{self.name} transport not started")
        return self._pool, self._receiver

    def expect(self, manifest: TransferManifest, dst_pages: list[int]) -> None:
        """Allow exactly this transfer into `dst_pages`. ValueError: reused id, wrong page count,
        bad/repeated pages, or pages reserved by another pending transfer."""
        self._started()[1].expect(manifest, list(dst_pages))

    async def completion(self, transfer_id: str) -> TransferResult:
        """The expected transfer's result (KeyError when it was never expected). Failures include
        the push's rejection reasons, "cancelled", "peer_lost", "transport_closed"."""
        return await self._started()[1].completion(transfer_id)

    async def cancel(self, transfer_id: str) -> bool:
        """Both halves: un-expect it (no write can follow) and stop pushing it (no read can
        follow). Always True: both are immediate, since every read and write of pages is a
        synchronous step on the event loop preceded by a check of the cancellation."""
        if self._receiver is not None:
            self._receiver.cancel(transfer_id)
        self._outgoing.cancel(transfer_id)
        return True

    async def wait_quiet(self, transfer_id: str) -> bool:
        """True: `cancel` here is immediate, so nothing is left to wait for (the one-sided
        transports override this)."""
        return True

    def _check_push(self, manifest: TransferManifest, src_pages: list[int], dst_pages: list[int]) -> PoolView:
        pool = self._started()[0]
        if self._closed:
            raise RuntimeError(f"{self.name} transport is closed")
        n = manifest.num_pages
        if len(src_pages) != n or len(dst_pages) != n:
            raise ValueError(f"transfer {manifest.transfer_id}: {len(src_pages)} src / {len(dst_pages)} "
                             f"dst pages for num_pages={n}")
        if len(manifest.digests) not in (0, n):
            raise ValueError(f"transfer {manifest.transfer_id}: {len(manifest.digests)} digests for {n} pages")
        pool.check_pages(list(src_pages), f"transfer {manifest.transfer_id} src")
        return pool


class ListeningEndpoint(PoolEndpoint):
    """A PoolEndpoint that serves from a task group of its own, started inside the caller's (tcp and
    the one-sided transports): `_loops()` run there until `aclose` cancels it, then `_stop_serving()`
    closes what they used. `_tg` is that task group while it runs; `_stopped` is set once it ended.

    `handshake_timeout_s`: the authentication and the pairing exchange of a connection, together,
    or it is closed. `keepalive_s`: a paired connection on which nothing arrives for this long is
    closed (keepalive.py). `max_connections`: accepted connections open at once; one more is
    closed on arrival."""

    def __init__(self, *, handshake_timeout_s: float = 10.0, keepalive_s: float = 30.0, max_connections: int = 64,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for what, value in (("handshake_timeout_s", handshake_timeout_s), ("keepalive_s", keepalive_s),
                            ("max_connections", max_connections)):
            if not value > 0:
                raise ValueError(f"{what} must be positive, got {value!r}")
        self.handshake_timeout_s = handshake_timeout_s
        self.keepalive_s = keepalive_s
        self.max_connections = max_connections
        self.refused_peers = 0  # connections closed because they did not authenticate
        self._open_connections = 0
        self._tg: TaskGroup | None = None
        self._stopped = anyio.Event()

    # -- accepted connections ----------------------------------------------------------------
    def _on_accept(self, sock: socket.socket, serve: Callable[[Channel], Awaitable[None]]) -> None:
        """Serve an accepted socket with `serve` (which authenticates first, see `_authenticate`),
        or close it at once when `max_connections` are open."""
        if self._tg is None or self._open_connections >= self.max_connections:
            log.warning("%s endpoint %s: %d connections open (the cap): closing a new one from %s", self.name,
                        self._info.address if self._info else "?", self._open_connections, _peer_name(sock))
            sock.close()
            return
        self._open_connections += 1
        self._tg.start_soon(self._serve_accepted, Channel(sock), serve)

    async def _serve_accepted(self, channel: Channel, serve: Callable[[Channel], Awaitable[None]]) -> None:
        try:
            await serve(channel)
        finally:
            self._open_connections -= 1
            channel.close()

    async def _authenticate(self, channel: Channel) -> bool:
        """The listening side of peer_auth's handshake (call inside the handshake timeout). False,
        logged, when the peer did not prove the deployment secret: send it nothing more."""
        try:
            await authenticate_as_listener(channel, self.secret, self.name)
        except AuthenticationFailed as e:
            self.refused_peers += 1
            log.warning("%s endpoint %s: refused a connection from %s: %s", self.name, self.info.address,
                        _peer_name(channel.sock), e)
            return False
        return True

    async def _connect_authenticated(self, channel: Channel, peer: EndpointInfo) -> None:
        """The connecting side of peer_auth's handshake; AuthenticationFailed names the peer."""
        try:
            await authenticate_as_connector(channel, self.secret, self.name)
        except AuthenticationFailed as e:
            raise AuthenticationFailed(f"{peer.address}: {e}") from None

    def _keep_alive(self, channel: Channel, ping: Callable[[], Awaitable[None]], what: str) -> None:
        """Run the keep-alive of a paired connection in the endpoint's task group."""
        if self._tg is not None:
            self._tg.start_soon(keep_alive, channel, ping, self.keepalive_s, f"{self.name} {what}")

    def _loops(self) -> list[Callable[[], Awaitable[None]]]:
        raise NotImplementedError

    def _stop_serving(self) -> None:
        raise NotImplementedError

    def _check_pairable(self, peer: EndpointInfo) -> None:
        """Before dialing `peer`: RuntimeError when not serving, PairingRefused for another transport."""
        if self._tg is None or self._closed or self._stopped.is_set():
            raise RuntimeError(f"{self.name} transport is not serving")
        if peer.transport != self.name:
            raise PairingRefused(f"transport: {self.name!r} != {peer.transport!r}")

    def _check_hello_reply(self, peer: EndpointInfo, reply: object) -> HelloReply:
        """The peer's answer to our Hello, checked: ConnectionError for anything but a HelloReply,
        PairingRefused when it refused, its record does not match ours, or it is another incarnation
        than `peer` announced; RuntimeError when this endpoint closed meanwhile."""
        if not isinstance(reply, HelloReply):
            raise ConnectionError(f"{peer.address}: expected hello_reply, got {type(reply).__name__}")
        check_pair(self.info, peer, None if reply.accepted else reply.reason, reply.info)
        if self._closed or self._stopped.is_set():
            raise RuntimeError(f"{self.name} transport closed while pairing")
        return reply

    async def _serve(self, *, task_status: TaskStatus[None]) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for loop in self._loops():
                    tg.start_soon(loop)
                task_status.started()
        finally:
            self._stop_serving()
            self._stopped.set()


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except (OSError, ValueError):
        return "an unknown peer"
    return f"{host}:{port}"
