"""Workers behind real control connections (app/remote/server.py <-> app/remote/client.py),
in this process on loopback sockets: steps and both halves of every transfer cross the control
channel, KV crosses a real tcp transport between the workers' own endpoints.

Outputs equal the offline engine's; pages return to baseline; a peer without the deployment
secret gets nothing; a second scheduler is refused while one owns a worker; and when the owning
scheduler's connection drops, the worker ends everything it held (every page untagged and
poisoned, a new incarnation, a fresh KV endpoint) and the next scheduler serves exactly again.
A thousand silent connections to the control ports and the KV endpoint stop none of it.
"""

from __future__ import annotations

import socket

import anyio
import msgspec
import pytest
import torch
from front_keys import FRONT
from hosted_workers import MODEL_ID, PAGE, PAGES, Hosted, host_pair
from flood import FLOOD, connect, enough_descriptors
from serving_harness import wait_idle

from kvfence.app.remote.client import RemoteWorker
from kvfence.app.remote.front import WorkerSetError, check_worker, pair_remote
from kvfence.app.serve.readiness import greedy_answer
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.registry import build_model
from kvfence.engine.protocol import PageGrant, RunStep, SeqStep, StepDone, WorkerLost
from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.driver import Scheduler
from kvfence.scheduler.handle import RequestHandle
from kvfence.scheduler.offline import OfflineEngine
from kvfence.transports.core.secret import DeploymentSecret

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], list(range(30, 52))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


async def front(tg: anyio.abc.TaskGroup, hosted: list[Hosted], secret: DeploymentSecret,
                tokenizer) -> tuple[Scheduler, list[RemoteWorker]]:  # type: ignore[no-untyped-def]
    workers = [await RemoteWorker.connect(tg, h.address, secret, front_key=FRONT) for h in hosted]
    for w in workers:
        check_worker(w, MODEL_ID, PAGE)
    pair = await pair_remote(*workers, PAGE, FRONT)
    config = SchedulerConfig(page_size_tokens=PAGE, max_context_tokens=pair.max_context_tokens, chunk_tokens=8,
                             disaggregated=True, transfer_timeout_s=5)
    scheduler = Scheduler(config, tokenizer, pair.prefill, pair.decode, prefill_pages=PAGES, decode_pages=PAGES,
                          link=pair.link)
    await scheduler.run(tg)
    return scheduler, workers


