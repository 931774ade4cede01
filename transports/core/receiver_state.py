"""The receiver's protocol state machine, pure: no I/O, no awaits, no pool access.

Per transfer id:  EXPECTED --admit--> RECEIVING --finish/abort--> FINISHED
                  EXPECTED --admit (mismatch) / cancel--> FINISHED (failed)
                  RECEIVING --cancel--> FINISHED ("cancelled"; remaining bytes are discarded)

`admit` decides whether a push may land in the pool: only an EXPECTED transfer whose manifest
(transfer_id, lease, nonce, num_pages, num_tokens, capability), page size and dst pages equal what
was expected. With a `capability` check (every endpoint has one: the front end's signature, see
core/front_key.py; none with the capability guard off, app/serve/guards.py), `expect` refuses a manifest
whose capability does not verify for its dst pages,
and `admit` refuses such a push ("capability") before anything else (a push identical to the
expectation it names, capability and dst pages included, was verified at `expect`: the signature is
not checked twice over the same bytes); when it names an expected
transfer, that transfer fails with it (the push that arrived for it is not the planned one).
Any other push gets a rejected `Admission` (its bytes must be read into scratch and dropped). A
push that names an expected transfer but does not match it fails that transfer.
`writable(adm)` is the single gate for pool writes; it turns False for good the moment the
transfer finishes or is cancelled, so a caller that checks it right before each synchronous write
never writes after `cancel` returned.

FINISHED results are remembered (the latest `remember` of them) for `result` and for rejecting
duplicate pushes; an evicted id is treated as unknown (its push is "unexpected_transfer": still
never written).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvfence.transports.base import TransferManifest, TransferResult
from kvfence.transports.core.pool_bytes import check_pages


def _covered(manifest: TransferManifest) -> tuple[object, ...]:
    """The fields of a manifest its capability covers, with the capability itself."""
    return manifest.lease, manifest.nonce, manifest.num_pages, manifest.num_tokens, manifest.capability


@dataclass(eq=False)
class Admission:
    """One push as the receiver sees it. `reject_reason` "" means accepted (may be written)."""

    transfer_id: str
    dst_pages: tuple[int, ...]
    num_pages: int
    digests: tuple[str, ...]  # from the pushed manifest; empty: the sender sends them at the end
    reject_reason: str
    live: bool = False  # accepted and neither finished nor cancelled


CapabilityCheck = Callable[[TransferManifest, Sequence[int]], bool]


class ReceiverState:
    def __init__(self, num_pages: int, page_nbytes: int, digest: str, remember: int = 65536,
                 capability: CapabilityCheck | None = None, page_size_tokens: int = 0) -> None:
        """`page_size_tokens` (0: unknown): a manifest must name exactly the pages its tokens fill."""
        self.num_pages = num_pages
        self.page_size_tokens = page_size_tokens
        self._capability = capability
        self.page_nbytes = page_nbytes
        self.digest = digest
        self._remember = remember
        self._expected: dict[str, tuple[TransferManifest, tuple[int, ...]]] = {}
        self._receiving: dict[str, tuple[Admission, TransferManifest]] = {}
        self._finished: OrderedDict[str, TransferResult] = OrderedDict()
        self._reserved: set[int] = set()  # dst pages of EXPECTED and RECEIVING transfers

    # -- queries ---------------------------------------------------------------------------
    def result(self, transfer_id: str) -> TransferResult | None:
        return self._finished.get(transfer_id)

    def pending(self, transfer_id: str) -> bool:
        return transfer_id in self._expected or transfer_id in self._receiving

    def pending_ids(self) -> list[str]:
        return [*self._expected, *self._receiving]

    def receiving(self, transfer_id: str) -> bool:
        """Admitted and not finished: its push is landing."""
        return transfer_id in self._receiving

    def writable(self, adm: Admission) -> bool:
        return adm.live

    # -- transitions -----------------------------------------------------------------------
    def expect(self, manifest: TransferManifest, dst_pages: list[int]) -> None:
        """Make `manifest` EXPECTED into `dst_pages`; ValueError on a capability that does not
        verify, a reused id, bad pages or pages already reserved by another pending transfer."""
        tid = manifest.transfer_id
        if self._capability is not None and not self._capability(manifest, dst_pages):
            raise ValueError(f"transfer {tid}: refused: capability (it does not verify for this lease, nonce, "
                             f"these pages and this receiver's incarnation)")
        if self.pending(tid) or tid in self._finished:
            raise ValueError(f"transfer {tid} is already expected or finished")
        if manifest.num_pages < 1 or len(dst_pages) != manifest.num_pages:
            raise ValueError(f"transfer {tid}: {len(dst_pages)} dst pages for num_pages={manifest.num_pages}")
        if self.page_size_tokens and manifest.num_pages != -(-manifest.num_tokens // self.page_size_tokens):
            raise ValueError(f"transfer {tid}: plan: {manifest.num_pages} pages for {manifest.num_tokens} tokens "
                             f"of {self.page_size_tokens} per page")
        if len(manifest.digests) not in (0, manifest.num_pages):
            raise ValueError(f"transfer {tid}: {len(manifest.digests)} digests for {manifest.num_pages} pages")
        check_pages(dst_pages, self.num_pages, f"transfer {tid} dst")
        if busy := self._reserved.intersection(dst_pages):
            raise ValueError(f"transfer {tid}: dst pages {sorted(busy)} belong to another pending transfer")
        self._expected[tid] = (manifest, tuple(dst_pages))
        self._reserved.update(dst_pages)

    def admit(self, manifest: TransferManifest, dst_pages: list[int], page_nbytes: int) -> Admission:
        """Decide what to do with the bytes of a push that announces itself like this."""
        tid = manifest.transfer_id

        def rejected(reason: str) -> Admission:
            return Admission(transfer_id=tid, dst_pages=tuple(dst_pages), num_pages=manifest.num_pages,
                             digests=tuple(manifest.digests), reject_reason=reason)

        armed = self._expected.get(tid)
        verified = armed is not None and tuple(dst_pages) == armed[1] and _covered(manifest) == _covered(armed[0])
        if self._capability is not None and not verified and not self._capability(manifest, dst_pages):
            if (entry := self._expected.pop(tid, None)) is not None:  # a push of it that nobody planned
                self._reserved.difference_update(entry[1])
                self._record(TransferResult(tid, False, "capability"))
            return rejected("capability")
        if tid in self._receiving:
            return rejected("duplicate")
        if (done := self._finished.get(tid)) is not None:
            return rejected("cancelled" if done.reason == "cancelled" else "duplicate")
        if tid not in self._expected:
            return rejected("unexpected_transfer")
        want, want_dst = self._expected.pop(tid)
        reason = ""
        if page_nbytes != self.page_nbytes:
            reason = "page_size_mismatch"
        elif (manifest.lease, manifest.nonce, manifest.num_pages, manifest.num_tokens) != (
                want.lease, want.nonce, want.num_pages, want.num_tokens) \
                or len(manifest.digests) not in (0, manifest.num_pages):
            reason = "manifest_mismatch"
        elif tuple(dst_pages) != want_dst:
            reason = "dst_mismatch"
        elif manifest.capability != want.capability:
            reason = "capability"
        if reason:
            self._reserved.difference_update(want_dst)
            self._record(TransferResult(tid, False, reason))
            return rejected(reason)
        adm = Admission(transfer_id=tid, dst_pages=want_dst, num_pages=want.num_pages, digests=tuple(manifest.digests),
                        reject_reason="", live=True)
        self._receiving[tid] = (adm, want)
        return adm

    def finish(self, adm: Admission, pages_received: int, sent_digests: list[str],
               landed_digests: list[str]) -> TransferResult:
        """The push ended normally; returns the verdict for the sender.

        `landed_digests`: recomputed over the dst pages (only needed when `writable(adm)` and
        all pages arrived). Reference digests: the pushed manifest's if it had them, else
        `sent_digests` (what the sender computed over the bytes it sent); an expected manifest
        that carried digests must agree too."""
        if not adm.live:
            return self._verdict_for_dead(adm)
        reason = self.judge(adm, pages_received, sent_digests, landed_digests)
        return self._close(adm, TransferResult(adm.transfer_id, not reason, reason))

    def judge(self, adm: Admission, pages_received: int, sent_digests: list[str],
              landed_digests: list[str]) -> str:
        """Why `finish` with these arguments would fail a live admission ("": it would succeed);
        no transition. Lets a staged receiver copy into the pool only what `finish` will accept."""
        if not adm.live:
            raise ValueError(f"transfer {adm.transfer_id}: judging an admission that is not live")
        _, want = self._receiving[adm.transfer_id]
        reference = list(adm.digests) or list(sent_digests)
        if pages_received != adm.num_pages:
            return "short_transfer"
        if len(reference) != adm.num_pages or len(landed_digests) != adm.num_pages:
            return "manifest_mismatch"
        if landed_digests != reference or (want.digests and list(want.digests) != reference):
            return "digest_mismatch"
        return ""

    def abort(self, adm: Admission, reason: str) -> TransferResult:
        """The push ended without all its bytes (sender cancelled, peer lost, ...)."""
        if not adm.live:
            return self._verdict_for_dead(adm)
        return self._close(adm, TransferResult(adm.transfer_id, False, reason))

    def cancel(self, transfer_id: str, reason: str = "cancelled") -> TransferResult | None:
        """Fail a pending transfer; afterwards nothing of it is ever written. None if not pending."""
        if (entry := self._expected.pop(transfer_id, None)) is not None:
            self._reserved.difference_update(entry[1])
            return self._record(TransferResult(transfer_id, False, reason))
        if (rx := self._receiving.get(transfer_id)) is not None:
            return self._close(rx[0], TransferResult(transfer_id, False, reason))
        return None

    # -- helpers ---------------------------------------------------------------------------
    def _verdict_for_dead(self, adm: Admission) -> TransferResult:
        if adm.reject_reason:
            return TransferResult(adm.transfer_id, False, adm.reject_reason)
        return self._finished.get(adm.transfer_id) or TransferResult(adm.transfer_id, False, "cancelled")

    def _close(self, adm: Admission, result: TransferResult) -> TransferResult:
        adm.live = False
        del self._receiving[adm.transfer_id]
        self._reserved.difference_update(adm.dst_pages)
        return self._record(result)

    def _record(self, result: TransferResult) -> TransferResult:
        self._finished[result.transfer_id] = result
        while len(self._finished) > self._remember:
            self._finished.popitem(last=False)
        return result
