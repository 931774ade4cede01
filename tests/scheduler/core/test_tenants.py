"""Tenant limits in the real scheduler core: a tenant at its running limit waits without holding
up others, one over its queue or its tokens per minute gets 429 with Retry-After, and every count
returns to zero when its requests end."""

from __future__ import annotations

import pytest

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.scheduler import SchedulerCore
from kvfence.scheduler.core.errors import AdmissionRejected
from kvfence.scheduler.core.lifecycle import State
from kvfence.scheduler.core.tenants import Tenant, TokenBucket
from kvfence.scheduler.core.worker_binding import WorkerBinding

PARAMS = SamplingParams(temperature=0, max_tokens=4)


def core(tiny: Checkpoint) -> SchedulerCore:
    config = SchedulerConfig(page_size_tokens=4, max_context_tokens=64, max_running=8, max_queue=16,
                             chunk_tokens=16, disaggregated=False)
    binding = WorkerBinding("colocated", 64)
    return SchedulerCore(config, tiny.tokenizer, binding, binding)


def test_a_tenant_at_its_running_limit_waits_and_others_pass_it(tiny: Checkpoint) -> None:
    c = core(tiny)
    a, b = Tenant(name="a", max_running=1, max_queued=1), Tenant(name="b")
    a1 = c.submit([1, 2, 3], PARAMS, 0.0, tenant=a)
    a2 = c.submit([4, 5, 6], PARAMS, 0.0, tenant=a)
    b1 = c.submit([7, 8, 9], PARAMS, 0.0, tenant=b)
    assert (a1.state, a2.state, b1.state) == (State.PREFILLING, State.WAITING, State.PREFILLING)
    assert (a1.tenant, b1.tenant) == ("a", "b")
    with pytest.raises(AdmissionRejected) as refused:
        c.submit([1], PARAMS, 0.0, tenant=a)  # one already waits: its queue limit
    assert (refused.value.status, refused.value.code, refused.value.retry_after_s) == (429, "rate_limit_exceeded", 1)
    assert "tenant a" in refused.value.message
    c.submit([1], PARAMS, 0.0, tenant=b)  # b is not limited by a's queue
    c.abort(a2.request_id, 0.0)  # a queued request ends at once: a may queue one again
    a3 = c.submit([1], PARAMS, 0.0, tenant=a)
    assert a3.state is State.WAITING
    for rid in [a1.request_id, a3.request_id, b1.request_id]:
        c.abort(rid, 0.0)
    loads = c.registry.tenants
    assert (loads["a"].queued, loads["a"].running) == (0, 1)  # a1 ends once its step in flight is answered


def test_tokens_per_minute_refuse_with_the_wait_until_the_bucket_refills(tiny: Checkpoint) -> None:
    """A request is charged its prompt and its max_tokens at admission (what it may use, so no
    request overshoots what its tenant may spend unseen), and given back what it did not use when
    it ends."""
    c = core(tiny)
    t = Tenant(name="t", tokens_per_minute=20, max_running=1)
    c.submit(list(range(1, 9)), PARAMS, 0.0, tenant=t)  # 8 + 4 of 20
    waiting = c.submit(list(range(1, 9)), PARAMS, 0.0, tenant=t)  # 8 left: admitted, into debt (-4)
    assert waiting.state is State.WAITING
    with pytest.raises(AdmissionRejected) as refused:
        c.submit([1], PARAMS, 0.0, tenant=t)
    assert refused.value.status == 429 and refused.value.retry_after_s == 12  # 4 tokens at 1/3 token per second
    c.abort(waiting.request_id, 0.0)  # it ends having generated nothing: its 4 come back (0, not in debt)
    c.submit([1], PARAMS, 0.0, tenant=t)  # into debt again (-5)
    with pytest.raises(AdmissionRejected):
        c.submit([1], PARAMS, 14.0, tenant=t)
    c.submit([1], PARAMS, 15.0, tenant=t)
    c.submit([1], PARAMS, 15.0, tenant=Tenant(name="other", tokens_per_minute=10))  # buckets are per tenant


def test_one_request_cannot_overshoot_its_tenants_rate_unseen(tiny: Checkpoint) -> None:
    c = core(tiny)
    t = Tenant(name="t", tokens_per_minute=60)
    c.submit([1, 2], SamplingParams(temperature=0, max_tokens=59), 0.0, tenant=t)  # may use more than a minute
    with pytest.raises(AdmissionRejected) as refused:
        c.submit([1], PARAMS, 0.0, tenant=t)  # refused now, not after the first has spent it
    assert refused.value.retry_after_s == 1


def test_a_bucket_never_holds_more_than_a_minute() -> None:
    bucket = TokenBucket(60, 0.0)
    bucket.spend(61, 0.0)
    assert bucket.retry_after_s(0.0) == 1
    assert bucket.retry_after_s(1000.0) is None and bucket.level == 60


def test_the_readiness_canary_is_never_limited(tiny: Checkpoint) -> None:
    c = core(tiny)
    t = Tenant(name="t", max_running=1, max_queued=1, tokens_per_minute=1)
    c.submit([1, 2], PARAMS, 0.0, tenant=t)
    c.submit([1, 2], PARAMS, 0.0, tenant=t, priority=True)  # over every limit of t: still admitted


@pytest.mark.parametrize("bad", ["", "a b", "x/y", "ü" * 0 + "a;b"])
def test_a_tenant_name_is_plain(bad: str) -> None:
    with pytest.raises(ValueError, match="tenant name"):
        Tenant(name=bad)


def test_limits_are_positive_integers() -> None:
    with pytest.raises(ValueError, match="max_running"):
        Tenant(name="a", max_running=0)
    with pytest.raises(ValueError, match="tokens_per_minute"):
        Tenant(name="a", tokens_per_minute=1.5)  # type: ignore[arg-type]
