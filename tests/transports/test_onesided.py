"""The one-sided protocol (transports/onesided/) over a fake data plane whose writes stay PENDING
until the test lands or fails them: when a cancel is acknowledged, what a failed write tells the
receiver, that refused pushes post nothing, the "landed" path of planes without notifications,
and an idle poller; which pages a receiver exposes to writes, and when. The NIXL plane itself is
tested for real in test_nixl_plane.py, and the transport end to end by the conformance suites
(kind "nixl")."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import ClassVar

import anyio
import pytest
import torch
from transport_harness import TEST_FRONT, TEST_SECRET, make_manifest, make_record, page_bytes, signed

from kvfence.transports.base import Peer, TransferManifest, TransferResult, TransportUnavailable
from kvfence.transports.onesided.data_plane import DataPlane, WriteState
from kvfence.transports.onesided.link import write_chunks
from kvfence.transports.onesided.transport import OneSidedTransport

pytestmark = pytest.mark.anyio
PAGE = 4096  # bytes: pages of 1024 float32


class FakeWrite:
    def __init__(self, src: str, dst: str, ranges: list[tuple[int, int, int]], note: bytes) -> None:
        self.src, self.dst, self.ranges, self.note = src, dst, ranges, note
        self.state = WriteState.PENDING


class Fabric:
    """Where fake planes meet. `hold`: posted writes stay PENDING until `land` / `fail`."""

    def __init__(self) -> None:
        self.pools: dict[str, torch.Tensor] = {}  # flat uint8 views, by plane key
        self.notes: dict[str, list[tuple[str, bytes]]] = {}
        self.writes: list[FakeWrite] = []
        self.hold = False
        self.fail_post = False
        self.exposed: dict[str, list[tuple[int, int]]] = {}  # byte ranges peers may write now, by plane key
        self.refuse_expose = False

    def land(self, write: FakeWrite) -> None:
        for src, dst, nbytes in write.ranges:
            self.pools[write.dst][dst:dst + nbytes] = self.pools[write.src][src:src + nbytes]
        write.state = WriteState.DONE
        if write.note:
            self.notes[write.dst].append((write.src, write.note))

    def fail(self, write: FakeWrite) -> None:
        write.state = WriteState.FAILED


class FakePlane(DataPlane):
    name: ClassVar[str] = "fake"
    delivers_notifications: ClassVar[bool] = True

    def __init__(self, fabric: Fabric) -> None:
        self.fabric, self.key, self.polls, self.closed = fabric, "", 0, False

    def open(self, memory: torch.Tensor) -> bytes:
        self.key = f"plane-{len(self.fabric.pools)}"
        self.fabric.pools[self.key] = memory.reshape(-1).view(torch.uint8)
        self.fabric.notes[self.key] = []
        return self.key.encode()

    def expose(self, ranges: list[tuple[int, int]]) -> object:
        if self.fabric.refuse_expose:
            raise RuntimeError("injected expose failure")
        exposure = list(ranges)
        self.fabric.exposed.setdefault(self.key, []).extend(exposure)
        return exposure

    def conceal(self, exposure: object) -> None:
        assert isinstance(exposure, list)
        mine = self.fabric.exposed.get(self.key, [])
        for r in exposure:
            if r in mine:
                mine.remove(r)

    def connect(self, descriptor: bytes) -> str:
        return descriptor.decode()

    def post_write(self, peer: str, ranges: list[tuple[int, int, int]], notification: bytes) -> object:
        if self.fabric.fail_post:
            raise RuntimeError("injected post failure")
        write = FakeWrite(self.key, peer, ranges, notification if self.delivers_notifications else b"")
        self.fabric.writes.append(write)
        if not self.fabric.hold:
            self.fabric.land(write)
        return write

    def state(self, handle: object) -> WriteState:
        self.polls += 1
        assert isinstance(handle, FakeWrite)
        return handle.state

    def release(self, handle: object) -> None:
        assert isinstance(handle, FakeWrite) and handle.state is not WriteState.PENDING

    def notifications(self) -> list[tuple[str, bytes]]:
        self.polls += 1
        notes, self.fabric.notes[self.key] = self.fabric.notes[self.key], []
        return notes

    def close(self) -> None:
        self.closed = True


class SilentPlane(FakePlane):
    delivers_notifications: ClassVar[bool] = False


class FakeTransport(OneSidedTransport):
    name: ClassVar[str] = "fake"


@dataclass
class Pair:
    fabric: Fabric
    tx: FakeTransport
    rx: FakeTransport
    src: torch.Tensor
    dst: torch.Tensor
    peer: Peer

    def push_soon(self, tg: anyio.abc.TaskGroup, manifest: TransferManifest, pages: list[int],
                  results: dict[str, TransferResult]) -> None:
        manifest = signed(manifest, pages, self.rx.info)
        self.rx.expect(manifest, pages)

        async def run() -> None:
            results["push"] = await self.tx.push(self.peer, manifest, pages, pages)

        tg.start_soon(run)


@asynccontextmanager
async def fake_pair(plane: type[FakePlane] = FakePlane, **options: object) -> AsyncIterator[Pair]:
    """Sender and receiver over 8-page pools; one page per write unless `options` say otherwise."""
    fabric = Fabric()
    options = {"write_chunk_bytes": PAGE, "cancel_ack_timeout_s": 2.0, "secret": TEST_SECRET,
               "front_key": TEST_FRONT.public, **options}
    src, dst = torch.randn(8, 1024), torch.zeros(8, 1024)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tx = FakeTransport(plane(fabric), **options)  # type: ignore[arg-type]
            rx = FakeTransport(plane(fabric), **options)  # type: ignore[arg-type]
            try:
                rx_info = await rx.start(tg, dst, make_record())
                await tx.start(tg, src, make_record())
                yield Pair(fabric, tx, rx, src, dst, await tx.pair(rx_info))
            finally:
                for write in fabric.writes:  # let nothing wait for a held write on the way out
                    if write.state is WriteState.PENDING:
                        fabric.fail(write)
                await tx.aclose()
                await rx.aclose()


def cancel_soon(tg: anyio.abc.TaskGroup, endpoint: FakeTransport, transfer_id: str, acks: list[bool]) -> None:
    """Cancel `transfer_id` on `endpoint` in a task; its acknowledgement is appended to `acks`."""

    async def cancel() -> None:
        acks.append(await endpoint.cancel(transfer_id))

    tg.start_soon(cancel)


async def posted(fabric: Fabric, count: int) -> list[FakeWrite]:
    with anyio.fail_after(5):
        while len(fabric.writes) < count:
            await anyio.sleep(0.001)
    return fabric.writes


async def test_receiver_cancel_after_go_is_acknowledged_only_once_the_write_is_terminal() -> None:
    async with fake_pair() as p:
        p.fabric.hold = True
        manifest, results, acks = make_manifest(4), {}, []
        async with anyio.create_task_group() as tg:
            p.push_soon(tg, manifest, [0, 1, 2, 3], results)
            [first] = await posted(p.fabric, 1)

            cancel_soon(tg, p.rx, manifest.transfer_id, acks)
            await anyio.sleep(0.1)
            assert acks == []  # the write in flight could still land
            assert (await p.rx.completion(manifest.transfer_id)).reason == "cancelled"  # settled at once
            p.fabric.land(first)
        assert acks == [True]
        assert len(p.fabric.writes) == 1  # the sender stopped: no second write was posted
        assert results["push"].reason == "cancelled"
        assert not page_bytes(p.dst, 1).any()


async def test_an_unconfirmed_receiver_cancel_returns_false_after_the_timeout() -> None:
    async with fake_pair(cancel_ack_timeout_s=0.2) as p:
        p.fabric.hold = True
        manifest, results = make_manifest(2), {}
        async with anyio.create_task_group() as tg:
            p.push_soon(tg, manifest, [0, 1], results)
            await posted(p.fabric, 1)
            start = anyio.current_time()
            assert await p.rx.cancel(manifest.transfer_id) is False  # the write never ended
            assert anyio.current_time() - start >= 0.2
            p.fabric.fail(p.fabric.writes[0])
        assert results["push"].reason == "cancelled"


@pytest.mark.parametrize("confirmed", [True, False])
async def test_sender_cancel_waits_for_the_write_in_flight(confirmed: bool) -> None:
    async with fake_pair(cancel_ack_timeout_s=0.3) as p:
        p.fabric.hold = True
        manifest, results, acks = make_manifest(3), {}, []
        async with anyio.create_task_group() as tg:
            p.push_soon(tg, manifest, [0, 1, 2], results)
            [first] = await posted(p.fabric, 1)

            cancel_soon(tg, p.tx, manifest.transfer_id, acks)
            await anyio.sleep(0.1)
            assert acks == []  # the write in flight still reads the source pages
            if confirmed:
                p.fabric.land(first)
            else:
                with anyio.fail_after(5):
                    while not acks:
                        await anyio.sleep(0.01)
                assert acks == [False]  # the timeout passed with the write still in flight
                p.fabric.fail(first)
        assert acks == [confirmed]
        assert results["push"].reason == "cancelled"
        assert len(p.fabric.writes) == 1
        assert (await p.rx.completion(manifest.transfer_id)).reason == "cancelled"


@pytest.mark.parametrize("how", ["failed_write", "failed_post"])
async def test_a_failed_write_fails_both_sides_at_once(how: str) -> None:
    async with fake_pair() as p:
        manifest, results = make_manifest(3), {}
        p.fabric.hold = how == "failed_write"
        p.fabric.fail_post = how == "failed_post"
        async with anyio.create_task_group() as tg:
            p.push_soon(tg, manifest, [0, 1, 2], results)
            if how == "failed_write":
                p.fabric.fail((await posted(p.fabric, 1))[0])
            with anyio.fail_after(2):  # the receiver hears of it without waiting for any timeout
                verdict = await p.rx.completion(manifest.transfer_id)
        assert (verdict.ok, verdict.reason) == (False, "write_failed")
        assert (results["push"].ok, results["push"].reason) == (False, "write_failed")
        assert len(p.fabric.writes) == (1 if how == "failed_write" else 0)


async def test_a_failed_handle_is_not_acknowledged_until_every_handle_is_terminal() -> None:
    """FAILURES 7: a transfer in several handles (one per page here). The sender posts a handle only
    once the previous one is terminal, so a failed handle never has a sibling still writing; a
    cancel asked while a handle is in flight is acknowledged only when it is terminal, and nothing
    after a failed handle is posted."""
    async with fake_pair() as p:
        p.fabric.hold = True
        manifest, results, acks = make_manifest(4), {}, []
        async with anyio.create_task_group() as tg:
            p.push_soon(tg, manifest, [0, 1, 2, 3], results)
            [first] = await posted(p.fabric, 1)
            p.fabric.land(first)
            second = (await posted(p.fabric, 2))[1]
            assert second.state is WriteState.PENDING

            cancel_soon(tg, p.rx, manifest.transfer_id, acks)
            await anyio.sleep(0.1)
            assert acks == []  # the second handle could still write
            p.fabric.fail(second)
        assert acks == [True]
        assert len(p.fabric.writes) == 2  # nothing after the failed handle
        assert not results["push"].ok
        assert torch.equal(page_bytes(p.dst, 0), page_bytes(p.src, 0))  # the first handle's page landed
        assert not page_bytes(p.dst, 2).any() and not page_bytes(p.dst, 3).any()


async def test_a_refused_push_posts_no_write() -> None:
    async with fake_pair() as p:
        # validly signed but never expected, then not even signed: refused either way, nothing written
        result = await p.tx.push(p.peer, signed(make_manifest(2), [0, 1], p.rx.info), [0, 1], [0, 1])
        assert (result.ok, result.reason) == (False, "unexpected_transfer")
        result = await p.tx.push(p.peer, make_manifest(2), [0, 1], [0, 1])
        assert (result.ok, result.reason) == (False, "capability")
        assert p.fabric.writes == [] and not p.dst.any()


def exposed_pages(p: Pair) -> list[int]:
    return sorted(off // PAGE + i for off, n in p.fabric.exposed.get(p.rx.plane.key, []) for i in range(n // PAGE))


@pytest.mark.parametrize("end", ["landed", "failed_write", "sender_cancelled"])
async def test_a_push_exposes_its_dst_pages_from_go_until_it_ends(end: str) -> None:
    """The receiver exposes exactly a push's dst pages, and only from its "go" until the push
    ends, however it ends: nothing else of the pool is ever writable by a peer's plane."""
    async with fake_pair() as p:
        p.fabric.hold = True
        manifest, results, acks = make_manifest(2), {}, []
        assert exposed_pages(p) == []
        async with anyio.create_task_group() as tg:
            p.push_soon(tg, manifest, [5, 2], results)
            [first] = await posted(p.fabric, 1)
            assert exposed_pages(p) == [2, 5]
            if end == "sender_cancelled":
                cancel_soon(tg, p.tx, manifest.transfer_id, acks)
                await anyio.sleep(0.05)
                p.fabric.land(first)
            elif end == "failed_write":
                p.fabric.fail(first)
            else:
                p.fabric.land(first)
                p.fabric.land((await posted(p.fabric, 2))[1])
            with anyio.fail_after(2):
                verdict = await p.rx.completion(manifest.transfer_id)
        assert verdict.ok is (end == "landed")
        assert exposed_pages(p) == []


