"""The scheduler: admission, page reservation, dispatch to workers, output, release.

Decisions are synchronous (admission, planning, accounting); only dispatch awaits. One asyncio
task per worker loop plus one per KV transfer, all in the server's task group.

Page ownership: every request gets a lease per pool it uses (minted here, 128-bit). The ledger
hands pages to a lease at admission; the worker tags them with the lease when the first message
that uses them arrives; releasing a lease returns its pages to the ledger at once and the worker
untags them in the next message it receives (before any new grant in that message).

Decode pages grow with the sequence, and the newest running request is preempted when the pool
runs out (preemption.py); admission still takes only requests that can ever fit (admission.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskGroup

from kvfence.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.tokenizer import Tokenizer
from kvfence.engine.worker import WorkerChannel
from kvfence.scheduler.admission import Refusal, quarantine_refusal, size_refusal
from kvfence.scheduler.config import SchedulerConfig
from kvfence.scheduler.errors import AdmissionRejected, RequestError, overloaded
from kvfence.scheduler.handle import OutputDelta, RequestHandle
from kvfence.scheduler.ids import mint_id
from kvfence.scheduler.messages import Landing, PageGrant, SeqStep, StepDone, StepFailed, WorkerReply, id_hex
from kvfence.scheduler.metrics import SchedulerMetrics
from kvfence.scheduler.policy import decode_steps, prefill_chunks
from kvfence.scheduler.preemption import Preemption
from kvfence.scheduler.request import Request, State
from kvfence.scheduler.transfer import TransferLink
from kvfence.scheduler.worker_pool import WorkerPool

log = logging.getLogger(__name__)


class Scheduler(Preemption):
    def __init__(self, config: SchedulerConfig, tokenizer: Tokenizer, prefill: WorkerChannel,
                 decode: WorkerChannel | None, *, prefill_pages: int, decode_pages: int,
                 link: TransferLink | None = None, metrics: SchedulerMetrics | None = None) -> None:
        if config.disaggregated != (decode is not None and link is not None):
            raise ValueError("disaggregated mode needs a decode worker and a transfer link; colocated needs neither")
        self.config = config
        self.tokenizer = tokenizer
        self.prefill = WorkerPool(prefill, prefill_pages, self._pages_returned)
        self.decode = WorkerPool(decode, decode_pages, self._pages_returned) if decode is not None else self.prefill
        self.link = link
        self.metrics = metrics or SchedulerMetrics()
        self.queue: deque[Request] = deque()  # admitted, waiting for pages
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self.transferring: set[Request] = set()
        self.draining = False
        self._arrivals = 0  # admission order (Request.arrival)
        self._step_id = 0
        self._prefill_work = anyio.Event()  # one wake-up event per loop, so none is missed
        self._decode_work = anyio.Event()
        self._task_group: TaskGroup | None = None

    @property
    def max_context_tokens(self) -> int:
        return self.config.max_context_tokens

    def refresh_metrics(self) -> None:
        pools = [("colocated", self.prefill)] if self.decode is self.prefill else \
            [("prefill", self.prefill), ("decode", self.decode)]
        now = time.monotonic()
        for role, pool in pools:
            quarantined, since = pool.ledger.num_quarantined, pool.ledger.quarantined_since
            self.metrics.pool(role, pool.ledger.num_pages, pool.ledger.num_used - quarantined, quarantined,
                              0.0 if since is None else now - since)
        self.metrics.queue_sizes(len(self.queue), len(self.prefilling) + len(self.decoding) + len(self.transferring))

    def in_flight(self) -> int:
        """Requests admitted and not yet ended."""
        return len(self.queue) + len(self.prefilling) + len(self.transferring) + len(self.decoding)

    def pages_in_use(self) -> dict[str, int]:
        """Pages held per role (the baseline is 0 when idle; quarantined pages count as held)."""
        if self.decode is self.prefill:
            return {"colocated": self.prefill.ledger.num_used}
        return {"prefill": self.prefill.ledger.num_used, "decode": self.decode.ledger.num_used}

    # ---- admission (synchronous) ----

    def submit(self, prompt: list[int], params: SamplingParams) -> RequestHandle:
        """Admit or raise AdmissionRejected; nothing is reserved for a rejected request."""
        max_tokens = self._admissible(prompt, params)
        would_wait = bool(self.queue) or self._num_running() >= self.config.max_running \
            or not self._can_reserve(len(prompt), self._num_running())
        if would_wait and len(self.queue) >= self.config.max_queue:
            self.metrics.rejected("queue_full")
            raise overloaded(f"the waiting queue is full ({self.config.max_queue} requests); retry shortly")
        return self._enqueue(prompt, params, max_tokens, priority=False)

    def submit_priority(self, prompt: list[int], params: SamplingParams) -> RequestHandle:
        """Admit a server-internal request (the readiness canary; the HTTP API never calls this)
        ahead of every queued one: no queue or running-slot limit applies, and when the decode pool
        is full the newest running request is preempted to make room for it. Admission is checked
        exactly as for `submit`."""
        return self._enqueue(prompt, params, self._admissible(prompt, params), priority=True)

    def _admissible(self, prompt: list[int], params: SamplingParams) -> int:
        """The request's max_tokens if it can ever be served; else raise AdmissionRejected."""
        max_tokens = params.max_tokens if params.max_tokens is not None else self.config.max_context_tokens - len(prompt)
        if not prompt:
            raise AdmissionRejected(400, "invalid_prompt", "the prompt is empty", param="prompt")
        refusal = size_refusal(self.config, self.prefill.ledger, self.decode.ledger, len(prompt), max_tokens) \
            or self._quarantine_refusal(len(prompt), len(prompt), max_tokens)
        if refusal is not None:
            self.metrics.rejected(refusal.reason)
            raise refusal.error
        if self.draining:
            self.metrics.rejected("draining")
            raise overloaded("the server is shutting down; retry on another replica", retry_after_s=5)
        return max_tokens

    def _enqueue(self, prompt: list[int], params: SamplingParams, max_tokens: int, *, priority: bool) -> RequestHandle:
        self._arrivals += 1
        request_id = id_hex(mint_id())
        req = Request(request_id, list(prompt), params, max_tokens, handle=None,  # type: ignore[arg-type]
                      detok=IncrementalDetokenizer(self.tokenizer, prompt), stops=StopStringMatcher(params.stop),
                      tokens=list(prompt), prefill_target=len(prompt), arrival=self._arrivals, priority=priority)
        req.handle = RequestHandle(request_id, req.prompt, lambda: self.abort(req))
        if priority:
            self.queue.insert(self._queue_front(), req)
        else:
            self.queue.append(req)
        self._reserve_queued()
        self.metrics.queue_sizes(len(self.queue), self._num_running())
        self._wake()
        return req.handle

    def _num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding) + len(self.transferring)

    def _queue_front(self) -> int:
        """Where a request goes to be next: behind the priority requests already waiting."""
        return next((i for i, r in enumerate(self.queue) if not r.priority), len(self.queue))

    def _initial_pages(self, num_tokens: int) -> tuple[int, int]:
        """Pages an attempt that prefills `num_tokens` reserves at admission, (prefill, decode): the
        decode side also gets the page of the first token it generates; it grows from there."""
        return self.config.pages_for(num_tokens), self.config.pages_for(num_tokens + 1)

    def _can_reserve(self, num_tokens: int, headroom_pages: int = 0) -> bool:
        need_prefill, need_decode = self._initial_pages(num_tokens)
        if self.decode is self.prefill:
            return self.prefill.ledger.can_reserve(need_decode + headroom_pages)
        return (self.prefill.ledger.can_reserve(need_prefill)
                and self.decode.ledger.can_reserve(need_decode + headroom_pages))

    def _quarantine_refusal(self, prompt_tokens: int, prefill_tokens: int, max_tokens: int) -> Refusal | None:
        """A refusal (and a log line) when the request fits only with quarantined pages."""
        needs = [(self.decode.role, self.decode.ledger, self.config.pages_for(prompt_tokens + max_tokens))]
        if self.decode is not self.prefill:
            needs.append((self.prefill.role, self.prefill.ledger, self.config.pages_for(prefill_tokens)))
        refusal = quarantine_refusal(needs, time.monotonic())
        if refusal is not None:
            log.warning("request refused with 503: %s", refusal.error.message)
        return refusal

    def _reserve_queued(self) -> None:
        """Reserve pages for queued requests in order while they fit: a priority request as soon
        as its pages are free; any other while a running slot is free and the decode pool keeps a
        page of headroom per running request (each may need one more page soon), so a new request
        does not take the page a running one is about to need. A queued request that can no
        longer ever fit (pages were quarantined since it came) ends now with 503."""
        if self.prefill.ledger.num_quarantined or self.decode.ledger.num_quarantined:
            for req in list(self.queue):
                refusal = self._quarantine_refusal(len(req.prompt), req.prefill_target, req.max_tokens)
                if refusal is not None:
                    self.queue.remove(req)
                    self.metrics.rejected(refusal.reason)
                    self._end(req, refusal.error, admit=False)
        while self.queue:
            req = self.queue[0]
            running = self._num_running()
            if not req.priority and running >= self.config.max_running:
                return
            if not self._can_reserve(req.prefill_target, 0 if req.priority else running):
                return
            self.queue.popleft()
            need_prefill, need_decode = self._initial_pages(req.prefill_target)
            if self.decode is self.prefill:
                req.prefill_lease = req.decode_lease = mint_id()
                req.prefill_pages = req.decode_pages = self._grant(self.prefill, req.prefill_lease, need_decode)
            else:
                req.prefill_lease, req.decode_lease = mint_id(), mint_id()
                req.prefill_pages = self._grant(self.prefill, req.prefill_lease, need_prefill)
                req.decode_pages = self._grant(self.decode, req.decode_lease, need_decode)
            req.advance(State.PREFILLING)
            if req.priority:  # its chunks go first
                self.prefilling.insert(sum(1 for r in self.prefilling if r.priority), req)
            else:
                self.prefilling.append(req)
            self._prefill_work.set()

    def _grant(self, pool: WorkerPool, lease: int, num_pages: int) -> list[int]:
        pages = pool.ledger.reserve(lease, num_pages)
        if pages is None:  # _can_reserve said yes a moment ago, synchronously
            raise RuntimeError("ledger refused a reservation it had just allowed")
        pool.grants.append(PageGrant(id_hex(lease), pages))
        return pages

    def _pages_returned(self) -> None:
        """A quarantine ended: admit what now fits."""
        self._reserve_queued()
        self._wake()

    # ---- abort and release ----

    def abort(self, req: Request) -> None:
        """Client gone: end the request; pages come back when no worker or transfer can touch them."""
        if req.state.terminal or req.abort_requested:
            return
        req.abort_requested = True
        if req in self.queue:  # nothing reserved yet
            self.queue.remove(req)
            self._end(req, RequestError(499, "client_closed", "the client closed the request"), aborted=True)
        self._wake()

    def _end(self, req: Request, error: RequestError | None, aborted: bool = False, reason: str = "",
             tail: str = "", tail_ids: list[int] | None = None, admit: bool = True) -> None:
        """Terminal transition plus release of every page the request holds; then, unless `admit`
        is False (the caller is planning pages and admits afterwards), admit what now fits."""
        ended = req.fail(error, aborted=aborted) if error is not None else req.finish(reason, tail, tail_ids)
        if ended:
            self.metrics.finished(req)
        self._release_leases(req)
        if admit:
            self._reserve_queued()
        self._wake()

    def _release_leases(self, req: Request) -> None:
        """Take `req` out of the running sets and release every lease it holds (the workers
        untag and scrub the pages in their next message)."""
        for group in (self.prefilling, self.decoding):
            if req in group:
                group.remove(req)
        self.prefill.release(req.prefill_lease)
        if self.decode is not self.prefill:
            self.decode.release(req.decode_lease)
        req.prefill_lease = req.decode_lease = 0

    def _drop_aborted(self, group: list[Request]) -> None:
        for req in [r for r in group if r.abort_requested]:
            self._end(req, RequestError(499, "client_closed", "the client closed the request"), aborted=True)

    # ---- output ----

    def _accept_token(self, req: Request, token: int) -> None:
        req.tokens.append(token)
        self.metrics.token(req)
        p = req.params
        if (not p.ignore_eos and token in self.tokenizer.eos_token_ids) or token in p.stop_token_ids:
            tail = req.stops.push(req.detok.flush())[0] + req.stops.flush()
            self._end(req, None, reason="stop", tail=tail, tail_ids=[token])
            return
        text, matched = req.stops.push(req.detok.push(token))
        if matched:
            self._end(req, None, reason="stop", tail=text, tail_ids=[token])
        elif req.num_generated >= req.max_tokens:
            text += req.stops.push(req.detok.flush())[0]
            if req.stops.matched:
                self._end(req, None, reason="stop", tail=text, tail_ids=[token])
            else:
                self._end(req, None, reason="length", tail=text + req.stops.flush(), tail_ids=[token])
        else:
            req.handle.push(OutputDelta(text, [token]))

    def _accept_decoded(self, decodes: list[Request], tokens: list[int | None]) -> None:
        for req, token in zip(decodes, tokens):
            if req.state is State.DECODING and token is not None:
                self._accept_token(req, token)

    def _settle(self, role: str, reqs: list[Request], seqs: list[SeqStep], reply: WorkerReply) -> StepDone | None:
        """Fail the requests of a failed step, or those whose pages failed the owner-tag check, or
        every request bound to a worker that turns out to have restarted.

        Returns the reply when the step ran (its other requests carry on), else None."""
        pool = self.decode if role == "decode" else self.prefill
        if self._observe(pool, reply):
            return None
        if isinstance(reply, StepFailed) and reply.stale_incarnation:  # built before the restart was seen
            for req in reqs:
                self._end(req, self._restart_error(pool))
            return None
        if not isinstance(reply, StepDone):
            for req in reqs:
                self._end(req, RequestError(500, "worker_error", f"the model step failed: {reply.message}"))
            return None
        for v in reply.violations:
            req, seq = reqs[v.seq_index], seqs[v.seq_index]
            what = "belongs to" if v.check == "owner_tag" else f"{v.detail} was last written by"
            log.error("KV integrity violation (%s) on the %s worker: page %d %s lease %s, was to be read by "
                      "lease %s (request %s); the request is failed closed", v.check, role, v.page, what, v.owner,
                      seq.lease, req.request_id)
            self.metrics.integrity_violation(role, v.check)
            self._end(req, RequestError(500, "kv_integrity_error",
                                        "a KV page of this request failed its ownership check; the request was "
                                        "stopped before the step's token was sent"))
        return reply

    # ---- worker incarnations ----

    def _observe(self, pool: WorkerPool, reply: WorkerReply) -> bool:
        """True when `reply` shows `pool`'s worker restarted; every request bound to the old
        incarnation has then been failed (503) or, mid-transfer, is failed when the transfer is quiet."""
        if not pool.restarted(reply):
            return False
        error = self._restart_error(pool)
        bound = [r for r in [*self.prefilling, *self.transferring, *self.decoding]
                 if (pool is self.prefill and r.prefill_lease) or (pool is self.decode and r.decode_lease)]
        log.warning("the %s worker restarted (now incarnation %s): %d requests bound to the old one fail with 503",
                    pool.role, pool.incarnation, len(bound))
        self.metrics.worker_restart(pool.role)
        for req in bound:
            if req in self.transferring:  # its pages are released when the transport is quiet
                req.abort_requested, req.abort_error = True, error
            else:
                self._end(req, error)
        return True

    @staticmethod
    def _restart_error(pool: WorkerPool) -> RequestError:
        return RequestError(503, "worker_restarted", f"the {pool.role} worker restarted while serving this "
                            "request; retry it", error_type="service_unavailable", retry_after_s=1)

    async def _heartbeat(self) -> None:
        """Ask every worker for its incarnation once per heartbeat, so a restart is seen (and its
        requests failed) within about a second even when no step runs."""
        pools = [self.prefill] if self.decode is self.prefill else [self.prefill, self.decode]
        while True:
            await anyio.sleep(self.config.heartbeat_s)
            for pool in pools:
                self._observe(pool, await self._send(pool, []))

    # ---- loops ----

    async def _send(self, pool: WorkerPool, seqs: list[SeqStep]) -> WorkerReply:
        """One RunStep to `pool`'s worker, carrying its pending tag changes; its reply."""
        return await pool.call(self._next_step_id(), seqs)

    def _prefilled(self, chunks: list[tuple[Request, SeqStep]], tokens: list[int | None]) -> list[tuple[Request, int]]:
        """Count each chunk of a step that ran as prefilled; the requests whose whole prompt is now
        in, taken out of the prefill set, each with the first token it sampled."""
        done = []
        for (req, seq), token in zip(chunks, tokens):
            if req.state.terminal or seq.lease != id_hex(req.prefill_lease):  # ended, or a later attempt
                continue
            req.prefilled += len(seq.token_ids)
            if token is not None:
                self.prefilling.remove(req)
                done.append((req, token))
        return done

    def _next_step_id(self) -> int:
        self._step_id += 1
        return self._step_id

    def _wake(self) -> None:
        self._prefill_work.set()
        self._decode_work.set()

    async def _wait_for_prefill_work(self) -> None:
        await self._prefill_work.wait()
        self._prefill_work = anyio.Event()

    async def _wait_for_decode_work(self) -> None:
        await self._decode_work.wait()
        self._decode_work = anyio.Event()

    async def run(self, task_group: TaskGroup) -> None:
        """Start the worker loops in `task_group` (they run until it is cancelled)."""
        self._task_group = task_group
        task_group.start_soon(self._expire_queued, name="queue-deadlines")
        task_group.start_soon(self._heartbeat, name="worker-heartbeat")
        if self.config.disaggregated:
            task_group.start_soon(self._prefill_loop, name="prefill-loop")
            task_group.start_soon(self._decode_loop, name="decode-loop")
        else:
            task_group.start_soon(self._colocated_loop, name="colocated-loop")

    async def _expire_queued(self) -> None:
        """Every waiting state has a deadline: a request queued for pages too long ends with 503."""
        while True:
            await anyio.sleep(min(1.0, self.config.queue_timeout_s / 4))
            self.expire_queued(time.monotonic())

    def expire_queued(self, now: float) -> None:
        """End (503) every request that joined the queue (admitted, or preempted) more than
        queue_timeout_s before `now`."""
        for req in [r for r in self.queue if now - r.queued_s > self.config.queue_timeout_s]:
            self.queue.remove(req)
            self.metrics.rejected("queue_timeout")
            self._end(req, RequestError(503, "overloaded", f"waited {self.config.queue_timeout_s:g} s for KV pages; "
                                        "retry shortly", error_type="service_unavailable", retry_after_s=1))

    async def _colocated_loop(self) -> None:
        while True:
            self._drop_aborted(self.prefilling)
            self._drop_aborted(self.decoding)
            self._make_room_for_priority()
            decodes = self._grow(list(self.decoding))
            seqs = decode_steps(decodes)
            chunks = prefill_chunks(self.prefilling, self.config.chunk_tokens - len(seqs))
            if not seqs and not chunks:
                await self._wait_for_prefill_work()
                continue
            all_seqs = seqs + [s for _, s in chunks]
            reply = self._settle("colocated", decodes + [r for r, _ in chunks], all_seqs,
                                 await self._send(self.prefill, all_seqs))
            if reply is None:
                continue
            self._accept_decoded(decodes, reply.tokens)
            for req, token in self._prefilled(chunks, reply.tokens[len(seqs):]):
                req.advance(State.DECODING)
                self.decoding.append(req)
                self._accept_token(req, token)

    async def _prefill_loop(self) -> None:
        if self._task_group is None:
            raise RuntimeError("run() starts the loops")
        while True:
            self._drop_aborted(self.prefilling)
            chunks = prefill_chunks(self.prefilling, self.config.chunk_tokens)
            if not chunks:
                await self._wait_for_prefill_work()
                continue
            seqs = [s for _, s in chunks]
            reply = self._settle("prefill", [r for r, _ in chunks], seqs, await self._send(self.prefill, seqs))
            if reply is None:
                continue
            for req, token in self._prefilled(chunks, reply.tokens):
                req.advance(State.TRANSFERRING)
                req.pending_token = token
                req.prefill_done_s = time.monotonic()
                self.transferring.add(req)
                self._task_group.start_soon(self._transfer, req, name=f"transfer-{req.request_id[:8]}")

    async def _transfer(self, req: Request) -> None:
        """Move the prompt's KV to the decode pool; the first token is emitted only after it landed."""
        try:
            await self._transfer_unguarded(req)
        except Exception:  # a bug here must fail one request, not the server
            log.exception("request %s: transfer task failed", req.request_id)
            self.transferring.discard(req)
            if req.decode_lease:  # whatever the transport did is unknown: keep the pages out
                self.decode.quarantine(req.decode_lease)
                req.decode_lease = 0
            self._end(req, RequestError(500, "kv_transfer_failed", "the KV transfer failed on the server"))

    async def _transfer_unguarded(self, req: Request) -> None:
        if self.link is None:
            raise RuntimeError("a transfer needs a transfer link")
        # The destination pages carry this lease's tag, and any earlier owner's release (and scrub)
        # has been applied, before any byte can land in them: wait for the message that carried the
        # grant, or send one if it is still pending.
        if not await self.decode.tags_applied(id_hex(req.decode_lease)):
            self._observe(self.decode, await self._send(self.decode, []))
        result = await self.link.move(req.prefill_target, req.prefill_pages, req.decode_pages, req.decode_lease,
                                      timeout_s=self.config.transfer_timeout_s)
        self.transferring.discard(req)
        self.metrics.transfer(result.ok, result.nbytes, time.monotonic() - req.prefill_done_s)
        # push() has returned; unless its cancellation went unacknowledged, the source pages are quiet.
        held: list[tuple[WorkerPool, int]] = []
        if result.source_quiet:
            self.prefill.release(req.prefill_lease)
        else:  # a posted one-sided write may still read them
            self.prefill.quarantine(req.prefill_lease)
            held.append((self.prefill, req.prefill_lease))
        req.prefill_lease = 0
        if not result.quiet:  # a write may still land: the destination pages stay out of the free list
            self.decode.quarantine(req.decode_lease)
            held.append((self.decode, req.decode_lease))
            req.decode_lease = 0
        if held and result.until_quiet is not None and self._task_group is not None:
            self._task_group.start_soon(self._end_quarantine_when_quiet, result.until_quiet, held,
                                        name=f"quarantine-{req.request_id[:8]}")
        if req.abort_requested:
            self._end(req, req.abort_error or RequestError(499, "client_closed", "the client closed the request"),
                      aborted=req.abort_error is None)
            return
        if not result.ok:
            log.warning("request %s: KV transfer failed (%s)", req.request_id, result.reason)
            self._end(req, RequestError(502, "kv_transfer_failed", f"the KV transfer failed: {result.reason}"))
            return
        self.decode.landed.append(Landing(id_hex(req.decode_lease), req.decode_pages, req.prefill_target))
        req.advance(State.DECODING)
        req.decoded_context = req.prefill_target
        self.decoding.append(req)
        self._reserve_queued()  # its prefill pages came back: a queued request may fit now
        token, req.pending_token = req.pending_token, None
        if token is not None:
            self._accept_token(req, token)
        self._wake()

    async def _end_quarantine_when_quiet(self, until_quiet: Callable[[], Awaitable[bool]],
                                         held: list[tuple[WorkerPool, int]]) -> None:
        """Release a timed-out transfer's quarantined leases once its transport learns that every
        write it posted is terminal; never before, and never if it cannot learn it."""
        if await until_quiet():
            for pool, lease in held:
                pool.confirm_quiet(lease)  # which admits what now fits

    async def _decode_loop(self) -> None:
        while True:
            self._drop_aborted(self.decoding)
            self._make_room_for_priority()
            decodes = self._grow(list(self.decoding))
            if not decodes:
                await self._wait_for_decode_work()
                continue
            seqs = decode_steps(decodes)
            reply = self._settle("decode", decodes, seqs,
                                 await self._send(self.decode, seqs))
            if reply is None:
                continue
            self._accept_decoded(decodes, reply.tokens)
