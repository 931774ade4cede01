"""The owner-tag check: a sequence writes only pages tagged with its own lease, and reads only
those and pages sealed with its tenant's seal.

Run by the runner before every forward, over every page each sequence's step will touch (the
pages holding its cached context and the ones its new tokens land in). The rule, per page:
- a page the step writes (from the one holding its first new token on) must carry the lease;
- a page it only reads must carry the lease, or be sealed with the sequence's seal (read-only
  prompt KV shared within its tenant by the prefix cache; `seal` 0: none).
So a write into a sealed page, or a read of another tenant's sealed page, is a violation. A
sequence with any mismatching page is taken out of the step before anything is read: it produces
no token, and the caller fails it closed. The check is one gather and two compares per step,
whatever the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch

from kvfence.engine.kv_pool import KVPool, lease_tag, tag_lease
from kvfence.engine.protocol import SeqStep


class _Reader(Protocol):
    """A sequence's step with its whole page table (engine/runner.py's SeqWork)."""

    seq: SeqStep
    page_table: list[int]


@dataclasses.dataclass(frozen=True)
class OwnerViolation:
    """`work_index` would have read `page`, which belongs to `owner` (0 = free), not to `lease`."""

    work_index: int
    page: int
    lease: int
    owner: int


def check_owner_tags(pool: KVPool, works: Sequence[_Reader]) -> list[OwnerViolation]:
    """Violations, at most one (the first bad page) per work; [] when every page is the reader's."""
    if not works:
        return []
    page_size = pool.page_size_tokens
    pages: list[int] = []
    expected: list[tuple[int, int]] = []
    also: list[tuple[int, int]] = []  # what a page may carry instead: the seal, for pages only read
    counts: list[int] = []
    for w in works:
        n = -(-(w.seq.context_tokens + len(w.seq.token_ids)) // page_size)
        read_only = min(w.seq.context_tokens // page_size, n) if w.seq.seal else 0
        own = lease_tag(w.seq.lease)
        pages.extend(w.page_table[:n])
        expected.extend([own] * n)
        also.extend([lease_tag(w.seq.seal)] * read_only + [own] * (n - read_only))
        counts.append(n)
    index = torch.tensor(pages, dtype=torch.int64, device=pool.device)
    found = pool.owner_tags.index_select(0, index)  # [P, 2]
    want = torch.tensor([expected, also], dtype=torch.int64, device=pool.device)  # [2, P, 2]
    bad = ((found != want[0]).any(dim=1) & (found != want[1]).any(dim=1))
    if not bool(bad.any()):
        return []
    violations: list[OwnerViolation] = []
    bad_rows = set(bad.nonzero().flatten().tolist())
    start = 0
    for i, (w, n) in enumerate(zip(works, counts)):
        row = next((r for r in range(start, start + n) if r in bad_rows), None)
        if row is not None:
            hi, lo = found[row].tolist()
            violations.append(OwnerViolation(work_index=i, page=pages[row], lease=w.seq.lease, owner=tag_lease(hi, lo)))
        start += n
    return violations
