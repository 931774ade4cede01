"""Decode pages that grow with the sequence, and preemption when the pool runs out: the part of the
scheduler that decides, between two steps, which request gets the next page.

Admission reserves a request's prompt pages and the page of its first generated token. Before each
decode step every request whose next token lands in a page it does not own yet gets that page,
oldest request first, as a PageGrant carried by that step's own message: the worker applies
releases, then grants, then runs, so the page is tagged with the lease before the forward writes it.

When no page is free a running request of that decode pool is preempted: its pages are released
through the normal path (the worker untags and scrubs them in its next message) and it goes back to
the front of the queue, to prefill prompt + everything it generated as a new attempt with new
leases (in disaggregated mode: on the prefill worker, then a new transfer); one that has streamed
output keeps its place there and is never timed out. The victim (`victim`) is the newest request
of the fair-share group (a tenant, or without keys a client: `Request.share`) holding the most of
that pool's pages for its weight; a request only ever preempts one that ranks above it in that
order (group usage, then newness), so the lowest-ranked always progresses and every request ends
(a priority request, which is short, may preempt any); one preempted more than `max_preemptions`
times ends with 503 instead.

All of it is synchronous, in the scheduler core, and only touches requests no step in flight holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvfence.scheduler.core.admission import quarantine_refusal
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.errors import RequestError
from kvfence.scheduler.core.fleet import Fleet
from kvfence.scheduler.core.lifecycle import State
from kvfence.scheduler.core.pages import Pages
from kvfence.scheduler.core.policy import pages_short
from kvfence.scheduler.core.registry import Registry
from kvfence.scheduler.core.request import Request
from kvfence.scheduler.core.worker_binding import WorkerBinding
from kvfence.scheduler.metrics import SchedulerMetrics

log = logging.getLogger(__name__)

End = Callable[[Request, RequestError, float], None]


class Preemption:
    def __init__(self, config: SchedulerConfig, metrics: SchedulerMetrics, registry: Registry, fleet: Fleet,
                 pages: Pages, *, end: End, start_queued: Callable[[float], None]) -> None:
        """`end`: the core's end of a request (its pages released, its error sent); `start_queued`:
        the core's start of the queued requests that fit, run once pages were taken back."""
        self.config = config
        self.metrics = metrics
        self.registry = registry
        self.fleet = fleet
        self.pages = pages
        self._end = end
        self._start_queued = start_queued

    def preemptible(self, decode: WorkerBinding) -> list[Request]:
        """Running requests whose pages in `decode`'s pool can be taken back now: prefilling or
        decoding ones that no step in flight holds. A transfer's pages never are."""
        return [r for r in (*self.registry.in_state(State.PREFILLING), *self.registry.in_state(State.DECODING))
                if not r.stepping and r.pair is not None and r.pair.decode is decode]

    def victim(self, decode: WorkerBinding, grower: Request | None) -> Request | None:
        """The request to preempt on `decode` for `grower` (None: for a priority request, which may
        take from anyone): among the preemptible ones other than the grower (never a priority
        one), the newest of the group holding the most of the pool's pages for its weight; and
        only if it ranks above the grower in that order (group usage, then newness), else None."""
        candidates = [r for r in self.preemptible(decode) if r is not grower and not r.priority]
        if not candidates:
            return None
        held: dict[str, int] = {}
        for r in self.registry.running():
            if r.pair is not None and r.pair.decode is decode:
                held[r.share] = held.get(r.share, 0) + len(r.decode_pages)

        def rank(r: Request) -> tuple[float, int]:
            return held.get(r.share, 0) / r.weight, r.arrival

        victim = max(candidates, key=rank)
        return victim if grower is None or rank(victim) > rank(grower) else None

    def grow(self, w: WorkerBinding, now: float) -> list[Request]:
        """Before a decode step of `w`: a priority request waiting for decode pages gets them, then
        each request decoding on `w`, oldest first, gets the page its next token lands in; when
        the pool is out, newer requests of that pool are preempted for it. A request still without
        its page sits the step out. Returns the requests that step now, in the order they started
        decoding."""
        self._make_room_for_priority(now)
        decodes = [r for r in self.registry.in_state(State.DECODING) if r.pair is not None and r.pair.decode is w]
        for req in sorted(decodes, key=lambda r: r.arrival):
            if req.state is State.DECODING:
                self._give_page(req, now)
        self._start_queued(now)
        page = self.config.page_size_tokens
        return [r for r in decodes if r.state is State.DECODING and pages_short(r, page) <= 0]

    def _give_page(self, req: Request, now: float) -> None:
        assert req.pair is not None
        decode = req.pair.decode
        table = decode.table
        while (short := pages_short(req, self.config.page_size_tokens)) > 0:
            pages = table.reserve(req.decode_lease, short)
            if pages is not None:
                req.decode_pages.extend(pages)  # one pool for both roles: the same list as prefill_pages
                return
            victim = self.victim(decode, None if req.priority else req)
            if victim is not None:
                self.preempt(victim, now)
                continue
            held_by_others = table.ledger.num_in_use - table.ledger.num_quarantined - len(req.decode_pages)
            if held_by_others <= 0:  # only quarantined pages stand in its way: no page may ever come
                refusal = quarantine_refusal([(decode.name, table.ledger, len(req.decode_pages) + short)], now)
                if refusal is not None:
                    log.warning("%s ends with 503: %s", req.who, refusal.error.message)
                    self.metrics.rejected(refusal.reason)
                    self._end(req, refusal.error, now)
            return  # else it waits for an older or a transferring request to give pages back

    def _make_room_for_priority(self, now: float) -> None:
        """A priority request waiting at the head of the queue for decode pages gets them from the
        newest running requests of one pair's decode pool, the one with the most pages free
        among the pairs whose other pool has room (pages of another pool come back as transfers end)."""
        if not self.registry.queue or not self.registry.queue[0].priority:
            return
        head = self.registry.queue[0]
        room = []
        for pair in self.fleet.serving_pairs:
            needs = self.pages.needs(pair, head.prefill_target)
            if all(w.ledger.can_reserve(n) for w, n in needs.items() if w is not pair.decode):
                room.append((pair, needs))
        if not room:
            return
        pair, needs = max(room, key=lambda r: r[0].decode.ledger.num_pages - r[0].decode.ledger.num_in_use)
        while not pair.decode.ledger.can_reserve(needs[pair.decode]):
            victim = self.victim(pair.decode, None)
            if victim is None:
                break
            self.preempt(victim, now)
        self._start_queued(now)

    def preempt(self, req: Request, now: float, why: str = "the decode pool is out of pages") -> None:
        """Take a running request's pages back and put it at the front of the queue, to be
        recomputed; or end it, when it is being ended anyway, was preempted too often, or its
        tokens no longer fit one prefill. `why`: the reason, for the log."""
        if req.pending_end is not None:
            self._end(req, req.pending_end, now)
            return
        assert req.pair is not None
        if req.preemptions >= self.config.max_preemptions or any(
                n > w.ledger.num_pages for w, n in self.pages.needs(req.pair, len(req.tokens)).items()):
            log.warning("%s: %s and it cannot be preempted again (%d preemptions, %d tokens): it ends with 503",
                        req.who, why, req.preemptions, len(req.tokens))
            self._end(req, RequestError(503, "overloaded", "the server is too busy to finish this request; retry "
                                        "shortly", error_type="service_unavailable", retry_after_s=1), now)
            return
        log.info("%s preempted after %d generated tokens (preemption %d): %s",
                 req.who, req.num_generated, req.preemptions + 1, why)
        self.metrics.preempted()
        self.pages.release(req)
        self.registry.requeue(req, now)

    def make_slot_for_share(self, req: Request, now: float) -> bool:
        """Every running slot is taken and `req` is next: when another group holds more slots for
        its weight than `req`'s group would with one more (still at least as many after giving
        one up), preempt that group's request preempted least often, the newest among those, that
        can be, and say True; so a tenant under its share gets a slot as soon as it asks, from the
        tenant most over its share, and shares even out without taking slots back and forth.
        Least often first: the one preempted goes back to the front of the queue and runs again
        as the newest of its group, so newest first alone would take the same request back for
        each of a stream of requests until `max_preemptions` ended it."""
        running = self.registry.running_per_share()
        mine = (running.get(req.share, 0) + 1) / req.weight
        candidates = [r for w in self.fleet.workers for r in self.preemptible(w)
                      if r.share != req.share and not r.priority and (running[r.share] - 1) / r.weight >= mine]
        if not candidates:
            return False
        victim = max(candidates, key=lambda r: (running[r.share] / r.weight, -r.preemptions, r.arrival))
        self.preempt(victim, now, f"its running slot went to {req.who}, whose group runs fewer for its weight")
        return True
