"""Fault injection (transports/faults.py): the plan parser, deterministic selection, and each
fault against real tcp / inprocess pairs (plain and staged) and nixl pairs: the receiver's verdict is a failure
with the right reason, a failed transfer leaves the destination pages as they were, and the pair
still moves a clean transfer afterwards (except after `vanish`)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
import torch
from transport_harness import KINDS, Pair, make_manifest, make_record, make_transport, page_bytes, split_kind

from kvfence.transports.base import TransferManifest, TransferResult
from kvfence.transports.faults import FAULT_KINDS, FaultInjectingTransport, FaultPlan, FaultSpec, InjectedFault
from kvfence.transports.inprocess import InProcessHub

SRC, DST = [3, 4, 5], [10, 11, 12]  # the faulty transfer
CLEAN_SRC, CLEAN_DST = [6, 7], [20, 21]  # the clean one after it


# -- the parser ------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("drop", (FaultSpec(kind="drop"),)),
    ("delay=0.5", (FaultSpec(kind="delay", seconds=0.5),)),
    ("corrupt@1.0", (FaultSpec(kind="corrupt", probability=1.0),)),
    ("drop#3", (FaultSpec(kind="drop", every=3),)),
    (" truncate@0.25 , delay=0#2,late_write", (FaultSpec(kind="truncate", probability=0.25),
                                                FaultSpec(kind="delay", seconds=0.0, every=2),
                                                FaultSpec(kind="late_write"))),
    ("duplicate,fail_post,vanish", (FaultSpec(kind="duplicate"), FaultSpec(kind="fail_post"),
                                    FaultSpec(kind="vanish"))),
    ("", ()),
    ("none", ()),
])
def test_parse_valid(text: str, expected: tuple[FaultSpec, ...]) -> None:
    plan = FaultPlan.parse(text)
    assert plan.faults == expected
    assert FaultPlan.parse(str(plan)) == plan  # round trip


def test_every_kind_parses() -> None:
    for kind in FAULT_KINDS:
        text = f"{kind}=0.1" if kind == "delay" else kind
        assert FaultPlan.parse(text).kinds() == {kind}


@pytest.mark.parametrize(("text", "match"), [
    ("explode", "unknown fault 'explode'.*known faults: drop, delay"),
    ("drop,explode@0.5", "unknown fault 'explode'"),
    ("delay", "delay needs seconds"),
    ("delay=soon", "not a number"),
    ("delay=-1", ">= 0"),
    ("drop=1", "takes no value"),
    ("drop@1.5", r"\[0, 1\]"),
    ("drop@often", "not a number"),
    ("drop#0", ">= 1"),
    ("drop#x", ">= 1"),
    ("drop,drop#2", "given twice"),
    ("Drop", "not of the form|unknown fault"),
])
def test_parse_errors_are_actionable(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        FaultPlan.parse(text)
    assert "syntax:" in str(info.value) or "given twice" in str(info.value)


def test_every_nth_selection() -> None:
    plan, rng = FaultPlan.parse("drop#3,corrupt#2"), random.Random(0)
    fired = {n: sorted(plan.select(n, rng)) for n in range(1, 7)}
    assert fired == {1: [], 2: ["corrupt"], 3: ["drop"], 4: ["corrupt"], 5: [], 6: ["corrupt", "drop"]}


def test_probability_selection_is_seeded() -> None:
    def run(text: str, seed: int) -> list[bool]:
        plan, rng = FaultPlan.parse(text), random.Random(seed)
        return ["drop" in plan.select(n, rng) for n in range(1, 2001)]

    assert all(run("drop@1.0", 1)) and not any(run("drop@0", 1))
    half = run("drop@0.5", 7)
    assert half == run("drop@0.5", 7)  # the same seed: the same pushes fail
    assert half != run("drop@0.5", 8)
    assert 850 < sum(half) < 1150
    assert 150 < sum(run("drop@0.1", 7)) < 250


# -- the faults, on real pairs ---------------------------------------------------------------


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@asynccontextmanager
async def faulty_pair(kind: str, plan: str, seed: int = 0) -> AsyncIterator[Pair]:
    """As `transport_harness.paired`, with the sender wrapped in a FaultInjectingTransport."""
    hub = InProcessHub()
    name, staged = split_kind(kind)
    src = torch.randn(32, 1024, generator=torch.Generator().manual_seed(32))
    dst = torch.zeros_like(src)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tx = FaultInjectingTransport(make_transport(kind, hub), FaultPlan.parse(plan), seed=seed)
            rx = make_transport(kind, hub)
            try:
                rx_info = await rx.start(tg, dst, make_record())
                tx_info = await tx.start(tg, src, make_record())
                peer = await tx.pair(rx_info)
                yield Pair(name, staged, hub, tx, rx, src, dst, tx_info, rx_info, peer)
            finally:
                await tx.aclose()
                await rx.aclose()


async def push(p: Pair, src: list[int] = SRC, dst: list[int] = DST) -> tuple[TransferManifest, TransferResult]:
    manifest = make_manifest(len(src))
    manifest = p.arm(manifest, dst)
    assert p.peer is not None
    return manifest, await p.tx.push(p.peer, manifest, src, dst)


def assert_pages_equal(p: Pair, src: list[int], dst: list[int]) -> None:
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(page_bytes(p.dst, d), page_bytes(p.src, s)), f"dst page {d} != src page {s}"


async def assert_silent_until_cancelled(p: Pair, manifest: TransferManifest) -> None:
    """The receiver's completion does not end on its own; cancel ends it as "cancelled"."""
    with anyio.move_on_after(0.2) as scope:
        await p.rx.completion(manifest.transfer_id)
    assert scope.cancelled_caught, "the receiver settled a transfer it never received"
    assert await p.rx.cancel(manifest.transfer_id) is True
    verdict = await p.rx.completion(manifest.transfer_id)
    assert (verdict.ok, verdict.reason) == (False, "cancelled")


