"""Which pages of one KV pool are free, and who holds each of the others: one lease, a
quarantine, or the prefix cache.

Plain Python (no torch, no I/O) so it can be tested exhaustively. Running out of pages is a
return value (`None`), not an exception; a broken invariant is an exception with the numbers.

Invariant: every page is in exactly one place:
- the free queue;
- owned by one live lease (its page table, in order);
- quarantined under one lease (a transfer may still write or read it; it returns to the free
  queue only when that is confirmed, and never on a timeout);
- sealed: read-only prompt KV shared by reference count. A sealed page is held by the leases
  that reference it (live or quarantined) and, while it is cached, by its cache entry under a
  key (scheduler/core/prefix_cache.py: a chain hash salted with the tenant). It is free only when no
  lease and no cache entry holds it: a cached page nobody references is idle, and idle pages are
  evicted least recently used first when a reservation needs them.

A lease may grow: `reserve` again appends pages to its table (a decoding sequence gets the page
its next token lands in when it needs it). The ledger keeps no clock: the caller passes the time
a quarantine began, and `quarantined_since` reports the oldest.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence


class LedgerError(RuntimeError):
    """An invariant of the ledger was broken (a bug, never a capacity problem)."""


class PageLedger:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._owned: dict[int, list[int]] = {}  # lease -> its pages, in page-table order
        self._quarantined: dict[int, list[int]] = {}  # lease -> pages a write may still reach
        self._quarantined_s: dict[int, float] = {}  # lease -> when its quarantine began (caller's clock)
        self._refs: dict[int, list[int]] = {}  # lease (live or quarantined) -> sealed pages it holds
        self._refcount: dict[int, int] = {}  # sealed page -> leases holding it
        self._key_of: dict[int, Hashable] = {}  # cached sealed page -> its cache key
        self._page_of: dict[Hashable, int] = {}  # cache key -> its page
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages no lease holds, evicted first-in first

    # ---- counts ----

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages not free: held by a lease, quarantined, or cached."""
        return self.num_pages - len(self._free)

    @property
    def num_cached_idle(self) -> int:
        """Cached pages no lease holds: evictable at once."""
        return len(self._idle)

    @property
    def num_in_use(self) -> int:
        """Pages some lease or quarantine holds (not free, not idle in the cache): 0 when no request
        is in flight, whatever the cache holds."""
        return self.num_used - len(self._idle)

    @property
    def num_sealed(self) -> int:
        return len(self._refcount)

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    @property
    def num_quarantined(self) -> int:
        """Pages a quarantine holds: those its leases owned, and sealed pages they share (a posted
        write may still read them); none may come back."""
        shared = {p for lease in self._quarantined for p in self._refs.get(lease, ())}
        return sum(len(p) for p in self._quarantined.values()) + len(shared)

    @property
    def num_reclaimable(self) -> int:
        """Pages that are free or can still become free: all but the quarantined ones, which may
        never come back. A request needing more than this can never fit."""
        return self.num_pages - self.num_quarantined

    @property
    def quarantined_since(self) -> float | None:
        """When the oldest quarantine still in force began (as passed to `quarantine`); None if none."""
        return min(self._quarantined_s.values(), default=None)

    # ---- leases ----

    def can_reserve(self, num_pages: int, pinned: Sequence[int] = ()) -> bool:
        """`num_pages` new pages can be had, evicting idle cached pages if need be, once the sealed
        `pinned` pages (a cache hit the same reservation will share) are no longer evictable."""
        return num_pages <= len(self._free) + len(self._idle) - sum(1 for p in pinned if p in self._idle)

    def reserve(self, lease: int, num_pages: int) -> list[int] | None:
        """Hand `num_pages` free pages more to `lease` (appended to its table); None if too few are
        free (evict idle cached pages first, `evict`). Returns only the newly reserved pages. All or
        nothing: nothing changes on None."""
        self._check_lease(lease)
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if num_pages > len(self._free):
            return None
        new = [self._free.popleft() for _ in range(num_pages)]
        self._owned.setdefault(lease, []).extend(new)
        return new

    def _check_lease(self, lease: int) -> None:
        if lease == 0:
            raise ValueError("lease 0 is reserved for free pages")
        if lease in self._quarantined:
            raise ValueError("a quarantined lease cannot take pages")

    def pages(self, lease: int) -> list[int]:
        """The pages `lease` owns, in page-table order (empty if it owns none)."""
        return list(self._owned.get(lease, ()))

    def shared_pages(self, lease: int) -> list[int]:
        """The sealed pages `lease` holds a reference on (live or quarantined)."""
        return list(self._refs.get(lease, ()))

    def holds(self, lease: int) -> bool:
        """`lease` is live and owns or shares some page."""
        return lease in self._owned or (lease in self._refs and lease not in self._quarantined)

    def release(self, lease: int) -> list[int]:
        """Return every page `lease` owns to the free queue and drop its references on sealed pages
        (a cached one nobody holds any more becomes idle, an uncached one free); returns the pages
        freed. Unknown or quarantined lease: []."""
        if lease in self._quarantined:
            return []
        pages = self._owned.pop(lease, [])
        self._free.extend(pages)
        return pages + self._drop_refs(lease)

    def quarantine(self, lease: int, now_s: float = 0.0) -> list[int]:
        """Take every page of `lease` out of use without freeing it (a write may still land, or a
        read still run), sealed pages it shares included; `now_s`: when, on the caller's clock
        (reported by `quarantined_since`). Returns the pages it owned."""
        pages = self._owned.pop(lease, [])
        if pages or lease in self._refs:
            self._quarantined[lease] = pages
            self._quarantined_s[lease] = now_s
        return pages

    def is_quarantined(self, lease: int) -> bool:
        return lease in self._quarantined

    def quarantined_pages(self, lease: int) -> list[int]:
        """The pages `lease` owned when it was quarantined (empty if none)."""
        return list(self._quarantined.get(lease, ()))

    def quarantined_leases(self) -> list[int]:
        """The leases whose pages are quarantined, oldest quarantine first."""
        return sorted(self._quarantined, key=self._quarantined_s.__getitem__)

    def confirm_quiet(self, lease: int) -> list[int]:
        """The transport confirmed no write can reach the quarantined pages of `lease`: free them,
        and drop its references on sealed pages. Returns the pages freed."""
        if lease not in self._quarantined:
            return []
        pages = self._quarantined.pop(lease)
        self._quarantined_s.pop(lease, None)
        self._free.extend(pages)
        return pages + self._drop_refs(lease)

    # ---- sealed pages and the cache ----

    def lookup(self, keys: Iterable[Hashable]) -> list[int]:
        """The cached pages of the longest run of `keys`, from the first: a chain stops at its first miss."""
        hits: list[int] = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            hits.append(page)
        return hits

    def is_sealed(self, page: int) -> bool:
        return page in self._refcount

    def seal(self, lease: int, pages: Sequence[int], keys: Sequence[Hashable]) -> list[int]:
        """Pages `lease` owns and filled, which no one writes again, become sealed and cached under
        `keys` (one each); the lease keeps a reference and reads them as before. A page whose key
        is already cached (another lease of the same prefix sealed it first) stays the lease's own.
        Returns the pages sealed."""
        owned = self._owned.get(lease, [])
        sealed: list[int] = []
        for page, key in zip(pages, keys, strict=True):
            if key in self._page_of:
                continue
            if page not in owned:
                raise LedgerError(f"lease {lease:#x} cannot seal page {page}, which it does not own")
            owned.remove(page)
            self._refcount[page] = 1
            self._refs.setdefault(lease, []).append(page)
            self._key_of[page], self._page_of[key] = key, page
            sealed.append(page)
        if lease in self._owned and not owned:
            del self._owned[lease]
        return sealed

    def share(self, lease: int, pages: Sequence[int]) -> None:
        """`lease` reads these cached pages (a prefix hit): each gains a reference, so none is
        evicted while the lease holds it."""
        self._check_lease(lease)
        for page in pages:
            if page not in self._key_of:
                raise LedgerError(f"page {page} is not cached and cannot be shared")
            self._refcount[page] += 1
            self._idle.pop(page, None)
        self._refs.setdefault(lease, []).extend(pages)

    def evict(self, num_pages: int) -> list[int]:
        """Free up to `num_pages` idle cached pages, least recently used first (a chain's tail
        before its head); returns them."""
        evicted: list[int] = []
        while self._idle and len(evicted) < num_pages:
            page, _ = self._idle.popitem(last=False)
            self._uncache(page)
            self._free_sealed(page)
            evicted.append(page)
        return evicted

    def flush(self) -> list[int]:
        """Drop every cache entry: idle pages are freed now (returned), pages leases still read stay
        sealed until the last of them lets go."""
        for page in list(self._key_of):
            self._uncache(page)
        freed = list(self._idle)
        self._idle.clear()
        for page in freed:
            self._free_sealed(page)
        return freed

    def _uncache(self, page: int) -> None:
        del self._page_of[self._key_of.pop(page)]

    def _free_sealed(self, page: int) -> None:
        del self._refcount[page]
        self._free.append(page)

    def _drop_refs(self, lease: int) -> list[int]:
        """Drop `lease`'s references; returns the sealed pages that became free (uncached, unheld)."""
        freed: list[int] = []
        for page in reversed(self._refs.pop(lease, [])):  # a chain's tail is evicted before its head
            self._refcount[page] -= 1
            if self._refcount[page]:
                continue
            if page in self._key_of:
                self._idle[page] = None
            else:
                self._free_sealed(page)
                freed.append(page)
        return freed

    # ---- checks ----

    def check_integrity(self) -> None:
        owned = [p for pages in self._owned.values() for p in pages]
        held = [p for pages in self._quarantined.values() for p in pages]
        every = owned + held + list(self._refcount) + list(self._free)
        if len(every) != self.num_pages or set(every) != set(range(self.num_pages)):
            raise LedgerError(f"ledger broken: {len(owned)} owned + {len(held)} quarantined + {len(self._refcount)} "
                              f"sealed + {len(self._free)} free != {self.num_pages} pages, or a page appears twice")
        counts: dict[int, int] = {}
        for pages in self._refs.values():
            for p in pages:
                counts[p] = counts.get(p, 0) + 1
        if any(counts.get(p, 0) != n for p, n in self._refcount.items()) or set(counts) - set(self._refcount):
            raise LedgerError("ledger broken: a sealed page's reference count differs from the leases holding it")
        idle = {p for p, n in self._refcount.items() if n == 0}
        if idle != set(self._idle) or not idle <= set(self._key_of):
            raise LedgerError("ledger broken: the idle cached pages are not exactly the sealed pages no lease holds")
        if set(self._key_of) - set(self._refcount) or {self._page_of[k] for k in self._key_of.values()} != set(self._key_of):
            raise LedgerError("ledger broken: a cache entry names a page that is not sealed, or two entries one page")
