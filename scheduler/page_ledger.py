"""Which pages of one KV pool are free, and which lease owns each of the others.

Plain Python (no torch, no I/O) so it can be tested exhaustively. Running out of pages is a
return value (`None`), not an exception; a broken invariant is an exception with the numbers.
Invariant: every page is in exactly one place: the free queue, owned by one live lease, or
quarantined under one lease (a transfer may still write it; it returns to the free queue only when
that is confirmed, and never on a timeout).
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

    def quarantine(self, lease: int) -> list[int]:
        """Take every page of `lease` out of use without freeing it (a write may still land)."""
        pages = self._owned.pop(lease, [])
        if pages:
            self._quarantined[lease] = pages
        return pages

    def is_quarantined(self, lease: int) -> bool:
        return lease in self._quarantined

    def confirm_quiet(self, lease: int) -> list[int]:
        """The transport confirmed no write can reach the quarantined pages of `lease`: free them."""
        pages = self._quarantined.pop(lease, [])
        self._free.extend(pages)
        return pages

    def check_integrity(self) -> None:
        owned = [p for pages in self._owned.values() for p in pages]
        held = [p for pages in self._quarantined.values() for p in pages]
        every = owned + held + list(self._free)
        if len(every) != self.num_pages or set(every) != set(range(self.num_pages)):
            raise LedgerError(f"ledger broken: {len(owned)} owned + {len(held)} quarantined + "
                              f"{len(self._free)} free != {self.num_pages} pages, or a page appears twice")
