"""The receiving half shared by the built-in transports: `ReceiverState` + the pool + waiters.

Transports call `admit` when a push announces itself, write page `i` only into `target(adm, i)` /
`target_tensor(adm, i)` (a writable view while `writable(adm)`, else None: discard), and end every
admission with `finish` or `abort`. Everything runs on the event loop; a write must be a
synchronous call made right after asking for the target, so once `cancel` returns nothing of that
transfer is written.

Host pools: the targets are the pool's own pages, and `finish` recomputes the digests over them.

Staged pools (not on the CPU; see core/staging.py) verify, then copy: an accepted push gets a host
buffer of its whole transfer at `admit` (never a rejected one; the size of the dst pages the
server reserved for it, and since those are disjoint between pending transfers, all buffers
together never exceed the pool). The targets are that buffer's pages; `finish` recomputes the
digests over the staged bytes and copies them into the dst pages only when the transfer verifies,
as one synchronous step before the transfer is settled. So a failed, cancelled or aborted transfer
never touches the pool, and a verified one lands in exactly its dst pages. (The alternative,
copying each page into the pool as it arrives, would need only a page of host memory but leaves a
failed transfer's bytes in its dst pages.) The buffer is dropped when the transfer ends in any way.
"""

from __future__ import annotations

import logging

import anyio
import torch

from kvfence.transports.base import TransferManifest, TransferResult
from kvfence.transports.core.digest import page_digest
from kvfence.transports.core.pool_bytes import PoolBytes
from kvfence.transports.core.receiver_state import Admission, CapabilityCheck, ReceiverState
from kvfence.transports.core.staging import copy_pages, host_pages, host_view

log = logging.getLogger(__name__)


class Receiver:
    """A `ReceiverState` over the registered bytes of one pool (`PoolBytes`), with waiters."""

    def __init__(self, pool_bytes: PoolBytes, capability: CapabilityCheck | None = None,
                 page_size_tokens: int = 0) -> None:
        self.pool_bytes = pool_bytes
        self.state = ReceiverState(pool_bytes.num_pages, pool_bytes.page_nbytes, pool_bytes.digest,
                                   capability=capability, page_size_tokens=page_size_tokens)
        self._waiters: dict[str, anyio.Event] = {}
        self._staging: dict[Admission, torch.Tensor] = {}  # live admissions of a staged pool
        self._closed_reason = ""

    def expect(self, manifest: TransferManifest, dst_pages: list[int]) -> None:
        if self._closed_reason:
            raise RuntimeError("the transport is closed")
        self.state.expect(manifest, dst_pages)

    def admit(self, manifest: TransferManifest, dst_pages: list[int], page_nbytes: int) -> Admission:
        adm = self.state.admit(manifest, dst_pages, page_nbytes)
        if adm.live and self.pool_bytes.staged:
            self._staging[adm] = host_pages(adm.num_pages, self.pool_bytes.page_nbytes, self.pool_bytes.device)
        self._wake(adm.transfer_id)
        return adm

    def writable(self, adm: Admission) -> bool:
        return self.state.writable(adm)

    def target_tensor(self, adm: Admission, index: int) -> torch.Tensor | None:
        """Where page `index` of the push may be written now, as a uint8 host tensor (the pool
        page, or its staging page), or None (discard)."""
        if not self.state.writable(adm) or not 0 <= index < len(adm.dst_pages):
            return None
        if (staging := self._staging.get(adm)) is not None:
            return staging[index]
        return self.pool_bytes.page_tensor(adm.dst_pages[index])

    def target(self, adm: Admission, index: int) -> memoryview | None:
        """`target_tensor` as writable bytes, or None (discard)."""
        if not self.state.writable(adm) or not 0 <= index < len(adm.dst_pages):
            return None
        if (staging := self._staging.get(adm)) is not None:
            return host_view(staging[index])
        return self.pool_bytes.page(adm.dst_pages[index])

    def finish(self, adm: Admission, pages_received: int, sent_digests: list[str]) -> TransferResult:
        """Verify what landed (digests recomputed over the pool pages, or over the staged bytes,
        which are then copied into the pool if and only if they verify) and settle the transfer."""
        staging = self._staging.pop(adm, None)
        landed = []
        if self.state.writable(adm) and pages_received == adm.num_pages:
            if staging is None:
                landed = [self.pool_bytes.digest_of(p) for p in adm.dst_pages]
            else:
                landed = [page_digest(host_view(page), self.pool_bytes.digest) for page in staging]
                if not self.state.judge(adm, pages_received, sent_digests, landed) and not self._commit(adm, staging):
                    return self.abort(adm, "staging_failed")
        result = self.state.finish(adm, pages_received, sent_digests, landed)
        self._wake(adm.transfer_id)
        return result

    def _commit(self, adm: Admission, staging: torch.Tensor) -> bool:
        """Copy a verified transfer's staged pages into its dst pages (synchronous). False when the
        copy failed (e.g. a device error): the transfer then fails, its dst pages may be partly
        written and are released by the server only as a failed transfer's pages; the transport
        and the server carry on."""
        try:
            copy_pages(self.pool_bytes.pages, adm.dst_pages, staging, range(adm.num_pages))
        except Exception:
            log.exception("transfer %s: copying the verified pages into the pool failed", adm.transfer_id)
            return False
        return True

    def abort(self, adm: Admission, reason: str) -> TransferResult:
        self._staging.pop(adm, None)
        result = self.state.abort(adm, reason)
        self._wake(adm.transfer_id)
        return result

    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        """Un-expect a pending transfer (no-op when unknown or finished)."""
        self.state.cancel(transfer_id, reason)
        self._drop_dead_staging()
        self._wake(transfer_id)

    async def completion(self, transfer_id: str) -> TransferResult:
        """Wait for the transfer's result; KeyError when it was never expected (or long forgotten)."""
        while (result := self.state.result(transfer_id)) is None:
            if not self.state.pending(transfer_id):
                raise KeyError(f"transfer {transfer_id} is not expected")
            event = self._waiters.setdefault(transfer_id, anyio.Event())
            await event.wait()
        return result

    def close(self, reason: str = "transport_closed") -> None:
        """Fail every pending transfer with `reason` and refuse new expectations; idempotent."""
        self._closed_reason = self._closed_reason or reason
        for tid in self.state.pending_ids():
            self.state.cancel(tid, reason)
        self._staging.clear()
        for event in self._waiters.values():
            event.set()
        self._waiters.clear()

    def staging_nbytes(self) -> int:
        """Host bytes held for staged transfers now being received."""
        return sum(t.numel() for t in self._staging.values())

    def _drop_dead_staging(self) -> None:
        for adm in [a for a in self._staging if not a.live]:
            del self._staging[adm]

    def _wake(self, transfer_id: str) -> None:
        if self.state.result(transfer_id) is not None and (event := self._waiters.pop(transfer_id, None)):
            event.set()