async def test_a_plane_that_cannot_expose_the_pages_refuses_the_push() -> None:
    async with fake_pair() as p:
        p.fabric.refuse_expose = True
        manifest, results = make_manifest(2), {}
        async with anyio.create_task_group() as tg:
            p.push_soon(tg, manifest, [0, 1], results)
        assert (results["push"].ok, results["push"].reason) == (False, "plane_refused")
        assert (await p.rx.completion(manifest.transfer_id)).reason == "plane_refused"
        assert p.fabric.writes == [] and not p.dst.any()
        p.fabric.refuse_expose = False  # the endpoint still serves the next push
        manifest = make_manifest(1)
        async with anyio.create_task_group() as tg:
            p.push_soon(tg, manifest, [3], results)
        assert results["push"].ok, results["push"]


async def test_a_plane_without_notifications_is_told_after_the_last_write_is_done() -> None:
    async with fake_pair(SilentPlane) as p:
        p.fabric.hold = True
        manifest, results = make_manifest(2), {}
        async with anyio.create_task_group() as tg:
            p.push_soon(tg, manifest, [0, 1], results)
            p.fabric.land((await posted(p.fabric, 1))[0])
            last = (await posted(p.fabric, 2))[1]
            with anyio.move_on_after(0.1) as scope:  # posted, not DONE: the receiver must not judge yet
                await p.rx.completion(manifest.transfer_id)
            assert scope.cancelled_caught
            p.fabric.land(last)
        assert results["push"].ok, results["push"]
        assert torch.equal(p.dst[:2], p.src[:2])
        assert all(not w.note for w in p.fabric.writes)


