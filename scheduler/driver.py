"""The server's scheduler: the scheduler core (scheduler/core/scheduler.py) driven against real workers and a
KV transfer link, on the event loop.

Thin on purpose: it reads the clock, turns the core's actions into tasks in the server's task
group (one per step in flight — at most one per worker —, one per transfer, one per quarantine
watch), pushes output into each request's handle, and feeds every result back to the core as an
event. Every decision is the core's. A step that raises is a failed step (its requests fail, the
server goes on), except WorkerLost: the worker is gone (`worker_lost`); a transfer task that
raises is a crashed transfer (its destination pages stay quarantined: what the transport did is
unknown).

It holds a channel per worker and a transfer link per pair, by name: the first pair at
construction, more with `add_pair` (workers in other processes, found while serving).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
from anyio.abc import TaskGroup

from kvfence.engine.sampling import SamplingParams
from kvfence.engine.tokenizer import Tokenizer
from kvfence.scheduler.core.actions import CutStep, Emit, MoveResult, SendStep, StartTransfer, WatchQuiet
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.scheduler import SchedulerCore
from kvfence.scheduler.handle import RequestHandle
from kvfence.scheduler.core.tenants import ANONYMOUS, INTERNAL, Tenant
from kvfence.engine.protocol import StepFailed, WorkerChannel, WorkerLost, WorkerReply
from kvfence.scheduler.metrics import SchedulerMetrics
from kvfence.scheduler.core.page_ledger import PageLedger
from kvfence.scheduler.core.lifecycle import State
from kvfence.scheduler.core.request import Request
from kvfence.scheduler.transfer import TransferLink
from kvfence.scheduler.core.worker_binding import WorkerBinding

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, tokenizer: Tokenizer, prefill: WorkerChannel,
                 decode: WorkerChannel | None, *, prefill_pages: int, decode_pages: int,
                 link: TransferLink | None = None, metrics: SchedulerMetrics | None = None,
                 max_context_tokens: int | None = None) -> None:
        """The first pair; `decode` None: the prefill worker is bound to both roles (colocated; no
        link). `max_context_tokens`: what the first pair holds, when less than the config's."""
        if config.disaggregated != (decode is not None and link is not None):
            raise ValueError("disaggregated mode needs a decode worker and a transfer link; colocated needs neither")
        bound_prefill = WorkerBinding(prefill.name, prefill_pages, prefill.role, prefill.device)
        bound_decode = (WorkerBinding(decode.name, decode_pages, decode.role, decode.device) if decode is not None
                        else bound_prefill)
        self.core = SchedulerCore(config, tokenizer, bound_prefill, bound_decode, metrics,
                                  max_context_tokens=max_context_tokens)
        self.prefill_channel = prefill  # the first pair's (the only one in one process)
        self.decode_channel = decode or prefill
        self.link = link
        self._channels: dict[str, WorkerChannel] = {bound_prefill.name: prefill, bound_decode.name: self.decode_channel}
        self._links: dict[tuple[str, str], TransferLink] = {}
        if link is not None:
            self._links[bound_prefill.name, bound_decode.name] = link
        self._handles: dict[str, RequestHandle] = {}
        self._task_group: TaskGroup | None = None
        self._not_started: list[tuple[Callable[..., Coroutine[Any, Any, None]], Any]] = []

    # ---- what the server and the HTTP layer use ----

    @property
    def config(self) -> SchedulerConfig:
        return self.core.config

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer

    @property
    def metrics(self) -> SchedulerMetrics:
        return self.core.metrics

    @property
    def max_context_tokens(self) -> int:
        return self.core.max_context_tokens

    def add_pair(self, prefill: WorkerChannel, decode: WorkerChannel, link: TransferLink, prefill_pages: int,
                 decode_pages: int, max_context_tokens: int) -> None:
        """Serve on one more pair (disaggregated): `link` moves KV from `prefill` to `decode`. A
        worker already serving (by name) keeps its binding; a new one is bound with its pool size."""
        known = {w.name: w for w in self.core.workers}
        p, d = (known.get(c.name) or WorkerBinding(c.name, pages, c.role, c.device)
                for c, pages in ((prefill, prefill_pages), (decode, decode_pages)))
        self.core.add_pair(p, d, max_context_tokens)
        self._channels[prefill.name], self._channels[decode.name] = prefill, decode
        self._links[prefill.name, decode.name] = link
        self._carry_out()

    def worker_lost(self, name: str) -> None:
        """The worker named `name` is gone (SchedulerCore.worker_lost); a no-op once it is known."""
        if self._channels.pop(name, None) is None:
            return
        self._links = {k: v for k, v in self._links.items() if name not in k}
        self.core.worker_lost(name, time.monotonic())
        self._carry_out()

    @property
    def can_serve(self) -> bool:
        """Some pair of workers takes new requests (none lost or draining)."""
        return bool(self.core.serving_pairs)

    def workers(self) -> list[str]:
        """The names of the live workers."""
        return [w.name for w in self.core.workers]

    @property
    def draining(self) -> bool:
        return self.core.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.core.draining = value

    def submit(self, prompt: list[int], params: SamplingParams, tenant: Tenant = ANONYMOUS,
               cache_salt: str = "") -> RequestHandle:
        """Admit for `tenant` or raise AdmissionRejected; nothing is reserved for a rejected request.
        `cache_salt`: partitions the prefix cache within the tenant (SchedulerCore.submit)."""
        return self._admit(self.core.submit(prompt, params, time.monotonic(), tenant=tenant, cache_salt=cache_salt))

    def submit_samples(self, prompt: list[int], samples: list[SamplingParams], tenant: Tenant = ANONYMOUS,
                       cache_salt: str = "") -> list[RequestHandle]:
        """Admit the samples of one request together (OpenAI's `n`; SchedulerCore.submit_samples),
        one handle each, or raise AdmissionRejected for all of them."""
        reqs = self.core.submit_samples(prompt, samples, time.monotonic(), tenant=tenant, cache_salt=cache_salt)
        return [self._admit(req) for req in reqs]

    def submit_priority(self, prompt: list[int], params: SamplingParams) -> RequestHandle:
        """Admit a server-internal request (the readiness canary) ahead of every queued one
        (SchedulerCore.submit with `priority`)."""
        return self._admit(self.core.submit(prompt, params, time.monotonic(), priority=True, tenant=INTERNAL))

    def in_flight(self) -> int:
        return self.core.in_flight()

    def pages_in_use(self) -> dict[str, int]:
        return self.core.pages_in_use()

    def pages_cached(self) -> dict[str, int]:
        return self.core.pages_cached()

    def flush_cache(self) -> dict[str, int]:
        """Drop the prefix cache of every pool (SchedulerCore.flush_cache); returns the pages freed per worker."""
        freed = self.core.flush_cache(time.monotonic())
        self._carry_out()
        return freed

    def ledger(self, worker: str) -> PageLedger:
        """The page ledger of the worker named `worker`; a role names the first worker serving it
        (in one process: "prefill" or "decode", the one pool when colocated)."""
        return self._bound(worker).ledger

    def _bound(self, worker: str) -> WorkerBinding:
        try:
            return self.core.worker(worker)
        except KeyError:
            return next(w for w in self.core.workers if (w.prefills if worker == "prefill" else w.decodes))

    def requests_in(self, state: State) -> list[Request]:
        return self.core.requests_in(state)

    def confirm_quiet(self, worker: str, lease: int) -> list[int]:
        """End the quarantine of `lease` in the pool of `worker` (as `ledger` names it): no write
        can reach its pages any more. They come back through the release path; returns them."""
        pages = self.core.lease_quiet(self._bound(worker).name, lease, time.monotonic())
        self._carry_out()
        return pages

    def refresh_metrics(self) -> None:
        self.core.report_metrics(time.monotonic())

    def tick(self, now: float) -> None:
        """Feed the core the time `now` (deadlines, heartbeats); the ticker task does this every
        fraction of a second."""
        self.core.tick(now)
        self._carry_out()

    async def run(self, task_group: TaskGroup) -> None:
        """Start driving the core in `task_group` (its tasks run until it is cancelled)."""
        self._task_group = task_group
        task_group.start_soon(self._ticker, name="scheduler-ticker")
        for fn, arg in self._not_started:
            task_group.start_soon(fn, arg)
        self._not_started.clear()

    # ---- carrying out the core's actions ----

    def _admit(self, req: Request) -> RequestHandle:
        request_id = req.request_id
        handle = RequestHandle(request_id, req.prompt, lambda: self._abort(request_id))
        self._handles[request_id] = handle
        self._carry_out()
        return handle

    def _abort(self, request_id: str) -> None:
        self.core.abort(request_id, time.monotonic())
        self._carry_out()

    def _carry_out(self) -> None:
        for action in self.core.take_actions():
            if isinstance(action, Emit):
                handle = self._handles.get(action.request_id)
                if handle is not None:
                    handle.push(action.delta)
                    if action.delta.terminal:
                        del self._handles[action.request_id]
            elif isinstance(action, SendStep):
                self._start(self._run_step, action)
            elif isinstance(action, CutStep):
                self._start(self._cut, action)
            elif isinstance(action, StartTransfer):
                self._start(self._transfer, action)
            elif isinstance(action, WatchQuiet):
                self._start(self._watch_quiet, action)

    def _start(self, fn: Callable[..., Coroutine[Any, Any, None]], action: Any) -> None:
        if self._task_group is None:
            self._not_started.append((fn, action))
        else:
            self._task_group.start_soon(fn, action)

    async def _ticker(self) -> None:
        interval = min(self.config.heartbeat_s, 1.0, self.config.queue_timeout_s / 4)
        while True:
            await anyio.sleep(interval)
            self.tick(time.monotonic())

    async def _run_step(self, action: SendStep) -> None:
        reply: WorkerReply
        channel = self._channels.get(action.worker)
        try:
            if channel is None:
                raise WorkerLost(f"the {action.worker} worker is gone")
            reply = await channel.call(action.message)
        except WorkerLost as e:
            log.warning("%s worker: lost (%s)", action.worker, e)
            self.worker_lost(action.worker)
            return
        except Exception as e:  # the channel broke: the step failed, the server goes on
            log.exception("%s worker: step %d could not be run", action.worker, action.message.step_id)
            reply = StepFailed(step_id=action.message.step_id, message=f"{type(e).__name__}: {e}")
        self.core.step_replied(action.worker, reply, time.monotonic())
        self._carry_out()

    async def _cut(self, action: CutStep) -> None:
        """Ask for a step to be cut; whatever becomes of it, its reply settles it (`_run_step`)."""
        channel = self._channels.get(action.worker)
        try:
            if channel is not None:
                await channel.cut(action.step_id)
        except Exception as e:  # a lost worker is noticed by its step's call
            log.debug("%s worker: asking to cut step %d failed: %r", action.worker, action.step_id, e)

    async def _transfer(self, action: StartTransfer) -> None:
        """Move the prompt's KV to the decode pool (the core emits the first token once it landed)."""
        crashed = False
        link = self._links.get((action.sender, action.receiver))
        try:
            if link is None:  # a worker of its pair was lost before it started
                result = MoveResult(ok=False,
                                    reason=f"no link from {action.sender} to {action.receiver}: a worker was lost")
            else:
                result = await link.move(action, timeout_s=self.config.transfer_timeout_s)
        except Exception:  # a bug here must fail one request, not the server
            log.exception("%s: transfer task failed", action.who)
            result, crashed = MoveResult(ok=False, reason="the transfer task failed", quiet=False), True
        self.core.transfer_finished(action.key, result, time.monotonic(), crashed=crashed)
        self._carry_out()

    async def _watch_quiet(self, action: WatchQuiet) -> None:
        """Release a failed transfer's quarantined leases once its transport learns that every
        write it posted is terminal; never before, and never if it cannot learn it."""
        if await action.until_quiet():
            self.core.transfer_quiet(action.key, time.monotonic())
            self._carry_out()
