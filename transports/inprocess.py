"""`InProcessTransport`: the transport semantics without sockets, for tests and colocated workers.

Endpoints find each other through an explicit `InProcessHub` passed to their constructors (no
global registry). A push copies each page tensor-to-tensor into the receiver's pool, through the
same receiver state machine as TCP (`Receiver`): only an expected, matching transfer is
written, and it succeeds only when the digests recomputed over the landed pages equal the sender's
(the manifest's, or when it has none, the ones computed over the copied source bytes).
The pushing task yields to the event loop every `yield_every_bytes`, so `cancel` (checked before
every page read) and other tasks interleave with large pushes.

Pools on other devices are staged through host memory at both ends (core/staging.py): the sender
copies its source pages to a host buffer a chunk at a time, the receiver lands them in a host
buffer of the transfer and copies them into its pool only once they verified.
"""

from __future__ import annotations

import secrets
from typing import ClassVar

import anyio
import anyio.lowlevel
import torch
from anyio.abc import TaskGroup

from kvfence.transports.base import (EndpointInfo, PairingRecord, PairingRefused, Peer, TransferManifest,
                                     TransferResult)
from kvfence.transports.core.digest import page_digest
from kvfence.transports.core.endpoint import Endpoint, check_pair, pairing_problem
from kvfence.transports.core.pool_bytes import DEFAULT_STAGE_CHUNK_BYTES
from kvfence.transports.core.front_key import FrontPublicKey
from kvfence.transports.core.secret import NONCE_BYTES, AuthenticationFailed, DeploymentSecret
from kvfence.transports.core.staging import SourcePages


class InProcessHub:
    """Address book of in-process endpoints; addresses are "inprocess-<n>", unique per hub."""

    def __init__(self) -> None:
        self._endpoints: dict[str, InProcessTransport] = {}
        self._count = 0

    def register(self, endpoint: InProcessTransport) -> str:
        self._count += 1
        address = f"inprocess-{self._count}"
        self._endpoints[address] = endpoint
        return address

    def unregister(self, address: str) -> None:
        self._endpoints.pop(address, None)

    def lookup(self, address: str) -> InProcessTransport | None:
        return self._endpoints.get(address)


class InProcessPeer(Peer):
    def __init__(self, owner: InProcessTransport, info: EndpointInfo, remote: InProcessTransport) -> None:
        self.owner = owner
        self.info = info
        self.remote = remote


