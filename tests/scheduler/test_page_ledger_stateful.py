"""A hypothesis state machine over the page ledger's lifecycle: reserve, grow, release, time out
into quarantine, confirm quiet. After every step: every page is in exactly one place, quarantined
pages are never handed out, and the accounting matches a plain model of it."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvfence.scheduler.ids import mint_id
from kvfence.scheduler.page_ledger import PageLedger

NUM_PAGES = 24


class LedgerLifecycle(RuleBasedStateMachine):
    live = Bundle("live")
    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.ledger = PageLedger(NUM_PAGES)
        self.model_live: dict[int, list[int]] = {}
        self.model_held: dict[int, list[int]] = {}

    @rule(target=live, n=st.integers(0, 10))
    def reserve(self, n: int) -> int:
        lease = mint_id()
        free_before = self.ledger.num_free
        pages = self.ledger.reserve(lease, n)
        if pages is None:
            assert n > free_before and self.ledger.num_free == free_before  # all or nothing
            return lease  # holds nothing; releasing it later is a no-op
        quarantined = {p for ps in self.model_held.values() for p in ps}
        assert not set(pages) & quarantined, "a quarantined page was handed out"
        self.model_live[lease] = list(pages)
        return lease

    @rule(lease=live, n=st.integers(1, 4))
    def grow(self, lease: int, n: int) -> None:
        if lease not in self.model_live:
            return
        pages = self.ledger.reserve(lease, n)
        if pages is not None:
            self.model_live[lease] += pages

    @rule(lease=consumes(live))
    def release(self, lease: int) -> None:
        freed = self.ledger.release(lease)
        assert freed == self.model_live.pop(lease, [])

    @rule(target=held, lease=consumes(live))
    def time_out(self, lease: int) -> int:
        """A transfer into these pages timed out: they go to quarantine, never to free."""
        pages = self.ledger.quarantine(lease)
        assert pages == self.model_live.pop(lease, [])
        if pages:
            self.model_held[lease] = pages
        return lease

    @rule(lease=consumes(held))
    def confirm_quiet(self, lease: int) -> None:
        """The cancellation was acknowledged (or the late write landed and finished)."""
        assert self.ledger.confirm_quiet(lease) == self.model_held.pop(lease, [])

    @rule(lease=held)
    def release_of_quarantined_is_refused(self, lease: int) -> None:
        assert self.ledger.release(lease) == []  # only confirm_quiet frees quarantined pages

    @invariant()
    def accounted(self) -> None:
        self.ledger.check_integrity()
        live = sum(len(p) for p in self.model_live.values())
        held = sum(len(p) for p in self.model_held.values())
        assert self.ledger.num_quarantined == held
        assert self.ledger.num_free == NUM_PAGES - live - held
        for lease, pages in self.model_live.items():
            assert self.ledger.pages(lease) == pages


TestLedgerLifecycle = LedgerLifecycle.TestCase
TestLedgerLifecycle.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
