"""Tenant isolation with the real model: tenant A's prompts carry unique canary strings; tenant B
sends over-long and near-limit prompts and cancels mid-stream and mid-transfer, while transfer
faults are injected. Every prompt of both starts with the same system prompt, so the prefix cache
holds it for each tenant (and the pools are small enough that cached pages are evicted and running
requests preempted). B sending exactly A's prompt finds nothing cached; no output of B ever
contains an A canary; every A output is its solo output on a cold server (or, if a fault hit A's
own transfer, an error with no content beyond a prefix of it); no read fails a tag or sanitizer
check; both pools return to their baseline, and to all free once the cache is flushed."""

from __future__ import annotations

import random

import anyio
import pytest
from serving_harness import start_serving

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.errors import AdmissionRejected
from kvfence.scheduler.handle import RequestHandle
from kvfence.scheduler.core.tenants import Tenant
from kvfence.transports.faults import FaultPlan

CONTEXT = 512
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


A, B = Tenant(name="a"), Tenant(name="b")
SYSTEM = "You are a helpful assistant. Answer every question briefly and exactly. " * 3


def chat(tok, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    """Every prompt of either tenant starts with the same system text (so with the same pages)."""
    return tok.encode(f"{SYSTEM}\n{text}")


async def cached_tokens(handle: RequestHandle) -> int:
    async for d in handle.deltas():
        if d.finish_reason or d.error:
            assert d.error is None, d.error
            return d.cached_tokens
    raise AssertionError("no terminal delta")


async def run(handle: RequestHandle, abort_after: int | None = None) -> tuple[str, str | None, str | None]:
    text, n = "", 0
    async for d in handle.deltas():
        text += d.text
        n += len(d.token_ids)
        if abort_after is not None and n >= abort_after:
            handle.abort()
        if d.finish_reason or d.error:
            return text, d.finish_reason, d.error.code if d.error else None
    return text, None, None


# Every fault of the injector, several at once on different pushes (a push may draw more than one);
# `vanish` (the pair is gone for good) and `stuck` (pages quarantined for good) get runs of their own.
EVERY_FAULT = "delay=0.05#1,truncate#2,duplicate#3,late_write#3,corrupt#4,reorder#5,fail_post#6,drop#7"


@pytest.mark.anyio
@pytest.mark.parametrize(("transport", "faults"), [
    ("tcp", ""), ("tcp", EVERY_FAULT), ("tcp", "vanish#5"), ("tcp", "stuck#3"),
    ("nixl", EVERY_FAULT), ("mooncake", EVERY_FAULT),
])
async def test_b_never_sees_a_canary(smollm2: Checkpoint, transport: str, faults: str) -> None:
    tok = smollm2.tokenizer
    rng = random.Random(7)  # fixed canaries: the test is deterministic
    canaries = [f"KVF{rng.getrandbits(32):08X}" for _ in range(3)]
    a_prompts = [chat(tok, f"Code: {c}. Code: {c}. Code: {c}. Code:") for c in canaries]
    config = SchedulerConfig(page_size_tokens=16, max_context_tokens=CONTEXT, max_running=8, max_queue=16,
                             chunk_tokens=128, disaggregated=True, transfer_timeout_s=2)
    async with anyio.create_task_group() as tg:
        solo_serving = await start_serving(tg, smollm2, transport, config, num_pages=160)
        solo = [await run(solo_serving.scheduler.submit(p, GREEDY, A, cache_salt=f"cold{i}"))
                for i, p in enumerate(a_prompts)]
        assert all(reason == "length" for _, reason, _ in solo)
        assert all(c in text for c, (text, _, _) in zip(canaries, solo))  # the model echoes them
        # FAILURES 24: b sends exactly a's prompt, which a's cache holds: b finds nothing cached
        for tenant, want in ((A, 0), (A, len(a_prompts[2]) // 16 * 16), (B, 0)):
            got = await cached_tokens(solo_serving.scheduler.submit(a_prompts[2], GREEDY, tenant))
            assert got in (want, want - 16), (tenant, got)
        await solo_serving.aclose()

        serving = await start_serving(tg, smollm2, transport, config, num_pages=48, faults=faults)
        s = serving.scheduler
        with pytest.raises(AdmissionRejected):  # over-long: refused before anything exists
            s.submit(chat(tok, "tell me " * 400), GREEDY, B)
        near = chat(tok, "Summarize: " + "the cat sat on the mat. " * 60)[: CONTEXT - 30]
        results: dict[str, tuple[str, str | None, str | None]] = {}

        async def a(i: int) -> None:
            results[f"a{i}"] = await run(s.submit(a_prompts[i], GREEDY, A))

        async def b(name: str, prompt: list[int], abort_after: int | None) -> None:
            results[name] = await run(s.submit(prompt, GREEDY, B), abort_after)

        for _ in range(2):  # the second round finds each tenant's own pages of the first in the cache
            async with anyio.create_task_group() as load:
                for i in range(3):
                    load.start_soon(a, i)
                load.start_soon(b, "b_near", near, None)
                load.start_soon(b, "b_mid_stream", chat(tok, "What was the code?"), 3)
                load.start_soon(b, "b_mid_transfer", chat(tok, "Repeat the previous code."), 0)
                load.start_soon(b, "b_plain", chat(tok, "Say a secret code."), None)

            for name, (text, reason, error) in results.items():
                if name.startswith("b"):
                    assert not any(c[3:7] in text for c in canaries), (name, text)
                    assert reason in ("length", "stop", None)
            for i, (want, _, _) in enumerate(solo):
                text, reason, error = results[f"a{i}"]
                if error is None:
                    assert (text, reason) == (want, "length")
                else:
                    assert error in ("kv_transfer_failed",) and want.startswith(text)
        # partial hits happened on both sides of the tenant line, each within its own tenant
        assert all(s.metrics.tokens.labels(t, "cached")._value.get() > 0 for t in ("a", "b"))
        with anyio.fail_after(10):
            while s.in_flight():
                await anyio.sleep(0.01)
        if faults:  # every fault of the plan really fired during the load
            injected = s.link.sender.transport.injected  # type: ignore[union-attr]
            assert set(injected) == FaultPlan.parse(faults).kinds(), injected
        # back to baseline, but for what an unacknowledged cancel keeps quarantined (`stuck` only)
        held = {"prefill": s.ledger("prefill").num_quarantined, "decode": s.ledger("decode").num_quarantined}
        assert s.pages_in_use() == held
        # `stuck` is a sender whose cancel is never acknowledged: both ends stay quarantined
        assert bool(held["decode"]) == bool(held["prefill"]) == ("stuck" in faults)
        assert sum(s.metrics.integrity_violations.labels(role, check)._value.get()
                   for role in ("prefill", "decode") for check in ("owner_tag", "sanitizer")) == 0
        s.flush_cache()  # what only the cache held comes back: all free but the quarantined pages
        assert {role: s.ledger(role).num_used for role in held} == held
        await serving.aclose()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_b_never_sees_a_canary_when_requests_are_preempted(smollm2: Checkpoint) -> None:
    """Both tenants' requests outgrow a small decode pool at once, so running requests are preempted
    and recomputed (finding their own tenant's prompt pages cached) while the other tenant's sealed
    pages sit beside them: B never sees a canary, A's outputs equal its cold solo runs."""
    tok = smollm2.tokenizer
    rng = random.Random(11)
    canaries = [f"KVF{rng.getrandbits(32):08X}" for _ in range(4)]
    a_prompts = [chat(tok, f"Code: {c}. Code: {c}. Code: {c}. Code:") for c in canaries]
    b_prompts = [chat(tok, q) for q in ("What was the code?", "Repeat the previous code.", "Say a secret code.",
                                        "Tell me the code you saw.")]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    config = SchedulerConfig(page_size_tokens=16, max_context_tokens=CONTEXT, max_running=8, max_queue=16,
                             chunk_tokens=128, disaggregated=True, transfer_timeout_s=10)
    async with anyio.create_task_group() as tg:
        solo_serving = await start_serving(tg, smollm2, "tcp", config, num_pages=160)
        solo = [await run(solo_serving.scheduler.submit(p, params, A, cache_salt=f"cold{i}"))
                for i, p in enumerate(a_prompts)]
        await solo_serving.aclose()

        serving = await start_serving(tg, smollm2, "tcp", config, num_pages=40)
        s = serving.scheduler
        for _ in range(2):
            results: dict[str, tuple[str, str | None, str | None]] = {}

            async def one(name: str, prompt: list[int], tenant: Tenant) -> None:
                results[name] = await run(s.submit(prompt, params, tenant))

            async with anyio.create_task_group() as load:
                for i in range(4):
                    load.start_soon(one, f"a{i}", a_prompts[i], A)
                    load.start_soon(one, f"b{i}", b_prompts[i], B)
            for i in range(4):
                assert results[f"a{i}"] == solo[i]
                text, reason, error = results[f"b{i}"]
                assert error is None and reason == "length"
                assert not any(c[3:7] in text for c in canaries), text
        assert s.metrics.preemptions._value.get() > 0
        assert all(s.metrics.tokens.labels(t, "cached")._value.get() > 0 for t in ("a", "b"))
        assert sum(s.metrics.integrity_violations.labels(role, check)._value.get()
                   for role in ("prefill", "decode") for check in ("owner_tag", "sanitizer")) == 0
        assert s.pages_in_use() == {"prefill": 0, "decode": 0}
        s.flush_cache()
        assert {role: s.ledger(role).num_used for role in ("prefill", "decode")} == {"prefill": 0, "decode": 0}
        await serving.aclose()
        tg.cancel_scope.cancel()
