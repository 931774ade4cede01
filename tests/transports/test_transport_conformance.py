"""Conformance of the built-in transports (tcp, inprocess, nixl) to the Transport contract: pairing,
exact placement of pages, and the rejections that must leave the receiver's pool untouched."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch
from transport_harness import KINDS, digests_of, make_manifest, make_record, paired, signed

from kvfence.transports.base import EndpointInfo, PairingRefused, TransferResult
from kvfence.transports.core.front_key import FrontKey

pytestmark = pytest.mark.anyio


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


async def test_pairing_works(kind: str) -> None:
    async with paired(kind) as p:
        assert p.peer is not None and p.peer.info == p.rx_info
        assert p.rx_info.transport == p.tx_info.transport == p.kind
        assert await p.tx.health() and await p.rx.health()
        back = await p.rx.pair(p.tx_info)  # pairing is per direction; the other one works too
        assert back.info == p.tx_info


@pytest.mark.parametrize("field", ["dtype", "page_nbytes", "digest"])
async def test_incompatible_record_is_refused_on_both_sides(kind: str, field: str) -> None:
    if field == "dtype":  # same page size in bytes, other element type
        dst, rec = torch.zeros(32, 2048, dtype=torch.bfloat16), make_record(dtype="bfloat16")
    elif field == "page_nbytes":
        dst, rec = torch.zeros(32, 512), make_record(page_nbytes=2048)
    else:
        dst, rec = torch.zeros(32, 1024), make_record(digest="none")
    async with paired(kind, pair=False, rx_record=rec, dst=dst) as p:
        with pytest.raises(PairingRefused, match=field):
            await p.tx.pair(p.rx_info)
        with pytest.raises(PairingRefused, match=field):
            await p.rx.pair(p.tx_info)
        # a peer claiming compatibility is still refused by the real endpoint behind the address
        claimed = EndpointInfo(p.kind, p.rx_info.address, p.tx_info.record)
        with pytest.raises(PairingRefused, match=field):
            await p.tx.pair(claimed)


async def test_transport_name_and_incarnation_mismatch_refuse(kind: str) -> None:
    async with paired(kind, pair=False) as p:
        other = "inprocess" if p.kind == "tcp" else "tcp"
        with pytest.raises(PairingRefused, match="transport"):
            await p.tx.pair(EndpointInfo(other, p.rx_info.address, p.rx_info.record))
        stale = make_record(incarnation="an-earlier-start")
        with pytest.raises(PairingRefused, match="incarnation"):
            await p.tx.pair(EndpointInfo(p.kind, p.rx_info.address, stale))


@pytest.mark.parametrize("num_pages", [1, 2, 32])
@pytest.mark.parametrize("shuffled", [False, True])
async def test_push_lands_exactly_in_the_named_pages(kind: str, num_pages: int, shuffled: bool) -> None:
    rng = random.Random(num_pages * 2 + shuffled)
    src_pages = rng.sample(range(32), num_pages)
    dst_pages = sorted(rng.sample(range(32), num_pages))
    if shuffled:
        rng.shuffle(dst_pages)
    async with paired(kind) as p:
        manifest, result = await p.expect_and_push(src_pages, dst_pages)
        assert result.ok and result.transfer_id == manifest.transfer_id, result
        assert await p.rx.completion(manifest.transfer_id) == result
        p.assert_landed(src_pages, dst_pages)


async def test_manifest_digests_supplied_by_the_caller_are_accepted(kind: str) -> None:
    async with paired(kind) as p:
        _, result = await p.expect_and_push([3, 4], [9, 1], digests=digests_of(p.src, [3, 4]))
        assert result.ok, result
        p.assert_landed([3, 4], [9, 1])


async def test_unexpected_transfer_writes_nothing(kind: str) -> None:
    async with paired(kind) as p:
        manifest = signed(make_manifest(2), [0, 1], p.rx_info)  # a valid capability, never expected
        result = await p.tx.push(p.peer, manifest, [0, 1], [0, 1])
        assert (result.ok, result.reason) == (False, "unexpected_transfer")
        p.assert_untouched()
        with pytest.raises(KeyError):
            await p.rx.completion(manifest.transfer_id)


@pytest.mark.parametrize("field", ["lease", "nonce", "num_pages", "num_tokens", "dst_pages"])
async def test_manifest_mismatch_writes_nothing_and_fails_the_transfer(kind: str, field: str) -> None:
    async with paired(kind) as p:
        expected = make_manifest(3)
        expected = p.arm(expected, [5, 6, 7])
        pushed, src, dst = expected, [0, 1, 2], [5, 6, 7]
        if field == "num_pages":
            pushed, src, dst = make_manifest(2, transfer_id=expected.transfer_id, lease=expected.lease,
                                             nonce=expected.nonce, num_tokens=expected.num_tokens), [0, 1], [5, 6]
        elif field == "dst_pages":
            dst = [5, 6, 8]
        else:
            pushed = msgspec.structs.replace(expected, **{field: "x" if field != "num_tokens" else 1})
        # signed for what it claims (a sender holding the secret that got it wrong): the receiver's
        # own comparison with what it expected refuses it
        result = await p.tx.push(p.peer, signed(pushed, dst, p.rx_info), src, dst)
        reason = "dst_mismatch" if field == "dst_pages" else "manifest_mismatch"
        assert (result.ok, result.reason) == (False, reason)
        assert await p.rx.completion(expected.transfer_id) == result
        p.assert_untouched()


@pytest.mark.parametrize("field", ["lease", "nonce", "num_tokens", "dst_pages", "incarnation", "key"])
async def test_a_push_whose_capability_does_not_verify_is_refused_and_writes_nothing(kind: str, field: str) -> None:
    """FAILURES 23: the capability of the expected transfer, on a push that changes what it covers
    (or one minted for an earlier incarnation of the receiver, or signed with a key that is not the
    front end's: all a worker host could sign with), is refused before a byte lands, and fails the
    expected transfer."""
    async with paired(kind) as p:
        expected = p.arm(make_manifest(3), [5, 6, 7])
        pushed, dst = expected, [5, 6, 7]
        if field == "dst_pages":
            dst = [5, 6, 8]
        elif field == "incarnation":
            old = msgspec.structs.replace(p.rx_info, record=msgspec.structs.replace(p.rx_info.record,
                                                                                    incarnation="0" * 16))
            pushed = signed(expected, dst, old)
        elif field == "key":
            pushed = signed(expected, dst, p.rx_info, FrontKey.generate())
        else:
            pushed = msgspec.structs.replace(expected, **{field: "x" if field != "num_tokens" else 1})
        result = await p.tx.push(p.peer, pushed, [0, 1, 2], dst)
        assert (result.ok, result.reason) == (False, "capability")
        assert await p.rx.completion(expected.transfer_id) == TransferResult(expected.transfer_id, False, "capability")
        p.assert_untouched()
        # an expectation whose capability does not verify is refused before it is armed
        with pytest.raises(ValueError, match="refused: capability"):
            p.rx.expect(make_manifest(1), [9])
        await_ok = await p.expect_and_push([0], [9])
        assert await_ok[1].ok


async def test_digest_mismatch_fails(kind: str) -> None:
    async with paired(kind) as p:
        digests = digests_of(p.src, [0, 1, 2])
        digests[1] = "0123456789abcdef"
        manifest, result = await p.expect_and_push([0, 1, 2], [3, 4, 5], digests=digests)
        assert (result.ok, result.reason) == (False, "digest_mismatch")
        assert await p.rx.completion(manifest.transfer_id) == result


async def test_duplicate_push_is_refused_without_writing(kind: str) -> None:
    async with paired(kind) as p:
        manifest, first = await p.expect_and_push([0, 1], [2, 3])
        assert first.ok
        again = await p.tx.push(p.peer, manifest, [10, 11], [2, 3])
        assert (again.ok, again.reason) == (False, "duplicate")
        p.assert_landed([0, 1], [2, 3])
        assert await p.rx.completion(manifest.transfer_id) == first


async def test_receiver_cancel_before_push_writes_nothing(kind: str) -> None:
    async with paired(kind) as p:
        manifest = make_manifest(2)
        manifest = p.arm(manifest, [0, 1])
        assert await p.rx.cancel(manifest.transfer_id) is True
        assert (await p.rx.completion(manifest.transfer_id)).reason == "cancelled"
        result = await p.tx.push(p.peer, manifest, [0, 1], [0, 1])
        assert not result.ok and result.reason == "cancelled"
        p.assert_untouched()


async def test_cancel_after_a_completed_push_is_acknowledged_and_changes_nothing(kind: str) -> None:
    async with paired(kind) as p:
        manifest, result = await p.expect_and_push([4, 5, 6], [9, 1, 7])
        assert result.ok
        assert await p.tx.cancel(manifest.transfer_id) is True
        assert await p.rx.cancel(manifest.transfer_id) is True
        assert (await p.rx.completion(manifest.transfer_id)).ok  # the verdict stands
        p.assert_landed([4, 5, 6], [9, 1, 7])
        _, again = await p.expect_and_push([0], [0])  # and the pair goes on working
        assert again.ok


async def test_bad_arguments_raise(kind: str) -> None:
    async with paired(kind) as p:
        manifest = make_manifest(2)
        with pytest.raises(ValueError):
            p.arm(manifest, [0])  # page count differs from num_pages
        manifest = p.arm(manifest, [0, 1])
        with pytest.raises(ValueError):
            p.arm(make_manifest(1), [1])  # page reserved by a pending transfer
        with pytest.raises(ValueError):
            p.arm(manifest, [2, 3])  # id reused
        with pytest.raises(ValueError):
            await p.tx.push(p.peer, manifest, [0, 0], [0, 1])  # repeated src page
        with pytest.raises(ValueError):
            await p.tx.push(p.peer, manifest, [0, 99], [0, 1])  # src page outside the pool
