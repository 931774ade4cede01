"""The scheduler with real workers on a tiny random Llama: outputs, admission, aborts, page baselines.

Disaggregated runs pair a prefill and a decode worker through a real transport; their greedy
outputs must equal a colocated run and the offline engine, token for token.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import pytest
import torch
from serving_harness import assert_baseline, start_serving, wait_idle

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.registry import build_model
from kvfence.scheduler.offline import OfflineEngine
from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.worker import Worker
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.driver import Scheduler
from kvfence.scheduler.core.errors import AdmissionRejected
from kvfence.scheduler.handle import RequestHandle
from kvfence.engine.ids import mint_id

PAGE = 4
CONTEXT = 96


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(3, 250, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


class Harness:
    def __init__(self, scheduler: Scheduler, workers: list[Worker]) -> None:
        self.scheduler = scheduler
        self.workers = workers


async def collect(handle: RequestHandle) -> tuple[list[int], str, str | None, str | None]:
    ids: list[int] = []
    text = ""
    async for d in handle.deltas():
        ids += d.token_ids
        text += d.text
        if d.finish_reason or d.error:
            return ids, text, d.finish_reason, d.error.code if d.error else None
    return ids, text, None, None


@pytest.fixture(params=["colocated", "inprocess", "tcp"])
async def harness(request: pytest.FixtureRequest, tiny: Checkpoint) -> AsyncIterator[Harness]:
    mode = request.param
    config = SchedulerConfig(page_size_tokens=PAGE, max_context_tokens=CONTEXT, max_running=8, max_queue=4,
                             chunk_tokens=16, disaggregated=mode != "colocated", transfer_timeout_s=10)
    async with anyio.create_task_group() as tg:
        serving = await start_serving(tg, tiny, mode, config, num_pages=64)
        yield Harness(serving.scheduler, serving.workers)
        await serving.aclose()
        tg.cancel_scope.cancel()


def offline_greedy(tiny: Checkpoint, ps: list[list[int]], max_tokens: int) -> list[tuple[list[int], str]]:
    model = build_model(tiny, torch.float32)
    engine = OfflineEngine(ModelRunner(model, KVPool(model.config, 256, PAGE, torch.float32)), tiny.tokenizer,
                           chunk_tokens=16)
    outs = engine.generate(ps, [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)] * len(ps))
    return [(o.generated_token_ids, o.text) for o in outs]


@pytest.mark.anyio
async def test_greedy_equals_offline_engine(harness: Harness, tiny: Checkpoint) -> None:
    ps = prompts(6)
    want = offline_greedy(tiny, ps, 12)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results: list[tuple] = [None] * len(ps)  # type: ignore[list-item]

    async def one(i: int) -> None:
        results[i] = await collect(harness.scheduler.submit(ps[i], params))

    async with anyio.create_task_group() as tg:
        for i in range(len(ps)):
            tg.start_soon(one, i)
    for (ids, text, reason, error), (want_ids, want_text) in zip(results, want):
        assert error is None and reason == "length"
        assert ids == want_ids
        assert text == want_text
    assert_baseline(harness.scheduler)


@pytest.mark.anyio
async def test_context_length_rejected_before_anything_is_reserved(harness: Harness) -> None:
    s = harness.scheduler
    with pytest.raises(AdmissionRejected) as info:
        s.submit(list(range(3, 3 + CONTEXT)), SamplingParams(max_tokens=1))
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    with pytest.raises(AdmissionRejected) as info:
        s.submit([5, 6, 7], SamplingParams(max_tokens=CONTEXT))
    assert info.value.param == "max_tokens"
    assert s.in_flight() == 0
    assert_baseline(harness.scheduler)


@pytest.mark.anyio
async def test_queue_full_is_503_with_retry_after(harness: Harness) -> None:
    s = harness.scheduler
    big = SamplingParams(temperature=0, max_tokens=CONTEXT - 8, ignore_eos=True)
    handles = []
    with pytest.raises(AdmissionRejected) as info:
        for _ in range(64):  # decode pages grow with the sequence: 8 run (max_running), 4 more queue
            handles.append(s.submit([5, 6, 7, 8], big))
    assert info.value.status == 503 and info.value.retry_after_s
    assert len(handles) == 12
    for h in handles:
        h.abort()
    for h in handles:
        _, _, reason, error = await collect(h)
        assert reason is None and error == "client_closed"
    await wait_idle(harness.scheduler)


@pytest.mark.anyio
@pytest.mark.parametrize("after_tokens", [0, 1, 5])
async def test_abort_returns_every_page(harness: Harness, after_tokens: int) -> None:
    s = harness.scheduler
    handle = s.submit(prompts(1)[0] * 2, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    if after_tokens == 0:
        await anyio.sleep(0)  # let the loops pick it up: it may be prefilling or transferring
        handle.abort()
    seen = 0
    async for d in handle.deltas():
        seen += len(d.token_ids)
        if seen >= after_tokens:
            handle.abort()
        if d.finish_reason or d.error:
            assert d.finish_reason is None and d.error is not None and d.error.code == "client_closed"
            break
    handle.abort()  # idempotent
    await wait_idle(harness.scheduler)
    # Others keep working afterwards.
    ids, _, reason, _ = await collect(s.submit([4, 5, 6], SamplingParams(temperature=0, max_tokens=3)))
    assert reason in ("stop", "length") and ids
    await wait_idle(harness.scheduler)


@pytest.mark.anyio
@pytest.mark.parametrize("pool", ["prefill", "decode"])
async def test_foreign_page_tag_fails_only_that_request(harness: Harness, tiny: Checkpoint, pool: str) -> None:
    """A page whose tag is not the reader's lease (here: a corrupted grant) fails that request closed
    with kv_integrity_error before the step's token; the other request's output is untouched."""
    s = harness.scheduler
    ps = prompts(2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = offline_greedy(tiny, ps, 8)
    table = s._bound(pool).table
    take, leases = table.take_pending, []

    def corrupted():  # type: ignore[no-untyped-def]
        """The first grant to the second request's lease tags its first page with a stranger's lease."""
        pending = take()
        out = []
        for grant in pending.grants:
            if grant.lease not in leases:
                leases.append(grant.lease)
                if len(leases) == 2:
                    out += [type(grant)(mint_id(), grant.pages[:1]), type(grant)(grant.lease, grant.pages[1:])]
                    continue
            out.append(grant)
        return pending._replace(grants=out)

    table.take_pending = corrupted  # type: ignore[method-assign]
    try:
        good = s.submit(ps[0], params)
        bad = s.submit(ps[1], params)
        good_out, bad_out = await collect(good), await collect(bad)
    finally:
        del table.take_pending
    assert good_out[0] == want[0][0] and good_out[2] == "length"
    ids, text, reason, error = bad_out
    assert error == "kv_integrity_error" and reason is None
    if pool == "prefill" or not s.config.disaggregated:
        assert ids == [] and text == ""  # failed before its first token
    assert s.metrics.integrity_violations.labels(
        "colocated" if not s.config.disaggregated else pool, "owner_tag")._value.get() == 1
    await wait_idle(harness.scheduler)


@pytest.mark.anyio
async def test_queued_request_ends_at_its_deadline(tiny: Checkpoint) -> None:
    config = SchedulerConfig(page_size_tokens=PAGE, max_context_tokens=CONTEXT, max_running=1, max_queue=4,
                             chunk_tokens=16, disaggregated=False, queue_timeout_s=30)
    async with anyio.create_task_group() as tg:
        serving = await start_serving(tg, tiny, "colocated", config, num_pages=64)
        s = serving.scheduler
        running = s.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=CONTEXT - 4, ignore_eos=True))
        queued = s.submit([8, 9], SamplingParams(temperature=0, max_tokens=4))
        s.tick(time.monotonic() + 1)  # not yet due
        assert s.in_flight() == 2
        s.tick(time.monotonic() + 31)  # as if 31 s passed: the queued request ends
        with anyio.fail_after(10):
            _, _, reason, error = await collect(queued)
        assert reason is None and error == "overloaded"
        running.abort()
        await collect(running)
        await wait_idle(s)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_client_gone_while_queued(tiny: Checkpoint) -> None:
    """FAILURES 11, the queued point (prefilling, transferring and decoding are covered above and in
    test_transfer_failures): the queued request ends at once as client_closed, nothing was
    reserved for it, the running one is undisturbed."""
    config = SchedulerConfig(page_size_tokens=PAGE, max_context_tokens=CONTEXT, max_running=1, max_queue=4,
                             chunk_tokens=16, disaggregated=False)
    async with anyio.create_task_group() as tg:
        serving = await start_serving(tg, tiny, "colocated", config, num_pages=64)
        s = serving.scheduler
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        want = offline_greedy(tiny, [[5, 6, 7]], 12)[0][0]
        running = s.submit([5, 6, 7], params)
        queued = s.submit([8, 9], params)
        held = s.pages_in_use()["colocated"]
        queued.abort()
        with anyio.fail_after(5):
            ids, _, reason, error = await collect(queued)
        assert (ids, reason, error) == ([], None, "client_closed")
        assert s.pages_in_use()["colocated"] == held  # it never held any
        assert (await collect(running))[0] == want
        await wait_idle(s)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_the_incident_prompt_over_the_prefill_pool_is_refused_at_admission(tiny: Checkpoint) -> None:
    """The 2026 incident, with the sizing guard bypassed (the scheduler is built directly on an
    undersized prefill pool): a prompt within the context but longer than the prefill pool is
    refused at admission with context_length_exceeded; no lease, page, tag or transfer exists,
    and a request that fits is still served."""
    config = SchedulerConfig(page_size_tokens=PAGE, max_context_tokens=CONTEXT, chunk_tokens=16,
                             disaggregated=True)
    async with anyio.create_task_group() as tg:
        serving = await start_serving(tg, tiny, "tcp", config, num_pages=8)  # 32 tokens per pool
        s = serving.scheduler
        with pytest.raises(AdmissionRejected) as info:
            s.submit(list(range(3, 3 + 60)), SamplingParams(temperature=0, max_tokens=4))
        assert info.value.status == 400 and info.value.code == "context_length_exceeded"
        assert info.value.param == "messages" and "32 (prefill)" in info.value.message
        assert s.in_flight() == 0 and s.pages_in_use() == {"prefill": 0, "decode": 0}
        assert not any(w.table.has_pending for w in s.core.workers)  # no page was ever handed out
        for w in serving.workers:
            assert not w.pool.owner_tags.any()  # and no page was ever tagged
        assert s.metrics.transfers.labels("ok")._value.get() == 0
        ids, _, reason, error = await collect(s.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=4)))
        assert reason == "length" and error is None and len(ids) == 4
        await wait_idle(s)
        await serving.aclose()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_sanitizer_fails_a_decode_that_reads_past_what_its_transfer_landed(
        harness: Harness, tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transfer recorded as landing one token fewer than the decode then reads (a short transfer
    the transport did not notice, simulated at the record): pages and tags are the request's own, so
    only the KV sanitizer can see it. The request fails closed before its first decode; the next one
    is served exactly."""
    s = harness.scheduler
    if not s.config.disaggregated:
        pytest.skip("colocated requests have no transfer")
    from kvfence.scheduler.core import lease_table
    from kvfence.engine.protocol import Landing

    short = [True]

    def landing(lease: int, pages: list[int], num_tokens: int, first_token: int = 0) -> Landing:
        return Landing(lease=lease, pages=pages, num_tokens=num_tokens - 1 if short[0] else num_tokens,
                       first_token=first_token)

    monkeypatch.setattr(lease_table, "Landing", landing)
    ps = prompts(2)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids, _, reason, error = await collect(s.submit(ps[0], params))
    assert error == "kv_integrity_error" and reason is None
    assert len(ids) <= 1  # at most the prefill's token; nothing decoded from the unlanded slot
    assert s.metrics.integrity_violations.labels("decode", "sanitizer")._value.get() == 1
    await wait_idle(harness.scheduler)
    short[0] = False
    ids, _, reason, error = await collect(s.submit(ps[1], params))
    assert (ids, reason, error) == (offline_greedy(tiny, [ps[1]], 6)[0][0], "length", None)
    await wait_idle(harness.scheduler)


