"""A scheduler with real workers (and, disaggregated, a real transport) for in-process tests."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import torch
from anyio.abc import TaskGroup
from front_keys import FRONT

from kvfence.app.serve.pairing import pair_workers, role_record
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.compute import ComputeThread
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.kv_sanitizer import KvSanitizer
from kvfence.engine.models.registry import build_model
from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.worker import Worker, LocalWorkerChannel
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.lifecycle import State
from kvfence.scheduler.driver import Scheduler
from kvfence.scheduler.handle import RequestHandle
from kvfence.transports.base import Transport
from kvfence.transports.core.front_key import FrontKey
from kvfence.transports.core.secret import DeploymentSecret
_T = TypeVar("_T")

_compute: ComputeThread | None = None


def compute_thread() -> ComputeThread:
    """The one CPU compute thread of this test process (a server has one per device)."""
    global _compute
    if _compute is None:
        _compute = ComputeThread("test-compute")
    return _compute


def channel(worker: Worker) -> LocalWorkerChannel:
    return LocalWorkerChannel(worker, compute_thread())


def make_worker(checkpoint: Checkpoint, role: str, num_pages: int, page_size: int,
                dtype: torch.dtype = torch.float32) -> Worker:
    model = build_model(checkpoint, dtype)
    pool = KVPool(model.config, num_pages, page_size, dtype)
    return Worker(role, ModelRunner(model, pool, sanitizer=KvSanitizer(num_pages, page_size)), tokenizer=checkpoint.tokenizer)


@dataclasses.dataclass
class Serving:
    scheduler: Scheduler
    workers: list[Worker]
    transports: list[Transport]

    async def aclose(self) -> None:
        for t in self.transports:
            await t.aclose()


async def start_serving(tg: TaskGroup, checkpoint: Checkpoint, mode: str, config: SchedulerConfig,
                        num_pages: int, faults: str = "") -> Serving:
    """mode: "colocated", or a transport name ("tcp", "inprocess") for a disaggregated pair;
    `faults`: a FaultPlan spec applied to the sending (prefill) side."""
    page = config.page_size_tokens
    if mode == "colocated":
        w = make_worker(checkpoint, "colocated", num_pages, page)
        scheduler = Scheduler(config, checkpoint.tokenizer, channel(w), None, prefill_pages=num_pages,
                              decode_pages=num_pages)
        await scheduler.run(tg)
        return Serving(scheduler, [w], [])
    pw, dw = make_worker(checkpoint, "prefill", num_pages, page), make_worker(checkpoint, "decode", num_pages, page)
    options: dict[str, object] = {}
    if mode == "inprocess":
        from kvfence.transports.inprocess import InProcessHub
        options = {"hub": InProcessHub()}
    roles = [(w.pool, role_record(w.pool, "tiny", config.max_context_tokens)) for w in (pw, dw)]
    paired = await pair_workers(tg, mode, roles[0], roles[1], DeploymentSecret.generate(), FRONT, faults, options)
    scheduler = Scheduler(config, checkpoint.tokenizer, channel(pw), channel(dw), prefill_pages=num_pages,
                          decode_pages=num_pages, link=paired.link)
    await scheduler.run(tg)
    return Serving(scheduler, [pw, dw], paired.endpoints)


@contextlib.asynccontextmanager
async def serving_in(checkpoint: Checkpoint, mode: str, config: SchedulerConfig,
                     num_pages: int) -> AsyncIterator[Serving]:
    """`start_serving` in a task group of its own, closed on exit (a fixture's body)."""
    async with anyio.create_task_group() as tg:
        s = await start_serving(tg, checkpoint, mode, config, num_pages)
        yield s
        await s.aclose()
        tg.cancel_scope.cancel()


async def read_each(handles: list[RequestHandle], read: Callable[[RequestHandle], Awaitable[_T]],
                    timeout_s: float = 60) -> list[_T]:
    """`read(handle)` for every handle at once; the results in the handles' order."""
    results: dict[int, _T] = {}

    async def one(i: int) -> None:
        results[i] = await read(handles[i])

    with anyio.fail_after(timeout_s):
        async with anyio.create_task_group() as tg:
            for i in range(len(handles)):
                tg.start_soon(one, i)
    return [results[i] for i in range(len(handles))]


def assert_baseline(scheduler: Scheduler) -> None:
    """Every page is back in its ledger, and each ledger accounts for every page."""
    assert all(n == 0 for n in scheduler.pages_in_use().values()), scheduler.pages_in_use()
    for worker in scheduler.core.workers:
        worker.ledger.check_integrity()
        assert worker.table.num_leases == 0, f"the {worker.name} pool's table still names ended leases"


async def wait_idle(scheduler: Scheduler, timeout_s: float = 10) -> None:
    """Until no request is in flight; then `assert_baseline`."""
    with anyio.fail_after(timeout_s):
        while scheduler.in_flight():
            await anyio.sleep(0.01)
    assert_baseline(scheduler)


async def until_transferring(scheduler: Scheduler, timeout_s: float = 5) -> None:
    """Until some request's KV transfer is in flight."""
    with anyio.fail_after(timeout_s):
        while not scheduler.requests_in(State.TRANSFERRING):
            await anyio.sleep(0.005)


async def start_serving_over(tg: TaskGroup, checkpoint: Checkpoint, config: SchedulerConfig, num_pages: int,
                             sender: Transport, receiver: Transport, front_key: FrontKey = FRONT,
                             route=None) -> Serving:  # type: ignore[no-untyped-def]
    """Disaggregated serving over transports the test built itself (e.g. over a data plane of its
    own), paired as `pair_workers` pairs the built-ins. `route(info)`: an async function giving
    the receiver info the sender dials instead (e.g. through a relay)."""
    from kvfence.scheduler.transfer import TransferLink

    page = config.page_size_tokens
    pw, dw = make_worker(checkpoint, "prefill", num_pages, page), make_worker(checkpoint, "decode", num_pages, page)
    records = [role_record(w.pool, "tiny", config.max_context_tokens) for w in (pw, dw)]
    receiver_info = await receiver.start(tg, dw.pool.data, records[1])
    await sender.start(tg, pw.pool.data, records[0])
    peer = await sender.pair(receiver_info if route is None else await route(receiver_info))
    link = TransferLink.local(sender, receiver, peer, page, records[0].page_nbytes, front_key)
    scheduler = Scheduler(config, checkpoint.tokenizer, channel(pw), channel(dw), prefill_pages=num_pages,
                          decode_pages=num_pages, link=link)
    await scheduler.run(tg)
    return Serving(scheduler, [pw, dw], [sender, receiver])


@dataclasses.dataclass
class Outcome:
    """What one request sent its reader: tokens, text, logprobs, and how it ended (a finish
    reason or an error code)."""

    ids: list[int]
    text: str
    logprobs: list
    end: str | None
    prompt_logprobs: list = dataclasses.field(default_factory=list)


async def serve_all(scheduler: Scheduler, prompts: list[list[int]], params: list[SamplingParams],
                    timeout_s: float = 60) -> list[Outcome]:
    """Submit every prompt at once and read every stream to its end."""
    handles = [scheduler.submit(p, q) for p, q in zip(prompts, params)]
    results: list[Outcome] = [Outcome([], "", [], None) for _ in prompts]

    async def one(i: int) -> None:
        out = results[i]
        async for d in handles[i].deltas():
            out.ids += d.token_ids
            out.text += d.text
            out.logprobs += d.logprobs
            out.prompt_logprobs += d.prompt_logprobs
            if d.terminal:
                out.end = d.error.code if d.error else d.finish_reason

    with anyio.fail_after(timeout_s):
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
    return results


def small_config(mode: str, page_size_tokens: int, max_context_tokens: int) -> SchedulerConfig:
    """Room for 32 requests, chunks of 16 tokens; colocated or disaggregated by `mode`."""
    return SchedulerConfig(page_size_tokens=page_size_tokens, max_context_tokens=max_context_tokens, max_running=32,
                           max_queue=32, chunk_tokens=16, disaggregated=mode != "colocated", transfer_timeout_s=10)