class InProcessTransport(Endpoint):
    name: ClassVar[str] = "inprocess"

    def __init__(self, hub: InProcessHub, *, secret: DeploymentSecret, front_key: FrontPublicKey,
                 yield_every_bytes: int = 4 << 20,
                 stage_through_host: bool | None = None,
                 stage_chunk_bytes: int = DEFAULT_STAGE_CHUNK_BYTES) -> None:
        super().__init__(secret=secret, front_key=front_key, stage_through_host=stage_through_host,
                         stage_chunk_bytes=stage_chunk_bytes)
        self.hub = hub
        self._challenges: dict[bytes, bytes] = {}  # listener nonce -> connector nonce, until answered
        self.yield_every_bytes = yield_every_bytes
        self._paired: set[str] = set()  # incarnations of the senders this endpoint accepted
        self._remotes: list[InProcessTransport] = []  # the endpoints this one paired with

    async def start(self, task_group: TaskGroup, memory: torch.Tensor, record: PairingRecord) -> EndpointInfo:
        """Register the pool and join the hub (no long-lived tasks are needed)."""
        self._register(memory, record)
        self._info = EndpointInfo(self.name, self.hub.register(self), record)
        return self._info

    def _challenge(self, connector_nonce: bytes) -> tuple[bytes, bytes]:
        """The listening side of the handshake (wire/handshake.py), first step: a fresh nonce and our proof."""
        listener_nonce = secrets.token_bytes(NONCE_BYTES)
        self._challenges[listener_nonce] = connector_nonce
        return listener_nonce, self.secret.proof("listener", self.name, connector_nonce, listener_nonce)

    def _accept_pairing(self, sender: EndpointInfo, listener_nonce: bytes, proof: bytes) -> str | None:
        """The receiving side of `pair`, once the sender answered our challenge: why it refuses,
        or None (and the sender may push). A challenge is answered at most once."""
        connector_nonce = self._challenges.pop(listener_nonce, None)
        if connector_nonce is None or not self.secret.proves(proof, "connector", self.name, connector_nonce,
                                                             listener_nonce):
            raise AuthenticationFailed("the peer did not prove the deployment secret")
        if self._closed:
            return "the endpoint is closed"
        if (problem := pairing_problem(self.info, sender)) is None:
            self._paired.add(sender.record.incarnation)
        return problem

    async def pair(self, peer: EndpointInfo) -> Peer:
        """Authenticate both ways (core/secret.py's proofs, without a wire) and pair. PairingRefused on
        any mismatch (either side's verdict); AuthenticationFailed when either side does not prove
        the deployment secret; ConnectionRefusedError when no endpoint of this hub has that address."""
        if self._info is None or self._closed:
            raise RuntimeError("inprocess transport is not serving")
        if peer.transport != self.name:
            raise PairingRefused(f"transport: {self.name!r} != {peer.transport!r}")
        remote = self.hub.lookup(peer.address)
        if remote is None:
            raise ConnectionRefusedError(f"no in-process endpoint at {peer.address!r}")
        connector_nonce = secrets.token_bytes(NONCE_BYTES)
        listener_nonce, listener_proof = remote._challenge(connector_nonce)
        if not self.secret.proves(listener_proof, "listener", self.name, connector_nonce, listener_nonce):
            raise AuthenticationFailed(f"{peer.address}: the peer did not prove the deployment secret")
        proof = self.secret.proof("connector", self.name, connector_nonce, listener_nonce)
        check_pair(self.info, peer, remote._accept_pairing(self.info, listener_nonce, proof), remote.info)
        await anyio.lowlevel.checkpoint()
        self._remotes = [r for r in self._remotes if r is not remote] + [remote]
        return InProcessPeer(self, remote.info, remote)

    def _reachable(self, remote: InProcessTransport) -> bool:
        return (not remote._closed and self.hub.lookup(remote.info.address) is remote
                and self.info.record.incarnation in remote._paired)

    async def push(self, peer: Peer, manifest: TransferManifest, src_pages: list[int],
                   dst_pages: list[int]) -> TransferResult:
        """Copy the pages and return the receiver's verdict ("cancelled" when `cancel` stopped
        it, "peer_lost" when the receiver closed, "transport_closed" when this endpoint did)."""
        pool_bytes = self._check_push(manifest, src_pages, dst_pages)
        if not isinstance(peer, InProcessPeer) or peer.owner is not self:
            raise ValueError("push to a peer this inprocess endpoint did not pair with")
        tid, remote = manifest.transfer_id, peer.remote
        if not self._reachable(remote):
            return TransferResult(tid, False, "peer_lost")
        rx = remote._started()[1]
        out = self._outgoing.add(tid)
        adm = rx.admit(manifest, list(dst_pages), pool_bytes.page_nbytes)
        try:
            source = SourcePages(pool_bytes, src_pages)
            digests: list[str] = []
            since_yield = 0
            for index in range(len(src_pages)):
                if out.cancelled or self._closed or not self._reachable(remote):
                    break
                page = source.page_tensor(index)  # a staged pool's only read: right after the check
                digests.append(page_digest(source.page(index), pool_bytes.digest))
                if (dst := rx.target_tensor(adm, index)) is not None:
                    dst.copy_(page)
                since_yield += pool_bytes.page_nbytes
                if since_yield >= self.yield_every_bytes:
                    since_yield = 0
                    await anyio.lowlevel.checkpoint()
            else:
                return rx.finish(adm, len(src_pages), digests)
            reason = "cancelled" if out.cancelled else "transport_closed" if self._closed else "peer_lost"
            rx.abort(adm, "cancelled" if out.cancelled else "peer_lost")  # as the receiver sees it
            return TransferResult(tid, False, reason)
        finally:
            rx.abort(adm, "cancelled")  # no-op unless the pushing task itself was cancelled
            self._outgoing.remove(out)

    async def health(self) -> bool:
        """Started, not closed, and every paired peer still reachable in the hub."""
        return self._info is not None and not self._closed and all(map(self._reachable, self._remotes))

    async def aclose(self) -> None:
        """Leave the hub and fail everything pending ("transport_closed"); idempotent."""
        if not self._close_once():
            return
        if self._info is not None:
            self.hub.unregister(self._info.address)
        self._fail_pending()
        self._paired.clear()
        self._remotes.clear()
        await anyio.lowlevel.checkpoint()
