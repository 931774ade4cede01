"""Which pages each request holds, in every pool it uses: reservation at admission (in queue
order, within the running-slot limit and a page of headroom per running request, on the pair the
router picks), the prefix
cache (hits at reservation, sealing once pages are filled), release, and quarantine and its end.
Part of the scheduler core (no I/O, no clock: the time is passed in).

A pool bound to both roles (colocated) gives a request one lease and one page list for both; two
pools give it one lease in each. Every reservation is a grant queued in that pool's lease table,
carried to the worker by its next message.

The prefix cache, per pool: a request's page table starts with the longest run of cached pages
its keys find there (scheduler/core/prefix_cache.py: a chain over its full pages, rooted in its
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

from kvfence.scheduler.core.admission import Refusal, no_live_pair, quarantine_refusal, size_refusal
from kvfence.scheduler.core.errors import RequestError
from kvfence.scheduler.core.prefix_cache import block_keys, reusable_blocks, sealable_blocks
from kvfence.scheduler.core.lifecycle import Event, State
from kvfence.scheduler.core.request import Request
from kvfence.scheduler.core.router import Candidate, pick
from kvfence.scheduler.core.worker_binding import Pair, WorkerBinding

if TYPE_CHECKING:
    from kvfence.scheduler.core.config import SchedulerConfig
    from kvfence.scheduler.metrics import SchedulerMetrics
    from kvfence.scheduler.core.output import OutputDelta
    from kvfence.scheduler.core.tenants import TenantLoads

log = logging.getLogger(__name__)


class Reservation:
    """Mixed into SchedulerCore, whose state it reads and changes."""

    if TYPE_CHECKING:
        config: SchedulerConfig
        metrics: SchedulerMetrics
        workers: list[WorkerBinding]
        pairs: list[Pair]
        serving_pairs: list[Pair]
        _pairs_changed: bool
        _running: dict[State, dict[str, Request]]
        _tenants: TenantLoads
        queue: deque[Request]
        mint: Callable[[], int]

        def num_running(self) -> int: ...
        def _preemptible(self, decode: WorkerBinding) -> list[Request]: ...
        def _preempt(self, req: Request, now: float, why: str = ...) -> None: ...
        def _end(self, req: Request, error: RequestError | None, now: float, last: OutputDelta | None = None) -> None: ...
        def _move(self, req: Request, event: Event) -> None: ...


    def _needs(self, pair: Pair, num_tokens: int) -> dict[WorkerBinding, int]:
        """Pages an attempt that prefills `num_tokens` reserves at admission on `pair`, per pool:
        the decode side also gets the page of the first token it generates (it grows from there);
        a pool bound to both roles reserves the larger."""
        return self._per_pool(pair, self.config.pages_for(num_tokens), self.config.pages_for(num_tokens + 1))

    @staticmethod
    def _per_pool(pair: Pair, prefill_pages: int, decode_pages: int) -> dict[WorkerBinding, int]:
        """Pages needed per pool of `pair`; a pool bound to both roles needs the larger."""
        needs = {pair.prefill: prefill_pages}
        needs[pair.decode] = max(needs.get(pair.decode, 0), decode_pages)
        return needs

    def _can_reserve(self, pair: Pair, num_tokens: int, headroom_pages: int = 0,
                     hits: dict[WorkerBinding, list[int]] | None = None) -> bool:
        """The pages an attempt of `num_tokens` needs on `pair` are free or evictable in each of its
        pools, with `headroom_pages` more in the decode pool; `hits`: cached pages it shares instead."""
        hits = hits or {}
        return all(w.ledger.can_reserve(n - len(hits.get(w, ())) + (headroom_pages if w is pair.decode else 0),
                                        pinned=hits.get(w, ()))
                   for w, n in self._needs(pair, num_tokens).items())

    def _refusal(self, prompt_tokens: int, prefill_tokens: int, max_tokens: int, now: float) -> Refusal | None:
        """Why no live pair can ever serve this request (None: one can). Over the context or a
        whole pool everywhere: 400; fits somewhere only with quarantined pages: 503 (and a log
        line); no pair at all: 503."""
        pairs = self.serving_pairs
        if not pairs:
            return no_live_pair()
        refusals = []
        for pair in pairs:
            refusal = size_refusal(self.config, pair.max_context_tokens, pair.prefill.ledger, pair.decode.ledger,
                                   prompt_tokens, max_tokens) \
                or self._quarantine_refusal(pair, prompt_tokens, prefill_tokens, max_tokens, now)
            if refusal is None:
                return None
            refusals.append((refusal.error.status == 503, pair.max_context_tokens, refusal))
        refusal = max(refusals, key=lambda r: r[:2])[2]  # one that may pass later, else the largest pair's
        if refusal.error.status == 503:
            log.warning("request refused with 503: %s", refusal.error.message)
        return refusal

    def _quarantine_refusal(self, pair: Pair, prompt_tokens: int, prefill_tokens: int, max_tokens: int,
                            now: float) -> Refusal | None:
        """A refusal when the request fits `pair` only with quarantined pages."""
        needs = self._per_pool(pair, self.config.pages_for(prefill_tokens),
                               self.config.pages_for(prompt_tokens + max_tokens))
        return quarantine_refusal([(w.name, w.ledger, n) for w, n in needs.items()], now)

    def _queue_front(self) -> int:
        """Where a request goes to be next: behind the priority requests already waiting."""
        return next((i for i, r in enumerate(self.queue) if not r.priority), len(self.queue))

    def _reserve_queued(self, now: float) -> None:
        """Reserve pages for queued requests in order while they fit, each on the pair the router
        picks (scheduler/core/router.py): a priority request as soon as its pages are free; any other
        while a running slot is free and the pair's decode pool keeps a page of headroom per
        request running there (each may need one more page soon), so a new request does not take
        the page a running one is about to need. A queued request that can no longer ever fit
        (pages were quarantined, or pairs lost, since it came) ends now with 503."""
        if any(w.ledger.num_quarantined for w in self.workers) or self._pairs_changed:
            self._pairs_changed = False
            for queued in list(self.queue):
                refusal = self._refusal(len(queued.prompt), queued.prefill_target, queued.max_tokens, now)
                if refusal is not None:
                    self.metrics.rejected(refusal.reason)
                    self._end(queued, refusal.error, now)
        running_on = self._running_per_decode()
        while True:
            req = self._next_to_start()
            if req is None:
                return
            if not req.priority and self.num_running() >= self.config.max_running \
                    and not self._make_slot_for_share(req, now):
                return
            choice = self._route(req, running_on)
            if choice is None:
                return
            pair, hits = choice
            leases: dict[WorkerBinding, tuple[int, list[int]]] = {}
            for w, n in self._needs(pair, req.prefill_target).items():
                lease, shared = self.mint(), hits.get(w, [])
                w.table.open(lease, req.tenant, shared)  # first: a hit is never evicted for the pages below
                pages = w.table.reserve(lease, n - len(shared))
                if pages is None:  # _can_reserve said yes a moment ago
                    raise RuntimeError("ledger refused a reservation it had just allowed")
                leases[w] = lease, shared + pages
            req.pair = pair
            (req.prefill_lease, req.prefill_pages), (req.decode_lease, req.decode_pages) = \
                leases[pair.prefill], leases[pair.decode]  # one pool for both roles: one lease, one page list
            req.shared_prefill, req.shared_decode = len(hits.get(pair.prefill, ())), len(hits.get(pair.decode, ()))
            req.prefilled = req.shared_prefill * self.config.page_size_tokens
            if req.attempt == 1:
                req.cached_tokens = req.prefilled
            running_on[pair.decode] = running_on.get(pair.decode, 0) + 1
            self._move(req, Event.RESERVE)

    def _running_per_decode(self) -> dict[WorkerBinding, int]:
        """How many running requests each decode pool serves (their headroom pages)."""
        counts: dict[WorkerBinding, int] = {}
        for group in self._running.values():
            for req in group.values():
                if req.pair is not None:
                    counts[req.pair.decode] = counts.get(req.pair.decode, 0) + 1
        return counts

    def _route(self, req: Request, running_on: dict[WorkerBinding, int]
               ) -> tuple[Pair, dict[WorkerBinding, list[int]]] | None:
        """The pair this attempt of `req` starts on now and the cached pages it shares there, or
        None when no live pair that can hold it has its pages free yet."""
        candidates = []
        for pair in self.serving_pairs:
            if size_refusal(self.config, pair.max_context_tokens, pair.prefill.ledger, pair.decode.ledger,
                            len(req.prompt), req.max_tokens) is not None:
                continue
            hits = self._cache_hits(req, pair)
            headroom = 0 if req.priority else running_on.get(pair.decode, 0)
            if self._can_reserve(pair, req.prefill_target, headroom, hits):
                candidates.append(Candidate(pair, hits, running_on.get(pair.decode, 0)))
        best = pick(candidates)
        return None if best is None else (best.pair, best.hits)

    def _cache_keys(self, req: Request) -> list[bytes]:
        """The keys of the full pages of what this attempt prefills ([] when it is not cached)."""
        if req.cache_root is None:
            return []
        if req.keys_for != req.prefill_target:
            page = self.config.page_size_tokens
            req.cache_keys = block_keys(req.cache_root, req.tokens, page, sealable_blocks(req.prefill_target, page))
            req.keys_for = req.prefill_target
        return req.cache_keys

    def _cache_hits(self, req: Request, pair: Pair) -> dict[WorkerBinding, list[int]]:
        """Per pool of `pair`, the cached pages of the longest prefix of `req` found there, short
        of the page of its last token (which is computed to sample the next one); none for a
        request that still scores its prompt."""
        if req.scores_prompt:  # every prompt token's logits are needed: computed, never found cached
            return {}
        keys = self._cache_keys(req)[:reusable_blocks(req.prefill_target, self.config.page_size_tokens)]
        return {w: w.ledger.lookup(keys) for w in pair.pools} if keys else {}

    def _seal(self, w: WorkerBinding, req: Request, lease: int, pages: list[int], shared: int) -> None:
        """The full pages `lease` filled in `w`'s pool (after the `shared` ones it found cached)
        become sealed in that pool's cache."""
        keys = self._cache_keys(req)
        if len(keys) > shared:
            w.table.seal(lease, req.seal, pages[shared:len(keys)], keys[shared:])

    def _running_per_share(self) -> dict[str, int]:
        running: dict[str, int] = {}
        for group in self._running.values():
            for r in group.values():
                running[r.share] = running.get(r.share, 0) + 1
        return running

    def _next_to_start(self) -> Request | None:
        """The queued request to start next, among those whose tenant may run one more and that
        wait for no other (a tenant at its running limit, or a sample whose first sample's prompt
        is not cached yet, `_waits_for_leader`, waits without holding up the others): a priority
        request first; then one of the fair-share group (`Request.share`: a tenant, or without
        keys a client) that runs the fewest requests for its weight; within a group, a preempted
        request that has streamed output first (it keeps its place), then the earliest queued.
        One group's flood therefore takes only its share of the slots that free up."""
        eligible = [r for r in self.queue if r.priority or not (self._tenants[r.tenant].at_running_limit
                                                                or self._waits_for_leader(r))]
        if not eligible:
            return None
        if eligible[0].priority:
            return eligible[0]
        running = self._running_per_share()
        return min(eligible, key=lambda r: (running.get(r.share, 0) / r.weight, not r.num_generated))

    def _make_slot_for_share(self, req: Request, now: float) -> bool:
        """Every running slot is taken and `req` is next: when another group holds more slots for
        its weight than `req`'s group would with one more (still at least as many after giving
        one up), preempt that group's request preempted least often, the newest among those, that
        can be (scheduler/core/preemption.py) and say True; so a tenant under its share gets a slot as
        soon as it asks, from the tenant most over its share, and shares even out without taking
        slots back and forth. Least often first: the one preempted goes back to the front of the
        queue and runs again as the newest of its group, so newest first alone would take the
        same request back for each of a stream of requests until `max_preemptions` ended it."""
        running = self._running_per_share()
        mine = (running.get(req.share, 0) + 1) / req.weight
        candidates = [r for w in self.workers for r in self._preemptible(w)
                      if r.share != req.share and not r.priority and (running[r.share] - 1) / r.weight >= mine]
        if not candidates:
            return False
        victim = max(candidates, key=lambda r: (running[r.share] / r.weight, -r.preemptions, r.arrival))
        self._preempt(victim, now, f"its running slot went to {req.who}, whose group runs fewer for its weight")
        return True

    @staticmethod
    def _waits_for_leader(req: Request) -> bool:
        """A later sample of an n > 1 request waits while its first sample's first attempt has not
        yet cached its prompt pages in both pools (it caches them as it starts decoding)."""
        lead = req.leader
        return lead is not None and lead.attempt == 1 and lead.pending_end is None and lead.state in (
            State.WAITING, State.PREFILLING, State.TRANSFERRING)

    def _release_leases(self, req: Request) -> None:
        """Release every lease `req` holds (the workers untag and scrub the pages in their next
        message; in the pool of a lost worker they go with its table)."""
        if req.pair is not None:
            for w, lease in {(req.pair.prefill, req.prefill_lease), (req.pair.decode, req.decode_lease)}:
                w.table.release(lease)
        req.prefill_lease = req.decode_lease = 0

    def _quarantine(self, w: WorkerBinding, lease: int, now: float) -> None:
        pages = w.table.quarantine(lease, now)
        if pages:
            self._log_quarantine(w, f"{len(pages)} pages of {w.table.who(lease)} quarantined", now)

    @staticmethod
    def _log_quarantine(w: WorkerBinding, what: str, now: float) -> None:
        ledger = w.ledger
        since = ledger.quarantined_since
        held = f"oldest for {now - since:.1f} s" if since is not None else "none left"
        log.warning("%s pool: %s; %d of %d pages quarantined (%s)", w.name, what, ledger.num_quarantined,
                    ledger.num_pages, held)

    def _confirm_quiet(self, w: WorkerBinding, lease: int, now: float) -> list[int]:
        who = w.table.who(lease)  # before: the table forgets a lease once its pages are back
        pages = w.table.confirm_quiet(lease)
        if pages:
            self._log_quarantine(w, f"quarantine of {who} ended, {len(pages)} pages returned", now)
        return pages