async def assert_pair_still_works(p: Pair) -> None:
    """A clean transfer (bypassing the injection) lands exactly."""
    manifest = make_manifest(len(CLEAN_SRC))
    manifest = p.arm(manifest, CLEAN_DST)
    assert isinstance(p.tx, FaultInjectingTransport) and p.peer is not None
    result = await p.tx.inner.push(p.peer, manifest, CLEAN_SRC, CLEAN_DST)
    assert result.ok, result
    assert (await p.rx.completion(manifest.transfer_id)).ok
    assert_pages_equal(p, CLEAN_SRC, CLEAN_DST)


def injected(p: Pair) -> dict[str, int]:
    assert isinstance(p.tx, FaultInjectingTransport)
    return dict(p.tx.injected)


@pytest.mark.anyio
async def test_drop(kind: str) -> None:
    async with faulty_pair(kind, "drop") as p:
        manifest, result = await push(p)
        assert (result.ok, result.reason) == (False, "dropped")
        assert injected(p) == {"drop": 1}
        await assert_silent_until_cancelled(p, manifest)
        p.assert_untouched()
        await assert_pair_still_works(p)


@pytest.mark.anyio
async def test_delay(kind: str) -> None:
    async with faulty_pair(kind, "delay=0.25") as p:
        start = anyio.current_time()
        manifest, result = await push(p)
        assert anyio.current_time() - start >= 0.25
        assert result.ok, result
        assert (await p.rx.completion(manifest.transfer_id)).ok
        assert_pages_equal(p, SRC, DST)
        assert injected(p) == {"delay": 1}


@pytest.mark.anyio
async def test_duplicate(kind: str) -> None:
    async with faulty_pair(kind, "duplicate") as p:
        manifest, result = await push(p)
        assert result.ok, result
        assert isinstance(p.tx, FaultInjectingTransport)
        [second] = p.tx.extra_results
        assert (second.transfer_id, second.ok, second.reason) == (manifest.transfer_id, False, "duplicate")
        assert (await p.rx.completion(manifest.transfer_id)).ok  # the first verdict stands
        p.assert_landed(SRC, DST)
        assert injected(p) == {"duplicate": 1}
        await assert_pair_still_works(p)


@pytest.mark.anyio
async def test_corrupt(kind: str) -> None:
    async with faulty_pair(kind, "corrupt") as p:
        before = p.src.clone()
        manifest, result = await push(p)
        assert (result.ok, result.reason) == (False, "digest_mismatch")
        verdict = await p.rx.completion(manifest.transfer_id)
        assert (verdict.ok, verdict.reason) == (False, "digest_mismatch")
        assert torch.equal(p.src, before), "the flipped source byte was not restored"
        assert injected(p) == {"corrupt": 1}
        if not p.staged:
            # A host (unstaged) receiver writes pages in place and verifies afterwards: the failed
            # transfer's (corrupt) bytes stay in its dst pages. The verdict says they are garbage;
            # the server must not reuse them as KV. Pin that behaviour so a change shows up here.
            assert_pages_differ_only_in_first_page(p)
        else:
            p.assert_untouched()
        await assert_pair_still_works(p)


def assert_pages_differ_only_in_first_page(p: Pair) -> None:
    first_src, first_dst = page_bytes(p.src, SRC[0]), page_bytes(p.dst, DST[0])
    assert int((first_src != first_dst).sum()) == 1  # exactly the flipped byte
    assert_pages_equal(p, SRC[1:], DST[1:])


@pytest.mark.anyio
async def test_truncate(kind: str) -> None:
    async with faulty_pair(kind, "truncate") as p:
        manifest, result = await push(p)
        # the shortened manifest and page list are not what the capability was minted for
        assert (result.ok, result.reason) == (False, "capability")
        verdict = await p.rx.completion(manifest.transfer_id)
        assert (verdict.ok, verdict.reason) == (False, "capability")
        p.assert_untouched()
        assert injected(p) == {"truncate": 1}
        await assert_pair_still_works(p)


