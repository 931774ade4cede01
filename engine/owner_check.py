"""The owner-tag check: a sequence reads and writes only pages tagged with its own lease.

Run by the runner before every forward, over every page each sequence's step will touch (the
pages holding its cached context and the ones its new tokens land in). A sequence with any
mismatching page is taken out of the step before anything is read: it produces no token, and the
caller fails it closed. The check is one gather and one compare per step, whatever the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch

from kvfence.engine.kv_pool import KVPool, lease_tag, tag_lease


class _Reader(Protocol):
    token_ids: list[int]
    context_tokens: int
    page_table: list[int]
    lease: int


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
    counts: list[int] = []
    for w in works:
        n = -(-(w.context_tokens + len(w.token_ids)) // page_size)
        pages.extend(w.page_table[:n])
        expected.extend([lease_tag(w.lease)] * n)
        counts.append(n)
    index = torch.tensor(pages, dtype=torch.int64, device=pool.device)
    found = pool.owner_tags.index_select(0, index)  # [P, 2]
    want = torch.tensor(expected, dtype=torch.int64, device=pool.device)  # [P, 2]
    bad = (found != want).any(dim=1)
    if not bool(bad.any()):
        return []
    violations: list[OwnerViolation] = []
    bad_rows = set(bad.nonzero().flatten().tolist())
    start = 0
    for i, (w, n) in enumerate(zip(works, counts)):
        row = next((r for r in range(start, start + n) if r in bad_rows), None)
        if row is not None:
            hi, lo = found[row].tolist()
            violations.append(OwnerViolation(i, pages[row], w.lease, tag_lease(hi, lo)))
        start += n
    return violations
