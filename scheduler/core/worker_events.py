"""What a step's reply says about its worker, and workers lost; part of the scheduler core (no
I/O, no clock: the time is passed in). A worker lost (its requests retried once or failed), a
failed step, a step refused for an old incarnation, a worker seen to have restarted, pages that
failed their owner-tag or sanitizer check (that request failed closed, the others carry on), and
seqs that failed alone (that request ends, 400 when its own grammar led into a dead end, else 500;
the others carry on).

A lost worker ends its incarnation: requests that still need it and sent no token yet are retried
once, as a new attempt on another pair, once nothing touches their old pages; the others fail with
503 worker_lost. Its pool goes with it (the worker ends every lease itself when its scheduler's
connection drops). A restarted worker (seen from a reply's incarnation) fails every request bound
to the old one with 503 worker_restarted (mid-transfer: once the transfer is quiet).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvfence.engine.ids import id_hex
from kvfence.engine.protocol import StepDone, StepFailed, WorkerReply
from kvfence.scheduler.core.errors import RequestError
from kvfence.scheduler.core.fleet import Fleet
from kvfence.scheduler.core.lease_table import LeaseTable
from kvfence.scheduler.core.lifecycle import Event, State
from kvfence.scheduler.core.registry import Registry
from kvfence.scheduler.core.request import Request
from kvfence.scheduler.core.worker_binding import Step, WorkerBinding
from kvfence.scheduler.metrics import SchedulerMetrics

log = logging.getLogger(__name__)


class WorkerEvents:
    def __init__(self, metrics: SchedulerMetrics, registry: Registry, fleet: Fleet, *,
                 end: Callable[[Request, RequestError, float], None],
                 seal_owner: Callable[[int], str | None]) -> None:
        """`end`: the core's end of a request; `seal_owner`: the tenant whose seal a tag is (None: no seal)."""
        self.metrics = metrics
        self.registry = registry
        self.fleet = fleet
        self._end = end
        self._seal_owner = seal_owner

    def lost(self, name: str, now: float) -> bool:
        """The worker named `name` is gone (its control connection dropped, its membership lease
        expired): its pairs end, its step in flight never replies, and every request that still
        needs it is retried once on another pair when it sent no token yet (as soon as no step or
        transfer touches its pages), else ends with 503 worker_lost. A no-op for an unknown name."""
        w = self.fleet.lose(name)
        if w is None:
            return False
        if w.in_flight is not None:
            for req in w.in_flight.requests:
                req.fire(Event.STEP_SETTLED)
            w.in_flight = None
        bound = [r for r in self.registry.running() if self.needs_worker(r, w)]
        retried = 0
        for req in bound:
            if req.pending_end is None and req.num_generated == 0 and req.retries == 0:
                req.fire(Event.ASK_RETRY)
                retried += 1
            else:
                req.fire(Event.ASK_END, error=RequestError(
                    503, "worker_lost", f"the {w.role} worker serving this request was lost; retry it",
                    error_type="service_unavailable", retry_after_s=1))
        log.warning("the %s worker %s was lost: %d requests bound to it (%d retried on another pair, %d fail with "
                    "503); %d pairs left", w.role, w.name, len(bound), retried, len(bound) - retried, len(self.fleet.pairs))
        self.metrics.worker_lost(w.name)
        return True

    @staticmethod
    def needs_worker(req: Request, w: WorkerBinding) -> bool:
        """Whether running request `req` still needs worker `w`: its decode worker always, its
        prefill worker until its KV has left it."""
        pair = req.pair
        if pair is None:
            return False
        if pair.decode is w:
            return True
        return pair.prefill is w and req.state in (State.PREFILLING, State.TRANSFERRING)

    def _observe(self, w: WorkerBinding, reply: WorkerReply, now: float) -> bool:
        """True when `reply` shows `w`'s worker restarted; every request bound to the old
        incarnation has then been failed (503) or, mid-transfer, is failed when the transfer is quiet."""
        if not w.restarted(reply):
            return False
        error = self._restart_error(w)
        bound = [r for r in self.registry.running() if r.pair is not None
                 and ((r.pair.prefill is w and r.prefill_lease) or (r.pair.decode is w and r.decode_lease))]
        log.warning("the %s worker restarted (now incarnation %s): %d requests bound to the old one fail with 503",
                    w.name, w.incarnation, len(bound))
        self.metrics.worker_restart(w.name)
        w.table.flush()  # a restarted worker's pool is blank: nothing cached there holds KV any more
        for req in bound:
            if req.transfer:  # its pages are released when the transport is quiet
                req.fire(Event.ASK_END, error=error)
            else:
                self._end(req, error, now)
        return True

    @staticmethod
    def _restart_error(w: WorkerBinding) -> RequestError:
        return RequestError(503, "worker_restarted", f"the {w.name} worker restarted while serving this "
                            "request; retry it", error_type="service_unavailable", retry_after_s=1)

    def settle(self, w: WorkerBinding, step: Step, reply: WorkerReply, now: float) -> StepDone | None:
        """Fail the requests of a failed step, or those whose pages failed the owner-tag check, or
        every request bound to a worker that turns out to have restarted.

        Returns the reply when the step ran (its other requests carry on), else None."""
        if self._observe(w, reply, now):
            return None
        if isinstance(reply, StepFailed) and reply.stale_incarnation:  # built before the restart was seen
            for req in step.requests:
                self._end(req, self._restart_error(w), now)
            return None
        if not isinstance(reply, StepDone):
            for req in step.requests:
                self._end(req, RequestError(500, "worker_error", f"the model step failed: {reply.message}"), now)
            return None
        requests = step.requests
        for v in reply.violations:
            req, seq = requests[v.seq_index], step.seqs[v.seq_index]
            what = "belongs to" if v.check == "owner_tag" else f"{v.detail} was last written by"
            log.error("KV integrity violation (%s) on the %s worker: page %d %s %s, was to be read by "
                      "%s of %s; the request is failed closed", v.check, w.name, v.page, what,
                      self._name_tag(w.table, v.owner), id_hex(seq.lease), req.who)
            self.metrics.integrity_violation(w.name, v.check)
            self._end(req, RequestError(500, "kv_integrity_error",
                                        "a KV page of this request failed its ownership check; the request was "
                                        "stopped before the step's token was sent"), now)
        for f in reply.failed:
            req = requests[f.seq_index]
            if req.state.terminal:
                continue
            if f.request_fault:
                log.info("%s ends on the %s worker: %s", req.who, w.name, f.message)
                error = RequestError(400, "grammar_dead_end", f.message)
            else:
                log.error("%s failed alone on the %s worker: %s", req.who, w.name, f.message)
                error = RequestError(500, "worker_error", f"the model step failed for this request: {f.message}")
            self._end(req, error, now)
        return reply

    def _name_tag(self, table: LeaseTable, tag: int) -> str:
        """What a page's owner tag is, for a log line: a lease (with its tenant while it is known),
        a tenant's seal, or nobody."""
        if not tag:
            return "nobody"
        tenant = self._seal_owner(tag)
        return f"the seal of tenant {tenant}" if tenant is not None else table.who(tag)
