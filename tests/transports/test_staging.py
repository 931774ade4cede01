"""Pools staged through host memory (a CUDA pool; forced here with `stage_through_host=True`):
the receiver verifies before it copies, so a failed transfer never touches the pool; the sender
reads only the source pages a push names, a bounded chunk at a time. The conformance and
lifecycle suites also run on the staged kinds (transport_harness.KINDS)."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import torch
from transport_harness import (STAGE_CHUNK_PAGES, digests_of, make_manifest, make_record, page_bytes, paired, signed,
                               split_kind)

from kvfence.transports.core import staging
from kvfence.transports.core.pool_bytes import PoolBytes
from kvfence.transports.core.receiver import Receiver
from kvfence.transports.core.receiver_state import Admission

pytestmark = pytest.mark.anyio
STAGED = ["tcp+staged", "inprocess+staged"]
BIG = 1 << 18  # floats per page: 16 x 1 MiB pushes are still running when a test acts (see lifecycle)


def staged_receiver(num_pages: int = 4) -> tuple[Receiver, torch.Tensor]:
    pool = torch.zeros(num_pages, 1024)
    return Receiver(PoolBytes(pool, make_record(), stage_through_host=True)), pool


def land(rx: Receiver, adm: Admission, pages: torch.Tensor) -> None:
    for index in range(pages.shape[0]):
        target = rx.target(adm, index)
        assert target is not None
        target[:] = pages[index].numpy().tobytes()


# -- PoolBytes -------------------------------------------------------------------------------
def test_a_pool_that_is_not_on_the_cpu_is_accepted_and_staged() -> None:
    meta = torch.empty(4, 1024, device="meta")  # stands in for a CUDA pool on this machine
    view = PoolBytes(meta, make_record())
    assert view.staged and view.device.type == "meta" and (view.num_pages, view.page_nbytes) == (4, 4096)
    with pytest.raises(RuntimeError, match="staged"):
        view.page(0)  # no host bytes: only staging.copy_pages moves them
    with pytest.raises(ValueError, match="staged"):
        PoolBytes(meta, make_record(), stage_through_host=False)
    with pytest.raises(ValueError, match="dtype"):  # dtype and page size are checked on any device
        PoolBytes(torch.empty(4, 2048, dtype=torch.float16, device="meta"), make_record())
    with pytest.raises(ValueError, match="bytes"):
        PoolBytes(torch.empty(4, 512, device="meta"), make_record())
    assert PoolBytes(torch.empty(4, 2048, dtype=torch.bfloat16, device="meta"), make_record(dtype="bfloat16")).staged


def test_a_cpu_pool_is_used_in_place_unless_staging_is_forced() -> None:
    pool = torch.zeros(4, 1024)
    assert not PoolBytes(pool, make_record()).staged
    forced = PoolBytes(pool, make_record(), stage_through_host=True, stage_chunk_bytes=10_000)
    assert forced.staged and forced.stage_chunk_pages == 2
    assert PoolBytes(pool, make_record(), stage_through_host=True, stage_chunk_bytes=1).stage_chunk_pages == 1
    with pytest.raises(RuntimeError):
        forced.page(0)


def test_host_buffers_are_plain_memory_for_a_cpu_pool() -> None:
    buffer = staging.host_pages(3, 64, torch.device("cpu"))
    assert buffer.shape == (3, 64) and buffer.dtype == torch.uint8 and not buffer.is_pinned()


# -- sender ----------------------------------------------------------------------------------
def test_page_runs_coalesce_pages_consecutive_on_both_sides() -> None:
    assert list(staging.page_runs(range(5), [7, 2, 3, 4, 9])) == [(0, 7, 1), (1, 2, 3), (4, 9, 1)]
    assert list(staging.page_runs([3, 4, 0], [0, 1, 2])) == [(3, 0, 2), (0, 2, 1)]
    assert list(staging.page_runs([], [])) == []


def test_source_pages_stage_only_the_named_pages_a_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = torch.randn(10, 1024)
    pool = PoolBytes(memory, make_record(), stage_through_host=True, stage_chunk_bytes=3 * 4096)
    reads: list[list[int]] = []
    copy = staging.copy_pages

    def spy(dst, dst_pages, src, src_pages):  # type: ignore[no-untyped-def]
        assert src is pool.pages
        reads.append(list(src_pages))
        copy(dst, dst_pages, src, src_pages)

    monkeypatch.setattr(staging, "copy_pages", spy)
    names = [7, 2, 3, 4, 9]
    source = staging.SourcePages(pool, names)
    assert reads == []  # nothing is read before a page is asked for
    for index, page in enumerate(names):
        assert bytes(source.page(index)) == page_bytes(memory, page).numpy().tobytes()
        assert torch.equal(source.page_tensor(index), page_bytes(memory, page))
    assert reads == [[7, 2, 3], [4, 9]]  # bounded by the chunk, and nothing but the named pages
    assert source._buffer is not None and source._buffer.shape == (3, 4096)


def test_source_pages_of_a_host_pool_are_its_own_pages() -> None:
    memory = torch.randn(4, 1024)
    source = staging.SourcePages(PoolBytes(memory, make_record()), [2, 0])
    source.page(0)[:4] = b"\x00\x00\x80\x7f"  # a view of the pool: no copy
    assert memory[2, 0].item() == float("inf")


@pytest.mark.parametrize("kind", STAGED)
async def test_a_staged_sender_reads_only_the_named_source_pages(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[list[int]] = []
    copy = staging.copy_pages

    def spy(dst, dst_pages, src, src_pages):  # type: ignore[no-untyped-def]
        reads.append(list(src_pages))
        copy(dst, dst_pages, src, src_pages)

    monkeypatch.setattr(staging, "copy_pages", spy)  # the sender's reads (the receiver copies on its own)
    async with paired(kind) as p:
        src_pages, dst_pages = [30, 1, 2, 3, 17, 4, 5], [0, 9, 8, 7, 6, 5, 4]
        _, result = await p.expect_and_push(src_pages, dst_pages)
        assert result.ok, result
        p.assert_landed(src_pages, dst_pages)
    assert reads == [src_pages[i:i + STAGE_CHUNK_PAGES] for i in range(0, len(src_pages), STAGE_CHUNK_PAGES)]


async def test_a_failed_staging_copy_aborts_the_push_and_keeps_the_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    copy = staging.copy_pages
    calls = 0

    def fail_second(dst, dst_pages, src, src_pages):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("device copy failed")
        copy(dst, dst_pages, src, src_pages)

    async with paired("tcp+staged") as p:
        manifest = make_manifest(6)
        manifest = p.arm(manifest, list(range(6)))
        monkeypatch.setattr(staging, "copy_pages", fail_second)
        with pytest.raises(RuntimeError, match="device copy failed"):
            await p.tx.push(p.peer, manifest, list(range(6)), list(range(6)))
        assert (await p.rx.completion(manifest.transfer_id)).reason == "staging_failed"
        p.assert_untouched()
        monkeypatch.setattr(staging, "copy_pages", copy)
        _, again = await p.expect_and_push([8], [9])  # the stream stayed in sync
        assert again.ok, again
        p.assert_landed([8], [9])


# -- receiver --------------------------------------------------------------------------------
async def test_staged_bytes_reach_the_pool_only_once_verified_and_only_the_named_pages() -> None:
    rx, pool = staged_receiver(6)
    src = torch.randn(3, 1024)
    m = make_manifest(3)
    rx.expect(m, [4, 0, 2])
    adm = rx.admit(m, [4, 0, 2], 4096)
    assert rx.staging_nbytes() == 3 * 4096
    land(rx, adm, src)
    assert not pool.any()  # landed in staging, not yet in the pool
    assert rx.finish(adm, 3, digests_of(src, [0, 1, 2])).ok
    assert torch.equal(pool[4], src[0]) and torch.equal(pool[0], src[1]) and torch.equal(pool[2], src[2])
    assert not pool[[1, 3, 5]].any()
    assert rx.target(adm, 0) is None and rx.staging_nbytes() == 0


async def test_staged_digests_are_recomputed_over_the_bytes_that_landed() -> None:
    rx, pool = staged_receiver()
    src = torch.randn(2, 1024)
    m = make_manifest(2)
    rx.expect(m, [2, 0])
    adm = rx.admit(m, [2, 0], 4096)
    land(rx, adm, src)
    corrupt = rx.target(adm, 1)
    assert corrupt is not None
    corrupt[7] ^= 1  # a staged byte changed after landing, before verification
    verdict = rx.finish(adm, 2, digests_of(src, [0, 1]))
    assert (verdict.ok, verdict.reason) == (False, "digest_mismatch")
    assert not pool.any() and rx.staging_nbytes() == 0
    assert await rx.completion(m.transfer_id) == verdict


@pytest.mark.parametrize("how", ["cancel", "abort", "short", "close"])
async def test_a_staged_transfer_that_ends_otherwise_never_touches_the_pool(how: str) -> None:
    rx, pool = staged_receiver()
    src = torch.randn(2, 1024)
    m = make_manifest(2)
    rx.expect(m, [1, 3])
    adm = rx.admit(m, [1, 3], 4096)
    land(rx, adm, src)
    if how == "cancel":
        rx.cancel(m.transfer_id)
    elif how == "abort":
        rx.abort(adm, "peer_lost")
    elif how == "close":
        rx.close()
    verdict = rx.finish(adm, 1 if how == "short" else 2, digests_of(src, [0, 1]))
    assert not verdict.ok
    assert verdict.reason == {"cancel": "cancelled", "abort": "peer_lost", "short": "short_transfer",
                              "close": "transport_closed"}[how]
    assert not pool.any() and rx.staging_nbytes() == 0


async def test_rejected_pushes_get_no_staging() -> None:
    rx, _ = staged_receiver()
    m = make_manifest(1)
    assert rx.admit(m, [0], 4096).reject_reason == "unexpected_transfer"
    rx.expect(m, [0])
    assert rx.admit(msgspec.structs.replace(m, nonce="x"), [0], 4096).reject_reason == "manifest_mismatch"
    assert rx.staging_nbytes() == 0


async def test_a_failed_copy_into_the_pool_fails_the_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvfence.transports.core.receiver as receiver_module

    def broken(*args: object) -> None:
        raise RuntimeError("device copy failed")

    monkeypatch.setattr(receiver_module, "copy_pages", broken)
    rx, _ = staged_receiver()
    src = torch.randn(1, 1024)
    m = make_manifest(1)
    rx.expect(m, [0])
    adm = rx.admit(m, [0], 4096)
    land(rx, adm, src)
    # The transfer fails; the receiver (and the server around it) carries on.
    result = rx.finish(adm, 1, digests_of(src, [0]))
    assert not result.ok and result.reason == "staging_failed"
    assert (await rx.completion(m.transfer_id)).reason == "staging_failed"


# -- both ends, through the transports -------------------------------------------------------
@pytest.mark.parametrize("kind", STAGED)
async def test_the_staged_kinds_really_stage(kind: str) -> None:
    async with paired(kind) as p:
        for endpoint in (p.tx, p.rx):
            assert endpoint._pool_bytes.staged  # type: ignore[attr-defined]
            with pytest.raises(RuntimeError):
                endpoint._pool_bytes.page(0)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", STAGED)
async def test_a_digest_mismatch_leaves_the_staged_pool_untouched(kind: str) -> None:
    async with paired(kind) as p:
        digests = digests_of(p.src, [0, 1, 2, 3])
        digests[3] = "0123456789abcdef"
        manifest, result = await p.expect_and_push([0, 1, 2, 3], [3, 4, 5, 6], digests=digests)
        assert (result.ok, result.reason) == (False, "digest_mismatch")
        p.assert_untouched()  # not even the pages whose digests matched
        assert p.rx._receiver.staging_nbytes() == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", STAGED)
async def test_a_manifest_mismatch_leaves_the_staged_pool_untouched(kind: str) -> None:
    async with paired(kind) as p:
        for signed_push, reason in ((False, "capability"), (True, "manifest_mismatch")):
            expected = p.arm(make_manifest(2), [5, 6])
            changed = msgspec.structs.replace(expected, lease="x")
            if signed_push:  # signed for what it claims, but not what was expected
                changed = signed(changed, [5, 6], p.rx_info)
            result = await p.tx.push(p.peer, changed, [0, 1], [5, 6])
            assert (result.ok, result.reason) == (False, reason)
        p.assert_untouched()


@pytest.mark.parametrize("side", ["receiver", "sender"])
@pytest.mark.parametrize("kind", STAGED)
async def test_a_cancelled_staged_transfer_leaves_the_pool_untouched(kind: str, side: str) -> None:
    async with paired(kind, num_pages=16, page_floats=BIG) as p:
        manifest, results = make_manifest(16), {}
        manifest = p.arm(manifest, list(range(16)))

        async def push() -> None:
            results["push"] = await p.tx.push(p.peer, manifest, list(range(16)), list(range(16)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(push)
            with anyio.fail_after(10):
                while not p.receiving(manifest):
                    await anyio.sleep(0)
            assert await (p.rx if side == "receiver" else p.tx).cancel(manifest.transfer_id) is True
        assert results["push"].reason == "cancelled"
        assert (await p.rx.completion(manifest.transfer_id)).reason == "cancelled"
        p.assert_untouched()  # the pages that had landed in staging never reached the pool
        assert p.rx._receiver.staging_nbytes() == 0  # type: ignore[attr-defined]
        _, again = await p.expect_and_push([1], [15])
        assert again.ok, again


# -- real devices (skipped without CUDA) -----------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["tcp", "inprocess"])
async def test_cuda_pools_are_staged_automatically(kind: str) -> None:
    assert split_kind(kind) == (kind, False)  # no forcing: the device alone decides
    devices = ("cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    async with paired(kind, devices=devices) as p:
        assert p.tx._pool_bytes.staged and p.rx._pool_bytes.staged  # type: ignore[attr-defined]
        src_pages, dst_pages = [5, 6, 7, 20, 0], [31, 2, 3, 4, 9]
        _, result = await p.expect_and_push(src_pages, dst_pages)
        assert result.ok, result
        p.assert_landed(src_pages, dst_pages)
        digests = digests_of(p.src, [1, 2])
        digests[0] = "0123456789abcdef"
        _, bad = await p.expect_and_push([1, 2], [10, 11], digests=digests)
        assert (bad.ok, bad.reason) == (False, "digest_mismatch")
        p.assert_landed(src_pages, dst_pages)  # pages 10 and 11 were never written
