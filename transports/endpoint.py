"""What the built-in transports share: pool registration, the receiver half (expect, completion,
cancel) and the checks on pairing and push arguments.

Both built-ins take the pool on any device: one that is not on the CPU (a CUDA pool) is staged
through host memory (staging.py). Their constructors pass `stage_through_host` (None: stage iff the
pool is not on the CPU; True also stages a CPU pool, to test that path) and `stage_chunk_bytes`
(how much of a push the sender stages at once) to `PoolView`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import torch
from anyio.abc import TaskGroup, TaskStatus

from kvfence.transports.base import (
    EndpointInfo, PairingRecord, PairingRefused, TransferManifest, TransferResult, Transport,
)
from kvfence.transports.pool_view import DEFAULT_STAGE_CHUNK_BYTES, PoolView
from kvfence.transports.receiver import PoolReceiver
from kvfence.transports.sender_state import OutgoingPushes
from kvfence.transports.tcp_wire import HelloReply


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
    call `_register` from `start`."""

    def __init__(self, *, stage_through_host: bool | None = None,
                 stage_chunk_bytes: int = DEFAULT_STAGE_CHUNK_BYTES) -> None:
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
        self._pool, self._receiver = pool, PoolReceiver(pool)
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
    closes what they used. `_tg` is that task group while it runs; `_stopped` is set once it ended."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tg: TaskGroup | None = None
        self._stopped = anyio.Event()

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
