"""What the built-in transports share: pool registration, the receiver half (expect, completion,
cancel), and the checks on pairing and push arguments. The ones that listen on a socket build on
it in wire/listening.py.

Both built-ins take the pool on any device: one that is not on the CPU (a CUDA pool) is staged
through host memory (core/staging.py). Their constructors pass `stage_through_host` (None: stage iff the
pool is not on the CPU; True also stages a CPU pool, to test that path) and `stage_chunk_bytes`
(how much of a push the sender stages at once) to `PoolBytes`."""

from __future__ import annotations

import torch

from kvfence.transports.base import (
    EndpointInfo, PairingRecord, PairingRefused, TransferManifest, TransferResult, Transport,
)
from kvfence.transports.core.pool_bytes import DEFAULT_STAGE_CHUNK_BYTES, PoolBytes
from kvfence.transports.core.receiver import Receiver
from kvfence.transports.core.front_key import FrontPublicKey
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.core.sender_state import OutgoingPushes


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


class Endpoint(Transport):
    """Base of the built-in transports. Subclasses implement start/pair/push/health/aclose and
    call `_register` from `start`. `secret`: the deployment's (core/secret.py), which peers prove;
    `front_key`: the front end's public key (core/front_key.py); the receiver checks
    every capability with it against this endpoint's incarnation (`capabilities=False`: it checks
    none, only with the capability guard off, app/serve/guards.py)."""

    _closed: bool  # set by aclose: nothing new starts

    def __init__(self, *, secret: DeploymentSecret, front_key: FrontPublicKey, stage_through_host: bool | None = None,
                 stage_chunk_bytes: int = DEFAULT_STAGE_CHUNK_BYTES, capabilities: bool = True) -> None:
        if not isinstance(secret, DeploymentSecret):
            raise TypeError(f"secret must be a DeploymentSecret, not {type(secret).__name__}")
        if not isinstance(front_key, FrontPublicKey):
            raise TypeError(f"front_key must be a FrontPublicKey, not {type(front_key).__name__}")
        self.secret, self.front_key = secret, front_key
        self.capabilities = capabilities
        self.stage_through_host = stage_through_host
        self.stage_chunk_bytes = stage_chunk_bytes
        self._pool_bytes: PoolBytes | None = None
        self._receiver: Receiver | None = None
        self._outgoing = OutgoingPushes()
        self._info: EndpointInfo | None = None
        self._closed = False

    @property
    def info(self) -> EndpointInfo:
        """This endpoint's EndpointInfo (after `start`)."""
        if self._info is None:
            raise RuntimeError(f"{self.name} transport not started")
        return self._info

    def _register(self, memory: torch.Tensor, record: PairingRecord) -> PoolBytes:
        if self._closed:
            raise RuntimeError(f"{self.name} transport is closed")
        if self._pool_bytes is not None:
            raise RuntimeError(f"{self.name} transport already started")
        pool_bytes = PoolBytes(memory, record, stage_through_host=self.stage_through_host,
                               stage_chunk_bytes=self.stage_chunk_bytes)
        front_key, incarnation = self.front_key, record.incarnation
        self._pool_bytes = pool_bytes
        capability = (lambda m, dst: front_key.capability_ok(m, dst, incarnation)) if self.capabilities else None
        self._receiver = Receiver(pool_bytes, capability, page_size_tokens=record.page_size_tokens)
        return pool_bytes

    def _started(self) -> tuple[PoolBytes, Receiver]:
        if self._pool_bytes is None or self._receiver is None:
            raise RuntimeError(f"{self.name} transport not started")
        return self._pool_bytes, self._receiver

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

    def _close_once(self) -> bool:
        """Mark this endpoint closed; True only the first time (aclose's idempotence)."""
        first = not self._closed
        self._closed = True
        return first

    def _fail_pending(self) -> None:
        """Closing: every expected transfer and every push in flight fails ("transport_closed")."""
        if self._receiver is not None:
            self._receiver.close("transport_closed")
        self._outgoing.settle_all("transport_closed")

    async def wait_quiet(self, transfer_id: str) -> bool:
        """True: `cancel` here is immediate, so nothing is left to wait for (the one-sided
        transports override this)."""
        return True

    def _check_push(self, manifest: TransferManifest, src_pages: list[int], dst_pages: list[int]) -> PoolBytes:
        pool_bytes = self._started()[0]
        if self._closed:
            raise RuntimeError(f"{self.name} transport is closed")
        n = manifest.num_pages
        if len(src_pages) != n or len(dst_pages) != n:
            raise ValueError(f"transfer {manifest.transfer_id}: {len(src_pages)} src / {len(dst_pages)} "
                             f"dst pages for num_pages={n}")
        if len(manifest.digests) not in (0, n):
            raise ValueError(f"transfer {manifest.transfer_id}: {len(manifest.digests)} digests for {n} pages")
        pool_bytes.check_pages(list(src_pages), f"transfer {manifest.transfer_id} src")
        return pool_bytes
