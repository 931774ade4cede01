"""The scheduler's table of one KV pool: who holds which page, and which tag changes the pool's
worker has yet to apply.

One per pool (a colocated worker's pool serves both roles and has one table). It holds:
- the page ledger (free, owned by a lease, or quarantined: scheduler/page_ledger.py);
- the pending tag operations, in the order the worker must apply them: releases (the worker
  untags and scrubs those pages), grants (it tags pages with their lease), landings (a verified
  transfer wrote these pages: the KV sanitizer records the writer);
- how much of each lease's page table the worker has been sent (it keeps the tables: a step
  sends only the pages a lease gained since its last step), and the leases it may forget;
- a watermark of the messages the worker has applied. The worker runs its messages in the order
  they were built (one compute thread, first in first out), so an answer to message n means every
  message up to n was applied: `grant_applied` says whether a lease's pages carry its tag yet.

Pages come back through one path: `release` (and `confirm_quiet`, which ends a quarantine) hands
them to the ledger's free queue at once and to the worker, which untags and scrubs them at the
start of its next message, before any grant in it. Plain Python: no I/O, no clock.
"""

from __future__ import annotations

from kvfence.engine.protocol import Landing, PageGrant
from kvfence.scheduler.page_ledger import PageLedger


class LeaseTable:
    def __init__(self, num_pages: int) -> None:
        self.ledger = PageLedger(num_pages)
        self._grants: list[tuple[int, list[int]]] = []  # (lease, pages), not yet sent
        self._released: list[int] = []
        self._landed: list[tuple[int, list[int], int]] = []  # (lease, pages, tokens)
        self._sent: dict[int, int] = {}  # lease -> pages of its table the worker was sent
        self._ended: list[int] = []  # leases whose tables the worker may forget, not yet sent
        self._built = 0  # messages built for the worker, in the order it runs them
        self.applied = 0  # the highest of them the worker has answered (applied or refused)
        self._grant_message: dict[int, int] = {}  # lease -> the last message that carried a grant of it

    @property
    def has_pending(self) -> bool:
        """Tag changes are waiting for the next message."""
        return bool(self._grants or self._released or self._landed)

    def reserve(self, lease: int, num_pages: int) -> list[int] | None:
        """Hand `num_pages` more pages to `lease` and queue their grant; None if too few are free."""
        pages = self.ledger.reserve(lease, num_pages)
        if pages:
            self._grants.append((lease, pages))
        return pages

    def release(self, lease: int) -> None:
        if lease:
            self._released.extend(self.ledger.release(lease))
            self._end(lease)

    def quarantine(self, lease: int, now_s: float) -> list[int]:
        """Keep the lease's pages out of the free list (a write may still land in them) until
        `confirm_quiet`; returns them."""
        self._end(lease)
        return self.ledger.quarantine(lease, now_s)

    def _end(self, lease: int) -> None:
        self._grant_message.pop(lease, None)
        if self._sent.pop(lease, None) is not None:
            self._ended.append(lease)

    def new_pages(self, lease: int, pages: list[int]) -> list[int]:
        """The pages of `lease`'s table (`pages`, in order) that its next step must send: those
        appended since the last one. Call once per step built."""
        sent = self._sent.get(lease, 0)
        self._sent[lease] = len(pages)
        return pages[sent:]

    def confirm_quiet(self, lease: int) -> list[int]:
        """End the quarantine of `lease`: no write can still reach its pages. They go back through
        the release path. Returns them ([] if `lease` was not quarantined)."""
        pages = self.ledger.confirm_quiet(lease)
        self._released.extend(pages)
        return pages

    def land(self, lease: int, pages: list[int], num_tokens: int) -> None:
        """A verified transfer wrote token positions [0, num_tokens) of `lease` through `pages`."""
        self._landed.append((lease, pages, num_tokens))

    def take_pending(self) -> tuple[int, list[PageGrant], list[int], list[Landing], list[int]]:
        """The next message's number, its tag changes (releases, grants, landings) in wire form,
        and the leases whose page tables the worker may forget. A grant or landing of a lease that ended before it was sent names pages that are no
        longer its own: it is dropped rather than tag free pages with a dead lease."""
        self._built += 1
        grants = [PageGrant(lease, pages) for lease, pages in self._grants if self.ledger.holds(lease)]
        landed = [Landing(lease, pages, n) for lease, pages, n in self._landed if self.ledger.holds(lease)]
        for lease, _ in self._grants:
            if self.ledger.holds(lease):
                self._grant_message[lease] = self._built
        released, ended = self._released, self._ended
        self._grants, self._released, self._landed, self._ended = [], [], [], []
        return self._built, grants, released, landed, ended

    def answered(self, number: int) -> None:
        """The worker answered message `number`: it is past it and every message before it."""
        self.applied = max(self.applied, number)

    def grant_applied(self, lease: int) -> bool:
        """Every page granted to `lease` so far carries its tag on the worker (and every release
        before those grants was applied): the message that carried its last grant was answered."""
        if any(g == lease for g, _ in self._grants):
            return False
        number = self._grant_message.get(lease)
        return number is not None and number <= self.applied
