"""A hypothesis state machine over the page ledger's lifecycle: reserve, grow (a decoding lease
gets one page at a time as its sequence grows), release, time out into quarantine (at a time the
caller passes), confirm quiet; and the prefix cache's shared pages: seal (a lease's filled pages
become cached, read-only), share (a later lease reads cached pages by reference), evict (idle cached
pages are freed for a reservation), flush. After every step: every page is in exactly one place,
quarantined and sealed pages are never handed out, a page is free only when no lease and no cache
entry holds it, and the accounting (including what can still become free and since when pages are
quarantined) matches a plain model of it."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvfence.engine.ids import mint_id
from kvfence.scheduler.core.page_ledger import PageLedger

NUM_PAGES = 24


class LedgerLifecycle(RuleBasedStateMachine):
    live = Bundle("live")
    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.ledger = PageLedger(NUM_PAGES)
        self.model_live: dict[int, list[int]] = {}
        self.model_held: dict[int, list[int]] = {}
        self.model_since: dict[int, float] = {}  # lease -> when its quarantine began
        self.clock_s = 0.0
        self.model_refs: dict[int, list[int]] = {}  # lease (live or quarantined) -> sealed pages it holds
        self.model_cached: dict[bytes, int] = {}  # cache key -> page
        self.keys = 0

    def _sealed(self) -> set[int]:
        return {p for ps in self.model_refs.values() for p in ps} | set(self.model_cached.values())

    def _idle(self) -> set[int]:
        return set(self.model_cached.values()) - {p for ps in self.model_refs.values() for p in ps}

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
        assert not set(pages) & self._sealed(), "a sealed page was handed out"
        self.model_live[lease] = list(pages)
        return lease

    @rule(lease=live, n=st.integers(1, 4))
    def grow(self, lease: int, n: int) -> None:
        if lease not in self.model_live:
            return
        free_before = self.ledger.num_free
        pages = self.ledger.reserve(lease, n)
        if pages is None:
            assert n > free_before and self.ledger.pages(lease) == self.model_live[lease]  # unchanged
            return
        assert len(pages) == n and not set(pages) & {p for ps in self.model_held.values() for p in ps}
        self.model_live[lease] += pages
        assert self.ledger.pages(lease)[-n:] == pages  # appended: the page table keeps its order

    @rule(lease=live)
    def grow_one_page(self, lease: int) -> None:
        """A decode step's token lands in a page the lease does not own yet: one page more, or
        None (then the scheduler preempts or waits) with nothing changed."""
        self.grow(lease, 1)

    @rule(lease=consumes(live))
    def release(self, lease: int) -> None:
        freed = self.ledger.release(lease)
        refs = self.model_refs.pop(lease, [])
        still = self._sealed()
        assert freed == self.model_live.pop(lease, []) + [p for p in reversed(refs) if p not in still]

    @rule(lease=live, n=st.integers(1, 3))
    def seal(self, lease: int, n: int) -> None:
        """The lease filled its first pages: they become cached under fresh keys."""
        owned = self.model_live.get(lease, [])[:n]
        keys = [self._key() for _ in owned]
        assert self.ledger.seal(lease, owned, keys) == owned
        for page, key in zip(owned, keys):
            self.model_live[lease].remove(page)
            self.model_refs.setdefault(lease, []).append(page)
            self.model_cached[key] = page
        if lease in self.model_live and not self.model_live[lease] and lease not in self.model_refs:
            del self.model_live[lease]

    def _key(self) -> bytes:
        self.keys += 1
        return self.keys.to_bytes(4, "little")

    @rule(target=live, data=st.data())
    def share(self, data: st.DataObject) -> int:
        """A new lease finds a run of cached pages and reads them."""
        lease = mint_id()
        if self.model_cached:
            keys = data.draw(st.lists(st.sampled_from(sorted(self.model_cached)), max_size=3, unique=True))
            pages = [self.model_cached[k] for k in keys]
            assert self.ledger.lookup(keys) == pages
            self.ledger.share(lease, pages)
            self.model_refs[lease] = list(pages)
            self.model_live[lease] = []
        return lease

    @rule(n=st.integers(1, 6))
    def evict(self, n: int) -> None:
        idle = self._idle()
        evicted = self.ledger.evict(n)
        assert len(evicted) == min(n, len(idle)) and set(evicted) <= idle  # only pages nobody holds
        self.model_cached = {k: p for k, p in self.model_cached.items() if p not in evicted}

    @rule()
    def flush(self) -> None:
        idle = self._idle()
        assert set(self.ledger.flush()) == idle
        self.model_cached.clear()

    @rule(target=held, lease=consumes(live), dt=st.floats(0, 5))
    def time_out(self, lease: int, dt: float) -> int:
        """A transfer into these pages timed out: they go to quarantine, never to free."""
        self.clock_s += dt
        pages = self.ledger.quarantine(lease, self.clock_s)
        assert pages == self.model_live.pop(lease, [])
        if pages or lease in self.model_refs:
            self.model_held[lease] = pages
            self.model_since[lease] = self.clock_s
        return lease

    @rule(lease=consumes(held))
    def confirm_quiet(self, lease: int) -> None:
        """The cancellation was acknowledged (or the late write landed and finished)."""
        refs = self.model_refs.pop(lease, [])
        still = self._sealed()
        assert self.ledger.confirm_quiet(lease) == self.model_held.pop(lease, []) + [
            p for p in reversed(refs) if p not in still]
        self.model_since.pop(lease, None)

    @rule(lease=held)
    def release_of_quarantined_is_refused(self, lease: int) -> None:
        assert self.ledger.release(lease) == []  # only confirm_quiet frees quarantined pages

    @invariant()
    def accounted(self) -> None:
        self.ledger.check_integrity()
        live = sum(len(p) for p in self.model_live.values())
        held = sum(len(p) for p in self.model_held.values())
        held_shared = {p for lease in self.model_held for p in self.model_refs.get(lease, [])}
        sealed = self._sealed()
        assert self.ledger.num_quarantined == held + len(held_shared)
        assert self.ledger.num_free == NUM_PAGES - live - held - len(sealed)  # free only when nobody holds it
        assert self.ledger.num_cached_idle == len(self._idle())
        assert self.ledger.num_in_use == live + held + len(sealed - self._idle())
        # live pages come back, quarantined ones (and sealed pages a quarantine reads) may not
        assert self.ledger.num_reclaimable == NUM_PAGES - held - len(held_shared)
        assert self.ledger.quarantined_since == min(self.model_since.values(), default=None)
        assert set(self.ledger.quarantined_leases()) == set(self.model_held)
        for lease, pages in self.model_held.items():
            assert self.ledger.quarantined_pages(lease) == pages
        for lease, pages in self.model_live.items():
            assert self.ledger.pages(lease) == pages
        for lease, pages in self.model_refs.items():
            assert self.ledger.shared_pages(lease) == pages


TestLedgerLifecycle = LedgerLifecycle.TestCase
TestLedgerLifecycle.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
