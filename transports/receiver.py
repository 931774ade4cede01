"""The receiving half shared by the built-in transports: `ReceiverState` + the pool + waiters.

Transports call `admit` when a push announces itself, write page `i` only into `target(adm, i)`
(which is the pool page while `writable(adm)`, else None: discard), and end every admission with
`finish` or `abort`. Everything runs on the event loop; a pool write must be a synchronous call
made right after checking `writable`, so once `cancel` returns nothing of that transfer is written.
"""

from __future__ import annotations

import anyio

from kvfence.transports.base import TransferManifest, TransferResult
from kvfence.transports.pool_view import PoolView
from kvfence.transports.receiver_state import Admission, ReceiverState


class PoolReceiver:
    def __init__(self, pool: PoolView) -> None:
        self.pool = pool
        self.state = ReceiverState(pool.num_pages, pool.page_nbytes, pool.digest)
        self._waiters: dict[str, anyio.Event] = {}
        self._closed_reason = ""

    def expect(self, manifest: TransferManifest, dst_pages: list[int]) -> None:
        if self._closed_reason:
            raise RuntimeError("the transport is closed")
        self.state.expect(manifest, dst_pages)

    def admit(self, manifest: TransferManifest, dst_pages: list[int], page_nbytes: int) -> Admission:
        adm = self.state.admit(manifest, dst_pages, page_nbytes)
        self._wake(adm.transfer_id)
        return adm

    def writable(self, adm: Admission) -> bool:
        return self.state.writable(adm)

    def target_page(self, adm: Admission, index: int) -> int | None:
        """The pool page that page `index` of the push may be written into now, or None (discard)."""
        if not self.state.writable(adm) or not 0 <= index < len(adm.dst_pages):
            return None
        return adm.dst_pages[index]

    def target(self, adm: Admission, index: int) -> memoryview | None:
        """`target_page` as a writable view of the pool page, or None (discard)."""
        page = self.target_page(adm, index)
        return None if page is None else self.pool.page(page)

    def finish(self, adm: Admission, pages_received: int, sent_digests: list[str]) -> TransferResult:
        """Verify what landed (digests recomputed over the pool pages) and settle the transfer."""
        landed = []
        if self.state.writable(adm) and pages_received == adm.num_pages:
            landed = [self.pool.digest_of(p) for p in adm.dst_pages]
        result = self.state.finish(adm, pages_received, sent_digests, landed)
        self._wake(adm.transfer_id)
        return result

    def abort(self, adm: Admission, reason: str) -> TransferResult:
        result = self.state.abort(adm, reason)
        self._wake(adm.transfer_id)
        return result

    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        """Un-expect a pending transfer (no-op when unknown or finished)."""
        self.state.cancel(transfer_id, reason)
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
        for event in self._waiters.values():
            event.set()
        self._waiters.clear()

    def _wake(self, transfer_id: str) -> None:
        if self.state.result(transfer_id) is not None and (event := self._waiters.pop(transfer_id, None)):
            event.set()
