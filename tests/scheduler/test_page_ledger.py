"""The page ledger: all-or-nothing reservations, release, and its integrity check."""

from __future__ import annotations

import random

import pytest

from kvfence.engine.ids import mint_id
from kvfence.scheduler.page_ledger import LedgerError, PageLedger


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
