"""The receiver's pure state machine, transition by transition."""

from __future__ import annotations

import msgspec
import pytest
from transport_harness import make_manifest

from kvfence.transports.base import TransferResult
from kvfence.transports.core.receiver_state import ReceiverState


def state(remember: int = 100) -> ReceiverState:
    return ReceiverState(num_pages=8, page_nbytes=64, digest="xxh3_64", remember=remember)


def test_accepted_push_is_writable_until_it_finishes() -> None:
    s, m = state(), make_manifest(2, digests=["a", "b"])
    s.expect(m, [3, 4])
    adm = s.admit(m, [3, 4], 64)
    assert s.writable(adm) and adm.dst_pages == (3, 4)
    verdict = s.finish(adm, 2, ["a", "b"], ["a", "b"])
    assert verdict == TransferResult(m.transfer_id, True) == s.result(m.transfer_id)
    assert not s.writable(adm) and not s.pending(m.transfer_id)
    s.expect(make_manifest(2), [3, 4])  # its pages are free for the next transfer


@pytest.mark.parametrize(("received", "sent", "landed", "reason"), [
    (1, ["a", "b"], [], "short_transfer"),
    (2, ["a", "b"], ["a", "x"], "digest_mismatch"),
    (2, ["a"], ["a", "b"], "manifest_mismatch"),
])
def test_finish_failures(received: int, sent: list[str], landed: list[str], reason: str) -> None:
    s, m = state(), make_manifest(2)
    s.expect(m, [0, 1])
    adm = s.admit(m, [0, 1], 64)
    assert s.finish(adm, received, sent, landed).reason == reason
    assert s.result(m.transfer_id) == TransferResult(m.transfer_id, False, reason)


def test_pushed_digests_take_precedence_and_expected_digests_must_agree() -> None:
    s, m = state(), make_manifest(1, digests=["a"])
    s.expect(m, [0])
    adm = s.admit(m, [0], 64)
    assert s.finish(adm, 1, ["b"], ["b"]).reason == "digest_mismatch"  # sender's manifest said "a"
    s2, expected = state(), make_manifest(1, digests=["a"])
    s2.expect(expected, [0])
    pushed = make_manifest(1, transfer_id=expected.transfer_id, lease=expected.lease, nonce=expected.nonce,
                           num_tokens=expected.num_tokens)
    adm2 = s2.admit(pushed, [0], 64)
    assert s2.finish(adm2, 1, ["b"], ["b"]).reason == "digest_mismatch"


def test_rejections() -> None:
    s, m = state(), make_manifest(1)
    assert s.admit(m, [0], 64).reject_reason == "unexpected_transfer"
    assert s.result(m.transfer_id) is None  # an unknown id is not remembered
    s.expect(m, [0])
    bad = s.admit(m, [0], 32)
    assert (bad.reject_reason, bad.live) == ("page_size_mismatch", False)
    assert s.result(m.transfer_id).reason == "page_size_mismatch"
    assert s.admit(m, [0], 64).reject_reason == "duplicate"


def test_duplicate_while_receiving_does_not_disturb_the_original() -> None:
    s, m = state(), make_manifest(1)
    s.expect(m, [0])
    adm = s.admit(m, [0], 64)
    dup = s.admit(m, [0], 64)
    assert dup.reject_reason == "duplicate" and not s.writable(dup)
    assert s.finish(dup, 1, [""], [""]).reason == "duplicate"
    assert s.writable(adm) and s.finish(adm, 1, ["d"], ["d"]).ok


def test_cancel_while_receiving_stops_writes_for_good() -> None:
    s, m = state(), make_manifest(2)
    s.expect(m, [0, 1])
    adm = s.admit(m, [0, 1], 64)
    assert s.cancel(m.transfer_id).reason == "cancelled"
    assert not s.writable(adm)
    assert s.finish(adm, 2, ["a", "b"], ["a", "b"]).reason == "cancelled"
    assert s.cancel(m.transfer_id) is None
    assert s.admit(m, [0, 1], 64).reject_reason == "cancelled"


def test_expect_validation_and_forgetting() -> None:
    s = state(remember=1)
    with pytest.raises(ValueError):
        s.expect(make_manifest(1), [8])  # outside the pool
    with pytest.raises(ValueError):
        s.expect(make_manifest(2), [1, 1])
    with pytest.raises(ValueError):
        s.expect(make_manifest(1, digests=["a", "b"]), [1])
    first, second = make_manifest(1), make_manifest(1)
    for m in (first, second):
        s.expect(m, [0])
        s.cancel(m.transfer_id)
    assert s.result(first.transfer_id) is None and s.result(second.transfer_id) is not None


def test_a_plan_whose_page_count_does_not_fit_its_tokens_is_refused_by_count() -> None:
    """FAILURES 26, the receiver's half: knowing its page size, it arms a transfer only if the pages
    named are exactly those its tokens fill (a partial prefix hit moves a suffix of whole pages)."""
    import msgspec

    s = ReceiverState(num_pages=8, page_nbytes=64, digest="xxh3_64", page_size_tokens=16)
    m = make_manifest(2)  # 2 * 16 - 3 tokens: two pages
    for tokens in (16, 33):  # one page's worth; three pages' worth
        with pytest.raises(ValueError, match="plan"):
            s.expect(msgspec.structs.replace(m, num_tokens=tokens), [3, 4])
    assert not s.pending(m.transfer_id)
    s.expect(m, [3, 4])
    assert s.pending(m.transfer_id)


def test_a_signature_is_checked_once_per_transfer_unless_the_push_differs_from_what_was_armed() -> None:
    """The capability check (an Ed25519 verification in every endpoint) runs at `expect`; a push
    identical to the expectation (capability and dst pages included) is not verified again, while
    any push that differs in what the capability covers is verified, and refused, first."""
    checked: list[str] = []

    def check(manifest, dst_pages) -> bool:  # type: ignore[no-untyped-def]
        checked.append(manifest.transfer_id)
        return manifest.capability == f"{manifest.nonce}{list(dst_pages)}"  # what a signature covers, in short

    s = ReceiverState(num_pages=8, page_nbytes=64, digest="xxh3_64", capability=check)
    m = make_manifest(2, nonce="n", capability="n[3, 4]")
    s.expect(m, [3, 4])
    assert s.writable(s.admit(m, [3, 4], 64)) and checked == [m.transfer_id]
    for changed, shift in ((dict(nonce="x"), 0), (dict(capability="forged"), 0), ({}, 1)):
        m = make_manifest(2, nonce="n", capability="n[5, 6]")
        s.expect(m, [5, 6])
        checked.clear()
        pushed = msgspec.structs.replace(m, **changed)
        assert s.admit(pushed, [5, 6 + shift], 64).reject_reason == "capability" and checked == [m.transfer_id]
        assert s.result(m.transfer_id) == TransferResult(m.transfer_id, False, "capability")
