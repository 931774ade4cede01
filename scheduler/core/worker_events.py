"""A step's reply (`step_replied`: tokens, chunks prefilled, seqs deferred or cut), workers as
they come and go, and what a reply says about its worker, part of the
scheduler core (no I/O, no clock: the time is passed in): pairs added while serving, a worker lost
(its requests retried once or failed), a failed step, a step refused for an old incarnation, a
worker seen to have restarted, and pages that failed their owner-tag or sanitizer check (that
request failed closed, the others carry on), and seqs that failed alone (that request ends,
400 when its own grammar led into a dead end, else 500; the others carry on).

A lost worker ends its incarnation: requests that still need it and sent no token yet are retried
once, as a new attempt on another pair, once nothing touches their old pages; the others fail with
503 worker_lost. Its pool goes with it (the worker ends every lease itself when its scheduler's
connection drops). A restarted worker (seen from a reply's incarnation) fails every request bound
to the old one with 503 worker_restarted (mid-transfer: once the transfer is quiet).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvfence.engine.ids import id_hex
from kvfence.engine.protocol import StepDone, StepFailed, WorkerReply
from kvfence.scheduler.core.lease_table import LeaseTable
from kvfence.scheduler.core.errors import RequestError
from kvfence.scheduler.core.lifecycle import Event, State
from kvfence.scheduler.core.request import Request
from kvfence.scheduler.core.worker_binding import Pair, Step, WorkerBinding

if TYPE_CHECKING:
    from kvfence.engine.logprobs import TokenLogprobs
    from kvfence.scheduler.core.config import SchedulerConfig
    from kvfence.scheduler.metrics import SchedulerMetrics
    from kvfence.scheduler.core.output import OutputDelta

log = logging.getLogger(__name__)


class WorkerEvents:
    """Mixed into SchedulerCore, whose state it reads and changes."""

    if TYPE_CHECKING:
        config: SchedulerConfig
        metrics: SchedulerMetrics
        workers: list[WorkerBinding]
        pairs: list[Pair]
        _pairs_changed: bool
        _running: dict[State, dict[str, Request]]

        _seals: dict[str, int]

        def _end(self, req: Request, error: RequestError | None, now: float, last: OutputDelta | None = None) -> None: ...
        def _schedule(self, now: float) -> None: ...
        def _accept_token(self, req: Request, token: int, logprobs: TokenLogprobs | None, now: float) -> None: ...
        def _prefilled(self, req: Request, token: int, logprobs: TokenLogprobs | None, now: float) -> None: ...

    def step_replied(self, worker: str, reply: WorkerReply, now: float) -> None:
        """The worker named `worker` answered its step in flight."""
        w = next((o for o in self.workers if o.name == worker), None)
        if w is None:  # lost while its step was in flight: its requests were settled then
            return
        step, w.in_flight = w.in_flight, None
        if step is None:
            raise RuntimeError(f"a reply from the {worker} worker, which has no step in flight")
        w.table.answered(step.number)
        if reply.draining and not w.draining:
            w.draining, self._pairs_changed = True, True
            log.info("the %s worker %s is draining: nothing new starts on it; %d pairs still take requests",
                     w.role, w.name, len(self.serving_pairs))
        for req in step.requests:
            req.fire(Event.STEP_SETTLED)
        done = self._settle(w, step, reply, now)
        if done is not None:
            if done.cut:
                self.metrics.step_cut(w.name)
                for req, _ in step.chunks:
                    req.chunk_cut = True  # at most once a chunk: other groups' first tokens cost it one try
            deferred = set(done.deferred)  # left out (a grammar compiling, or the step cut): sent again
            for i in deferred:
                step.requests[i].counted_lease = 0  # their history goes again with them
            logprobs = done.logprobs or [None] * len(done.tokens)
            for req, token, lp in zip(step.decodes, done.tokens, logprobs):
                if req.state is State.DECODING and token is not None:
                    self._accept_token(req, token, lp, now)
            n = len(step.decodes)
            scores = done.prompt_logprobs or [[]] * len(done.tokens)
            for j, ((req, seq), token, lp, scored) in enumerate(zip(step.chunks, done.tokens[n:], logprobs[n:],
                                                                    scores[n:])):
                if req.state.terminal or seq.lease != req.prefill_lease or n + j in deferred:
                    continue
                req.prompt_logprobs += scored
                req.prefilled += len(seq.token_ids)
                req.chunk_cut = False
                self.metrics.prefill(req, len(seq.token_ids))
                if token is not None:
                    self._prefilled(req, token, lp, now)
        self._schedule(now)

    def add_pair(self, prefill: WorkerBinding, decode: WorkerBinding, max_context_tokens: int | None = None) -> Pair:
        """Serve on `prefill` -> `decode` from now on (their endpoints paired; each is added as a
        worker if new). `max_context_tokens`: the longest request both hold (at most the config's)."""
        if self.config.disaggregated != (prefill is not decode):
            raise ValueError("disaggregated mode needs a prefill and a decode worker; colocated binds one to both")
        if not prefill.prefills or not decode.decodes:
            raise ValueError(f"{prefill.name} -> {decode.name}: a pair is a prefill and a decode worker")
        if any(p.prefill is prefill and p.decode is decode for p in self.pairs):
            raise ValueError(f"{prefill.name} -> {decode.name} is paired already")
        for w in (prefill, decode):
            if w not in self.workers:
                if any(o.name == w.name for o in self.workers):
                    raise ValueError(f"a worker named {w.name!r} serves already")
                self.workers.append(w)
        limit = self.config.max_context_tokens
        pair = Pair(prefill, decode, limit if max_context_tokens is None else min(limit, max_context_tokens))
        self.pairs.append(pair)
        return pair

    @property
    def serving_pairs(self) -> list[Pair]:
        """The pairs new attempts may start on: live, and neither worker draining."""
        return [p for p in self.pairs if not p.prefill.draining and not p.decode.draining]

    def worker(self, name: str) -> WorkerBinding:
        """A live worker by name (KeyError when no live worker has it)."""
        for w in self.workers:
            if w.name == name:
                return w
        raise KeyError(name)

    @property
    def max_context_tokens(self) -> int:
        """The longest request some live pair holds (the config's when none is live)."""
        return max((p.max_context_tokens for p in self.pairs), default=self.config.max_context_tokens)

    def worker_lost(self, name: str, now: float) -> None:
        """The worker named `name` is gone (its control connection dropped, its membership lease
        expired): its pairs end, its step in flight never replies, and every request that still
        needs it is retried once on another pair when it sent no token yet (as soon as no step or
        transfer touches its pages), else ends with 503 worker_lost. A no-op for an unknown name."""
        w = next((o for o in self.workers if o.name == name), None)
        if w is None:
            return
        self.workers.remove(w)
        self.pairs = [p for p in self.pairs if w not in (p.prefill, p.decode)]
        self._pairs_changed = True
        if w.in_flight is not None:
            for req in w.in_flight.requests:
                req.fire(Event.STEP_SETTLED)
            w.in_flight = None
        bound = [r for group in self._running.values() for r in group.values() if self._needs_worker(r, w)]
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
                    "503); %d pairs left", w.role, w.name, len(bound), retried, len(bound) - retried, len(self.pairs))
        self.metrics.worker_lost(w.name)
        self._schedule(now)

    @staticmethod
    def _needs_worker(req: Request, w: WorkerBinding) -> bool:
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
        bound = [r for group in self._running.values() for r in group.values() if r.pair is not None
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

    def _settle(self, w: WorkerBinding, step: Step, reply: WorkerReply, now: float) -> StepDone | None:
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
        tenant = next((t for t, seal in self._seals.items() if seal == tag), None)
        return f"the seal of tenant {tenant}" if tenant is not None else table.who(tag)
