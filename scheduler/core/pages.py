"""Which pages each request holds, in every pool it uses: what an attempt needs and whether it
fits (or can never fit: a refusal), where it starts (the router's pair, with its prefix-cache
hits), its leases opened and released, the pages it filled sealed into a pool's cache, and
quarantine and its end. Part of the scheduler core (no I/O, no clock: the time is passed in).

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
from collections.abc import Callable

from kvfence.scheduler.core.admission import Refusal, no_live_pair, quarantine_refusal, size_refusal
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.fleet import Fleet
from kvfence.scheduler.core.prefix_cache import block_keys, reusable_blocks, sealable_blocks
from kvfence.scheduler.core.request import Request
from kvfence.scheduler.core.router import Candidate, pick
from kvfence.scheduler.core.worker_binding import Pair, WorkerBinding

log = logging.getLogger(__name__)

Hits = dict[WorkerBinding, list[int]]  # per pool, the cached pages an attempt shares there


class Pages:
    def __init__(self, config: SchedulerConfig, fleet: Fleet, mint: Callable[[], int]) -> None:
        """`mint`: where lease ids come from (the core's)."""
        self.config = config
        self.fleet = fleet
        self.mint = mint
        self.held_until_quiet: dict[int, list[tuple[WorkerBinding, int]]] = {}  # transfer key -> leases quarantined
        self.seals: dict[str, int] = {}  # tenant -> the tag its sealed (cached) pages carry in every pool

    # ---- what an attempt needs, and whether it fits ----

    def needs(self, pair: Pair, num_tokens: int) -> dict[WorkerBinding, int]:
        """Pages an attempt that prefills `num_tokens` reserves at admission on `pair`, per pool:
        the decode side also gets the page of the first token it generates (it grows from there);
        a pool bound to both roles reserves the larger."""
        return self.per_pool(pair, self.config.pages_for(num_tokens), self.config.pages_for(num_tokens + 1))

    @staticmethod
    def per_pool(pair: Pair, prefill_pages: int, decode_pages: int) -> dict[WorkerBinding, int]:
        """Pages needed per pool of `pair`; a pool bound to both roles needs the larger."""
        needs = {pair.prefill: prefill_pages}
        needs[pair.decode] = max(needs.get(pair.decode, 0), decode_pages)
        return needs

    def can_reserve(self, pair: Pair, num_tokens: int, headroom_pages: int = 0, hits: Hits | None = None) -> bool:
        """The pages an attempt of `num_tokens` needs on `pair` are free or evictable in each of its
        pools, with `headroom_pages` more in the decode pool; `hits`: cached pages it shares instead."""
        hits = hits or {}
        return all(w.ledger.can_reserve(n - len(hits.get(w, ())) + (headroom_pages if w is pair.decode else 0),
                                        pinned=hits.get(w, ()))
                   for w, n in self.needs(pair, num_tokens).items())

    def refusal(self, prompt_tokens: int, prefill_tokens: int, max_tokens: int, now: float) -> Refusal | None:
        """Why no live pair can ever serve this request (None: one can). Over the context or a
        whole pool everywhere: 400; fits somewhere only with quarantined pages: 503 (and a log
        line); no pair at all: 503."""
        pairs = self.fleet.serving_pairs
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
        needs = self.per_pool(pair, self.config.pages_for(prefill_tokens),
                              self.config.pages_for(prompt_tokens + max_tokens))
        return quarantine_refusal([(w.name, w.ledger, n) for w, n in needs.items()], now)

    # ---- where an attempt starts, and its leases ----

    def route(self, req: Request, running_on: dict[WorkerBinding, int]) -> tuple[Pair, Hits] | None:
        """The pair this attempt of `req` starts on now and the cached pages it shares there, or
        None when no live pair that can hold it has its pages free yet."""
        candidates = []
        for pair in self.fleet.serving_pairs:
            if size_refusal(self.config, pair.max_context_tokens, pair.prefill.ledger, pair.decode.ledger,
                            len(req.prompt), req.max_tokens) is not None:
                continue
            hits = self.cache_hits(req, pair)
            headroom = 0 if req.priority else running_on.get(pair.decode, 0)
            if self.can_reserve(pair, req.prefill_target, headroom, hits):
                candidates.append(Candidate(pair, hits, running_on.get(pair.decode, 0)))
        best = pick(candidates)
        return None if best is None else (best.pair, best.hits)

    def reserve(self, req: Request, pair: Pair, hits: Hits) -> None:
        """Open `req`'s leases on `pair` for this attempt: the cached pages it shares (`hits`) and
        fresh ones for the rest, in every pool it uses."""
        leases: dict[WorkerBinding, tuple[int, list[int]]] = {}
        for w, n in self.needs(pair, req.prefill_target).items():
            lease, shared = self.mint(), hits.get(w, [])
            w.table.open(lease, req.tenant, shared)  # first: a hit is never evicted for the pages below
            pages = w.table.reserve(lease, n - len(shared))
            if pages is None:  # can_reserve said yes a moment ago
                raise RuntimeError("ledger refused a reservation it had just allowed")
            leases[w] = lease, shared + pages
        req.pair = pair
        (req.prefill_lease, req.prefill_pages), (req.decode_lease, req.decode_pages) = \
            leases[pair.prefill], leases[pair.decode]  # one pool for both roles: one lease, one page list
        req.shared_prefill, req.shared_decode = len(hits.get(pair.prefill, ())), len(hits.get(pair.decode, ()))
        req.prefilled = req.shared_prefill * self.config.page_size_tokens
        if req.attempt == 1:
            req.cached_tokens = req.prefilled

    def release(self, req: Request) -> None:
        """Release every lease `req` holds (the workers untag and scrub the pages in their next
        message; in the pool of a lost worker they go with its table)."""
        if req.pair is not None:
            for w, lease in {(req.pair.prefill, req.prefill_lease), (req.pair.decode, req.decode_lease)}:
                w.table.release(lease)
        req.prefill_lease = req.decode_lease = 0

    # ---- the prefix cache ----

    def cache_keys(self, req: Request) -> list[bytes]:
        """The keys of the full pages of what this attempt prefills ([] when it is not cached)."""
        if req.cache_root is None:
            return []
        if req.keys_for != req.prefill_target:
            page = self.config.page_size_tokens
            req.cache_keys = block_keys(req.cache_root, req.tokens, page, sealable_blocks(req.prefill_target, page))
            req.keys_for = req.prefill_target
        return req.cache_keys

    def cache_hits(self, req: Request, pair: Pair) -> Hits:
        """Per pool of `pair`, the cached pages of the longest prefix of `req` found there, short
        of the page of its last token (which is computed to sample the next one); none for a
        request that still scores its prompt."""
        if req.scores_prompt:  # every prompt token's logits are needed: computed, never found cached
            return {}
        keys = self.cache_keys(req)[:reusable_blocks(req.prefill_target, self.config.page_size_tokens)]
        return {w: w.ledger.lookup(keys) for w in pair.pools} if keys else {}

    def seal_of(self, tenant: str) -> int:
        """The tag `tenant`'s sealed pages carry in every pool (minted when first asked)."""
        seal = self.seals.get(tenant)
        if seal is None:
            seal = self.seals[tenant] = self.mint()
        return seal

    def seal_owner(self, tag: int) -> str | None:
        """The tenant whose sealed pages carry `tag` (None: no tenant's)."""
        return next((t for t, seal in self.seals.items() if seal == tag), None)

    def seal(self, w: WorkerBinding, req: Request, lease: int, pages: list[int], shared: int) -> None:
        """The full pages `lease` filled in `w`'s pool (after the `shared` ones it found cached)
        become sealed in that pool's cache."""
        keys = self.cache_keys(req)
        if len(keys) > shared:
            w.table.seal(lease, req.seal, pages[shared:len(keys)], keys[shared:])

    # ---- quarantine ----

    def quarantine(self, w: WorkerBinding, lease: int, now: float) -> None:
        """Keep `lease`'s pages in `w`'s pool out of every free list until a write can no longer
        reach them (`confirm_quiet`)."""
        pages = w.table.quarantine(lease, now)
        if pages:
            self._log_quarantine(w, f"{len(pages)} pages of {w.table.who(lease)} quarantined", now)

    def confirm_quiet(self, w: WorkerBinding, lease: int, now: float) -> list[int]:
        """No write can reach `lease`'s quarantined pages in `w`'s pool any more: they come back."""
        who = w.table.who(lease)  # before: the table forgets a lease once its pages are back
        pages = w.table.confirm_quiet(lease)
        if pages:
            self._log_quarantine(w, f"quarantine of {who} ended, {len(pages)} pages returned", now)
        return pages

    @staticmethod
    def _log_quarantine(w: WorkerBinding, what: str, now: float) -> None:
        ledger = w.ledger
        since = ledger.quarantined_since
        held = f"oldest for {now - since:.1f} s" if since is not None else "none left"
        log.warning("%s pool: %s; %d of %d pages quarantined (%s)", w.name, what, ledger.num_quarantined,
                    ledger.num_pages, held)