async def outputs(scheduler: Scheduler) -> list[list[int]]:
    async def one(handle: RequestHandle) -> list[int]:
        ids: list[int] = []
        async for d in handle.deltas():
            assert d.error is None, d.error
            ids += d.token_ids
        return ids

    handles = [scheduler.submit(p, GREEDY) for p in PROMPTS]
    results: list[list[int]] = [[] for _ in handles]

    async def into(i: int) -> None:
        results[i] = await one(handles[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(handles)):
            tg.start_soon(into, i)
    return results


def offline(tiny: Checkpoint) -> list[list[int]]:
    model = build_model(tiny, torch.float32)
    engine = OfflineEngine(ModelRunner(model, KVPool(model.config, 64, PAGE, torch.float32)), tiny.tokenizer)
    return [o.generated_token_ids for o in engine.generate(PROMPTS, [GREEDY] * len(PROMPTS))]


async def until(condition, timeout_s: float = 10) -> None:  # type: ignore[no-untyped-def]
    with anyio.fail_after(timeout_s):
        while not condition():
            await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_remote_workers_serve_exactly_and_end_a_gone_schedulers_leases(tiny: Checkpoint) -> None:
    want = offline(tiny)
    secret = DeploymentSecret.generate()
    async with anyio.create_task_group() as tg:
        hosted = await host_pair(tg, tiny, secret)
        async with anyio.create_task_group() as first:
            scheduler, workers = await front(first, hosted, secret, tiny.tokenizer)
            assert [w.role for w in workers] == ["prefill", "decode"]
            assert await outputs(scheduler) == want
            await wait_idle(scheduler)
            # the canary's known answer, from the prefill worker's model alone
            assert await workers[0].reference(PROMPTS[0], 10) == want[0]
            # while it owns the workers, another scheduler (with the secret) is refused
            with pytest.raises(WorkerLost, match="already serves"):
                await RemoteWorker.connect(first, hosted[1].address, secret, front_key=FRONT)
            # pages are held (an unfinished request, and the prefix cache) when the scheduler goes
            handle = scheduler.submit(PROMPTS[2], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
            async for d in handle.deltas():
                if d.token_ids:
                    break
            incarnations = [h.worker.incarnation for h in hosted]
            assert any(t != 0 for h in hosted for t in h.tags())
            for w in workers:
                w.close()
            first.cancel_scope.cancel()
        # each worker ended its leases: every page untagged, a new incarnation, a fresh KV endpoint
        await until(lambda: all(h.server.served == 1 for h in hosted))
        for h, old in zip(hosted, incarnations):
            assert h.worker.incarnation != old and h.tags() == [0] * PAGES and h.server.owner is None
        async with anyio.create_task_group() as second:
            scheduler, workers = await front(second, hosted, secret, tiny.tokenizer)
            assert await outputs(scheduler) == want
            await wait_idle(scheduler)
            for w in workers:
                w.close()
            second.cancel_scope.cancel()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_peer_without_the_secret_gets_nothing(tiny: Checkpoint) -> None:
    secret = DeploymentSecret.generate()
    async with anyio.create_task_group() as tg:
        hosted = await host_pair(tg, tiny, secret)
        with pytest.raises(WorkerLost, match="did not prove"):
            await RemoteWorker.connect(tg, hosted[0].address, DeploymentSecret.generate(), front_key=FRONT)
        # a client that speaks no handshake: the worker answers nothing and closes
        host, port = hosted[0].address.split(":")
        async with await anyio.connect_tcp(host, int(port)) as stream:
            await stream.send(b'{"call_id": 1, "body": {"type": "describe"}}\n' + bytes(64))
            with anyio.fail_after(5), pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError, OSError)):
                await stream.receive()  # closed (or reset) without a byte
        assert hosted[0].server.owner is None and hosted[0].server.served == 0
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_workers_that_cannot_serve_together_are_refused_with_the_reason(tiny: Checkpoint) -> None:
    secret = DeploymentSecret.generate()
    async with anyio.create_task_group() as tg:
        hosted = await host_pair(tg, tiny, secret)
        workers = [await RemoteWorker.connect(tg, h.address, secret, front_key=FRONT) for h in hosted]
        for w in workers:
            check_worker(w, MODEL_ID, PAGE)
            with pytest.raises(WorkerSetError, match="same --model"):
                check_worker(w, "another-model", PAGE)
            with pytest.raises(WorkerSetError, match="same --page-size"):
                check_worker(w, MODEL_ID, PAGE * 2)
            described = w.description
            w.description = msgspec.structs.replace(described, protocol=0)  # a worker from before versions
            with pytest.raises(WorkerSetError, match="control protocol 0, this front end .*same kvfence version"):
                check_worker(w, MODEL_ID, PAGE)
            w.description = described
        for w in workers:
            w.close()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_cut_crosses_the_control_connection_and_the_step_comes_back_deferred(tiny: Checkpoint) -> None:
    """`RemoteWorker.cut` reaches the worker beside its steps (answered at once): a cuttable step
    it names stops before its first layer and its reply, over the wire, defers every seq; sent
    again, the seq gets its token; a step not named runs whole."""
    secret = DeploymentSecret.generate()
    lease, pages = (5 << 80) | 3, [0, 1, 2]
    seq = SeqStep(lease=lease, token_ids=PROMPTS[0], context_tokens=0, new_pages=pages,
                  sampling=SamplingParams(temperature=0))
    async with anyio.create_task_group() as tg:
        hosted = await host_pair(tg, tiny, secret)
        prefill = await RemoteWorker.connect(tg, hosted[0].address, secret, front_key=FRONT)
        await prefill.cut(1)
        cut = await prefill.call(RunStep(step_id=1, seqs=[seq], grants=[PageGrant(lease, pages, tenant="t")],
                                         cuttable=True))
        assert isinstance(cut, StepDone) and cut.cut and cut.deferred == [0] and cut.tokens == [None]
        again = await prefill.call(RunStep(step_id=2, seqs=[SeqStep(lease=lease, token_ids=PROMPTS[0], context_tokens=0,
                                                                    new_pages=[], sampling=seq.sampling)],
                                           cuttable=True))
        assert isinstance(again, StepDone) and not again.cut and again.tokens == [offline(tiny)[0][0]]
        done = await prefill.call(RunStep(step_id=3, seqs=[], released=pages, ended=[lease]))
        assert isinstance(done, StepDone) and hosted[0].tags() == [0] * PAGES
        prefill.close()
        tg.cancel_scope.cancel()


def test_the_reference_is_the_models_own_greedy_answer(tiny: Checkpoint) -> None:
    model = build_model(tiny, torch.float32)
    assert greedy_answer(model, tiny.tokenizer, PROMPTS[0], 10, PAGE) == offline(tiny)[0]


@pytest.mark.anyio
async def test_a_thousand_silent_connections_stop_no_step_and_no_transfer(tiny: Checkpoint) -> None:
    """Silent connections to both control ports and to the decode worker's KV endpoint, opened
    while a scheduler serves: its steps and transfers go on exactly, the workers hold at most their
    budget of them, and a new scheduler still gets through the flood once this one leaves."""
    want = offline(tiny)
    secret = DeploymentSecret.generate()
    flood: list[socket.socket] = []
    enough_descriptors(FLOOD + 64)
    async with anyio.create_task_group() as tg:
        hosted = await host_pair(tg, tiny, secret)
        assert hosted[1].endpoint.info is not None
        targets = [hosted[0].address, hosted[1].address, hosted[1].endpoint.info.address]
        try:
            async with anyio.create_task_group() as first:
                scheduler, workers = await front(first, hosted, secret, tiny.tokenizer)
                for i in range(FLOOD):
                    flood.append(await anyio.to_thread.run_sync(connect, targets[i % len(targets)]))
                assert await outputs(scheduler) == want
                await wait_idle(scheduler)
                for h in hosted:
                    assert len(h.server._unauthenticated) <= h.server._unauthenticated.cap
                    assert h.server._unauthenticated.evicted > 0
                for w in workers:
                    w.close()
                first.cancel_scope.cancel()
            await until(lambda: all(h.server.served == 1 for h in hosted))
            async with anyio.create_task_group() as second:
                scheduler, workers = await front(second, hosted, secret, tiny.tokenizer)
                assert await outputs(scheduler) == want
                for w in workers:
                    w.close()
                second.cancel_scope.cancel()
        finally:
            for s in flood:
                s.close()
        tg.cancel_scope.cancel()
