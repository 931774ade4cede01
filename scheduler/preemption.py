"""Decode pages that grow with the sequence, and preemption when the pool runs out: the part of the
scheduler that decides, between two steps, which request gets the next page.

Admission reserves a request's prompt pages and the page of its first generated token. Before each
decode step every request whose next token lands in a page it does not own yet gets that page,
oldest request first, as a PageGrant carried by that step's own message: the worker applies
releases, then grants, then runs, so the page is tagged with the lease before the forward writes it.

When no page is free the newest running request is preempted: its pages are released through the
normal path (the worker untags and scrubs them in its next message) and it goes back to the front
of the queue, to prefill prompt + everything it generated as a new attempt with new leases (in
disaggregated mode: on the prefill worker, then a new transfer). A request is only ever preempted
for an older one (or for a priority request, which is short), so the oldest always progresses and
every request ends; one preempted more than `max_preemptions` times ends with 503 instead.

All of it is synchronous and runs in the loop that steps the requests it touches, between steps,
so no step in flight can see a request change hands.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from kvfence.scheduler.admission import quarantine_refusal
from kvfence.scheduler.errors import RequestError
from kvfence.scheduler.messages import PageGrant, id_hex
from kvfence.scheduler.policy import newest, pages_short
from kvfence.scheduler.request import Request, State

if TYPE_CHECKING:
    from kvfence.scheduler.config import SchedulerConfig
    from kvfence.scheduler.metrics import SchedulerMetrics
    from kvfence.scheduler.worker_pool import WorkerPool

log = logging.getLogger(__name__)


class Preemption:
    """Mixed into Scheduler, whose state it reads and changes."""

    if TYPE_CHECKING:
        config: SchedulerConfig
        metrics: SchedulerMetrics
        prefill: WorkerPool
        decode: WorkerPool
        queue: deque[Request]
        prefilling: list[Request]
        decoding: list[Request]

        def _end(self, req: Request, error: RequestError | None, aborted: bool = False, reason: str = "",
                 tail: str = "", tail_ids: list[int] | None = None, admit: bool = True) -> None: ...
        def _reserve_queued(self) -> None: ...
        def _release_leases(self, req: Request) -> None: ...
        def _queue_front(self) -> int: ...
        def _initial_pages(self, num_tokens: int) -> tuple[int, int]: ...

    def _preemptible(self) -> list[Request]:
        """Running requests whose pages can be taken back between steps: decoding ones, and in
        colocated mode (one loop runs both) prefilling ones. A transfer's pages never are."""
        if self.decode is self.prefill:
            return [*self.prefilling, *self.decoding]
        return list(self.decoding)

    def _grow(self, decodes: list[Request]) -> list[Request]:
        """Before a decode step: each decoding request, oldest first, gets the page its next token
        lands in; when the pool is out, newer requests are preempted for it. A request still
        without its page sits the step out. Returns the requests that step now, in their order."""
        for req in sorted(decodes, key=lambda r: r.arrival):
            if req.state is State.DECODING:
                self._give_page(req)
        self._reserve_queued()
        page = self.config.page_size_tokens
        return [r for r in decodes if r.state is State.DECODING and pages_short(r, page) <= 0]

    def _give_page(self, req: Request) -> None:
        pool = self.decode
        while (short := pages_short(req, self.config.page_size_tokens)) > 0:
            pages = pool.ledger.reserve(req.decode_lease, short)
            if pages is not None:
                req.decode_pages.extend(pages)  # colocated: the same list as prefill_pages
                pool.grants.append(PageGrant(id_hex(req.decode_lease), pages))
                return
            victim = newest(self._preemptible(), than=None if req.priority else req)
            if victim is not None:
                self._preempt(victim)
                continue
            held_by_others = pool.ledger.num_used - pool.ledger.num_quarantined - len(req.decode_pages)
            if held_by_others <= 0:  # only quarantined pages stand in its way: no page may ever come
                refusal = quarantine_refusal([(pool.role, pool.ledger, len(req.decode_pages) + short)],
                                             time.monotonic())
                if refusal is not None:
                    log.warning("request %s ends with 503: %s", req.request_id, refusal.error.message)
                    self.metrics.rejected(refusal.reason)
                    self._end(req, refusal.error, admit=False)
            return  # else it waits for an older or a transferring request to give pages back

    def _make_room_for_priority(self) -> None:
        """A priority request waiting at the head of the queue for decode pages gets them from the
        newest running requests (prefill pages, in a pool of their own, come back as transfers end)."""
        if not self.queue or not self.queue[0].priority:
            return
        need_prefill, need_decode = self._initial_pages(self.queue[0].prefill_target)
        if self.decode is not self.prefill and not self.prefill.ledger.can_reserve(need_prefill):
            return
        while not self.decode.ledger.can_reserve(need_decode):
            victim = newest(self._preemptible())
            if victim is None:
                break
            self._preempt(victim)
        self._reserve_queued()

    def _preempt(self, req: Request) -> None:
        """Take a running request's pages back and put it at the front of the queue, to be
        recomputed; or end it, when it is being aborted, was preempted too often, or its tokens no
        longer fit one prefill."""
        if req.abort_requested:
            self._end(req, req.abort_error or RequestError(499, "client_closed", "the client closed the request"),
                      aborted=req.abort_error is None, admit=False)
            return
        need_prefill, need_decode = self._initial_pages(len(req.tokens))
        if (req.preemptions >= self.config.max_preemptions or need_prefill > self.prefill.ledger.num_pages
                or need_decode > self.decode.ledger.num_pages):
            log.warning("request %s: the decode pool is out of pages and it cannot be preempted again "
                        "(%d preemptions, %d tokens): it ends with 503", req.request_id, req.preemptions, len(req.tokens))
            self._end(req, RequestError(503, "overloaded", "the server ran out of KV pages for this request; "
                                        "retry shortly", error_type="service_unavailable", retry_after_s=1),
                      admit=False)
            return
        log.info("request %s preempted after %d generated tokens (preemption %d): the decode pool is out of pages",
                 req.request_id, req.num_generated, req.preemptions + 1)
        self.metrics.preempted()
        self._release_leases(req)
        req.requeue()
        self.queue.insert(self._queue_front(), req)
