"""Several workers per role behind real control connections (tests/hosted_workers.py), driven
through the front end's Fleet (app/remote/front.py): every prefill worker pairs with every decode
worker, the router spreads requests over the pairs, and a decode worker that dies mid-stream ends
only what it served — requests that had sent tokens fail with 503 worker_lost, requests that had
not are retried once on the surviving pair and answer exactly — while the survivors' pages return
to baseline and a worker that joins while serving takes requests. A worker whose pool disagrees
on the bytes is refused at pairing, as a whole, and the others serve on."""

from __future__ import annotations

import logging

import anyio
import pytest
import torch
from front_keys import FRONT
from hosted_workers import CONTEXT, MODEL_ID, PAGE, PAGES, Hosted, host_pair
from serving_harness import wait_idle

from kvfence.app.remote.front import Fleet
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.registry import build_model
from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.lifecycle import State
from kvfence.scheduler.driver import Scheduler
from kvfence.scheduler.handle import RequestHandle
from kvfence.scheduler.offline import OfflineEngine
from kvfence.transports.core.secret import DeploymentSecret

LONG = [list(range(5 + i, 12 + i)) for i in range(4)]  # short prompts that decode for long
HEAVY = [list(range(40 + 3 * i, 80 + 3 * i)) for i in range(4)]  # 40-token prompts: 5 prefill chunks each
MAX_TOKENS = 40


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def offline(tiny: Checkpoint, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = build_model(tiny, torch.float32)
    engine = OfflineEngine(ModelRunner(model, KVPool(model.config, PAGES, PAGE, torch.float32)), tiny.tokenizer)
    return [o.generated_token_ids for o in engine.generate(prompts, [greedy(n)] * len(prompts))]


async def serve(tg: anyio.abc.TaskGroup, hosted: list[Hosted], secret: DeploymentSecret,
                tiny: Checkpoint) -> tuple[Fleet, Scheduler]:
    fleet = Fleet(tg, secret, FRONT, MODEL_ID, PAGE, rejoin=False)
    for h in hosted:
        assert await fleet.join(h.address)
    config = SchedulerConfig(page_size_tokens=PAGE, max_context_tokens=CONTEXT, chunk_tokens=8,
                             disaggregated=True, transfer_timeout_s=5)
    scheduler = fleet.start_scheduler(config, tiny.tokenizer)
    await scheduler.run(tg)
    return fleet, scheduler


class Outcome:
    """What one request's stream delivered: its tokens, or its error."""

    def __init__(self) -> None:
        self.request_id = ""
        self.tokens: list[int] = []
        self.error: tuple[int, str] | None = None
        self.done = anyio.Event()

    async def read(self, handle: RequestHandle) -> None:
        self.request_id = handle.request_id
        async for d in handle.deltas():
            self.tokens += d.token_ids
            if d.error is not None:
                self.error = (d.error.status, d.error.code)
        self.done.set()


def start(tg: anyio.abc.TaskGroup, scheduler: Scheduler, prompts: list[list[int]], n: int) -> list[Outcome]:
    outcomes = []
    for p in prompts:
        outcome = Outcome()
        tg.start_soon(outcome.read, scheduler.submit(p, greedy(n)))
        outcomes.append(outcome)
    return outcomes


async def until(condition, timeout_s: float = 20) -> None:  # type: ignore[no-untyped-def]
    with anyio.fail_after(timeout_s):
        while not condition():
            await anyio.sleep(0.005)


def decoding_on(scheduler: Scheduler, outcomes: list[Outcome] | None = None) -> set[str]:
    """The decode workers some request decodes on now (of `outcomes`' requests, when given)."""
    ids = None if outcomes is None else {o.request_id for o in outcomes}
    return {r.pair.decode.name for r in scheduler.requests_in(State.DECODING)
            if r.pair is not None and (ids is None or r.request_id in ids)}


async def finish(tg: anyio.abc.TaskGroup, fleet: Fleet, scheduler: Scheduler) -> None:
    """The live pools are back at baseline; then everything stops."""
    await wait_idle(scheduler)
    fleet.close()
    tg.cancel_scope.cancel()


async def run_watching(scheduler: Scheduler, prompts: list[list[int]]) -> tuple[list[Outcome], set[str]]:
    """Serve `prompts` to the end; their outcomes, and every decode worker seen decoding them."""
    seen: set[str] = set()
    async with anyio.create_task_group() as streams:
        outcomes = start(streams, scheduler, prompts, MAX_TOKENS)
        while not all(o.done.is_set() for o in outcomes):
            seen |= decoding_on(scheduler, outcomes)
            await anyio.sleep(0.005)
    return outcomes, seen


@pytest.mark.anyio
async def test_every_prefill_worker_pairs_with_every_decode_worker_and_requests_spread(tiny: Checkpoint) -> None:
    want = offline(tiny, LONG, MAX_TOKENS)
    secret = DeploymentSecret.generate()
    async with anyio.create_task_group() as tg:
        hosted = await host_pair(tg, tiny, secret, ("prefill", "decode", "prefill", "decode"))
        fleet, scheduler = await serve(tg, hosted, secret, tiny)
        assert sorted(p.name for p in scheduler.core.pairs) == sorted(
            f"prefill@{p.address} -> decode@{d.address}" for p in hosted[::2] for d in hosted[1::2])
        outcomes, seen = await run_watching(scheduler, LONG)
        assert [o.tokens for o in outcomes] == want and all(o.error is None for o in outcomes)
        assert seen == {f"decode@{h.address}" for h in hosted[1::2]}  # the router used both decode pools
        await finish(tg, fleet, scheduler)


@pytest.mark.anyio
async def test_a_lost_decode_worker_fails_or_retries_only_its_requests(tiny: Checkpoint,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    want_long, want_heavy = offline(tiny, LONG, MAX_TOKENS), offline(tiny, HEAVY, 8)
    secret = DeploymentSecret.generate()
    async with anyio.create_task_group() as tg:
        hosted = await host_pair(tg, tiny, secret, ("prefill", "decode", "decode"))
        fleet, scheduler = await serve(tg, hosted, secret, tiny)
        victim, survivor = hosted[1], hosted[2]
        async with anyio.create_task_group() as streams:
            long = start(streams, scheduler, LONG, MAX_TOKENS)
            await until(lambda: len(decoding_on(scheduler)) == 2 and all(o.tokens for o in long))
            heavy = start(streams, scheduler, HEAVY, 8)
            # some heavy request has its pages on the victim and has sent nothing yet: kill it then
            await until(lambda: any(r.pair is not None and r.pair.decode.name == f"decode@{victim.address}"
                                    for r in scheduler.requests_in(State.PREFILLING)))
            on_victim = {r.request_id for r in scheduler.core.registry.live()
                         if r.pair is not None and r.pair.decode.name == f"decode@{victim.address}"}
            victim.kill()
        lost = [o for o in long if o.error is not None]
        assert lost and all(o.error == (503, "worker_lost") for o in lost)  # they had streamed tokens
        for o, want in zip(long, want_long):
            assert o.error is not None or o.tokens == want
        assert [o.tokens for o in heavy] == want_heavy  # retried ones too: exactly, once, from the start
        assert len(lost) + scheduler.metrics.retries._value.get() == len(on_victim)  # noqa: SLF001
        assert [w.name for w in scheduler.core.workers] == [f"prefill@{hosted[0].address}",
                                                            f"decode@{survivor.address}"]
        await wait_idle(scheduler)  # the prefill and the surviving decode pool are back at baseline
        assert "was lost" in caplog.text and "retried as attempt 2" in caplog.text
        # a decode worker that joins while serving pairs with the prefill worker and takes requests
        joined = Hosted(tiny, "decode", secret)
        await joined.start(tg)
        assert await fleet.join(joined.address)
        assert len(scheduler.core.pairs) == 2
        again, seen = await run_watching(scheduler, LONG)
        assert [o.tokens for o in again] == want_long
        assert f"decode@{joined.address}" in seen
        await finish(tg, fleet, scheduler)


@pytest.mark.anyio
async def test_a_worker_whose_pool_disagrees_is_refused_at_pairing(tiny: Checkpoint,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    want = offline(tiny, LONG, 8)
    secret = DeploymentSecret.generate()
    async with anyio.create_task_group() as tg:
        hosted = await host_pair(tg, tiny, secret)
        odd = Hosted(tiny, "decode", secret, dtype=torch.bfloat16)
        await odd.start(tg)
        fleet, scheduler = await serve(tg, [*hosted, odd], secret, tiny)
        assert [p.name for p in scheduler.core.pairs] == [f"prefill@{hosted[0].address} -> decode@{hosted[1].address}"]
        assert "refused as a whole" in caplog.text and "dtype" in caplog.text
        async with anyio.create_task_group() as streams:
            outcomes = start(streams, scheduler, LONG, 8)
        assert [o.tokens for o in outcomes] == want
        await finish(tg, fleet, scheduler)


@pytest.mark.anyio
async def test_a_draining_worker_finishes_its_requests_and_takes_no_new_one(tiny: Checkpoint) -> None:
    want = offline(tiny, LONG, MAX_TOKENS)
    secret = DeploymentSecret.generate()
    async with anyio.create_task_group() as tg:
        hosted = await host_pair(tg, tiny, secret, ("prefill", "decode", "decode"))
        fleet, scheduler = await serve(tg, hosted, secret, tiny)
        draining, other = hosted[1], hosted[2]
        drained = anyio.Event()

        async def drain() -> None:
            assert await draining.server.drain(30)
            drained.set()

        async with anyio.create_task_group() as streams:
            running = start(streams, scheduler, LONG, MAX_TOKENS)
            await until(lambda: len(decoding_on(scheduler)) == 2)
            streams.start_soon(drain)
            await until(lambda: scheduler.core.worker(f"decode@{draining.address}").draining)
            later, seen = await run_watching(scheduler, LONG)  # while it drains: all on the other one
        assert [o.tokens for o in running] == want and all(o.error is None for o in running)
        assert [o.tokens for o in later] == want and seen == {f"decode@{other.address}"}
        await until(drained.is_set)
        assert len(draining.worker.page_tables) == 0
        draining.kill()  # it stops: its loss ends nothing
        await until(lambda: len(scheduler.core.workers) == 2)
        assert scheduler.metrics.retries._value.get() == 0  # noqa: SLF001
        await finish(tg, fleet, scheduler)
