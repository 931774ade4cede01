"""FAILURES.md through the real scheduler, workers and transports, with faults injected on the
sending side: every request ends within a bounded time, a failed transfer is an error (never
`length` or `stop`), no token of it is sent, other requests are undisturbed, and the pools return
to their baseline."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
from serving_harness import Serving, start_serving

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.config import SchedulerConfig
from kvfence.scheduler.handle import RequestHandle

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]


async def outcome(handle: RequestHandle) -> tuple[list[int], str | None, str | None]:
    ids: list[int] = []
    async for d in handle.deltas():
        ids += d.token_ids
        if d.finish_reason or d.error:
            return ids, d.finish_reason, d.error.code if d.error else None
    return ids, None, None


@pytest.fixture(params=["tcp", "inprocess"])
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


async def serve(tg: anyio.abc.TaskGroup, tiny: Checkpoint, transport: str, faults: str) -> Serving:
    config = SchedulerConfig(page_size_tokens=4, max_context_tokens=64, chunk_tokens=16, disaggregated=True,
                             transfer_timeout_s=0.5)
    return await start_serving(tg, tiny, transport, config, num_pages=64, faults=faults)


async def idle(s: Serving) -> None:
    with anyio.fail_after(10):
        while s.scheduler.in_flight():
            await anyio.sleep(0.01)
    assert all(n == 0 for n in s.scheduler.pages_in_use().values()), s.scheduler.pages_in_use()


@pytest.mark.anyio
@pytest.mark.parametrize("fault", ["corrupt", "truncate", "drop", "fail_post", "delay=2"])
async def test_failed_transfer_fails_closed_and_the_next_request_is_served(
        tiny: Checkpoint, transport: str, fault: str) -> None:
    async with anyio.create_task_group() as tg:
        s = await serve(tg, tiny, transport, f"{fault}#2")  # only the second push is hit
        want, reason, error = await outcome(s.scheduler.submit(PROMPT, GREEDY))
        assert (reason, error) == ("length", None) and len(want) == 6
        await idle(s)
        with anyio.fail_after(10):  # bounded: the transfer timeout is 0.5 s
            ids, reason, error = await outcome(s.scheduler.submit(PROMPT, GREEDY))
        assert ids == [] and reason is None and error == "kv_transfer_failed"  # no token, no `length`
        await idle(s)
        ids, reason, error = await outcome(s.scheduler.submit(PROMPT, GREEDY))
        assert (ids, reason, error) == (want, "length", None)  # the pair is not poisoned
        await idle(s)
        await s.aclose()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_client_gone_during_a_slow_transfer(tiny: Checkpoint, transport: str) -> None:
    """Abort while the transfer is in flight: the transfer is not torn down, the request ends
    aborted (never `length`), and every page comes back once the transfer is quiet."""
    async with anyio.create_task_group() as tg:
        s = await serve(tg, tiny, transport, "delay=0.3")
        handle = s.scheduler.submit(PROMPT, GREEDY)
        with anyio.fail_after(5):
            while not s.scheduler.transferring:
                await anyio.sleep(0.005)
        handle.abort()
        ids, reason, error = await outcome(handle)
        assert reason is None and error == "client_closed" and ids == []
        await idle(s)
        await s.aclose()
        tg.cancel_scope.cancel()