@pytest.mark.anyio
async def test_every_transfer_lands_in_pages_already_tagged_for_its_lease(tiny: Checkpoint) -> None:
    """A transfer starts only once the decode worker has applied its grant (and every release of
    the same pages before it), whether that took a message of its own or rode on a decode step.
    A small pool makes pages change hands between requests while others decode."""
    config = SchedulerConfig(page_size_tokens=PAGE, max_context_tokens=CONTEXT, max_running=6, max_queue=32,
                             chunk_tokens=16, disaggregated=True, transfer_timeout_s=10)
    async with anyio.create_task_group() as tg:
        serving = await start_serving(tg, tiny, "tcp", config, num_pages=40)
        scheduler, decode_pool = serving.scheduler, serving.workers[1].pool
        assert scheduler.link is not None
        move, checked = scheduler.link.move, []

        async def checked_move(plan, timeout_s: float):  # type: ignore[no-untyped-def]
            checked.append([decode_pool.owner(p) == plan.dst_lease for p in plan.dst_pages])
            return await move(plan, timeout_s)

        scheduler.link.move = checked_move  # type: ignore[method-assign]
        ps = prompts(16)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        results = [None] * len(ps)

        async def run(i: int) -> None:
            results[i] = await collect(scheduler.submit(ps[i], params))

        async with anyio.create_task_group() as inner:
            for i in range(len(ps)):
                inner.start_soon(run, i)
        assert all(r is not None and r[2] == "length" for r in results), results
        assert len(checked) == len(ps) and all(all(tags) for tags in checked), checked
        await wait_idle(scheduler)
        await serving.aclose()
        tg.cancel_scope.cancel()
