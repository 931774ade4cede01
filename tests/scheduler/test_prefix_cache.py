"""The tenant-scoped prefix cache through the real scheduler, workers and transports (tiny model).

A request of the same tenant reuses the longest cached chain and prefills only the rest, in both
pools; another tenant, or another cache salt, finds nothing; outputs always equal a cold run token
for token (greedy); a transfer moves only the pages the decode pool lacks, by an explicit plan
whose counts are checked (FAILURES 26); cached pages are evicted under pressure and every page
returns to its ledger after a flush.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
from serving_harness import Serving, serving_in, wait_idle

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.actions import StartTransfer
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.transfers import Transfers
from kvfence.scheduler.handle import RequestHandle
from kvfence.scheduler.core.tenants import Tenant
from test_scheduler import offline_greedy

PAGE = 4
T, U = Tenant(name="t"), Tenant(name="u")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(20, 50))  # 30 tokens: 7 full pages reusable, the 8th holds the last two


async def run(handle: RequestHandle) -> tuple[list[int], int, str | None]:
    """Generated ids, cached prompt tokens, error code."""
    ids: list[int] = []
    async for d in handle.deltas():
        ids += d.token_ids
        if d.error is not None:
            return ids, 0, d.error.code
        if d.finish_reason is not None:
            return ids, d.cached_tokens, None
    raise AssertionError("no terminal delta")


def cache_config(mode: str, max_queue: int = 16) -> SchedulerConfig:
    """Pages of 4 tokens, a context of 96, 8 running; colocated or disaggregated by `mode`."""
    return SchedulerConfig(page_size_tokens=PAGE, max_context_tokens=96, max_running=8, max_queue=max_queue,
                           chunk_tokens=16, disaggregated=mode != "colocated", transfer_timeout_s=10)


@pytest.fixture(params=["colocated", "inprocess", "tcp"])
async def serving(request: pytest.FixtureRequest, tiny: Checkpoint) -> AsyncIterator[Serving]:
    async with serving_in(tiny, request.param, cache_config(request.param), num_pages=48) as s:
        yield s


def moved_pages(s: Serving) -> float:
    """KV pages moved by transfers so far (0 when colocated)."""
    link = s.scheduler.link
    return s.scheduler.metrics.transfer_bytes._value.get() / link.page_nbytes if link else 0.0


@pytest.mark.anyio
async def test_the_same_tenant_hits_and_gets_the_cold_answer_another_tenant_gets_nothing(
        serving: Serving, tiny: Checkpoint) -> None:
    s = serving.scheduler
    want = offline_greedy(tiny, [PROMPT], 6)[0][0]
    moves = [moved_pages(serving)]
    outs = []
    for tenant in (T, T, U):
        outs.append(await run(s.submit(PROMPT, GREEDY, tenant)))
        await wait_idle(s)
        moves.append(moved_pages(serving))
    assert outs == [(want, 0, None), (want, 28, None), (want, 0, None)]
    if s.link is not None:  # the hit moved one page; the cold runs moved the whole prompt
        assert [b - a for a, b in zip(moves, moves[1:])] == [8, 1, 8]
    assert s.metrics.tokens.labels("t", "cached")._value.get() == 28
    assert s.metrics.prefilled.labels("u")._value.get() == 30  # u computed every prompt token
    assert s.metrics.prefilled.labels("t")._value.get() == 30 + 2


@pytest.mark.anyio
async def test_a_cache_salt_partitions_within_the_tenant(serving: Serving, tiny: Checkpoint) -> None:
    s = serving.scheduler
    want = offline_greedy(tiny, [PROMPT], 6)[0][0]
    assert await run(s.submit(PROMPT, GREEDY, T, cache_salt="x")) == (want, 0, None)
    assert await run(s.submit(PROMPT, GREEDY, T, cache_salt="y")) == (want, 0, None)
    assert await run(s.submit(PROMPT, GREEDY, T)) == (want, 0, None)
    assert await run(s.submit(PROMPT, GREEDY, T, cache_salt="x")) == (want, 28, None)
    await wait_idle(s)


@pytest.mark.anyio
async def test_a_partial_hit_on_either_side_moves_exactly_what_is_missing(serving: Serving, tiny: Checkpoint) -> None:
    """A prompt that shares 3 pages with a cached one; then the same prompt with only one pool's
    cache flushed, each way round (FAILURES 26: the plan never shifts a page)."""
    s = serving.scheduler
    other = PROMPT[:12] + list(range(100, 118))  # 30 tokens, the first 3 pages alike
    want, want_other = (o[0] for o in offline_greedy(tiny, [PROMPT, other], 6))
    assert await run(s.submit(PROMPT, GREEDY, T)) == (want, 0, None)
    before = moved_pages(serving)
    assert await run(s.submit(other, GREEDY, T)) == (want_other, 12, None)
    await wait_idle(s)
    if s.link is None:
        return
    assert moved_pages(serving) - before == 8 - 3
    for flushed, cached, moved in ((s.core.worker("decode"), 28, 8), (s.core.worker("prefill"), 0, 1)):
        flushed.table.flush()
        before = moved_pages(serving)
        assert await run(s.submit(PROMPT, GREEDY, T)) == (want, cached, None)
        await wait_idle(s)
        assert moved_pages(serving) - before == moved


@pytest.mark.anyio
async def test_a_plan_that_does_not_add_up_fails_that_request_closed(
        serving: Serving, tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """FAILURES 26: a plan one page short (as a miscounted partial hit would make) is refused before
    anything is armed: 502 for that request, no token, pages back; the next request is served."""
    s = serving.scheduler
    if s.link is None:
        pytest.skip("colocated requests have no transfer")
    want = offline_greedy(tiny, [PROMPT], 6)[0][0]
    assert await run(s.submit(PROMPT, GREEDY, T)) == (want, 0, None)
    real = Transfers.plan

    def short(self: Transfers, req) -> StartTransfer:  # type: ignore[no-untyped-def]
        plan = real(self, req)
        return StartTransfer(key=plan.key, request_id=plan.request_id, num_tokens=plan.num_tokens,
                             src_lease=plan.src_lease, src_pages=plan.src_pages, dst_lease=plan.dst_lease,
                             dst_pages=plan.dst_pages[1:], first_token=plan.first_token)

    monkeypatch.setattr(Transfers, "plan", short)
    assert await run(s.submit(PROMPT[:20], GREEDY, T)) == ([], 0, "kv_transfer_failed")
    await wait_idle(s)
    monkeypatch.setattr(Transfers, "plan", real)
    assert await run(s.submit(PROMPT, GREEDY, T)) == (want, 28, None)
    await wait_idle(s)


@pytest.mark.anyio
async def test_eviction_under_pressure_keeps_every_answer_and_a_flush_returns_every_page(
        serving: Serving, tiny: Checkpoint) -> None:
    """48 pages, 12 prompts from two tenants that grow to 16 pages each, twice: the cache fills, idle
    pages are evicted (tail first) for new requests, running requests are preempted and recomputed
    (finding their own prompt cached), every answer equals a cold run, and after a flush every page
    of every pool is free and untagged."""
    s = serving.scheduler
    prompts = [[7 + i] + list(range(60 + 3 * i, 60 + 3 * i + 21)) for i in range(12)]  # 22 tokens each
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o[0] for o in offline_greedy(tiny, prompts, 40)]
    for _ in range(2):
        results = [(0, [], 0, None)] * len(prompts)

        async def one(i: int) -> None:
            results[i] = (i, *await run(s.submit(prompts[i], long, (T, U)[i % 2])))

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        assert [(ids, err) for _, ids, _, err in results] == [(w, None) for w in want]
        await wait_idle(s)
        assert all(n > 0 for n in s.pages_cached().values())
    assert s.metrics.preemptions._value.get() > 0
    assert sum(s.metrics.integrity_violations.labels(w.name, check)._value.get()
               for w in s.core.workers for check in ("owner_tag", "sanitizer")) == 0
    freed = s.flush_cache()
    assert all(n > 0 for n in freed.values())
    with anyio.fail_after(5):
        while any(w.pool.owner_tags.any() for w in serving.workers):
            await anyio.sleep(0.01)  # the releases ride the next message to each idle worker
    for w in s.core.workers:
        assert w.ledger.num_used == 0
        w.ledger.check_integrity()