async def test_the_notification_rides_on_the_last_write_only() -> None:
    async with fake_pair() as p:
        manifest, results = make_manifest(3), {}
        async with anyio.create_task_group() as tg:
            p.push_soon(tg, manifest, [5, 6, 7], results)
        assert results["push"].ok, results["push"]
        assert [w.note for w in p.fabric.writes] == [b"", b"", manifest.transfer_id.encode()]


async def test_the_poller_sleeps_when_nothing_is_in_flight() -> None:
    async with fake_pair() as p:
        manifest, results = make_manifest(2), {}
        async with anyio.create_task_group() as tg:
            p.push_soon(tg, manifest, [0, 1], results)
        assert results["push"].ok
        await anyio.sleep(0.01)
        polls = p.tx.plane.polls + p.rx.plane.polls  # type: ignore[attr-defined]
        await anyio.sleep(0.2)
        assert p.tx.plane.polls + p.rx.plane.polls == polls  # type: ignore[attr-defined]


async def push_cancelled_mid_write(p: Pair, pages: list[int]) -> TransferManifest:
    """A push whose task is cancelled while its (held) write is still pending; returns once the
    push gave up on it (after `cancel_ack_timeout_s`)."""
    p.fabric.hold = True
    manifest, scope = signed(make_manifest(len(pages)), pages, p.rx.info), anyio.CancelScope()
    p.rx.expect(manifest, pages)

    async def push() -> None:
        with scope:
            await p.tx.push(p.peer, manifest, pages, pages)

    async with anyio.create_task_group() as tg:
        tg.start_soon(push)
        await posted(p.fabric, 1)
        scope.cancel()
    return manifest


