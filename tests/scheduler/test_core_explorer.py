"""Exhaustive check of the real scheduler core (tests/scheduler/core_explorer.py): every
interleaving of submit, abort, step replies, failed steps, worker restarts and losses, transfer success,
quiet and loud transfer failures, late writes, quiet reports and deadlines, for two requests and a
few pages, with the invariants of BRIEF.md checked after every event. And proof that it finds real
bugs: two the core once had, put back, are each found with a short trace."""

from __future__ import annotations

import pytest
from core_explorer import Budget, Violation, World, explore

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.config import SchedulerConfig
from kvfence.scheduler.core import SchedulerCore

PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
PROMPTS = [[5, 6, 7], [8, 9, 10]]


SHARED_PROMPTS = [[5, 6, 7], [5, 6, 7]]  # one full page alike: the second can share the first's


def world_factory(tiny: Checkpoint, disaggregated: bool, budget: Budget, pages: int = 4, chunk: int = 4,  # type: ignore[no-untyped-def]
                  cache: bool = False, prompts: list[list[int]] = PROMPTS, decodes: int = 1, samples: int = 1):
    config = SchedulerConfig(page_size_tokens=2, max_context_tokens=8, max_running=2, max_queue=samples,
                             chunk_tokens=chunk, disaggregated=disaggregated, queue_timeout_s=10, heartbeat_s=1,
                             max_preemptions=1, prefix_cache=cache)
    return lambda: World(tiny.tokenizer, config, pages, prompts, PARAMS, budget, decodes, samples)


@pytest.mark.parametrize(("disaggregated", "budget", "chunk", "cache"), [
    (True, Budget(restarts=1, transfer_faults=1, aborts=1, ticks=0), 4, False),
    (True, Budget(restarts=0, transfer_faults=1, aborts=1, ticks=1, failed_steps=1), 2, False),
    (False, Budget(restarts=1, transfer_faults=0, aborts=1, ticks=1, failed_steps=1), 2, False),
    (True, Budget(restarts=0, transfer_faults=1, aborts=1, ticks=0, flushes=1), 4, True),
    (False, Budget(restarts=1, transfer_faults=0, aborts=1, ticks=1, failed_steps=1, flushes=1), 2, True),
], ids=["disaggregated-faults", "disaggregated-chunked", "colocated", "disaggregated-shared-prefix",
        "colocated-shared-prefix"])
