"""Which queued request starts next, and on which pair: reservation in queue order within the
running-slot limit and each fair-share group's share; part of the scheduler core (no I/O, no
clock: the time is passed in).
"""

from __future__ import annotations

from collections.abc import Callable

from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.errors import RequestError
from kvfence.scheduler.core.fleet import Fleet
from kvfence.scheduler.core.lifecycle import Event, State
from kvfence.scheduler.core.pages import Pages
from kvfence.scheduler.core.preemption import Preemption
from kvfence.scheduler.core.registry import Registry
from kvfence.scheduler.core.request import Request
from kvfence.scheduler.metrics import SchedulerMetrics


class Starts:
    def __init__(self, config: SchedulerConfig, metrics: SchedulerMetrics, registry: Registry, fleet: Fleet,
                 pages: Pages, preemption: Preemption, *, end: Callable[[Request, RequestError, float], None]) -> None:
        """`end`: the core's end of a request (a queued one that can never fit ends with 503)."""
        self.config = config
        self.metrics = metrics
        self.registry = registry
        self.fleet = fleet
        self.pages = pages
        self.preemption = preemption
        self._end = end

    def start_queued(self, now: float) -> None:
        """Reserve pages for queued requests in order while they fit, each on the pair the router
        picks (scheduler/core/router.py): a priority request as soon as its pages are free; any other
        while a running slot is free and the pair's decode pool keeps a page of headroom per
        request running there (each may need one more page soon), so a new request does not take
        the page a running one is about to need. A queued request that can no longer ever fit
        (pages were quarantined, or pairs lost, since it came) ends now with 503."""
        changed = self.fleet.take_changed()
        if changed or any(w.ledger.num_quarantined for w in self.fleet.workers):
            for queued in list(self.registry.queue):
                refusal = self.pages.refusal(len(queued.prompt), queued.prefill_target, queued.max_tokens, now)
                if refusal is not None:
                    self.metrics.rejected(refusal.reason)
                    self._end(queued, refusal.error, now)
        running_on = self.registry.running_per_decode()
        while True:
            req = self._next_to_start()
            if req is None:
                return
            if not req.priority and self.registry.num_running() >= self.config.max_running \
                    and not self.preemption.make_slot_for_share(req, now):
                return
            choice = self.pages.route(req, running_on)
            if choice is None:
                return
            pair, hits = choice
            self.pages.reserve(req, pair, hits)
            running_on[pair.decode] = running_on.get(pair.decode, 0) + 1
            self.registry.move(req, Event.RESERVE)

    def _next_to_start(self) -> Request | None:
        """The queued request to start next, among those whose tenant may run one more and that
        wait for no other (a tenant at its running limit, or a sample whose first sample's prompt
        is not cached yet, `_waits_for_leader`, waits without holding up the others): a priority
        request first; then one of the fair-share group (`Request.share`: a tenant, or without
        keys a client) that runs the fewest requests for its weight; within a group, a preempted
        request that has streamed output first (it keeps its place), then the earliest queued.
        One group's flood therefore takes only its share of the slots that free up."""
        tenants = self.registry.tenants
        eligible = [r for r in self.registry.queue if r.priority or not (tenants[r.tenant].at_running_limit
                                                                or self._waits_for_leader(r))]
        if not eligible:
            return None
        if eligible[0].priority:
            return eligible[0]
        running = self.registry.running_per_share()
        return min(eligible, key=lambda r: (running.get(r.share, 0) / r.weight, not r.num_generated))

    @staticmethod
    def _waits_for_leader(req: Request) -> bool:
        """A later sample of an n > 1 request waits while its first sample's first attempt has not
        yet cached its prompt pages in both pools (it caches them as it starts decoding)."""
        lead = req.leader
        return lead is not None and lead.attempt == 1 and lead.pending_end is None and lead.state in (
            State.WAITING, State.PREFILLING, State.TRANSFERRING)