async def quiet_while(p: Pair, transfer_id: str, meanwhile: Callable[[], Awaitable[None]]) -> list[bool]:
    """What the sender's `wait_quiet` says, if anything, by the time `meanwhile` has run."""
    quiet: list[bool] = []
    async with anyio.create_task_group() as tg:
        async def wait() -> None:
            quiet.append(await p.tx.wait_quiet(transfer_id))

        tg.start_soon(wait)
        await anyio.sleep(0.05)
        assert quiet == []  # not before the write is terminal
        await meanwhile()
    return quiet


async def test_a_cancelled_push_task_whose_write_never_ends_drops_the_pair() -> None:
    async with fake_pair(cancel_ack_timeout_s=0.2) as p:
        manifest = await push_cancelled_mid_write(p, [0, 1])
        assert (await p.rx.completion(manifest.transfer_id)).reason == "peer_lost"
        assert not await p.tx.health()
        # the push has returned, but its write is still pending: neither end may acknowledge a
        # cancel (FAILURES 8, 9), and the sender learns when the write is terminal
        assert await p.tx.cancel(manifest.transfer_id) is False
        assert await p.rx.cancel(manifest.transfer_id) is False
        assert await p.rx.wait_quiet(manifest.transfer_id) is False  # the receiver cannot know it

        async def late_landing() -> None:
            p.fabric.land(p.fabric.writes[0])

        assert await quiet_while(p, manifest.transfer_id, late_landing) == [True]
        assert await p.tx.cancel(manifest.transfer_id) is True  # and now it is acknowledged