@pytest.mark.anyio
async def test_truncate_single_page_is_not_injected(kind: str) -> None:
    async with faulty_pair(kind, "truncate") as p:
        manifest, result = await push(p, [9], [9])
        assert result.ok and injected(p) == {}
        assert_pages_equal(p, [9], [9])


@pytest.mark.anyio
async def test_fail_post(kind: str) -> None:
    async with faulty_pair(kind, "fail_post") as p:
        manifest = make_manifest(len(SRC))
        manifest = p.arm(manifest, DST)
        assert p.peer is not None
        with pytest.raises(InjectedFault, match=manifest.transfer_id):
            await p.tx.push(p.peer, manifest, SRC, DST)
        assert injected(p) == {"fail_post": 1}
        await assert_silent_until_cancelled(p, manifest)
        p.assert_untouched()
        await assert_pair_still_works(p)


@pytest.mark.anyio
async def test_vanish(kind: str) -> None:
    async with faulty_pair(kind, "vanish") as p:
        manifest = make_manifest(len(SRC))
        manifest = p.arm(manifest, DST)
        assert p.peer is not None
        try:
            result = await p.tx.push(p.peer, manifest, SRC, DST)
        except RuntimeError as e:  # the built-ins refuse to push on a closed endpoint
            assert "closed" in str(e)
        else:
            assert not result.ok
        assert injected(p) == {"vanish": 1}
        assert not await p.tx.health()
        await assert_silent_until_cancelled(p, manifest)
        p.assert_untouched()
        assert await p.rx.health()  # the receiver itself still serves


@pytest.mark.anyio
async def test_late_write(kind: str) -> None:
    async with faulty_pair(kind, "late_write") as p:
        before = p.src.clone()
        manifest, result = await push(p)
        assert result.ok, result
        assert isinstance(p.tx, FaultInjectingTransport)
        [late] = p.tx.extra_results
        assert late.transfer_id == manifest.transfer_id and not late.ok
        assert late.reason in ("duplicate", "unexpected_transfer")
        assert torch.equal(p.src, before), "the flipped source bytes were not restored"
        p.assert_landed(SRC, DST)  # the true bytes, not the late write's flipped ones
        assert (await p.rx.completion(manifest.transfer_id)).ok
        assert injected(p) == {"late_write": 1}
        await assert_pair_still_works(p)


@pytest.mark.anyio
async def test_stuck(kind: str) -> None:
    """The push never returns; this side's cancel of it is never acknowledged; others still work."""
    async with faulty_pair(kind, "stuck#1") as p:
        manifest = make_manifest(len(SRC))
        manifest = p.arm(manifest, DST)
        assert p.peer is not None
        with anyio.move_on_after(0.2) as scope:
            await p.tx.push(p.peer, manifest, SRC, DST)
        assert scope.cancelled_caught
        assert await p.tx.cancel(manifest.transfer_id) is False
        assert await p.rx.cancel(manifest.transfer_id) is True
        assert injected(p) == {"stuck": 1}
        p.assert_untouched()
        await assert_pair_still_works(p)


@pytest.mark.anyio
async def test_reorder(kind: str) -> None:
    """The second push is held until the third returned: the receiver completes them out of order,
    and each lands exactly in its own pages."""
    async with faulty_pair(kind, "reorder#2") as p:
        _, first = await push(p, [0], [0])
        assert first.ok
        order: list[str] = []
        results: dict[str, TransferResult] = {}

        async def go(name: str, src: list[int], dst: list[int]) -> None:
            results[name] = (await push(p, src, dst))[1]
            order.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(go, "held", [1, 2], [5, 6])
            await anyio.sleep(0.05)
            tg.start_soon(go, "later", [3], [7])
        assert order == ["later", "held"] and all(r.ok for r in results.values()), results
        assert_pages_equal(p, [0, 1, 2, 3], [0, 5, 6, 7])
        assert injected(p) == {"reorder": 1}


@pytest.mark.anyio
async def test_every_nth_push_through_the_wrapper(kind: str) -> None:
    async with faulty_pair(kind, "drop#2") as p:
        reasons = []
        for i in range(4):
            manifest, result = await push(p, [i], [i])
            reasons.append(result.reason)
            if not result.ok:
                assert await p.rx.cancel(manifest.transfer_id)
        assert reasons == ["", "dropped", "", "dropped"]
        assert injected(p) == {"drop": 2}
        assert_pages_equal(p, [0, 2], [0, 2])
        assert not page_bytes(p.dst, 1).any() and not page_bytes(p.dst, 3).any()


@pytest.mark.anyio
async def test_empty_plan_is_transparent(kind: str) -> None:
    async with faulty_pair(kind, "none") as p:
        manifest, result = await push(p)
        assert result.ok and (await p.rx.completion(manifest.transfer_id)).ok
        p.assert_landed(SRC, DST)
        assert injected(p) == {}
        assert p.tx_info == p.tx.info  # type: ignore[attr-defined]
