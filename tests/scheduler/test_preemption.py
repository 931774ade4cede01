"""Decode pages that grow with the sequence, and preemption when the pool runs out (FAILURES 28),
through the real scheduler and workers on a tiny random Llama, colocated and disaggregated.

A request reserves the decode pages of its prompt and first token at admission and gets one more
page, granted in the step that first writes it, as it grows. When the pool runs out the newest
running request goes back to the queue and is recomputed later: its stream must go on exactly
where it stopped (its output equals the one it produces alone), and every page comes back.
"""

from __future__ import annotations

import time

import anyio
import pytest
import torch
from serving_harness import read_each, start_serving, wait_idle

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import POISON_VALUE, KVPool
from kvfence.engine.models.registry import build_model
from kvfence.scheduler.offline import OfflineEngine
from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.driver import Scheduler
from kvfence.scheduler.core.errors import AdmissionRejected
from kvfence.scheduler.handle import RequestHandle
from kvfence.engine.ids import mint_id
from kvfence.scheduler.core.lifecycle import State

PAGE = 4
CONTEXT = 96
MODES = ["colocated", "tcp", "inprocess"]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def solo(tiny: Checkpoint, prompt: list[int], params: SamplingParams) -> tuple[list[int], str, str]:
    """The request alone, every page it could need reserved up front (never preempted)."""
    model = build_model(tiny, torch.float32)
    engine = OfflineEngine(ModelRunner(model, KVPool(model.config, 64, PAGE, torch.float32)), tiny.tokenizer,
                           chunk_tokens=16)
    out = engine.generate([prompt], [params])[0]
    return out.generated_token_ids, out.text, out.finish_reason


async def collect(handle: RequestHandle) -> tuple[list[int], str, str | None, str | None]:
    ids: list[int] = []
    text = ""
    async for d in handle.deltas():
        ids += d.token_ids
        text += d.text
        if d.finish_reason or d.error:
            return ids, text, d.finish_reason, d.error.code if d.error else None
    return ids, text, None, None


async def run_all(s: Scheduler, ps: list[list[int]], params: SamplingParams) -> list[tuple]:
    return await read_each([s.submit(p, params) for p in ps], collect)


def config(mode: str, **kw: object) -> SchedulerConfig:
    base: dict[str, object] = dict(page_size_tokens=PAGE, max_context_tokens=CONTEXT, max_running=32, max_queue=32,
                                   chunk_tokens=16, disaggregated=mode != "colocated", transfer_timeout_s=10)
    return SchedulerConfig(**{**base, **kw})  # type: ignore[arg-type]


