"""The scheduler's table of one KV pool: who holds which page, and which tag changes the pool's
worker has yet to apply.

One per pool (a colocated worker's pool serves both roles and has one table). It holds:
- the page ledger (free, owned by a lease, quarantined, or sealed in the prefix cache:
  scheduler/core/page_ledger.py);
- the pending tag operations, in the order the worker must apply them: releases (the worker
  untags and scrubs those pages), grants (it tags pages with their lease), landings (a verified
  transfer wrote these pages: the KV sanitizer records the writer), seals (pages a lease filled
  become read-only and tagged with its tenant's seal);
- the tenant of each lease (from its opening until its pages are back): log lines about a lease
  name it (`who`), and its grants carry it so the worker's own log lines can too;
- how much of each lease's page table the worker has been sent (it keeps the tables: a step
  sends only the pages a lease gained since its last step), and the leases it may forget;
- a watermark of the messages the worker has applied. The worker runs its messages in the order
  they were built (one compute thread, first in first out), so an answer to message n means every
  message up to n was applied: `grant_applied` says whether a lease's pages carry its tag yet.

Pages come back through one path: `release` (and `confirm_quiet`, which ends a quarantine, and
eviction or a flush of cached pages) hands them to the ledger's free queue at once and to the
worker, which untags and scrubs them at the start of its next message, before any grant in it.
Plain Python: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvfence.engine.ids import id_hex
from kvfence.engine.protocol import Landing, PageGrant, Seal
from kvfence.scheduler.core.page_ledger import PageLedger


class Pending(NamedTuple):
    """The tag changes of the next message to a worker, in wire form."""

    number: int  # the message's number (see `answered`)
    grants: list[PageGrant]
    released: list[int]
    landed: list[Landing]
    sealed: list[Seal]
    ended: list[int]  # leases whose page tables the worker may forget


class LeaseTable:
    def __init__(self, num_pages: int) -> None:
        self.ledger = PageLedger(num_pages)
        self._grants: list[tuple[int, list[int]]] = []  # (lease, pages), not yet sent
        self._released: list[int] = []
        self._landed: list[tuple[int, list[int], int, int]] = []  # (lease, page table, first token, tokens)
        self._sealing: dict[int, tuple[int, int]] = {}  # page -> (lease that filled it, seal tag), not yet sent
        self._sent: dict[int, int] = {}  # lease -> pages of its table the worker was sent
        self._ended: list[int] = []  # leases whose tables the worker may forget, not yet sent
        self._built = 0  # messages built for the worker, in the order it runs them
        self.applied = 0  # the highest of them the worker has answered (applied or refused)
        self._grant_message: dict[int, int] = {}  # lease -> the last message that carried a grant of it
        self._tenant: dict[int, str] = {}  # lease -> its tenant, while the ledger holds pages for it

    @property
    def has_pending(self) -> bool:
        """Tag changes are waiting for the next message."""
        return bool(self._grants or self._released or self._landed or self._sealing)

    def reserve(self, lease: int, num_pages: int) -> list[int] | None:
        """Hand `num_pages` more pages to `lease` and queue their grant, evicting idle cached pages
        when too few are free; None (nothing changed) if even that is not enough."""
        if not self.ledger.can_reserve(num_pages):
            return None
        self._freed(self.ledger.evict(num_pages - self.ledger.num_free))
        pages = self.ledger.reserve(lease, num_pages)
        if pages:
            self._grants.append((lease, pages))
        return pages

    def open(self, lease: int, tenant: str, shared: Sequence[int] = ()) -> None:
        """A new lease of `tenant`, reading the cached pages `shared` (a prefix hit: they stay
        sealed and are not granted). Call before its first `reserve`."""
        self._tenant[lease] = tenant
        self.share(lease, shared)

    def who(self, lease: int) -> str:
        """How log lines name a lease: its id and its tenant (while the table knows it)."""
        tenant = self._tenant.get(lease)
        return f"lease {id_hex(lease)}" + (f" (tenant {tenant})" if tenant is not None else "")

    def tenant_of(self, lease: int) -> str | None:
        return self._tenant.get(lease)

    @property
    def num_leases(self) -> int:
        """Leases the table names: live or quarantined ones (0 once every page is back)."""
        return len(self._tenant)

    def share(self, lease: int, pages: Sequence[int]) -> None:
        """`lease` reads these cached pages too; they stay sealed and are not granted."""
        if pages:
            self.ledger.share(lease, pages)

    def seal(self, lease: int, seal_tag: int, pages: Sequence[int], keys: Sequence[bytes]) -> list[int]:
        """Pages `lease` filled become sealed in the cache under `keys`, tagged `seal_tag` by the
        worker in the next message; returns those sealed (a key already cached is skipped)."""
        sealed = self.ledger.seal(lease, pages, keys)
        for page in sealed:
            self._sealing[page] = lease, seal_tag
        return sealed

    def flush(self) -> int:
        """Drop every cache entry (pages still read stay sealed until released); returns the pages freed."""
        freed = self.ledger.flush()
        self._freed(freed)
        return len(freed)

    def _freed(self, pages: list[int]) -> None:
        self._released.extend(pages)
        for page in pages:
            self._sealing.pop(page, None)

    def release(self, lease: int) -> None:
        if lease:
            self._freed(self.ledger.release(lease))
            self._end(lease)
            self._tenant.pop(lease, None)

    def quarantine(self, lease: int, now_s: float) -> list[int]:
        """Keep the lease's pages out of the free list (a write may still land in them) until
        `confirm_quiet`; returns them."""
        self._end(lease)
        pages = self.ledger.quarantine(lease, now_s)
        if not self.ledger.is_quarantined(lease):  # it held nothing: nothing is left to name
            self._tenant.pop(lease, None)
        return pages

    def _end(self, lease: int) -> None:
        """The worker may forget `lease` (its page table, its tenant's name) if it ever learned of it."""
        granted = self._grant_message.pop(lease, None) is not None
        if (self._sent.pop(lease, None) is not None) or granted:
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
        self._freed(pages)
        if not self.ledger.holds(lease):
            self._tenant.pop(lease, None)
        return pages

    def land(self, lease: int, pages: list[int], first_token: int, num_tokens: int) -> None:
        """A verified transfer wrote token positions [first_token, num_tokens) of `lease`, whose
        page table is `pages`."""
        self._landed.append((lease, list(pages), first_token, num_tokens))

    def take_pending(self) -> Pending:
        """The next message's tag changes. A grant or landing of a lease that ended before it was
        sent names pages that are no longer its own: it is dropped rather than tag free pages with a
        dead lease (a landing is kept while pages it wrote wait to be sealed: the worker checks a
        seal against who wrote the page)."""
        self._built += 1
        grants = [PageGrant(lease, pages, self._tenant.get(lease, "")) for lease, pages in self._grants
                  if self.ledger.holds(lease)]
        sealing = {lease for lease, _ in self._sealing.values()}
        landed = [Landing(lease=lease, pages=pages, num_tokens=n, first_token=first)
                  for lease, pages, first, n in self._landed if self.ledger.holds(lease) or lease in sealing]
        for lease, _ in self._grants:
            if self.ledger.holds(lease):
                self._grant_message[lease] = self._built
        seals: dict[tuple[int, int], list[int]] = {}
        for page, key in self._sealing.items():
            seals.setdefault(key, []).append(page)
        pending = Pending(number=self._built, grants=grants, released=self._released, landed=landed,
                          sealed=[Seal(lease, tag, pages) for (lease, tag), pages in seals.items()], ended=self._ended)
        self._grants, self._released, self._landed, self._ended, self._sealing = [], [], [], [], {}
        return pending

    def answered(self, number: int) -> None:
        """The worker answered message `number`: it is past it and every message before it."""
        self.applied = max(self.applied, number)

    def grant_unsent(self, lease: int) -> bool:
        """Pages granted to `lease` wait for the next message to the worker."""
        return any(g == lease for g, _ in self._grants)

    def grant_applied(self, lease: int) -> bool:
        """Every page granted to `lease` so far carries its tag on the worker (and every release
        before those grants was applied): the message that carried its last grant was answered."""
        if self.grant_unsent(lease):
            return False
        number = self._grant_message.get(lease)
        return number is not None and number <= self.applied
