"""The readiness canary: passes only when the real serving path returns the known answer, and
fails (so /ready turns 503) when the transfer path breaks while the process lives."""

from __future__ import annotations

import anyio
import pytest
from serving_harness import start_serving

from kvfence.app.readiness import ReadinessCanary
from kvfence.engine.checkpoint import Checkpoint
from kvfence.scheduler.config import SchedulerConfig


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["colocated", "tcp"])
async def test_canary_passes_then_fails_when_the_transfer_path_breaks(tiny: Checkpoint, mode: str) -> None:
    config = SchedulerConfig(page_size_tokens=4, max_context_tokens=128, disaggregated=mode != "colocated",
                             transfer_timeout_s=5)
    async with anyio.create_task_group() as tg:
        serving = await start_serving(tg, tiny, mode, config, num_pages=64)
        canary = ReadinessCanary(serving.scheduler, tiny.tokenizer, serving.workers[0].runner.model,
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
        canary = ReadinessCanary(serving.scheduler, tiny.tokenizer, serving.workers[0].runner.model,
                                 interval_s=3600, timeout_s=10)
        assert await canary.check_once()
        canary.expected = [t + 1 for t in canary.expected or []]  # as if the path returned stale KV
        assert not await canary.check_once()
        assert "!= known" in canary.last_failure
        tg.cancel_scope.cancel()