def preemptions(s: Scheduler) -> float:
    return s.metrics.preemptions._value.get()


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["colocated", "tcp"])
async def test_requests_without_max_tokens_run_at_once(tiny: Checkpoint, mode: str,
                                                       task_group: anyio.abc.TaskGroup) -> None:
    """Issue 11 item 3: pools sized like the defaults (4 contexts of decode pages); 16 requests
    without max_tokens. Each used to reserve prompt + max_tokens = a whole context up front, so 4
    ran and 12 queued; now each reserves its prompt and first token, and all 16 run at once."""
    serving = await start_serving(task_group, tiny, mode, config(mode), num_pages=4 * CONTEXT // PAGE)
    s = serving.scheduler
    ps = prompts(16, seed=1)
    handles = [s.submit(p, SamplingParams(temperature=0)) for p in ps]  # no max_tokens
    assert not s.requests_in(State.WAITING) and s.core.num_running() == 16
    assert s.pages_in_use()["colocated" if mode == "colocated" else "decode"] == sum(
        -(-(len(p) + 1) // PAGE) for p in ps)
    with anyio.fail_after(60):
        outs = [await collect(h) for h in handles]
    assert all(error is None and reason in ("stop", "length") and ids for ids, _, reason, error in outs)
    await wait_idle(s)
    await serving.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("mode", MODES)
async def test_preempted_streams_continue_exactly(tiny: Checkpoint, mode: str,
                                                  task_group: anyio.abc.TaskGroup) -> None:
    """FAILURES 28: a pool of 30 pages, six requests that grow to 9-16 pages each. The pool runs out
    mid-generation, the newest running requests are preempted (released, recomputed from prompt +
    what they generated), and every stream equals the request's solo output token for token and
    character for character: nothing duplicated, nothing lost. Every page comes back."""
    ps = prompts(6, seed=2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [solo(tiny, p, params) for p in ps]  # before serving: it blocks the event loop the endpoints ping on
    serving = await start_serving(task_group, tiny, mode, config(mode), num_pages=30)
    s = serving.scheduler
    results = await run_all(s, ps, params)
    for (ids, text, reason, error), (want_ids, want_text, want_reason) in zip(results, want):
        assert error is None and reason == want_reason == "length"
        assert ids == want_ids
        assert text == want_text
    assert preemptions(s) > 0  # the pool really ran out mid-generation
    assert 'kvfence_preemptions_total' in s.metrics.render()[0].decode()
    await wait_idle(s)
    await serving.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["colocated", "tcp"])
async def test_a_request_that_needs_the_whole_pool_finishes(tiny: Checkpoint, mode: str,
                                                           task_group: anyio.abc.TaskGroup) -> None:
    """Admission stays complete: the first request needs every page of the pool (prompt +
    max_tokens = 24 pages) and gets them, preempting the newer ones as it grows (a request is only
    preempted for an older one, so the oldest always progresses); the others finish after it,
    exactly, and the pages come back."""
    serving = await start_serving(task_group, tiny, mode, config(mode), num_pages=CONTEXT // PAGE)
    s = serving.scheduler
    big = [7, 8, 9, 10, 11, 12, 13, 14]
    big_params = SamplingParams(temperature=0, max_tokens=CONTEXT - len(big), ignore_eos=True)
    small = prompts(3, seed=3)
    small_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = s.submit(big, big_params)
    results = await run_all(s, small, small_params)
    with anyio.fail_after(30):
        ids, text, reason, error = await collect(first)
    assert (ids, text, reason) == solo(tiny, big, big_params) and error is None
    for (ids, text, reason, error), p in zip(results, small):
        assert (ids, text, reason) == solo(tiny, p, small_params) and error is None
    assert preemptions(s) > 0
    await wait_idle(s)
    await serving.aclose()


@pytest.mark.anyio
async def test_a_request_preempted_too_often_ends_with_503(tiny: Checkpoint, task_group: anyio.abc.TaskGroup) -> None:
    """With max_preemptions=0 a request the pool cannot keep ends (503 overloaded, Retry-After)
    instead of going back to the queue; its text so far was its own, the others are exact, and
    every page comes back."""
    serving = await start_serving(task_group, tiny, "colocated", config("colocated", max_preemptions=0),
                                  num_pages=30)
    s = serving.scheduler
    ps = prompts(6, seed=2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    results = await run_all(s, ps, params)
    ended = [i for i, r in enumerate(results) if r[3] is not None]
    assert ended and all(results[i][3] == "overloaded" for i in ended)
    for i, (ids, text, reason, error) in enumerate(results):
        want_ids, want_text, _ = solo(tiny, ps[i], params)
        if error is None:
            assert (ids, text, reason) == (want_ids, want_text, "length")
        else:
            assert want_ids[:len(ids)] == ids and want_text.startswith(text)  # a prefix, then the error
    assert preemptions(s) == 0
    await wait_idle(s)
    await serving.aclose()


# ---- the priority path (the readiness canary) ----

@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["colocated", "tcp"])
async def test_priority_request_runs_ahead_of_a_saturated_queue(tiny: Checkpoint, mode: str,
                                                               task_group: anyio.abc.TaskGroup) -> None:
    """Issue 11 item 7, at the scheduler: every running slot taken, requests queued behind them, the
    decode pool full. A priority request skips the queue and the slot limit, takes its pages from
    the newest running request (which is recomputed later, exactly), and finishes while the
    others still wait; the ordinary path (submit) still refuses when the queue is full."""
    serving = await start_serving(task_group, tiny, mode, config(mode, max_running=3, max_queue=3), num_pages=24)
    s = serving.scheduler
    ps = prompts(6, seed=4)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    handles = [s.submit(p, params) for p in ps]
    with pytest.raises(AdmissionRejected):
        s.submit([5, 6, 7], params)  # the queue is full
    with anyio.fail_after(10):
        while s.ledger("decode").num_free > 1:  # until the running requests have grown to fill the pool
            await anyio.sleep(0.002)
    canary = [9, 10, 11, 12, 13]
    canary_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with anyio.fail_after(10):
        ids, text, reason, error = await collect(s.submit_priority(canary, canary_params))
    assert (ids, text, reason) == solo(tiny, canary, canary_params) and error is None
    assert s.requests_in(State.WAITING)  # it went ahead of requests that are still waiting
    with anyio.fail_after(60):
        outs = [await collect(h) for h in handles]
    for (ids, text, reason, error), p in zip(outs, ps):
        assert (ids, text, reason) == solo(tiny, p, params) and error is None
    await wait_idle(s)
    await serving.aclose()


# ---- quarantined pages and admission (issue 11 item 5) ----

def quarantine_pages(s: Scheduler, num_pages: int) -> int:
    """Quarantine `num_pages` free decode pages under a lease of their own, as a transfer that
    timed out with its cancellation unacknowledged leaves them."""
    lease = mint_id()
    table = s._bound("decode").table
    assert table.reserve(lease, num_pages) is not None
    table.quarantine(lease, time.monotonic())
    return lease


@pytest.mark.anyio
async def test_admission_counts_only_pages_that_can_still_become_free(tiny: Checkpoint, caplog: pytest.LogCaptureFixture,
                                                                      task_group: anyio.abc.TaskGroup) -> None:
    """A request that fits the pool only with its quarantined pages is refused at once with 503
    (kv_pages_quarantined, Retry-After) and a log line; one that fits what is left is served; once
    the quarantine ends (confirm_quiet) the pages come back through the release path and the same
    request is served."""
    serving = await start_serving(task_group, tiny, "colocated", config("colocated"), num_pages=24)
    s = serving.scheduler
    lease = quarantine_pages(s, 8)  # 16 of 24 pages can still become free
    s.refresh_metrics()
    text = s.metrics.render()[0].decode()
    assert 'kvfence_kv_pages{state="quarantined",worker="colocated"} 8.0' in text
    assert 'kvfence_kv_quarantine_age_seconds{worker="colocated"}' in text
    long_params = SamplingParams(temperature=0, max_tokens=CONTEXT - 16, ignore_eos=True)  # 24 pages in all
    with pytest.raises(AdmissionRejected) as info:
        s.submit(list(range(3, 19)), long_params)
    assert info.value.status == 503 and info.value.code == "kv_pages_quarantined" and info.value.retry_after_s
    assert "8 quarantined" in caplog.text
    assert s.in_flight() == 0
    short = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # 14 pages
    ids, _, reason, error = await collect(s.submit(list(range(3, 19)), short))
    assert reason == "length" and error is None and len(ids) == 40
    returned = s.confirm_quiet("decode", lease)
    assert len(returned) == 8 and s.ledger("decode").num_quarantined == 0
    ids, _, reason, error = await collect(s.submit(list(range(3, 19)), long_params))
    assert reason == "length" and error is None and len(ids) == CONTEXT - 16
    await wait_idle(s)


@pytest.mark.anyio
async def test_a_queued_request_that_can_no_longer_fit_ends_at_once(tiny: Checkpoint,
                                                                     task_group: anyio.abc.TaskGroup) -> None:
    """Pages quarantined while a request waits in the queue: it ends with 503 when that is
    known, not at its queue deadline; a running request that can never get its next page
    (everything else is quarantined) ends with 503 too, never hangs."""
    serving = await start_serving(task_group, tiny, "colocated", config("colocated", max_running=1,
                                                                       queue_timeout_s=600), num_pages=24)
    s = serving.scheduler
    params = SamplingParams(temperature=0, max_tokens=CONTEXT - 16, ignore_eos=True)  # 24 pages in all
    running = s.submit(list(range(3, 19)), params)
    queued = s.submit(list(range(20, 36)), params)
    lease = quarantine_pages(s, s.ledger("decode").num_free)  # all but the running request's 5 pages
    with anyio.fail_after(10):
        r_ids, _, r_reason, r_error = await collect(running)
        q_ids, _, q_reason, q_error = await collect(queued)
    assert (q_ids, q_reason, q_error) == ([], None, "kv_pages_quarantined")
    assert r_reason is None and r_error == "kv_pages_quarantined" and len(r_ids) < CONTEXT - 16
    s.confirm_quiet("decode", lease)
    await wait_idle(s)


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["tcp", "inprocess"])
async def test_confirm_quiet_returns_a_timed_out_transfers_pages_scrubbed(tiny: Checkpoint, transport: str,
                                                                         task_group: anyio.abc.TaskGroup) -> None:
    """A transfer whose cancellation was never acknowledged leaves its decode pages quarantined;
    when its writes are known to be terminal, confirm_quiet frees them through the
    release path: the decode worker untags and scrubs them in its next message, and they serve
    the next request."""
    serving = await start_serving(task_group, tiny, transport, config(transport, transfer_timeout_s=0.5),
                                  num_pages=24, faults="stuck#2")  # the second push (and the fourth)
    s, decode_worker = serving.scheduler, serving.workers[1]
    prompt = list(range(3, 19))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = solo(tiny, prompt, params)[0]
    assert (await collect(s.submit(prompt, params)))[0] == want
    await wait_idle(s)
    with anyio.fail_after(10):
        _, _, _, error = await collect(s.submit(prompt, params))
    assert error == "kv_transfer_failed"
    (lease,) = s.ledger("decode").quarantined_leases()
    pages = s.ledger("decode").quarantined_pages(lease)
    assert pages and all(decode_worker.pool.owner(p) == lease for p in pages)
    assert s.confirm_quiet("decode", lease) == pages
    assert s.confirm_quiet("decode", lease) == []  # once
    for other in s.ledger("prefill").quarantined_leases():  # the source side, if its sender did not acknowledge either
        s.confirm_quiet("prefill", other)
    with anyio.fail_after(5):  # the next message to the decode worker (sent at once: it is idle) applies the release
        while s._bound("decode").in_flight is not None or s._bound("decode").table.has_pending:
            await anyio.sleep(0.005)
    assert all(decode_worker.pool.owner(p) == 0 for p in pages)
    assert bool((decode_worker.pool.data[pages] == POISON_VALUE).all())
    ids, _, reason, error = await collect(s.submit(prompt, params))
    assert (ids, reason, error) == (want, "length", None)
    await wait_idle(s)
    await serving.aclose()

