"""A hypothesis state machine over the whole page lifecycle of a transfer into the decode pool:
reserve, expect, push (admit), page writes, commit, abort, cancel with and without an
acknowledgement, timeout into quarantine, late writes, confirm-quiet and release, all interleaved
across requests, with the real PageLedger and the real receiver state machine (ReceiverState).

The server's rules are modelled as TransferLink and the scheduler apply them: release only when
the transfer is quiet (committed, failed, or its cancel acknowledged), quarantine otherwise.
Writes come in two kinds: gated ones (tcp, inprocess: written only while `writable(adm)`) and
one-sided ones (a WRITE already posted: it lands whatever the receiver now thinks, until the
sender confirms it is terminal).

Checked at every write and after every step: a byte only ever lands in a page owned (or held in
quarantine) by the lease whose transfer wrote it, never in a free page or another lease's; a
committed lease's pages all hold its own bytes; quarantined pages are never handed out; the
receiver's reserved pages belong to their transfer's lease; the ledger accounts for every page.
"""

from __future__ import annotations

import dataclasses
import secrets

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvfence.engine.ids import mint_id
from kvfence.scheduler.core.page_ledger import PageLedger
from kvfence.transports.base import TransferManifest
from kvfence.transports.core.receiver_state import Admission, ReceiverState

NUM_PAGES = 16
PAGE_NBYTES = 4096


@dataclasses.dataclass
class Transfer:
    lease: int
    pages: list[int]
    manifest: TransferManifest
    adm: Admission | None = None
    posted: bool = False  # a one-sided WRITE is in flight: it may land until the sender confirms
    state: str = "reserved"  # reserved | expected | receiving | committed | failed | quarantined | gone


class TransferLifecycle(RuleBasedStateMachine):
    transfers = Bundle("transfers")

    def __init__(self) -> None:
        super().__init__()
        self.ledger = PageLedger(NUM_PAGES)
        self.rx = ReceiverState(NUM_PAGES, PAGE_NBYTES, "xxh3_64")
        self.content: list[int] = [0] * NUM_PAGES  # lease whose bytes each page holds (0: none yet)
        self.by_lease: dict[int, Transfer] = {}

    # -- helpers -------------------------------------------------------------------------------
    def _owner(self, page: int) -> int:
        for lease in list(self.by_lease):
            t = self.by_lease[lease]
            if t.state != "gone" and page in t.pages and (self.ledger.holds(lease) or self.ledger.is_quarantined(lease)):
                return lease
        return 0

    def _land(self, t: Transfer, page: int) -> None:
        """A byte of `t` lands in `page`: the page must be `t`'s (owned or quarantined)."""
        owner = self._owner(page)
        assert owner == t.lease, f"transfer of lease {t.lease:x} wrote page {page}, owned by {owner:x}"
        self.content[page] = t.lease

    def _end_quiet(self, t: Transfer, state: str) -> None:
        t.posted = False
        t.state = state

    # -- rules ---------------------------------------------------------------------------------
    @rule(target=transfers, n=st.integers(1, 5))
    def reserve(self, n: int) -> Transfer | None:
        lease = mint_id()
        pages = self.ledger.reserve(lease, n)
        if pages is None:  # did not fit: the bundle gets a None, which every rule ignores
            return None
        manifest = TransferManifest(transfer_id=secrets.token_hex(16), lease=f"{lease:032x}",
                                    nonce=secrets.token_hex(16), num_tokens=n * 16 - 1, num_pages=n)
        t = Transfer(lease, pages, manifest)
        self.by_lease[lease] = t
        return t

    @rule(t=transfers)
    def expect(self, t: Transfer | None) -> None:
        if t is None or t.state != "reserved":
            return
        self.rx.expect(t.manifest, t.pages)
        t.state = "expected"

    @rule(t=transfers)
    def push_arrives(self, t: Transfer | None) -> None:
        """The sender's push announces itself (also after a cancel: a late push)."""
        if t is None or t.state in ("reserved", "gone") or t.adm is not None:
            return
        t.adm = self.rx.admit(t.manifest, t.pages, PAGE_NBYTES)
        if t.state == "expected":
            assert not t.adm.reject_reason, f"the expected push was refused: {t.adm.reject_reason}"
            t.state, t.posted = "receiving", True
        else:  # cancelled before it arrived: a late push, refused before any byte
            assert t.adm.reject_reason and not self.rx.writable(t.adm)

    @rule(t=transfers, i=st.integers(0, 4), one_sided=st.booleans())
    def write_page(self, t: Transfer | None, i: int, one_sided: bool) -> None:
        """One page's bytes arrive: gated by the receiver, or a one-sided WRITE still in flight."""
        if t is None or t.adm is None or i >= len(t.pages):
            return
        if self.rx.writable(t.adm) or (one_sided and t.posted):
            self._land(t, t.pages[i])

    @rule(t=transfers)
    def commit(self, t: Transfer | None) -> None:
        if t is None or t.state != "receiving" or t.adm is None or not t.adm.live:
            return
        for page in t.pages:  # every page arrived before the sender's end marker
            self._land(t, page)
        digests = ["d"] * len(t.pages)
        result = self.rx.finish(t.adm, len(t.pages), digests, digests)
        assert result.ok, result
        self._end_quiet(t, "committed")

    @rule(t=transfers)
    def abort(self, t: Transfer | None) -> None:
        """The push ended without all its bytes (peer lost, sender gave up): quiet."""
        if t is None or t.state != "receiving" or t.adm is None:
            return
        assert not self.rx.abort(t.adm, "peer_lost").ok
        self._end_quiet(t, "failed")

    @rule(t=transfers, acknowledged=st.booleans())
    def cancel(self, t: Transfer | None, acknowledged: bool) -> None:
        """Timeout or client gone: cancel on both ends. Acknowledged: released now. Not (a one-sided
        WRITE whose end the sender cannot confirm): quarantined, the write may still land."""
        if t is None or t.state not in ("expected", "receiving"):
            return
        self.rx.cancel(t.manifest.transfer_id)
        if acknowledged:
            self._end_quiet(t, "failed")
        else:
            self.ledger.quarantine(t.lease)
            t.state = "quarantined"

    @rule(t=transfers)
    def confirm_quiet(self, t: Transfer | None) -> None:
        if t is None or t.state != "quarantined":
            return
        t.posted = False
        self.ledger.confirm_quiet(t.lease)
        t.state = "gone"

    @rule(t=consumes(transfers))
    def release(self, t: Transfer | None) -> None:
        """The request ended: its pages go back, but only once its transfer is quiet."""
        if t is None or t.state not in ("reserved", "committed", "failed"):
            return
        assert not t.posted, "released pages a WRITE could still reach"
        self.ledger.release(t.lease)
        t.state = "gone"

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def ledger_accounts_for_every_page(self) -> None:
        self.ledger.check_integrity()

    @invariant()
    def committed_pages_hold_their_own_bytes(self) -> None:
        for t in self.by_lease.values():
            if t.state == "committed":
                assert all(self.content[p] == t.lease for p in t.pages)

    @invariant()
    def receiver_reservations_belong_to_their_lease(self) -> None:
        for t in self.by_lease.values():
            if self.rx.pending(t.manifest.transfer_id):
                assert self.ledger.pages(t.lease) == t.pages

    @invariant()
    def posted_writes_only_target_held_pages(self) -> None:
        for t in self.by_lease.values():
            if t.posted:
                assert self.ledger.holds(t.lease) or self.ledger.is_quarantined(t.lease)


TestTransferLifecycle = TransferLifecycle.TestCase
TestTransferLifecycle.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