async def test_a_write_still_pending_at_shutdown_never_quiets() -> None:
    async with fake_pair(cancel_ack_timeout_s=0.2) as p:
        manifest = await push_cancelled_mid_write(p, [0])
        # closing gives up on the write: it may still land, so it is never quiet
        assert await quiet_while(p, manifest.transfer_id, p.tx.aclose) == [False]


async def test_a_pool_that_is_not_on_the_cpu_is_refused() -> None:
    async with anyio.create_task_group() as tg:
        transport = FakeTransport(FakePlane(Fabric()), secret=TEST_SECRET, front_key=TEST_FRONT.public)
        with pytest.raises(TransportUnavailable, match="CPU"):
            await transport.start(tg, torch.empty(4, 1024, device="meta"), make_record())
        await transport.aclose()


def test_write_chunks_merge_consecutive_pages_and_cut_at_the_chunk_size() -> None:
    # src 0,1,2 -> dst 5,6,7 is one run; 9 -> 0 another; 3 -> 1 does not extend it
    chunks = write_chunks([0, 1, 2, 9, 3], [5, 6, 7, 0, 1], 10, 20)
    assert chunks == [[(0, 50, 20)], [(20, 70, 10), (90, 0, 10)], [(30, 10, 10)]]
    assert write_chunks([4], [2], 10, 1) == [[(40, 20, 10)]]  # at least one page per chunk
    assert write_chunks(list(range(6)), list(range(6)), 10, 1000) == [[(0, 0, 60)]]
