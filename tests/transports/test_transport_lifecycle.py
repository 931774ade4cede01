"""Built-in transports under concurrency, cancellation, peer loss and shutdown.

Mid-transfer tests use 32 pages of 1 MiB and act as soon as the first destination page shows
bytes (staged kinds: as soon as the receiver admitted the push, since their bytes reach the pool
only after verification), which every transport reaches long before the last page (the in-process
push yields every 4 MiB; TCP stalls on the socket buffer; nixl writes a few pages at a time, each
write posted once the previous one is done)."""

from __future__ import annotations

import asyncio
import os
import random
import socket
from collections.abc import Callable

import anyio
import pytest
import torch
from transport_harness import KINDS, Pair, make_manifest, page_bytes, paired

from kvfence.transports.base import TransferManifest, TransferResult
from kvfence.transports.wire.channel import split_address

pytestmark = pytest.mark.anyio
BIG = 1 << 18  # floats per page: 1 MiB pages
MARK = 12345.0  # never produced by randn; written into the source after a cancel


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


async def wait_until(predicate: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while not predicate():
            await anyio.sleep(0)


async def push_in_background(p: Pair, tg: anyio.abc.TaskGroup, manifest: TransferManifest,
                             results: dict[str, TransferResult], scope: anyio.CancelScope | None = None) -> None:
    pages = list(range(manifest.num_pages))

    async def run() -> None:
        with scope or anyio.CancelScope():
            results["push"] = await p.tx.push(p.peer, manifest, pages, pages)

    tg.start_soon(run)
    await wait_until(lambda: p.receiving(manifest))


async def test_concurrent_pushes_all_land(kind: str) -> None:
    rng = random.Random(7)
    dst_all, src_all = rng.sample(range(32), 32), [rng.randrange(32) for _ in range(32)]
    jobs = [(src_all[2 * i:2 * i + 2], dst_all[2 * i:2 * i + 2]) for i in range(16)]
    async with paired(kind) as p:
        results: list[TransferResult] = []

        async def one(src: list[int], dst: list[int]) -> None:
            results.append((await p.expect_and_push(src, dst))[1])

        async with anyio.create_task_group() as tg:
            for src, dst in jobs:
                tg.start_soon(one, src, dst)
        assert len(results) == 16 and all(r.ok for r in results), results
        p.assert_landed(src_all, dst_all)


async def test_transfer_of_a_few_mib(kind: str) -> None:
    async with paired(kind, num_pages=16, page_floats=1 << 16) as p:  # 16 x 256 KiB
        dst = list(range(16))
        random.Random(3).shuffle(dst)
        _, result = await p.expect_and_push(list(range(16)), dst)
        assert result.ok, result
        p.assert_landed(list(range(16)), dst)


async def test_sender_cancel_mid_push_stops_reading_the_source(kind: str) -> None:
    async with paired(kind, page_floats=BIG) as p:
        manifest, results = make_manifest(32), {}
        manifest = p.arm(manifest, list(range(32)))
        async with anyio.create_task_group() as tg:
            await push_in_background(p, tg, manifest, results)
            assert await p.tx.cancel(manifest.transfer_id) is True
            p.src.fill_(MARK)  # a read of the source after cancel returned would carry this over
        assert (results["push"].ok, results["push"].reason) == (False, "cancelled")
        assert (await p.rx.completion(manifest.transfer_id)).reason == "cancelled"
        assert not (p.dst == MARK).any()
        assert not page_bytes(p.dst, 31).any()
        _, again = await p.expect_and_push([0], [31])  # the pair still works
        assert again.ok, again


async def test_receiver_cancel_mid_transfer_stops_writes(kind: str) -> None:
    async with paired(kind, page_floats=BIG) as p:
        manifest, results = make_manifest(32), {}
        manifest = p.arm(manifest, list(range(32)))
        async with anyio.create_task_group() as tg:
            await push_in_background(p, tg, manifest, results)
            assert await p.rx.cancel(manifest.transfer_id) is True
            snapshot = p.dst.clone()
        assert (results["push"].ok, results["push"].reason) == (False, "cancelled")
        assert (await p.rx.completion(manifest.transfer_id)).reason == "cancelled"
        assert torch.equal(p.dst, snapshot)
        _, again = await p.expect_and_push([1], [31])
        assert again.ok, again


async def test_cancelled_push_task_leaves_the_pair_usable(kind: str) -> None:
    async with paired(kind, page_floats=BIG) as p:
        manifest, results, scope = make_manifest(32), {}, anyio.CancelScope()
        manifest = p.arm(manifest, list(range(32)))
        async with anyio.create_task_group() as tg:
            await push_in_background(p, tg, manifest, results, scope)
            scope.cancel()
        assert "push" not in results
        assert (await p.rx.completion(manifest.transfer_id)).reason == "cancelled"
        _, again = await p.expect_and_push([2, 3], [30, 31])
        assert again.ok, again


async def test_sender_closing_fails_the_receivers_transfer(kind: str) -> None:
    async with paired(kind, page_floats=BIG) as p:
        manifest, results = make_manifest(32), {}
        manifest = p.arm(manifest, list(range(32)))
        async with anyio.create_task_group() as tg:
            await push_in_background(p, tg, manifest, results)
            await p.tx.aclose()
        assert (results["push"].ok, results["push"].reason) == (False, "transport_closed")
        assert (await p.rx.completion(manifest.transfer_id)).reason == "peer_lost"
        assert await p.rx.health()


async def test_receiver_closing_fails_the_push(kind: str) -> None:
    async with paired(kind, page_floats=BIG) as p:
        manifest, results = make_manifest(32), {}
        manifest = p.arm(manifest, list(range(32)))
        async with anyio.create_task_group() as tg:
            await push_in_background(p, tg, manifest, results)
            tg.start_soon(lambda: p.rx.completion(manifest.transfer_id))
            await p.rx.aclose()
        assert (results["push"].ok, results["push"].reason) == (False, "peer_lost")
        assert (await p.rx.completion(manifest.transfer_id)).reason == "transport_closed"
        assert not await p.tx.health()
        later = await p.tx.push(p.peer, make_manifest(1), [0], [0])
        assert (later.ok, later.reason) == (False, "peer_lost")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_aclose_releases_sockets_and_tasks(kind: str) -> None:
    baseline_tasks, baseline_fds = asyncio.all_tasks(), open_fds()
    async with paired(kind) as p:
        _, result = await p.expect_and_push([0], [0])
        assert result.ok
        pending = make_manifest(1)
        pending = p.arm(pending, [1])
        waited: list[TransferResult] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _append(waited, p.rx.completion(pending.transfer_id)))
            await anyio.sleep(0)
            await p.rx.aclose()
        assert [r.reason for r in waited] == ["transport_closed"]
        await p.tx.aclose()
        await p.tx.aclose()  # idempotent
        assert not await p.tx.health() and not await p.rx.health()
        with pytest.raises(RuntimeError):
            p.arm(make_manifest(1), [2])
        if p.kind in ("tcp", "nixl", "mooncake"):  # one-sided kinds: their control channel
            with socket.socket() as s, pytest.raises(ConnectionRefusedError):
                s.settimeout(2)
                s.connect(split_address(p.rx_info.address))
        assert {t for t in asyncio.all_tasks() if not t.done()} == baseline_tasks
    assert open_fds() == baseline_fds


async def _append(out: list[TransferResult], awaitable) -> None:  # type: ignore[no-untyped-def]
    out.append(await awaitable)


async def test_a_vanished_peer_is_noticed_without_traffic(kind: str) -> None:
    async with paired(kind) as p:
        assert await p.tx.health()
        await p.rx.aclose()
        with anyio.fail_after(5):
            while await p.tx.health():
                await anyio.sleep(0.001)
        assert not await p.rx.health()
