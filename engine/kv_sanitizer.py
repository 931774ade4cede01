"""The KV sanitizer: a shadow ledger of which lease wrote every slot of a pool, checked on every read.

Owner tags (owner_check.py) say which lease a *page* belongs to now. The sanitizer records, per
token slot, which lease last *wrote* it, and checks every slot a step's attention will read
against the reading lease. So it also catches what tags cannot: a slot of one's own page that was
never written since the page changed hands (a stale read of another tenant's bytes), a decode that
starts before the transfer of its prompt landed, a transfer that wrote fewer tokens than it
claimed. A slot becomes written when the model stores K/V into it, or when a verified transfer
lands in it; releasing a page unwrites all its slots. Sealing a page (the prefix cache shares it
read-only within a tenant) hands its slots from the lease that wrote them to the tenant's seal;
a slot that lease did not write becomes unwritten, so nobody can read it. A sequence may read a
slot its own lease wrote, or one sealed with its own seal.

It is a debugging and testing aid (`--kv-sanitizer`, on in the test suite), not a second
enforcement layer: it costs one gather and compare over every context slot per step. A violation
is returned per sequence (the caller fails that request closed, exactly like an owner-tag
violation, and logs it loudly); nothing here raises on bad reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvfence.engine.kv_pool import lease_tag, tag_lease
from kvfence.engine.protocol import SeqStep


class _Step(Protocol):
    """A sequence's step with its whole page table (engine/runner.py's SeqWork)."""

    seq: SeqStep
    page_table: list[int]


@dataclasses.dataclass(frozen=True)
class SlotViolation:
    """`work_index` would have read token `position` (page `page`, slot `slot`), last written by
    `writer` (0: nobody since the page was released), not by its own `lease`."""

    work_index: int
    position: int
    page: int
    slot: int
    lease: int
    writer: int


class KvSanitizer:
    def __init__(self, num_pages: int, page_size_tokens: int) -> None:
        self.page_size_tokens = page_size_tokens
        self.num_pages = num_pages
        # the writer lease of every slot, as the two int64 halves owner tags use; (0, 0) = unwritten
        self._hi = np.zeros(num_pages * page_size_tokens, dtype=np.int64)
        self._lo = np.zeros(num_pages * page_size_tokens, dtype=np.int64)

    def _slots(self, page_table: Sequence[int], start: int, stop: int) -> np.ndarray:
        """Flat slot indices of token positions [start, stop) of a sequence with this page table."""
        pos = np.arange(start, stop, dtype=np.int64)
        table = np.asarray(page_table, dtype=np.int64)
        pages = table[pos // self.page_size_tokens]
        if pages.size and (pages.min() < 0 or pages.max() >= self.num_pages):
            raise ValueError(f"page table {list(page_table)} names a page outside 0..{self.num_pages - 1}")
        return pages * self.page_size_tokens + pos % self.page_size_tokens

    def record_write(self, lease: int, page_table: Sequence[int], start: int, num_tokens: int) -> None:
        """`lease` wrote token positions [start, start + num_tokens) through `page_table`."""
        slots = self._slots(page_table, start, start + num_tokens)
        hi, lo = lease_tag(lease)
        self._hi[slots], self._lo[slots] = hi, lo

    def seal(self, lease: int, seal: int, pages: Sequence[int]) -> None:
        """`pages`, filled by `lease`, are sealed with `seal`: its slots now read as the seal's; any
        slot `lease` did not write becomes unwritten."""
        hi, lo = lease_tag(lease)
        seal_hi, seal_lo = lease_tag(seal)
        for page in pages:
            span = slice(page * self.page_size_tokens, (page + 1) * self.page_size_tokens)
            mine = (self._hi[span] == hi) & (self._lo[span] == lo)
            self._hi[span] = np.where(mine, seal_hi, 0)
            self._lo[span] = np.where(mine, seal_lo, 0)

    def forget(self, pages: Sequence[int]) -> None:
        """`pages` were released: nobody's bytes are in them any more."""
        for page in pages:
            span = slice(page * self.page_size_tokens, (page + 1) * self.page_size_tokens)
            self._hi[span], self._lo[span] = 0, 0

    def check_reads(self, works: Sequence[_Step]) -> list[SlotViolation]:
        """The first slot, per work, that its step would read (its cached context) and that neither
        its own lease wrote nor is sealed with its seal; [] when every read is allowed."""
        violations: list[SlotViolation] = []
        for i, w in enumerate(works):
            if not w.seq.context_tokens:
                continue
            slots = self._slots(w.page_table, 0, w.seq.context_tokens)
            hi, lo = lease_tag(w.seq.lease)
            found_hi, found_lo = self._hi[slots], self._lo[slots]
            bad_mask = (found_hi != hi) | (found_lo != lo)
            if w.seq.seal:
                seal_hi, seal_lo = lease_tag(w.seq.seal)
                bad_mask &= (found_hi != seal_hi) | (found_lo != seal_lo)
            bad = np.flatnonzero(bad_mask)
            if bad.size:
                position = int(bad[0])
                slot = int(slots[position])
                writer = tag_lease(int(self._hi[slot]), int(self._lo[slot]))
                violations.append(SlotViolation(work_index=i, position=position, page=slot // self.page_size_tokens,
                                                slot=slot % self.page_size_tokens, lease=w.seq.lease, writer=writer))
        return violations

    def written_by(self, page: int, slot: int) -> int:
        """The lease that last wrote this slot (0: unwritten)."""
        flat = page * self.page_size_tokens + slot
        return tag_lease(int(self._hi[flat]), int(self._lo[flat]))
