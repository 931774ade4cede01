"""The server's scheduler: the scheduler core (scheduler/core.py) driven against real workers and a
KV transfer link, on the event loop.

Thin on purpose: it reads the clock, turns the core's actions into tasks in the server's task
group (one per step in flight — at most one per worker —, one per transfer, one per quarantine
watch), pushes output into each request's handle, and feeds every result back to the core as an
event. Every decision is the core's. A step that raises is a failed step (its requests fail, the
server goes on); a transfer task that raises is a crashed transfer (its destination pages stay
quarantined: what the transport did is unknown).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup

from kvfence.engine.sampling import SamplingParams
from kvfence.engine.tokenizer import Tokenizer
from kvfence.scheduler.actions import Emit, MoveResult, SendStep, StartTransfer, WatchQuiet
from kvfence.scheduler.config import SchedulerConfig
from kvfence.scheduler.core import SchedulerCore
from kvfence.scheduler.handle import RequestHandle
from kvfence.scheduler.tenants import ANONYMOUS, INTERNAL, Tenant
from kvfence.engine.protocol import StepFailed, WorkerChannel, WorkerReply
from kvfence.scheduler.metrics import SchedulerMetrics
from kvfence.scheduler.page_ledger import PageLedger
from kvfence.scheduler.request import Request, State
from kvfence.scheduler.transfer import TransferLink
from kvfence.scheduler.worker_binding import WorkerBinding

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, tokenizer: Tokenizer, prefill: WorkerChannel,
                 decode: WorkerChannel | None, *, prefill_pages: int, decode_pages: int,
                 link: TransferLink | None = None, metrics: SchedulerMetrics | None = None) -> None:
        """`decode` None: the prefill worker is bound to both roles (colocated; no link)."""
        if config.disaggregated != (decode is not None and link is not None):
            raise ValueError("disaggregated mode needs a decode worker and a transfer link; colocated needs neither")
        bound_prefill = WorkerBinding(prefill.role, prefill_pages)
        bound_decode = WorkerBinding(decode.role, decode_pages) if decode is not None else bound_prefill
        self.core = SchedulerCore(config, tokenizer, bound_prefill, bound_decode, metrics)
        self.prefill_channel = prefill
        self.decode_channel = decode or prefill
        self._channels = {bound_prefill.name: prefill, bound_decode.name: self.decode_channel}
        self.link = link
        self._handles: dict[str, RequestHandle] = {}
        self._task_group: TaskGroup | None = None
        self._not_started: list[tuple[Callable[..., Awaitable[None]], Any]] = []

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
        return self.core.config.max_context_tokens

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

    def ledger(self, role: str) -> PageLedger:
        """The page ledger of the pool serving `role` ("prefill" or "decode"; one pool when colocated)."""
        return self._bound(role).ledger

    def _bound(self, role: str) -> WorkerBinding:
        return self.core.prefill if role == "prefill" else self.core.decode

    def requests_in(self, state: State) -> list[Request]:
        return self.core.requests_in(state)

    def confirm_quiet(self, role: str, lease: int) -> list[int]:
        """End the quarantine of `lease` in the pool serving `role`: no write can reach its pages
        any more. They come back through the release path; returns them."""
        pages = self.core.lease_quiet(self._bound(role).name, lease, time.monotonic())
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
            elif isinstance(action, StartTransfer):
                self._start(self._transfer, action)
            elif isinstance(action, WatchQuiet):
                self._start(self._watch_quiet, action)

    def _start(self, fn: Callable[..., Awaitable[None]], action: Any) -> None:
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
        try:
            reply = await self._channels[action.worker].call(action.message)
        except Exception as e:  # the channel broke: the step failed, the server goes on
            log.exception("%s worker: step %d could not be run", action.worker, action.message.step_id)
            reply = StepFailed(action.message.step_id, f"{type(e).__name__}: {e}")
        self.core.step_replied(action.worker, reply, time.monotonic())
        self._carry_out()

    async def _transfer(self, action: StartTransfer) -> None:
        """Move the prompt's KV to the decode pool (the core emits the first token once it landed)."""
        crashed = False
        try:
            if self.link is None:
                raise RuntimeError("a transfer needs a transfer link")
            result = await self.link.move(action, timeout_s=self.config.transfer_timeout_s)
        except Exception:  # a bug here must fail one request, not the server
            log.exception("%s: transfer task failed", action.who)
            result, crashed = MoveResult(False, "the transfer task failed", quiet=False), True
        self.core.transfer_finished(action.key, result, time.monotonic(), crashed=crashed)
        self._carry_out()

    async def _watch_quiet(self, action: WatchQuiet) -> None:
        """Release a failed transfer's quarantined leases once its transport learns that every
        write it posted is terminal; never before, and never if it cannot learn it."""
        if await action.until_quiet():
            self.core.transfer_quiet(action.key, time.monotonic())
            self._carry_out()
