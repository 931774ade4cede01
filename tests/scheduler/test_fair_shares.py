"""Fair shares through the real scheduler and workers (tiny random Llama): one tenant's flood
takes only its share of the running slots that free up, the preemption victim is a request of the
group most over its share of decode pages, and a preempted request that has streamed output is
never timed out in the queue. Everything is counted (who started, who was preempted), never timed."""

from __future__ import annotations

import time

import anyio
import pytest
from serving_harness import start_serving, wait_idle

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.handle import RequestHandle
from kvfence.scheduler.core.lifecycle import State
from kvfence.scheduler.core.tenants import Tenant

PAGE = 4
FLOOD, OTHER = Tenant(name="flood"), Tenant(name="other")


def config(**kw: object) -> SchedulerConfig:
    base: dict[str, object] = dict(page_size_tokens=PAGE, max_context_tokens=96, max_running=2, max_queue=32,
                                   chunk_tokens=16, disaggregated=False)
    return SchedulerConfig(**{**base, **kw})  # type: ignore[arg-type]


async def first_tokens(handles: dict[str, RequestHandle], order: list[str]) -> None:
    """Read every stream; note each request's name in `order` when its first token arrives."""
    async def one(name: str, h: RequestHandle) -> None:
        seen = False
        async for d in h.deltas():
            if d.token_ids and not seen:
                seen = True
                order.append(name)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for name, h in handles.items():
                tg.start_soon(one, name, h)


@pytest.mark.anyio
async def test_a_flood_takes_only_its_share_of_the_slots_that_free_up(tiny: Checkpoint,
                                                                      task_group: anyio.abc.TaskGroup) -> None:
    """Two slots; one tenant queues ten requests, then another queues three. In arrival order the
    three would start after all ten; with fair shares each slot that frees goes to the tenant
    running fewer, so the three start among the first slots that free up."""
    serving = await start_serving(task_group, tiny, "colocated", config(), num_pages=128)
    s = serving.scheduler
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    handles = {f"flood{i}": s.submit([5 + i, 6, 7, 8], params, FLOOD) for i in range(10)}
    handles |= {f"other{i}": s.submit([9 + i, 10, 11], params, OTHER) for i in range(3)}
    order: list[str] = []
    await first_tokens(handles, order)
    last_other = max(order.index(f"other{i}") for i in range(3))
    floods_before = sum(1 for name in order[:last_other] if name.startswith("flood"))
    assert floods_before <= 2 + 3, order  # the two running at first, then one for each of the other's (FIFO: 10)
    await wait_idle(s)
    await serving.aclose()


@pytest.mark.anyio
async def test_the_preemption_victim_is_of_the_group_most_over_its_share(tiny: Checkpoint,
                                                                         task_group: anyio.abc.TaskGroup) -> None:
    """A pool too small for everyone: the flooding tenant's requests hold most of it, so when it
    runs out they are preempted, never the other tenant's one, even though it arrived last and
    the newest is what would be taken in arrival order."""
    serving = await start_serving(task_group, tiny, "colocated", config(max_running=8), num_pages=24)
    s = serving.scheduler
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    handles = {f"flood{i}": s.submit([5 + i, 6, 7, 8], params, FLOOD) for i in range(4)}
    other = s.submit([9, 10, 11], params, OTHER)
    reqs = {name: s.core.request(h.request_id) for name, h in handles.items()}
    mine = s.core.request(other.request_id)
    assert mine is not None and all(r is not None for r in reqs.values())
    handles["other"] = other
    await first_tokens(handles, [])
    assert sum(r.preemptions for r in reqs.values() if r is not None) > 0  # the pool did run out
    assert mine.preemptions == 0 and mine.state is State.FINISHED
    await wait_idle(s)
    await serving.aclose()


@pytest.mark.anyio
async def test_a_preempted_request_with_output_keeps_its_place_past_the_queue_deadline(
        tiny: Checkpoint, task_group: anyio.abc.TaskGroup) -> None:
    """A queue deadline far shorter than the wait for pages: requests that have streamed output
    are preempted and wait in the queue longer than it, and all of them still finish."""
    serving = await start_serving(task_group, tiny, "colocated", config(max_running=8, queue_timeout_s=1.0),
                                  num_pages=24)
    s = serving.scheduler
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    handles = [s.submit([5 + i, 6, 7, 8], params) for i in range(4)]
    reqs = [s.core.request(h.request_id) for h in handles]
    ends: list[str | None] = []

    async def read(h: RequestHandle) -> None:
        async for d in h.deltas():
            if d.terminal:
                ends.append(d.error.code if d.error else d.finish_reason)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for h in handles:
                tg.start_soon(read, h)
            while s.in_flight():
                s.tick(time.monotonic() + 3600)  # far past every queue deadline, as often as we can
                await anyio.sleep(0.005)
    assert sum(r.preemptions for r in reqs if r is not None) > 0
    assert ends == ["length"] * 4
    await wait_idle(s)
    await serving.aclose()


@pytest.mark.anyio
async def test_a_tenant_under_its_share_gets_a_slot_as_soon_as_it_asks(tiny: Checkpoint,
                                                                       task_group: anyio.abc.TaskGroup) -> None:
    """Every running slot is the flood's, on long requests: the other tenant's request does not
    wait for one of them to end; the newest flood request gives up its slot (preempted, to resume
    later where it stopped), and the other's first token comes before any flood request ends."""
    serving = await start_serving(task_group, tiny, "colocated", config(max_running=2), num_pages=128)
    s = serving.scheduler
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    handles = {f"flood{i}": s.submit([5 + i, 6, 7, 8], long, FLOOD) for i in range(3)}
    floods = [s.core.request(h.request_id) for h in handles.values()]
    with anyio.fail_after(30):
        while sum(1 for r in floods if r is not None and r.num_generated > 0) < 2:
            await anyio.sleep(0.001)
    handles["other"] = s.submit([9, 10, 11], SamplingParams(temperature=0, max_tokens=4), OTHER)
    events: list[str] = []

    async def read(name: str, h: RequestHandle) -> None:
        async for d in h.deltas():
            if d.token_ids and name == "other" and "other first token" not in events:
                events.append("other first token")
            if d.terminal:
                events.append(f"{name} {d.error.code if d.error else d.finish_reason}")

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for name, h in handles.items():
                tg.start_soon(read, name, h)
    assert events[0] == "other first token", events
    assert sorted(events[1:]) == ["flood0 length", "flood1 length", "flood2 length", "other length"]
    assert sum(r.preemptions for r in floods if r is not None) >= 1
    await wait_idle(s)
    await serving.aclose()


@pytest.mark.anyio
async def test_a_short_prompt_is_not_held_up_behind_another_tenants_long_prefills(
        tiny: Checkpoint, task_group: anyio.abc.TaskGroup) -> None:
    """Prefill chunks of 16 tokens: the flood's two 80-token prompts take five steps each; the
    other tenant's 3-token prompt, submitted after them, gets its first token first (each group's
    first prefill goes before any group's second, the shortest first among them)."""
    serving = await start_serving(task_group, tiny, "colocated", config(max_running=8), num_pages=128)
    s = serving.scheduler
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    handles = {f"flood{i}": s.submit([5 + i] + list(range(10, 89)), params, FLOOD) for i in range(2)}
    handles["other"] = s.submit([9, 10, 11], params, OTHER)
    order: list[str] = []
    await first_tokens(handles, order)
    assert order[0] == "other", order
    await wait_idle(s)
    await serving.aclose()
