"""Which pair of workers a request's attempt starts on: a pure choice among the live pairs that can
reserve its pages now (the scheduler core finds those; scheduler/core/reservation.py).

The order: the most prompt pages already cached for it (its tenant's prefix cache, in the pair's
prefill and decode pools: what it need not prefill or transfer again), then the decode pool with
the fewest requests running on it, then the one with the most pages free (or held only by the cache), then the order the pairs
joined in (a stable tie-break). Cache affinity never crosses tenants: the hits come from keys
rooted in the request's own tenant.
"""

from __future__ import annotations

import dataclasses

from kvfence.scheduler.core.worker_binding import Pair, WorkerBinding


@dataclasses.dataclass(frozen=True)
class Candidate:
    pair: Pair
    hits: dict[WorkerBinding, list[int]]  # cached pages the attempt would share, per pool of the pair
    running: int  # requests running on the pair's decode pool

    def rank(self) -> tuple[int, int, int]:
        cached = sum(len(pages) for pages in self.hits.values())
        ledger = self.pair.decode.ledger
        return cached, -self.running, ledger.num_pages - ledger.num_in_use  # free or only cached


def pick(candidates: list[Candidate]) -> Candidate | None:
    """The best of `candidates` (see the module docstring), or None when there is none."""
    best: Candidate | None = None
    for c in candidates:
        if best is None or c.rank() > best.rank():
            best = c
    return best
