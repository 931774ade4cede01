"""FAILURES 8 with a real late write, through the scheduler: a NIXL data plane that holds a posted
WRITE for a while before it really posts it. The transfer times out and its cancellation cannot
be acknowledged (the write is still pending); both the decode pages it aims at and the prefill
pages it reads stay quarantined while the write may land; the write then lands for real (its
bytes reach the quarantined pages, nobody else's) and only then do the pages return."""

from __future__ import annotations

import importlib.util
import time
import anyio
import pytest
from nixl_planes import PlaneTransport, WrappedNixlPlane
from serving_harness import start_serving_over, wait_idle

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.onesided.data_plane import WriteState

pytestmark = [pytest.mark.anyio,
              pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")]

HOLD_S = 1.5  # how long the plane sits on a posted write before it really posts it


class _Held:
    def __init__(self, args: tuple, at: float) -> None:
        self.args, self.at, self.inner = args, at, None


class HoldingPlane(WrappedNixlPlane):
    """A real NIXL plane whose writes are posted `HOLD_S` late: PENDING until then, then the real
    write, polled as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[_Held] = []
        self.on_done = lambda: None  # called once, when a write is first seen DONE

    def post_write(self, peer: str, ranges: list[tuple[int, int, int]], notification: bytes) -> object:
        held = _Held((peer, ranges, notification), time.monotonic() + HOLD_S)
        self.held.append(held)
        return held

    def state(self, handle: object) -> WriteState:
        assert isinstance(handle, _Held)
        if handle.inner is None:
            if time.monotonic() < handle.at:
                return WriteState.PENDING
            handle.inner = self.inner.post_write(*handle.args)
        state = self.inner.state(handle.inner)
        if state is WriteState.DONE:
            self.on_done()
            self.on_done = lambda: None
        return state

    def release(self, handle: object) -> None:
        assert isinstance(handle, _Held) and handle.inner is not None
        self.inner.release(handle.inner)


async def test_a_write_that_lands_after_the_timeout_lands_in_quarantined_pages_then_they_return(
        tiny: Checkpoint) -> None:
    secret = DeploymentSecret.generate()
    plane = HoldingPlane()
    config = SchedulerConfig(page_size_tokens=4, max_context_tokens=64, chunk_tokens=16, disaggregated=True,
                             transfer_timeout_s=0.3)
    async with anyio.create_task_group() as tg:
        s = await start_serving_over(tg, tiny, config, 64, PlaneTransport(plane, secret, cancel_ack_timeout_s=0.2),
                                     PlaneTransport(WrappedNixlPlane(), secret, cancel_ack_timeout_s=0.2))
        handle = s.scheduler.submit([11, 12, 13, 14, 15, 16, 17, 18, 19],
                                    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        with anyio.fail_after(10):
            deltas = [d async for d in handle.deltas()]
        assert deltas[-1].error is not None and deltas[-1].error.code == "kv_transfer_failed"
        assert not any(d.token_ids for d in deltas)  # no token of a transfer that failed
        assert plane.held and plane.held[0].inner is None  # the write is still held: not yet posted
        decode, prefill = s.scheduler.ledger("decode"), s.scheduler.ledger("prefill")
        assert decode.num_quarantined == 3 and prefill.num_quarantined == 3  # both ends, while it may land
        (dst_lease,), (src_lease,) = decode.quarantined_leases(), prefill.quarantined_leases()
        dst = decode.quarantined_pages(dst_lease)
        # the source's full pages were sealed into the prefill cache once filled: the quarantined
        # lease still holds them (the write may still read them), ahead of its own last page
        src = prefill.shared_pages(src_lease) + prefill.quarantined_pages(src_lease)
        assert len(src) == len(dst) == 3 and all(prefill.is_sealed(p) for p in src[:2])
        landed: list[bool] = []

        def at_landing() -> None:  # synchronously, as the poller first sees the write DONE
            dst_pool, src_pool = s.workers[1].pool.data, s.workers[0].pool.data
            landed.append(bool((dst_pool[dst] == src_pool[src]).all()))
            landed.append(decode.is_quarantined(dst_lease) and prefill.is_quarantined(src_lease))

        plane.on_done = at_landing
        with anyio.fail_after(HOLD_S + 5):
            while decode.num_quarantined or prefill.num_quarantined:
                await anyio.sleep(0.02)
        # the late bytes really landed in the quarantined pages, and those came back only after
        assert landed == [True, True]
        await wait_idle(s.scheduler)
        await s.aclose()
        tg.cancel_scope.cancel()