def test_every_interleaving_keeps_the_invariants(tiny: Checkpoint, disaggregated: bool, budget: Budget,
                                                 chunk: int, cache: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """The prefix-cache runs submit the same prompt twice: the second may share the first's sealed
    page in either pool (or both), while the first still runs, after it ended, or after a flush."""
    report = explore(world_factory(tiny, disaggregated, budget, chunk=chunk, cache=cache,
                                   prompts=SHARED_PROMPTS if cache else PROMPTS))
    with capsys.disabled():
        print(f"\ncore explorer ({'disaggregated' if disaggregated else 'colocated'}, chunk {chunk}"
              f"{', shared prefix' if cache else ''}): {report}")
    assert report.quiescent > 0 and report.states > 100
    if cache:
        assert report.shared > 0  # some path did read a page another request sealed


@pytest.mark.parametrize("disaggregated", [True, False], ids=["disaggregated", "colocated"])
def test_every_interleaving_of_two_samples_keeps_the_invariants(tiny: Checkpoint, disaggregated: bool,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Two samples of one request (OpenAI's `n`): the second waits until the first's prompt page is
    cached, then shares it; or runs alone once the first was aborted, preempted or retried."""
    # no queue deadline: it would end a sample left waiting forever, which must be found instead
    budget = (Budget(restarts=0, transfer_faults=1, aborts=1, ticks=0, flushes=1) if disaggregated else
              Budget(restarts=1, transfer_faults=0, aborts=1, ticks=0, failed_steps=1, flushes=1))
    report = explore(world_factory(tiny, disaggregated, budget, cache=True, prompts=SHARED_PROMPTS, samples=2))
    with capsys.disabled():
        print(f"\ncore explorer ({'disaggregated' if disaggregated else 'colocated'}, two samples): {report}")
    assert report.quiescent > 0 and report.shared > 0


def test_it_finds_a_release_before_the_transfer_is_quiet(tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put back the bug of freeing the pages of a transfer whose cancellation was not acknowledged."""
    monkeypatch.setattr(SchedulerCore, "_quarantine", lambda self, w, lease, now: w.table.release(lease))
    with pytest.raises(Violation) as found:
        explore(world_factory(tiny, True, Budget(restarts=0, aborts=0, ticks=0, transfer_faults=1)))
    print(found.value)
    assert "freed or given away" in found.value.what or "no longer holds" in found.value.what
    assert len(found.value.trace) <= 10


def test_it_finds_an_emit_before_the_kv_landed(tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put back the bug of a disaggregated request that starts decoding (and streams its first
    token) as soon as its prefill is done, before its KV transfer landed."""
    monkeypatch.setattr(SchedulerCore, "_prefilled", lambda self, req, token, logprobs, now: self._start_decoding(req, token, logprobs, now))
    with pytest.raises(Violation) as found:
        explore(world_factory(tiny, True, Budget(restarts=0, aborts=0, ticks=0, transfer_faults=0)))
    print(found.value)
    assert "before its KV landed" in found.value.what or "did not write" in found.value.what
    assert len(found.value.trace) <= 6


def test_it_finds_a_transfer_plan_that_ignores_the_decode_side_hit(tiny: Checkpoint,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan that moves the whole prompt although the decode lease shares its first page from the
    decode pool's cache would write into a sealed page another request reads (FAILURES 26)."""
    from kvfence.scheduler.actions import StartTransfer

    def whole_prompt(self: SchedulerCore, req):  # type: ignore[no-untyped-def]
        end = self.config.pages_for(req.prefill_target)
        return StartTransfer(req.transfer, req.request_id, req.prefill_target, req.prefill_lease,
                             req.prefill_pages[:end], req.decode_lease, req.decode_pages[:end])

    monkeypatch.setattr(SchedulerCore, "_transfer_plan", whole_prompt)
    with pytest.raises(Violation) as found:
        explore(world_factory(tiny, True, Budget(restarts=0, aborts=0, ticks=0, transfer_faults=0), cache=True,
                              prompts=SHARED_PROMPTS))
    print(found.value)
    assert "no longer holds" in found.value.what or "freed or given away" in found.value.what


def test_it_finds_a_seal_of_pages_the_prefill_did_not_fill(tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sealing the pages of the decode lease before its transfer landed: the transfer would then
    write into sealed pages (and the worker share slots nobody wrote)."""
    real = SchedulerCore._prefilled

    def seal_early(self: SchedulerCore, req, token, logprobs, now):  # type: ignore[no-untyped-def]
        if req.decode_lease != req.prefill_lease:
            self._seal(req.pair.decode, req, req.decode_lease, req.decode_pages, req.shared_decode)
        real(self, req, token, logprobs, now)

    monkeypatch.setattr(SchedulerCore, "_prefilled", seal_early)
    with pytest.raises(Violation) as found:
        explore(world_factory(tiny, True, Budget(restarts=0, aborts=0, ticks=0, transfer_faults=0), cache=True,
                              prompts=SHARED_PROMPTS))
    print(found.value)
    assert any(w in found.value.what for w in ("did not write", "no longer holds", "freed or given away"))


def test_every_interleaving_with_a_lost_worker_keeps_the_invariants(tiny: Checkpoint,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """One prefill worker paired with two decode workers, and any of the three lost at any point
    (mid-step, mid-transfer): retried requests never overlap their old attempt, nothing a transfer
    may touch is freed, and every request ends. (With a transfer fault on top: 31690 states, every
    one clean, but too slow for each run of the suite.)"""
    report = explore(world_factory(tiny, True, Budget(restarts=0, transfer_faults=0, aborts=0, ticks=0,
                                                      losses=1), decodes=2))
    with capsys.disabled():
        print(f"\ncore explorer (one prefill, two decode workers, a worker lost): {report}")
    assert report.quiescent > 0 and report.states > 100


def test_it_finds_requests_left_behind_by_a_lost_prefill_worker(tiny: Checkpoint,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Forgetting that a request still prefilling needs its prefill worker: it never ends."""
    monkeypatch.setattr(SchedulerCore, "_needs_worker", staticmethod(
        lambda req, w: req.pair is not None and req.pair.decode is w))
    with pytest.raises(Violation) as found:
        explore(world_factory(tiny, True, Budget(restarts=0, transfer_faults=0, aborts=0, ticks=0, losses=1),
                              decodes=2))
    print(found.value)
    assert "not terminal" in found.value.what
