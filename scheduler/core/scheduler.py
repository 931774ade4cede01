"""The scheduler core: every decision about requests and pages, with no I/O.

Events come in as method calls — `submit`, `abort`, `step_replied`, `transfer_finished`,
`transfer_quiet`, `tick` — each carrying the time (the core reads no clock); actions go out
through `take_actions()`: SendStep, StartTransfer, Emit, WatchQuiet (scheduler/core/actions.py). No
awaits: a driver (scheduler/driver.py for the server, scheduler/offline.py for `kvfence generate`)
carries the actions out and feeds their results back.

Workers are bindings (scheduler/core/worker_binding.py), each of a role (prefill, decode, or both:
colocated), joined into pairs (a prefill and a decode worker whose endpoints paired, or one
colocated worker); workers and pairs come (`add_pair`) and go (`worker_lost`) while serving. Each
attempt of a request runs on one pair, the router's pick at reservation (scheduler/core/router.py). A
step for a worker holds the decode steps of the requests decoding on it and prefill chunks of the
requests prefilling on it; a request whose prefill and decode leases are one (the same pool)
starts decoding where it prefilled, any other moves its KV first. Each worker has at most one step
in flight.

Workers coming and going, and what a step's reply says about its worker (a failed or refused
step, a restart, an integrity violation), are scheduler/core/worker_events.py's.

Page ownership: every request gets a lease per pool it uses (128-bit, minted here). The pool's
lease table (scheduler/core/lease_table.py) hands pages to the lease; the grant travels in the next
message to that worker, which tags the pages before it runs anything; a release returns the pages
to the ledger at once and the worker untags and scrubs them at the start of its next message.
A transfer starts only once the worker has applied its destination lease's grant.

Lifecycle (scheduler/core/lifecycle.py): every change of where a request is, is an event of its
transition table, which raises on any other. Each live request is in exactly one index, the one
of its state (`queue` for WAITING, in order; one dict for each running state), kept by `_move`,
`_requeue` and `_end`, the only callers of the events that change a state. An end or a retry asked
for while a step or a transfer may still touch the request's pages (an abort, a lost worker, a
restart) is the request's pending exit until nothing does.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable

from kvfence.engine.ids import id_hex, mint_id
from kvfence.engine.logprobs import TokenLogprobs
from kvfence.engine.protocol import StepDone, WorkerReply
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.tokenizer import Tokenizer
from kvfence.scheduler.core.actions import Action, Emit, MoveResult
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.errors import AdmissionRejected, RequestError, overloaded
from kvfence.scheduler.core.fleet import Fleet
from kvfence.scheduler.core.lifecycle import Event, State
from kvfence.scheduler.core.output import OutputDelta, TextOutput
from kvfence.scheduler.core.pages import Pages
from kvfence.scheduler.core.policy import RecentGroups, first_token_on, turn_order
from kvfence.scheduler.core.preemption import Preemption
from kvfence.scheduler.core.prefix_cache import chain_root, reusable_blocks
from kvfence.scheduler.core.registry import Registry
from kvfence.scheduler.core.request import Request, client_closed
from kvfence.scheduler.core.starts import Starts
from kvfence.scheduler.core.steps import Steps
from kvfence.scheduler.core.tenants import ANONYMOUS, Tenant
from kvfence.scheduler.core.transfers import Transfers
from kvfence.scheduler.core.worker_binding import Pair, Step, WorkerBinding
from kvfence.scheduler.core.worker_events import WorkerEvents
from kvfence.scheduler.metrics import SchedulerMetrics

log = logging.getLogger(__name__)



class SchedulerCore:
    """Composed of its parts, each with its own state: `registry` (the live requests, indexed by
    state), `fleet` (workers and pairs), `pages` (reservations, the prefix cache, quarantine),
    `starts` (which queued request starts next, where), `steps` (each worker's next message),
    `transfers` (the KV moved between pools), `preemption` and `worker_events`; this class takes
    the events and ends requests."""

    def __init__(self, config: SchedulerConfig, tokenizer: Tokenizer, prefill: WorkerBinding, decode: WorkerBinding,
                 metrics: SchedulerMetrics | None = None, *, mint: Callable[[], int] = mint_id,
                 max_context_tokens: int | None = None) -> None:
        """The first pair: `prefill` and `decode`, or one worker bound to both roles (`prefill is
        decode`: colocated), holding `max_context_tokens` (default and at most the config's). `mint`: where lease, request and
        transfer ids come from (a deterministic source makes a run replayable)."""
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics or SchedulerMetrics()
        self.mint = mint
        self.draining = False
        self.registry = Registry()
        self.fleet = Fleet(config)
        self.pages = Pages(config, self.fleet, mint)
        self.preemption = Preemption(config, self.metrics, self.registry, self.fleet, self.pages, end=self._end,
                                     start_queued=self._start_queued)
        self.worker_events = WorkerEvents(self.metrics, self.registry, self.fleet, end=self._end,
                                          seal_owner=self.pages.seal_owner)
        self._actions: list[Action] = []
        self.steps = Steps(config, self.registry, self.fleet, self.preemption, self._actions)
        self.starts = Starts(config, self.metrics, self.registry, self.fleet, self.pages, self.preemption,
                             end=self._end)
        self.transfers = Transfers(config, self.metrics, self.registry, self.fleet, self.pages, self._actions,
                                   end=self._end, retry=self._retry, start_decoding=self._start_decoding)
        self._recent = RecentGroups(config.contention_window_s)
        self.fleet.add_pair(prefill, decode, max_context_tokens)
        if config.unsafe_cache_across_tenants:
            log.error("UNSAFE: the prefix cache is shared across tenants (unsafe_cache_across_tenants, a broken guard "
                      "for testing the prober); never run this in production")

    # ---- queries ----

    def take_actions(self) -> list[Action]:
        """What the driver is to do, in order, since the last call (the list is emptied in place:
        the parts that add to it hold it)."""
        actions = list(self._actions)
        self._actions.clear()
        return actions

    def request(self, request_id: str) -> Request | None:
        """A live (not yet ended) request."""
        return self.registry.get(request_id)

    def requests_in(self, state: State) -> list[Request]:
        return self.registry.in_state(state)

    def num_running(self) -> int:
        return self.registry.num_running()

    def in_flight(self) -> int:
        """Requests admitted and not yet ended."""
        return len(self.registry)

    @property
    def queue(self) -> deque[Request]:
        """WAITING requests, in the order they get pages."""
        return self.registry.queue

    @property
    def workers(self) -> list[WorkerBinding]:
        return self.fleet.workers

    @property
    def pairs(self) -> list[Pair]:
        return self.fleet.pairs

    @property
    def serving_pairs(self) -> list[Pair]:
        """The pairs new attempts may start on: live, and neither worker draining."""
        return self.fleet.serving_pairs

    @property
    def max_context_tokens(self) -> int:
        """The longest request some live pair holds (the config's when none is live)."""
        return self.fleet.max_context_tokens

    def worker(self, name: str) -> WorkerBinding:
        """A live worker by name (KeyError when no live worker has it)."""
        return self.fleet.worker(name)

    def add_pair(self, prefill: WorkerBinding, decode: WorkerBinding, max_context_tokens: int | None = None) -> Pair:
        """Serve on `prefill` -> `decode` from now on (scheduler/core/fleet.py `add_pair`)."""
        return self.fleet.add_pair(prefill, decode, max_context_tokens)

    def pages_in_use(self) -> dict[str, int]:
        """Pages held per worker by leases and quarantines (the baseline is 0 when idle, whatever
        the prefix cache holds: `pages_cached`)."""
        return {w.name: w.ledger.num_in_use for w in self.workers}

    def pages_cached(self) -> dict[str, int]:
        """Pages per worker that only the prefix cache holds (evicted when a reservation needs them)."""
        return {w.name: w.ledger.num_cached_idle for w in self.workers}

    def report_metrics(self, now: float) -> None:
        for w in self.workers:
            ledger = w.ledger
            quarantined, since = ledger.num_quarantined, ledger.quarantined_since
            self.metrics.pool(w.name, ledger.num_pages, ledger.num_in_use - quarantined, quarantined,
                              ledger.num_cached_idle, 0.0 if since is None else now - since, w.draining)
        self.metrics.queue_sizes(len(self.queue), self.num_running())

    # ---- events ----

    def submit(self, prompt: list[int], params: SamplingParams, now: float, *, priority: bool = False,
               tenant: Tenant = ANONYMOUS, cache_salt: str = "") -> Request:
        """Admit or raise AdmissionRejected; nothing is reserved for a rejected request.

        `tenant`: who it is for (from the authenticated key); its limits hold here: over its
        tokens per minute or with `max_queued` requests waiting, 429 with Retry-After; at
        `max_running`, it waits while other tenants' requests behind it start.
        `priority`: a server-internal request (the readiness canary; the HTTP API never sets it),
        ahead of every queued one: no queue, running-slot or tenant limit applies, and when the
        decode pool is full the newest running request is preempted to make room for it; it is
        never cached (the canary runs the whole path every time).
        `cache_salt`: partitions the prefix cache further within the tenant (never across tenants:
        the chain is rooted in the tenant's name and its pages carry the tenant's seal)."""
        return self._admit(prompt, [params], now, priority, tenant, cache_salt)[0]

    def submit_samples(self, prompt: list[int], samples: list[SamplingParams], now: float, *,
                       tenant: Tenant = ANONYMOUS, cache_salt: str = "") -> list[Request]:
        """Admit the samples of one request (OpenAI's `n`) together, or refuse them all, as `submit`
        does one (the queue and the tenant's `max_queued` must hold all of them; the prompt counts
        once against its tokens per minute). Each sample is a request of its own: its leases,
        output and finish; `samples` differ only in their seeds.

        The prompt is prefilled and moved once: with the prefix cache on, the first sample goes
        first and the others wait in the queue (without holding up anyone behind them) until its
        full prompt pages are cached in both pools, then share them read-only; each computes only
        the page of the prompt's last token, which it writes its own tokens into, and decodes on
        its own pages. Once the first has been preempted or retried, they stop waiting for it."""
        if len(samples) > max(self.config.max_queue, 1):
            raise AdmissionRejected(400, "invalid_value", f"n is {len(samples)}, but this server queues at most "
                                    f"{self.config.max_queue} requests; ask for fewer samples", param="n")
        if any(p.max_tokens != samples[0].max_tokens for p in samples):
            raise ValueError("the samples of one request have the same max_tokens")
        return self._admit(prompt, samples, now, False, tenant, cache_salt)

    def _admit(self, prompt: list[int], samples: list[SamplingParams], now: float, priority: bool, tenant: Tenant,
               cache_salt: str) -> list[Request]:
        max_tokens = self.admissible(prompt, samples[0], now)
        load = self.registry.tenants.of(tenant, now)
        refusal = None if priority else self.registry.tenants.refusal(load, now, len(samples))
        if refusal is not None:
            self.metrics.rejected(refusal[0])
            raise refusal[1]
        running = self.num_running()
        if not priority and len(self.queue) + len(samples) > self.config.max_queue and (
                self.queue or running >= self.config.max_running
                or not any(self.pages.can_reserve(pair, len(prompt), running) for pair in self.serving_pairs)):
            self.metrics.rejected("queue_full")
            raise overloaded(f"the waiting queue is full ({self.config.max_queue} requests); retry shortly")
        admitted: list[Request] = []
        if not priority:  # the server's own checks contend with nobody
            self._recent.arrived(tenant.share_key, now)
        for params in samples:
            req = Request(request_id=id_hex(self.mint()), prompt=list(prompt), params=params, max_tokens=max_tokens,
                          output=TextOutput(self.tokenizer, prompt, params, max_tokens), created_s=now,
                          tokens=list(prompt), prefill_target=len(prompt), priority=priority, tenant=tenant.name,
                          share=tenant.share_key, weight=tenant.weight)
            if self.config.prefix_cache and not priority:
                scope = "*" if self.config.unsafe_cache_across_tenants else tenant.name  # "*": not a tenant name
                req.cache_root, req.seal = chain_root(scope, cache_salt), self.pages.seal_of(scope)
                if admitted and reusable_blocks(len(prompt), self.config.page_size_tokens):
                    req.leader = admitted[0]
            self.registry.add(req, front=priority)
            admitted.append(req)
        load.spend(len(prompt) + len(samples) * max_tokens, now)  # what it may use; settled at its end (_end)
        self._schedule(now)
        return admitted

    def admissible(self, prompt: list[int], params: SamplingParams, now: float) -> int:
        """The request's max_tokens if it can ever be served; else raise AdmissionRejected."""
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_context_tokens - len(prompt)
        if not prompt:
            raise AdmissionRejected(400, "invalid_prompt", "the prompt is empty", param="prompt")
        refusal = self.pages.refusal(len(prompt), len(prompt), max_tokens, now)
        if refusal is not None:
            self.metrics.rejected(refusal.reason)
            raise refusal.error
        if self.draining:
            self.metrics.rejected("draining")
            raise overloaded("the server is shutting down; retry on another replica", retry_after_s=5)
        return max_tokens

    def flush_cache(self, now: float) -> dict[str, int]:
        """Drop every prefix-cache entry of every pool; pages only the cache held are freed now
        (returned per worker), pages requests still read when those requests let go."""
        freed = {w.name: w.table.flush() for w in self.workers}
        log.info("prefix cache flushed: %s pages freed", ", ".join(f"{n} {name}" for name, n in freed.items()))
        self._schedule(now)
        return freed

    def abort(self, request_id: str, now: float, error: RequestError | None = None) -> None:
        """End a request (the client went away, unless `error` says otherwise); its pages come
        back when no step or transfer can touch them. A no-op for an ended request."""
        req = self.registry.get(request_id)
        if req is None or req.pending_end is not None:
            return
        req.fire(Event.ASK_END, error=error or client_closed())
        self._schedule(now)

    def transfer_finished(self, key: int, result: MoveResult, now: float, *, crashed: bool = False) -> None:
        """Transfer `key` ended (`crashed`: its task failed; what the transport did is unknown)."""
        self.transfers.finished(key, result, now, crashed=crashed)
        self._schedule(now)

    def transfer_quiet(self, key: int, now: float) -> None:
        """Every write transfer `key` posted is terminal: its quarantined pages come back."""
        self.transfers.quiet(key, now)
        self._schedule(now)

    def lease_quiet(self, worker: str, lease: int, now: float) -> list[int]:
        """No write can reach the quarantined pages of `lease` in the pool of the worker named
        `worker` any more (learned out of band): they come back. Returns them."""
        pages = self.pages.confirm_quiet(self.worker(worker), lease, now)
        self._schedule(now)
        return pages

    def tick(self, now: float) -> None:
        """Time passed: expire queued requests past their deadline, and ask every idle worker not
        heard from for a heartbeat interval for its incarnation (a restart is seen within about
        a heartbeat even when nothing runs)."""
        # a preempted request that has streamed output keeps its place: it is never timed out
        for req in [r for r in self.queue if now - r.queued_s > self.config.queue_timeout_s and not r.num_generated]:
            self.metrics.rejected("queue_timeout")
            self._end(req, RequestError(503, "overloaded", f"waited {self.config.queue_timeout_s:g} s for KV pages; "
                                        "retry shortly", error_type="service_unavailable", retry_after_s=1), now)
        self._schedule(now)
        for w in self.workers:
            if w.in_flight is None and now - w.last_sent_s >= self.config.heartbeat_s:
                self.steps.send(w, [], [], [], now)

    # ---- what happens after every event ----

    def _schedule(self, now: float) -> None:
        """End what may end, admit what fits, start transfers whose pages are tagged, and give
        every idle worker its next step."""
        for req in self.registry.live():
            if not req.life.settled:
                continue
            if req.pending_end is not None:
                self._end(req, req.pending_end, now)
            elif req.pending_retry:
                self._retry(req, now)
        self._start_queued(now)
        contended = self._recent.contended(now)
        for w in turn_order(self.workers, contended, lambda o: first_token_on(o, self.registry.index)):
            if w.in_flight is None:
                self.steps.plan(w, now, contended)
        self.steps.cut_for_first_tokens()
        self.transfers.start_ready()
        self.metrics.queue_sizes(len(self.queue), self.num_running())

    # ---- starting, retrying and ending requests ----

    def _retry(self, req: Request, now: float) -> None:
        """A worker of its pair was lost before it sent a token and nothing touches its pages any
        more: its old attempt's leases are released (or stay quarantined where a transfer left them)
        and it queues again as a new attempt, for another pair."""
        assert req.pair is not None
        log.warning("%s: attempt %d on %s lost a worker before its first token; retried as attempt %d",
                    req.who, req.attempt, req.pair.name, req.attempt + 1)
        self.metrics.retried()
        self.pages.release(req)
        self.registry.requeue(req, now, retry=True)

    def _end(self, req: Request, error: RequestError | None, now: float, last: OutputDelta | None = None) -> None:
        """Terminal transition (error, or `last` with its finish reason) and release of every page
        the request holds. A no-op for an ended request."""
        if req.state.terminal:
            return
        was = req.state
        if error is not None:
            delta = req.fail(error)
        elif last is not None and last.finish_reason is not None:
            delta = req.finish(last)
        else:
            raise ValueError(f"{req.who} ends with neither an error nor a last delta with its finish reason")
        self.registry.remove(req, was, now)
        self.pages.release(req)
        if delta is not None:
            self.metrics.finished(req, now)
            self._actions.append(Emit(req.request_id, delta))

    def _prefilled(self, req: Request, token: int, logprobs: TokenLogprobs | None, now: float) -> None:
        """Its whole prompt is in the prefill pool and `token` is its next token; the full pages it
        filled are sealed into the pool's cache."""
        assert req.pair is not None
        self.pages.seal(req.pair.prefill, req, req.prefill_lease, req.prefill_pages, req.shared_prefill)
        if req.decode_lease == req.prefill_lease:  # one pool for both roles: the KV is where decode reads
            self._start_decoding(req, token, logprobs, now)
            return
        self.registry.move(req, Event.PREFILLED)  # the token is sent once the KV has landed
        req.pending_token, req.pending_logprobs, req.prefill_done_s = token, logprobs, now

    def _start_decoding(self, req: Request, token: int | None, logprobs: TokenLogprobs | None, now: float) -> None:
        self.registry.move(req, Event.DECODE)
        req.decoded_context, req.pending_token, req.pending_logprobs = req.prefill_target, None, None
        if token is not None:
            self._accept_token(req, token, logprobs, now)

    def _accept_token(self, req: Request, token: int, logprobs: TokenLogprobs | None, now: float) -> None:
        req.tokens.append(token)
        self.metrics.token(req, now)
        delta = req.output.accept(token, logprobs)
        if req.prompt_logprobs and req.num_generated == 1:  # the prompt's go with the first token
            delta = dataclasses.replace(delta, prompt_logprobs=req.prompt_logprobs)
        if delta.terminal:
            self._end(req, None, now, last=delta)
        else:
            self._actions.append(Emit(req.request_id, delta))

    def _start_queued(self, now: float) -> None:
        """Start the queued requests that fit now (scheduler/core/starts.py)."""
        self.starts.start_queued(now)

    # ---- workers ----

    def step_replied(self, worker: str, reply: WorkerReply, now: float) -> None:
        """The worker named `worker` answered its step in flight."""
        w = self.fleet.find(worker)
        if w is None:  # lost while its step was in flight: its requests were settled then
            return
        step, w.in_flight = w.in_flight, None
        if step is None:
            raise RuntimeError(f"a reply from the {worker} worker, which has no step in flight")
        w.table.answered(step.number)
        if reply.draining:
            self.fleet.drain(w)
        for req in step.requests:
            req.fire(Event.STEP_SETTLED)
        done = self.worker_events.settle(w, step, reply, now)
        if done is not None:
            self._take(w, step, done, now)
        self._schedule(now)

    def _take(self, w: WorkerBinding, step: Step, done: StepDone, now: float) -> None:
        """What step `step` of `w` produced: the decodes' tokens, the chunks prefilled (and the
        first token of a prompt done); the seqs it left out go again as they were."""
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

    def worker_lost(self, name: str, now: float) -> None:
        """The worker named `name` is gone (scheduler/core/worker_events.py `lost`). A no-op for an
        unknown name."""
        if self.worker_events.lost(name, now):
            self._schedule(now)
