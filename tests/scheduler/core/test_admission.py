"""Admission checks as pure functions of the config and the ledgers: over the context or a pool is
400; fitting only with quarantined pages is 503 with Retry-After and says how many and since when."""

from __future__ import annotations

from kvfence.scheduler.core.admission import quarantine_refusal, size_refusal
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.page_ledger import PageLedger

CONFIG = SchedulerConfig(page_size_tokens=4, max_context_tokens=64)


def test_size_refusal_names_the_field() -> None:
    prefill, decode = PageLedger(16), PageLedger(16)  # 64 tokens each
    assert size_refusal(CONFIG, 64, prefill, decode, 10, 54) is None
    over = size_refusal(CONFIG, 64, prefill, decode, 10, 55)
    assert over is not None and over.reason == "context_length" and over.error.param == "max_tokens"
    assert over.error.status == 400 and over.error.code == "context_length_exceeded"
    small = PageLedger(4)  # 16 tokens: a bypassed sizing guard
    prompt = size_refusal(CONFIG, 64, small, decode, 20, 4)
    assert prompt is not None and prompt.reason == "pool_capacity" and prompt.error.param == "messages"
    total = size_refusal(CONFIG, 64, prefill, small, 10, 10)
    assert total is not None and total.reason == "pool_capacity" and total.error.param == "max_tokens"


def test_quarantine_refusal_counts_only_pages_that_can_still_become_free() -> None:
    ledger = PageLedger(16)
    assert ledger.reserve(7, 3) is not None and ledger.reserve(8, 5) is not None
    assert quarantine_refusal([("decode", ledger, 16)], now_s=0.0) is None  # live pages come back
    ledger.quarantine(7, now_s=100.0)
    assert ledger.num_reclaimable == 13 and ledger.quarantined_since == 100.0
    assert quarantine_refusal([("decode", ledger, 13)], now_s=130.0) is None
    refusal = quarantine_refusal([("decode", ledger, 14)], now_s=130.0)
    assert refusal is not None and refusal.reason == "quarantined"
    e = refusal.error
    assert (e.status, e.code, e.error_type) == (503, "kv_pages_quarantined", "service_unavailable")
    assert e.retry_after_s and "3 quarantined, the oldest for 30 s" in e.message and "13 of its 16" in e.message
    ledger.confirm_quiet(7)
    assert ledger.quarantined_since is None and quarantine_refusal([("decode", ledger, 16)], now_s=131.0) is None
