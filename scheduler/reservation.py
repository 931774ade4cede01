"""Which pages each request holds, in every pool it uses: reservation at admission (in queue
order, within the running-slot limit and a page of headroom per running request), the prefix
cache (hits at reservation, sealing once pages are filled), release, and quarantine and its end.
Part of the scheduler core (no I/O, no clock: the time is passed in).

A pool bound to both roles (colocated) gives a request one lease and one page list for both; two
pools give it one lease in each. Every reservation is a grant queued in that pool's lease table,
carried to the worker by its next message.

The prefix cache, per pool: a request's page table starts with the longest run of cached pages
its keys find there (scheduler/prefix_cache.py: a chain over its full pages, rooted in its
tenant), shared read-only by reference; it prefills only the rest (the prefill pool's hit), and
its transfer moves only the pages the decode pool does not hold (the decode pool's hit). Once its
prefill is done (prefill pool) or its KV has landed (decode pool), the full pages it filled are
sealed into that pool's cache for later requests of the same tenant.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvfence.scheduler.admission import Refusal, quarantine_refusal
from kvfence.scheduler.errors import RequestError
from kvfence.scheduler.lease_table import LeaseTable
from kvfence.scheduler.prefix_cache import block_keys, reusable_blocks, sealable_blocks
from kvfence.scheduler.request import Request, State
from kvfence.scheduler.worker_binding import WorkerBinding

if TYPE_CHECKING:
    from kvfence.scheduler.config import SchedulerConfig
    from kvfence.scheduler.metrics import SchedulerMetrics

log = logging.getLogger(__name__)


class Reservation:
    """Mixed into SchedulerCore, whose state it reads and changes."""

    if TYPE_CHECKING:
        config: SchedulerConfig
        metrics: SchedulerMetrics
        prefill: WorkerBinding
        decode: WorkerBinding
        workers: list[WorkerBinding]
        queue: deque[Request]
        mint: Callable[[], int]

        def num_running(self) -> int: ...
        def _end(self, req: Request, error: RequestError | None, now: float, last: object = None) -> None: ...
        def _move(self, req: Request, new: State) -> None: ...


    def _needs(self, num_tokens: int) -> dict[WorkerBinding, int]:
        """Pages an attempt that prefills `num_tokens` reserves at admission, per pool: the decode
        side also gets the page of the first token it generates (it grows from there); a pool
        bound to both roles reserves the larger."""
        return self._per_pool(self.config.pages_for(num_tokens), self.config.pages_for(num_tokens + 1))

    def _per_pool(self, prefill_pages: int, decode_pages: int) -> dict[WorkerBinding, int]:
        """Pages needed per pool; a pool bound to both roles needs the larger."""
        needs = {self.prefill: prefill_pages}
        needs[self.decode] = max(needs.get(self.decode, 0), decode_pages)
        return needs

    def _can_reserve(self, num_tokens: int, headroom_pages: int = 0,
                     hits: dict[WorkerBinding, list[int]] | None = None) -> bool:
        """The pages an attempt of `num_tokens` needs are free or evictable in every pool, with
        `headroom_pages` more in the decode pool; `hits`: cached pages it will share instead, per pool."""
        hits = hits or {}
        return all(w.ledger.can_reserve(n - len(hits.get(w, ())) + (headroom_pages if w is self.decode else 0),
                                        pinned=hits.get(w, ()))
                   for w, n in self._needs(num_tokens).items())

    def _quarantine_refusal(self, prompt_tokens: int, prefill_tokens: int, max_tokens: int, now: float) -> Refusal | None:
        """A refusal (and a log line) when the request fits only with quarantined pages."""
        needs = self._per_pool(self.config.pages_for(prefill_tokens), self.config.pages_for(prompt_tokens + max_tokens))
        refusal = quarantine_refusal([(w.name, w.ledger, n) for w, n in needs.items()], now)
        if refusal is not None:
            log.warning("request refused with 503: %s", refusal.error.message)
        return refusal

    def _queue_front(self) -> int:
        """Where a request goes to be next: behind the priority requests already waiting."""
        return next((i for i, r in enumerate(self.queue) if not r.priority), len(self.queue))

    def _reserve_queued(self, now: float) -> None:
        """Reserve pages for queued requests in order while they fit: a priority request as soon
        as its pages are free; any other while a running slot is free and the decode pool keeps a
        page of headroom per running request (each may need one more page soon), so a new request
        does not take the page a running one is about to need. A queued request that can no
        longer ever fit (pages were quarantined since it came) ends now with 503."""
        if any(w.ledger.num_quarantined for w in self.workers):
            for req in list(self.queue):
                refusal = self._quarantine_refusal(len(req.prompt), req.prefill_target, req.max_tokens, now)
                if refusal is not None:
                    self.metrics.rejected(refusal.reason)
                    self._end(req, refusal.error, now)
        while True:
            req = self._next_to_start()
            if req is None:
                return
            running = self.num_running()
            if not req.priority and running >= self.config.max_running:
                return
            hits = self._cache_hits(req)
            if not self._can_reserve(req.prefill_target, 0 if req.priority else running, hits):
                return
            leases: dict[WorkerBinding, tuple[int, list[int]]] = {}
            for w, n in self._needs(req.prefill_target).items():
                lease, shared = self.mint(), hits.get(w, [])
                w.table.open(lease, req.tenant, shared)  # first: a hit is never evicted for the pages below
                pages = w.table.reserve(lease, n - len(shared))
                if pages is None:  # _can_reserve said yes a moment ago
                    raise RuntimeError("ledger refused a reservation it had just allowed")
                leases[w] = lease, shared + pages
            (req.prefill_lease, req.prefill_pages), (req.decode_lease, req.decode_pages) = \
                leases[self.prefill], leases[self.decode]  # one pool for both roles: one lease, one page list
            req.shared_prefill, req.shared_decode = len(hits.get(self.prefill, ())), len(hits.get(self.decode, ()))
            req.prefilled = req.shared_prefill * self.config.page_size_tokens
            if not req.preemptions:
                req.cached_tokens = req.prefilled
            self._move(req, State.PREFILLING)

    def _cache_keys(self, req: Request) -> list[bytes]:
        """The keys of the full pages of what this attempt prefills ([] when it is not cached)."""
        if req.cache_root is None:
            return []
        if req.keys_for != req.prefill_target:
            page = self.config.page_size_tokens
            req.cache_keys = block_keys(req.cache_root, req.tokens, page, sealable_blocks(req.prefill_target, page))
            req.keys_for = req.prefill_target
        return req.cache_keys

    def _cache_hits(self, req: Request) -> dict[WorkerBinding, list[int]]:
        """Per pool, the cached pages of the longest prefix of `req` found there, short of the page
        of its last token (which is computed to sample the next one)."""
        keys = self._cache_keys(req)[:reusable_blocks(req.prefill_target, self.config.page_size_tokens)]
        return {w: w.ledger.lookup(keys) for w in self.workers} if keys else {}

    def _seal(self, w: WorkerBinding, req: Request, lease: int, pages: list[int], shared: int) -> None:
        """The full pages `lease` filled in `w`'s pool (after the `shared` ones it found cached)
        become sealed in that pool's cache."""
        keys = self._cache_keys(req)
        if len(keys) > shared:
            w.table.seal(lease, req.seal, pages[shared:len(keys)], keys[shared:])

    def _next_to_start(self) -> Request | None:
        """The first queued request whose tenant may run one more: a tenant at its running limit
        waits without holding up the others behind it."""
        return next((r for r in self.queue if r.priority or not self._tenants[r.tenant].at_running_limit), None)

    def _release_leases(self, req: Request) -> None:
        """Release every lease `req` holds (the workers untag and scrub the pages in their next message)."""
        for table, lease in {(self.prefill.table, req.prefill_lease), (self.decode.table, req.decode_lease)}:
            table.release(lease)
        req.prefill_lease = req.decode_lease = 0

    def _quarantine(self, table: LeaseTable, lease: int, now: float) -> None:
        pages = table.quarantine(lease, now)
        if pages:
            self._log_quarantine(table, f"{len(pages)} pages of {table.who(lease)} quarantined", now)

    def _log_quarantine(self, table: LeaseTable, what: str, now: float) -> None:
        name = next(w.name for w in self.workers if w.table is table)
        since = table.ledger.quarantined_since
        held = f"oldest for {now - since:.1f} s" if since is not None else "none left"
        log.warning("%s pool: %s; %d of %d pages quarantined (%s)", name, what, table.ledger.num_quarantined,
                    table.ledger.num_pages, held)

    def _confirm_quiet(self, table: LeaseTable, lease: int, now: float) -> list[int]:
        who = table.who(lease)  # before: the table forgets a lease once its pages are back
        pages = table.confirm_quiet(lease)
        if pages:
            self._log_quarantine(table, f"quarantine of {who} ended, {len(pages)} pages returned", now)
        return pages
