"""The readiness canary: passes only when the real serving path returns the known answer, and
fails (so /ready turns 503) when the transfer path breaks while the process lives."""

from __future__ import annotations

import anyio
import pytest
from serving_harness import Serving, compute_thread, start_serving

from kvfence.app.serve.readiness import ReadinessCanary, Reference, local_reference
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.lifecycle import State


def reference(serving: Serving, tiny: Checkpoint) -> Reference:
    """The prefill worker's own answer, as a server in one process computes it."""
    return local_reference(compute_thread(), serving.workers[0].runner.model, tiny.tokenizer,
                           serving.scheduler.config.page_size_tokens)


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["colocated", "tcp"])
async def test_canary_passes_then_fails_when_the_transfer_path_breaks(tiny: Checkpoint, mode: str) -> None:
    config = SchedulerConfig(page_size_tokens=4, max_context_tokens=128, disaggregated=mode != "colocated",
                             transfer_timeout_s=5)
    async with anyio.create_task_group() as tg:
        serving = await start_serving(tg, tiny, mode, config, num_pages=64)
        canary = ReadinessCanary(serving.scheduler, tiny.tokenizer, reference(serving, tiny),
                                 interval_s=3600, timeout_s=10)
        assert not canary.passed  # not ready before the first canary
        assert await canary.check_once()
        assert canary.expected is not None and len(canary.expected) == 8
        if mode == "tcp":
            await serving.transports[1].aclose()  # the decode side's endpoint goes away
            assert not await canary.check_once()
            assert not canary.passed and "kv_transfer_failed" in canary.last_failure
            text = serving.scheduler.metrics.render()[0].decode()
            assert 'kvfence_readiness_canaries_total{result="failed"} 1.0' in text
            assert "kvfence_ready 0.0" in text
        await serving.aclose()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_wrong_answer_fails_the_canary(tiny: Checkpoint) -> None:
    config = SchedulerConfig(page_size_tokens=4, max_context_tokens=128, disaggregated=False)
    async with anyio.create_task_group() as tg:
        serving = await start_serving(tg, tiny, "colocated", config, num_pages=64)
        canary = ReadinessCanary(serving.scheduler, tiny.tokenizer, reference(serving, tiny),
                                 interval_s=3600, timeout_s=10)
        assert await canary.check_once()
        canary.expected = [t + 1 for t in canary.expected or []]  # as if the path returned stale KV
        assert not await canary.check_once()
        assert "!= known" in canary.last_failure
        tg.cancel_scope.cancel()


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["colocated", "tcp"])
async def test_canary_passes_under_a_saturating_load(tiny: Checkpoint, mode: str) -> None:
    """Busy is not broken (issue 11 item 7): every running slot is taken by long generations, more
    requests wait behind them and the decode pool is full; the canary still runs the real path
    and passes (the scheduler's priority path: ahead of the queue, its pages taken from the newest
    running request), each time while the queue is still waiting, so /ready stays 200."""
    config = SchedulerConfig(page_size_tokens=4, max_context_tokens=128, max_running=3, max_queue=16,
                             disaggregated=mode != "colocated", transfer_timeout_s=5)
    async with anyio.create_task_group() as tg:
        serving = await start_serving(tg, tiny, mode, config, num_pages=48)
        s = serving.scheduler
        canary = ReadinessCanary(s, tiny.tokenizer, reference(serving, tiny), interval_s=3600, timeout_s=10)
        assert await canary.check_once()
        params = SamplingParams(temperature=0, max_tokens=110, ignore_eos=True)
        handles = [s.submit([5 + i, 6, 7, 8, 9, 10, 11, 12], params) for i in range(9)]
        with anyio.fail_after(10):
            while s.ledger("decode").num_free > 2:  # the running requests grew to fill the pool
                await anyio.sleep(0.002)
        for _ in range(3):
            assert s.requests_in(State.WAITING) and s.requests_in(State.DECODING)  # saturated: requests are waiting for slots or pages
            assert await canary.check_once(), canary.last_failure
            assert s.requests_in(State.WAITING)  # it did not wait its turn behind them
        assert canary.passed and "kvfence_ready 1.0" in s.metrics.render()[0].decode()
        for h in handles:
            h.abort()
        with anyio.fail_after(10):
            while s.in_flight():
                await anyio.sleep(0.01)
        assert all(n == 0 for n in s.pages_in_use().values())
        await serving.aclose()
        tg.cancel_scope.cancel()
