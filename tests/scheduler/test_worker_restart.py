"""A worker restarts (a new incarnation, blank pool): requests bound to the old incarnation fail
with 503 `worker_restarted`, requests that no longer need that worker carry on, new requests are
served exactly, and no step built for the old incarnation is applied by the new one (FAILURES 19)."""

from __future__ import annotations

import anyio
import pytest
import torch
from serving_harness import Serving, start_serving, until_transferring, wait_idle

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.handle import RequestHandle
from kvfence.engine.protocol import PageGrant, RunStep, SeqStep, StepDone, StepFailed

pytestmark = pytest.mark.anyio
LONG = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPT = [21, 22, 23, 24, 25, 26, 27]


async def serve(tg: anyio.abc.TaskGroup, tiny: Checkpoint, mode: str, faults: str = "") -> Serving:
    config = SchedulerConfig(page_size_tokens=4, max_context_tokens=96, chunk_tokens=16,
                             disaggregated=mode != "colocated", transfer_timeout_s=5, heartbeat_s=0.1)
    return await start_serving(tg, tiny, mode, config, num_pages=64, faults=faults)


async def rest(handle: RequestHandle, restart_after: int = 0, channel: object = None,
               ) -> tuple[list[int], str | None, int | None, str | None]:
    """The whole stream: ids, finish_reason, error status and code; restarts `channel`'s worker
    once `restart_after` tokens were seen (0: never)."""
    ids: list[int] = []
    async for d in handle.deltas():
        ids += d.token_ids
        if restart_after and len(ids) >= restart_after:
            restart_after = 0
            await channel.restart()  # type: ignore[attr-defined]
        if d.finish_reason or d.error:
            return ids, d.finish_reason, d.error.status if d.error else None, d.error.code if d.error else None
    return ids, None, None, None


@pytest.mark.parametrize("mode", ["colocated", "tcp", "inprocess"])
async def test_decode_side_restart_fails_its_requests_with_503_and_new_ones_are_served(
        tiny: Checkpoint, mode: str) -> None:
    async with anyio.create_task_group() as tg:
        s = await serve(tg, tiny, mode)
        sched = s.scheduler
        want, _, _, _ = await rest(sched.submit(PROMPT, SHORT))
        await wait_idle(s.scheduler)
        # restart the decode (or the only) worker after 3 tokens
        ids, reason, status, code = await rest(sched.submit(PROMPT * 2, LONG), 3, sched.decode_channel)
        assert (reason, status, code) == (None, 503, "worker_restarted")  # never `length` with a 200
        assert 3 <= len(ids) < 60
        assert sched.metrics.worker_restarts.labels(sched.decode_channel.role)._value.get() == 1
        await wait_idle(s.scheduler)
        # The new incarnation serves new requests exactly.
        with anyio.fail_after(30):
            ids, reason, status, _ = await rest(sched.submit(PROMPT, SHORT))
        assert (ids, reason, status) == (want, "length", None)
        await wait_idle(s.scheduler)
        await s.aclose()
        tg.cancel_scope.cancel()


async def test_prefill_restart_spares_requests_that_already_moved_to_decode(tiny: Checkpoint) -> None:
    async with anyio.create_task_group() as tg:
        s = await serve(tg, tiny, "tcp")
        sched = s.scheduler
        want, _, _, _ = await rest(sched.submit(PROMPT * 2, LONG))
        await wait_idle(s.scheduler)
        # restarted once decoding, when it holds decode pages only
        ids, reason, status, _ = await rest(sched.submit(PROMPT * 2, LONG), 2, sched.prefill_channel)
        assert (ids, reason, status) == (want, "length", None)
        with anyio.fail_after(5):
            while not sched.metrics.worker_restarts.labels("prefill")._value.get():
                await anyio.sleep(0.02)  # the heartbeat notices
        ids, reason, _, _ = await rest(sched.submit(PROMPT * 2, LONG))
        assert (ids, reason) == (want, "length")
        await wait_idle(s.scheduler)
        await s.aclose()
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("mode", ["tcp", "inprocess"])
async def test_a_decode_restart_while_its_transfer_is_in_flight_fails_it_with_503(tiny: Checkpoint, mode: str) -> None:
    """FAILURES 13 and 19: the decode worker restarts while the KV of a request is on its way to
    it: that request ends with 503 `worker_restarted` once the transfer is quiet (no token, never
    `length`), its pages come back, and the next request is served exactly."""
    async with anyio.create_task_group() as tg:
        s = await serve(tg, tiny, mode, faults="delay=1#2")  # the second push takes a second
        sched = s.scheduler
        want, _, _, _ = await rest(sched.submit(PROMPT, SHORT))
        handle = sched.submit(PROMPT, SHORT)
        await until_transferring(sched)
        await sched.decode_channel.restart()
        with anyio.fail_after(10):
            assert await rest(handle) == ([], None, 503, "worker_restarted")
        await wait_idle(sched)
        assert await rest(sched.submit(PROMPT, SHORT)) == (want, "length", None, None)
        await wait_idle(sched)
        await s.aclose()
        tg.cancel_scope.cancel()


def test_a_step_for_the_old_incarnation_is_refused_unapplied(tiny: Checkpoint) -> None:
    from serving_harness import make_worker

    w = make_worker(tiny, "decode", 8, 4)
    old = w.incarnation
    w.restart()
    lease = 5 << 64 | 3
    step = RunStep(step_id=1, seqs=[SeqStep(lease=lease, token_ids=[1, 2, 3], context_tokens=0, new_pages=[0],
                                            sampling=SamplingParams(temperature=0))],
                   grants=[PageGrant(lease, [0])], incarnation=old)
    before = w.pool.data.clone()
    reply = w.execute(step)
    assert isinstance(reply, StepFailed) and reply.stale_incarnation and reply.incarnation == w.incarnation
    assert w.pool.owner(0) == 0 and torch.equal(w.pool.data, before)  # nothing applied, nothing written
    ok = w.execute(RunStep(step_id=2, seqs=step.seqs, grants=step.grants, incarnation=w.incarnation))
    assert isinstance(ok, StepDone) and ok.tokens[0] is not None and ok.incarnation == w.incarnation
