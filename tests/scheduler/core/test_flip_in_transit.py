"""FAILURES 20 on the production digest path, through the scheduler: one byte of a page is
changed after the sender computed its digest — before its record is sealed (a relay holding the
keys changes the plaintext and seals it again) or in the source memory a one-sided WRITE is
reading (a NIXL plane that flips it at post time) — and the receiver's digest over what landed
catches it: the request fails closed with no token, and the next request is served exactly. A
byte flipped on the wire itself breaks the seal instead: the connection is dropped, the request
fails the same way, and the next push pairs again."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from contextlib import ExitStack

import anyio
import pytest
import torch
from nixl_planes import PlaneTransport, WrappedNixlPlane
from serving_harness import start_serving_over, wait_idle
from front_keys import FRONT
from tamper_relay import ALTER, TO_LISTENER, TamperingRelay, frame_namer, keylog_in_use

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.transports.base import EndpointInfo
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.onesided.data_plane import WriteState
from kvfence.transports.tcp.transport import TcpTransport
from kvfence.transports.tcp.wire import Frame

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("keylog")]
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
CONFIG = SchedulerConfig(page_size_tokens=4, max_context_tokens=64, chunk_tokens=16, disaggregated=True,
                         transfer_timeout_s=5)


async def outcome(scheduler, prompt=PROMPT):  # type: ignore[no-untyped-def]
    ids, last = [], None
    async for d in scheduler.submit(prompt, GREEDY).deltas():
        ids += d.token_ids
        last = d
    return ids, last.finish_reason, last.error.code if last.error else None


def naming_pushes() -> Callable[[bytes], str]:
    """Names records as frame_namer does, plus which push (counted by headers) they belong to."""
    frame_name, pushes = frame_namer(Frame), 0

    def name_of(plain: bytes) -> str:
        nonlocal pushes
        name = frame_name(plain)
        pushes += name == "PushHeader"
        return f"{name} of push {pushes}"
    return name_of


async def serve_through_relay(tiny: Checkpoint, op: str) -> tuple[tuple, TamperingRelay]:
    """Serve three requests with the KV path through a relay that does `op` to the first page
    record of the second push; (the second's outcome, the relay), the third checked against the
    first (the pair carries on)."""
    secret = DeploymentSecret.generate()
    sender, receiver = (TcpTransport(secret=secret, front_key=FRONT.public),
                        TcpTransport(secret=secret, front_key=FRONT.public))
    routes: list[TamperingRelay] = []
    async with anyio.create_task_group() as tg:
        with ExitStack() as relays:
            async def via_relay(info: EndpointInfo) -> EndpointInfo:
                routes.append(relays.enter_context(TamperingRelay(info.address, keylog_in_use(), "tcp", naming_pushes(),
                                                                  "page bytes of push 2", op, TO_LISTENER)))
                return EndpointInfo(info.transport, routes[-1].address, info.record)

            s = await start_serving_over(tg, tiny, CONFIG, 64, sender, receiver, route=via_relay)
            want, reason, error = await outcome(s.scheduler)
            assert (reason, error) == ("length", None) and len(want) == 4
            with anyio.fail_after(10):
                second = await outcome(s.scheduler)
                assert await outcome(s.scheduler) == (want, "length", None)
            await wait_idle(s.scheduler)
            await s.aclose()
            tg.cancel_scope.cancel()
    return second, routes[0]


async def test_a_byte_changed_between_digest_and_seal_is_caught_by_the_receivers_digest(tiny: Checkpoint) -> None:
    second, relay = await serve_through_relay(tiny, ALTER)
    assert second == ([], None, "kv_transfer_failed")  # no token, never `length`
    assert relay.tampered.is_set()


async def test_a_byte_flipped_on_the_wire_breaks_the_seal_and_the_pair_is_re_paired(
        tiny: Checkpoint, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    second, relay = await serve_through_relay(tiny, "flip")
    assert second == ([], None, "kv_transfer_failed")
    assert relay.tampered.is_set()
    assert any("failed authentication" in r.getMessage() and relay.upstream_local in r.getMessage()
               for r in caplog.records)
    assert any("re-paired tcp peer" in r.getMessage() for r in caplog.records)


class FlippingPlane(WrappedNixlPlane):
    """A real NIXL plane that flips one byte of the source range of its `flip_write`-th write
    right as it posts it (after the sender's digests were computed), restoring it once DONE."""

    def __init__(self, flip_write: int) -> None:
        super().__init__()
        self.flip_write, self.posts, self.flipped = flip_write, 0, 0
        self.memory: torch.Tensor | None = None
        self.restore: dict[int, int] = {}  # id(handle) -> offset to flip back

    def open(self, memory: torch.Tensor) -> bytes:
        self.memory = memory.reshape(-1).view(torch.uint8)
        return super().open(memory)

    def post_write(self, peer: str, ranges: list[tuple[int, int, int]], notification: bytes) -> object:
        assert self.memory is not None
        self.posts += 1
        offset = None
        if self.posts == self.flip_write:
            offset = ranges[0][0] + ranges[0][2] // 3
            self.memory[offset] ^= 1
            self.flipped += 1
        handle = super().post_write(peer, ranges, notification)
        if offset is not None:
            self.restore[id(handle)] = offset
        return handle

    def state(self, handle: object) -> WriteState:
        state = super().state(handle)
        if state is not WriteState.PENDING and (offset := self.restore.pop(id(handle), None)) is not None:
            assert self.memory is not None
            self.memory[offset] ^= 1
        return state


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")
async def test_a_byte_flipped_under_a_one_sided_write_is_caught_by_the_receivers_digest(tiny: Checkpoint) -> None:
    secret = DeploymentSecret.generate()
    plane = FlippingPlane(flip_write=2)
    async with anyio.create_task_group() as tg:
        s = await start_serving_over(tg, tiny, CONFIG, 64, PlaneTransport(plane, secret),
                                     PlaneTransport(WrappedNixlPlane(), secret))
        want, reason, error = await outcome(s.scheduler)
        assert (reason, error) == ("length", None) and len(want) == 4
        with anyio.fail_after(10):
            assert await outcome(s.scheduler) == ([], None, "kv_transfer_failed")
        assert plane.flipped == 1
        assert await outcome(s.scheduler) == (want, "length", None)
        await wait_idle(s.scheduler)
        await s.aclose()
        tg.cancel_scope.cancel()
