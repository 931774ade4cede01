"""Whether a request can ever be served by these pools: pure functions of the config and the page
ledgers (no I/O, no clock: the caller passes the time).

Invariant 1: a request enters only if it fits everywhere it will go (on some live pair of a prefill
and a decode pool; no pair at all is a 503): prompt + max_tokens within the
context, the prompt within the prefill pool, prompt + max_tokens within the decode pool (also when
a pool is smaller than the context: a sizing guard bypassed or misconfigured). Quarantined pages may
never come back, so a request that fits only with them is refused as well (503: retry later or
elsewhere) instead of waiting for them until its deadline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.errors import AdmissionRejected, context_length_exceeded
from kvfence.scheduler.core.page_ledger import PageLedger

QUARANTINE_RETRY_AFTER_S = 5
NO_PAIR_RETRY_AFTER_S = 2


class Refusal(NamedTuple):
    reason: str  # the label of kvfence_admission_rejections
    error: AdmissionRejected


def size_refusal(config: SchedulerConfig, limit: int, prefill: PageLedger, decode: PageLedger, prompt_tokens: int,
                 max_tokens: int) -> Refusal | None:
    """400 context_length_exceeded when the request is over `limit` (the context of the pair of
    pools) or over a whole pool (`prefill is decode` when colocated); else None."""
    if prompt_tokens >= limit or prompt_tokens + max_tokens > limit:
        return Refusal("context_length", context_length_exceeded(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the completion).",
            param="max_tokens" if prompt_tokens < limit else "messages"))
    prompt_room = prefill.num_pages * config.page_size_tokens
    total_room = decode.num_pages * config.page_size_tokens
    if prompt_tokens > prompt_room or prompt_tokens + max_tokens > total_room:
        too_long_prompt = prompt_tokens >= total_room if prefill is decode else prompt_tokens > prompt_room
        return Refusal("pool_capacity", context_length_exceeded(
            f"This request needs {prompt_tokens} prompt tokens and {prompt_tokens + max_tokens} tokens in all, "
            f"but the KV pools hold {prompt_room} (prefill) and {total_room} (decode) tokens.",
            param="messages" if too_long_prompt else "max_tokens"))
    return None


def quarantine_refusal(needs: Sequence[tuple[str, PageLedger, int]], now_s: float) -> Refusal | None:
    """503 kv_pages_quarantined when, in some pool, the pages a request needs at its longest are
    more than can still become free there. `needs`: (role, ledger, pages needed) per pool;
    `now_s`: the clock the quarantines were stamped with."""
    for role, ledger, need_pages in needs:
        if need_pages <= ledger.num_reclaimable:
            continue
        since = ledger.quarantined_since
        age = f", the oldest for {now_s - since:.0f} s" if since is not None else ""
        return Refusal("quarantined", AdmissionRejected(
            503, "kv_pages_quarantined",
            f"this request needs {need_pages} KV pages of the {role} pool, but only {ledger.num_reclaimable} of its "
            f"{ledger.num_pages} can still become free ({ledger.num_quarantined} quarantined{age}, after transfers "
            "that did not end cleanly); retry shortly or on another replica",
            error_type="service_unavailable", retry_after_s=QUARANTINE_RETRY_AFTER_S))
    return None


def no_live_pair() -> Refusal:
    """503 worker_lost: no prefill and decode worker pair takes requests (every one was lost or is
    draining)."""
    return Refusal("no_workers", AdmissionRejected(
        503, "worker_lost", "no prefill and decode worker pair takes requests right now (workers were lost or are "
        "shutting down); retry shortly or on another replica", error_type="service_unavailable",
        retry_after_s=NO_PAIR_RETRY_AFTER_S))
