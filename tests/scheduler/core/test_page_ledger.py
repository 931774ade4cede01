"""The page ledger: all-or-nothing reservations, release, and its integrity check."""

from __future__ import annotations

import random

import pytest

from kvfence.engine.ids import mint_id
from kvfence.scheduler.core.page_ledger import LedgerError, PageLedger


def test_reserve_extend_release() -> None:
    ledger = PageLedger(8)
    a = ledger.reserve(1, 3)
    b = ledger.reserve(2, 4)
    assert a is not None and b is not None and not set(a) & set(b)
    assert ledger.reserve(1, 1) is not None and len(ledger.pages(1)) == 4
    assert ledger.num_free == 0
    assert ledger.reserve(3, 1) is None  # back-pressure is a return value
    assert ledger.release(2) == b and ledger.num_free == 4
    assert ledger.release(2) == []  # releasing twice frees nothing twice
    ledger.check_integrity()


def test_short_reservation_changes_nothing() -> None:
    ledger = PageLedger(4)
    ledger.reserve(1, 3)
    assert ledger.reserve(2, 2) is None
    assert ledger.num_free == 1 and not ledger.holds(2)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        PageLedger(0)
    with pytest.raises(ValueError, match="lease 0"):
        PageLedger(2).reserve(0, 1)


def test_integrity_check_catches_a_double_owned_page() -> None:
    ledger = PageLedger(4)
    pages = ledger.reserve(1, 2)
    assert pages is not None
    ledger._free.append(pages[0])  # simulate a bug: the page is both owned and free
    with pytest.raises(LedgerError, match="4 pages"):
        ledger.check_integrity()


def test_random_lifecycle_keeps_every_page_accounted_for() -> None:
    rng = random.Random(0)
    ledger = PageLedger(64)
    live: list[int] = []
    for _ in range(2000):
        if live and rng.random() < 0.4:
            lease = live.pop(rng.randrange(len(live)))
            ledger.release(lease)
        else:
            lease = mint_id()
            if ledger.reserve(lease, rng.randint(1, 9)) is not None:
                live.append(lease)
        ledger.check_integrity()
        assert ledger.num_used == sum(len(ledger.pages(x)) for x in live)


def test_minted_ids_are_128_bit_and_distinct() -> None:
    ids = {mint_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(0 < i < 1 << 128 for i in ids)
    assert max(ids).bit_length() > 120


def test_sealed_pages_are_shared_by_reference_and_free_only_when_nobody_holds_them() -> None:
    ledger = PageLedger(6)
    a = ledger.reserve(1, 3)
    assert a is not None
    assert ledger.seal(1, a[:2], [b"k0", b"k1"]) == a[:2]  # its full pages; the last stays its own
    assert ledger.pages(1) == a[2:] and ledger.shared_pages(1) == a[:2] and ledger.num_sealed == 2
    assert ledger.lookup([b"k0", b"k1", b"k2"]) == a[:2] and ledger.lookup([b"k1"]) == [a[1]]
    assert ledger.lookup([b"x", b"k1"]) == []  # a chain stops at its first miss
    ledger.share(2, a[:2])  # a second request of the same prefix
    assert ledger.release(1) == [a[2]]  # its own page is free; the sealed ones are still read by 2
    assert ledger.num_cached_idle == 0 and ledger.num_in_use == 2
    assert ledger.release(2) == [] and ledger.num_cached_idle == 2 and ledger.num_in_use == 0  # cached, idle
    ledger.check_integrity()
    assert ledger.flush() == [a[1], a[0]] and ledger.num_used == 0 and ledger.lookup([b"k0"]) == []
    ledger.check_integrity()


def test_idle_cached_pages_are_evicted_tail_first_and_only_when_needed() -> None:
    ledger = PageLedger(4)
    a = ledger.reserve(1, 3)
    assert a is not None
    ledger.seal(1, a, [b"k0", b"k1", b"k2"])
    ledger.release(1)
    assert ledger.num_free == 1 and ledger.can_reserve(4) and not ledger.can_reserve(5)
    assert not ledger.can_reserve(4, pinned=[a[0]])  # a hit the same reservation will share is not evictable
    assert ledger.evict(1) == [a[2]]  # the tail of the chain goes first: its head stays useful
    assert ledger.lookup([b"k0", b"k1", b"k2"]) == a[:2]
    ledger.check_integrity()


def test_a_key_already_cached_is_not_sealed_twice_and_a_lease_seals_only_its_own_pages() -> None:
    ledger = PageLedger(4)
    a, b = ledger.reserve(1, 1), ledger.reserve(2, 1)
    assert a is not None and b is not None
    assert ledger.seal(1, a, [b"k"]) == a
    assert ledger.seal(2, b, [b"k"]) == [] and ledger.pages(2) == b  # the same prefix, filled twice: one cached
    with pytest.raises(LedgerError, match="does not own"):
        ledger.seal(2, a, [b"other"])
    with pytest.raises(LedgerError, match="not cached"):
        ledger.share(3, b)
    ledger.check_integrity()


def test_a_quarantined_lease_keeps_the_sealed_pages_it_reads_out_of_use() -> None:
    """A posted write may still read the sealed source pages: they stay held (and count as
    quarantined: they may never come back) until the quarantine ends."""
    ledger = PageLedger(4)
    a = ledger.reserve(1, 2)
    assert a is not None
    ledger.seal(1, a[:1], [b"k"])
    assert ledger.quarantine(1, 5.0) == a[1:]
    assert ledger.num_quarantined == 2 and ledger.num_reclaimable == 2 and ledger.num_cached_idle == 0
    assert ledger.flush() == [] and ledger.is_sealed(a[0])  # uncached, but still held
    assert ledger.release(1) == []  # only the end of the quarantine frees
    assert sorted(ledger.confirm_quiet(1)) == sorted(a) and ledger.num_used == 0
    ledger.check_integrity()


def test_integrity_check_catches_a_reference_count_that_lies() -> None:
    ledger = PageLedger(2)
    a = ledger.reserve(1, 1)
    assert a is not None
    ledger.seal(1, a, [b"k"])
    ledger._refcount[a[0]] = 2  # simulate a bug: a reference nobody holds
    with pytest.raises(LedgerError, match="reference count"):
        ledger.check_integrity()
