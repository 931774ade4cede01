"""Which pages of one KV pool are free, and which lease owns each of the others.

Plain Python (no torch, no I/O) so it can be tested exhaustively. Running out of pages is a
return value (`None`), not an exception; a broken invariant is an exception with the numbers.
Invariant: every page is in exactly one place: the free queue, owned by one live lease, or
quarantined under one lease (a transfer may still write it; it returns to the free queue only when
that is confirmed, and never on a timeout).

A lease may grow: `reserve` again appends pages to its table (a decoding sequence gets the page
its next token lands in when it needs it). The ledger keeps no clock: the caller passes the time
a quarantine began, and `quarantined_since` reports the oldest.
"""

from __future__ import annotations

from collections import deque


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

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages not free: owned by live leases or quarantined."""
        return self.num_pages - len(self._free)

    @property
    def num_quarantined(self) -> int:
        return sum(len(p) for p in self._quarantined.values())

    @property
    def num_reclaimable(self) -> int:
        """Pages that are free or can still become free: all but the quarantined ones, which may
        never come back. A request needing more than this can never fit."""
        return self.num_pages - self.num_quarantined

    @property
    def quarantined_since(self) -> float | None:
        """When the oldest quarantine still in force began (as passed to `quarantine`); None if none."""
        return min(self._quarantined_s.values(), default=None)

    def can_reserve(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def reserve(self, lease: int, num_pages: int) -> list[int] | None:
        """Hand `num_pages` more pages to `lease` (appended to its table); None if too few are free.

        Returns only the newly reserved pages. All or nothing: nothing changes on None.
        """
        if lease == 0:
            raise ValueError("lease 0 is reserved for free pages")
        if lease in self._quarantined:
            raise ValueError("a quarantined lease cannot reserve pages")
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if num_pages > len(self._free):
            return None
        new = [self._free.popleft() for _ in range(num_pages)]
        self._owned.setdefault(lease, []).extend(new)
        return new

    def pages(self, lease: int) -> list[int]:
        """The page table of `lease` (empty if it holds none)."""
        return list(self._owned.get(lease, ()))

    def holds(self, lease: int) -> bool:
        return lease in self._owned

    def release(self, lease: int) -> list[int]:
        """Return every page of `lease` to the free queue; returns them. Unknown lease: []."""
        pages = self._owned.pop(lease, [])
        self._free.extend(pages)
        return pages

    def quarantine(self, lease: int, now_s: float = 0.0) -> list[int]:
        """Take every page of `lease` out of use without freeing it (a write may still land);
        `now_s`: when, on the caller's clock (reported by `quarantined_since`)."""
        pages = self._owned.pop(lease, [])
        if pages:
            self._quarantined[lease] = pages
            self._quarantined_s[lease] = now_s
        return pages

    def is_quarantined(self, lease: int) -> bool:
        return lease in self._quarantined

    def quarantined_pages(self, lease: int) -> list[int]:
        """The pages `lease` holds in quarantine (empty if none)."""
        return list(self._quarantined.get(lease, ()))

    def quarantined_leases(self) -> list[int]:
        """The leases whose pages are quarantined, oldest quarantine first."""
        return sorted(self._quarantined, key=self._quarantined_s.__getitem__)

    def confirm_quiet(self, lease: int) -> list[int]:
        """The transport confirmed no write can reach the quarantined pages of `lease`: free them."""
        pages = self._quarantined.pop(lease, [])
        self._quarantined_s.pop(lease, None)
        self._free.extend(pages)
        return pages

    def check_integrity(self) -> None:
        owned = [p for pages in self._owned.values() for p in pages]
        held = [p for pages in self._quarantined.values() for p in pages]
        every = owned + held + list(self._free)
        if len(every) != self.num_pages or set(every) != set(range(self.num_pages)):
            raise LedgerError(f"ledger broken: {len(owned)} owned + {len(held)} quarantined + "
                              f"{len(self._free)} free != {self.num_pages} pages, or a page appears twice")
