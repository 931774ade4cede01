"""Exhaustive check of the real scheduler core (tests/scheduler/core/core_explorer.py): every
interleaving of submit, abort, step replies, failed steps, worker restarts and losses, transfer success,
quiet and loud transfer failures, late writes, quiet reports and deadlines, for two requests and a
few pages, with the invariants of BRIEF.md checked after every event. And proof that it finds real
bugs: two the core once had, put back, are each found with a short trace."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor

import pytest
from core_explorer import Budget
from explorer_search import Report, Violation, explore
from explorer_setup import Setup, explore_setup

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.pages import Pages
from kvfence.scheduler.core.scheduler import SchedulerCore
from kvfence.scheduler.core.transfers import Transfers
from kvfence.scheduler.core.worker_events import WorkerEvents

SHARED_PROMPTS = ((5, 6, 7), (5, 6, 7))  # one full page alike: the second can share the first's


def world_factory(tiny: Checkpoint, disaggregated: bool, budget: Budget, **setup):  # type: ignore[no-untyped-def]
    return Setup(tiny.source, disaggregated, budget, **setup).factory(tiny.tokenizer)


def runs(tiny: Checkpoint) -> dict[str, Setup]:
    """The exhaustive runs, the longest first. The prefix-cache runs submit the same prompt twice:
    the second may share the first's sealed page in either pool (or both), while the first still
    runs, after it ended, or after a flush. The two-sample runs are OpenAI's `n`: the second sample
    waits until the first's prompt page is cached, then shares it; or runs alone once the first
    was aborted, preempted or retried (no queue deadline there: it would end a sample left waiting
    forever, which must be found instead). The lost-worker run pairs one prefill worker with two
    decode workers, any of the three lost at any point (mid-step, mid-transfer): retried requests
    never overlap their old attempt, nothing a transfer may touch is freed, and every request ends
    (with a transfer fault on top: 31690 states, every one clean, but too slow for each run of the
    suite). The seq-failure runs fail any one seq of any step alone (a dead-end grammar, a seq the
    worker could not build): its request ends at that point, whatever state it is in, and the
    other request carries on; and leave any one sampling seq out of its step untouched (its
    grammar still compiling on the worker): it is sent again as it was. The cut run stops any one
    step of chunks sent cuttable short (RunStep.cuttable; outputs of 3 tokens, so the second
    request prefills while the first decodes; six pages, so both fit): its seqs go again as they were."""
    ckpt = tiny.source
    return {
        "disaggregated-shared-prefix": Setup(ckpt, True, Budget(restarts=0, transfer_faults=1, aborts=1, ticks=0,
                                                                  flushes=1), cache=True, prompts=SHARED_PROMPTS),
        "disaggregated-faults": Setup(ckpt, True, Budget(restarts=1, transfer_faults=1, aborts=1, ticks=0)),
        "disaggregated-chunked": Setup(ckpt, True, Budget(restarts=0, transfer_faults=1, aborts=1, ticks=1,
                                                            failed_steps=1), chunk=2),
        "lost-worker": Setup(ckpt, True, Budget(restarts=0, transfer_faults=0, aborts=0, ticks=0, losses=1),
                             decodes=2),
        "colocated-shared-prefix": Setup(ckpt, False, Budget(restarts=1, transfer_faults=0, aborts=1, ticks=1,
                                                               failed_steps=1, flushes=1), chunk=2, cache=True,
                                         prompts=SHARED_PROMPTS),
        "colocated": Setup(ckpt, False, Budget(restarts=1, transfer_faults=0, aborts=1, ticks=1, failed_steps=1),
                           chunk=2),
        "disaggregated-two-samples": Setup(ckpt, True, Budget(restarts=0, transfer_faults=1, aborts=1, ticks=0,
                                                                flushes=1), cache=True, prompts=SHARED_PROMPTS,
                                           samples=2),
        "disaggregated-seq-failure": Setup(ckpt, True, Budget(restarts=0, transfer_faults=1, aborts=0, ticks=0,
                                                                failed_seqs=1, deferred_seqs=1), chunk=2),
        "disaggregated-cut": Setup(ckpt, True, Budget(restarts=0, transfer_faults=0, aborts=1, ticks=0, cuts=1),
                                   chunk=2, pages=6,
                                   params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
        "colocated-seq-failure": Setup(ckpt, False, Budget(restarts=0, transfer_faults=0, aborts=1, ticks=0,
                                                           failed_seqs=1, deferred_seqs=1), chunk=2),
        "colocated-two-samples": Setup(ckpt, False, Budget(restarts=1, transfer_faults=0, aborts=1, ticks=0,
                                                             failed_steps=1, flushes=1), cache=True,
                                       prompts=SHARED_PROMPTS, samples=2),
    }


@pytest.fixture(scope="module")
def explorations(tiny: Checkpoint) -> Iterator[dict[str, Future[Report]]]:
    """Every run of `runs`, two at a time in processes of their own (each is pure Python on one
    core, and CI has two), started when the first test here asks; each test waits for its own."""
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: pool.submit(explore_setup, setup) for name, setup in runs(tiny).items()}
        try:
            yield futures
        finally:
            for f in futures.values():
                f.cancel()


def explored(explorations: dict[str, Future[Report]], name: str, capsys: pytest.CaptureFixture[str]) -> Report:
    report = explorations[name].result()  # a Violation found there is raised here, with its trace
    with capsys.disabled():
        print(f"\ncore explorer ({name}): {report}")
    return report


@pytest.mark.parametrize("name", ["disaggregated-faults", "disaggregated-chunked", "colocated",
                                  "disaggregated-shared-prefix", "colocated-shared-prefix",
                                  "disaggregated-seq-failure", "colocated-seq-failure", "disaggregated-cut"])
def test_every_interleaving_keeps_the_invariants(explorations: dict[str, Future[Report]], name: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    report = explored(explorations, name, capsys)
    assert report.quiescent > 0 and report.states > 100
    if "shared-prefix" in name:
        assert report.shared > 0  # some path did read a page another request sealed
    if name == "disaggregated-cut":
        assert report.cuts > 0  # some path cut a step of chunks short


@pytest.mark.parametrize("name", ["disaggregated-two-samples", "colocated-two-samples"])
def test_every_interleaving_of_two_samples_keeps_the_invariants(explorations: dict[str, Future[Report]], name: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    report = explored(explorations, name, capsys)
    assert report.quiescent > 0 and report.shared > 0


def test_every_interleaving_with_a_lost_worker_keeps_the_invariants(explorations: dict[str, Future[Report]],
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    report = explored(explorations, "lost-worker", capsys)
    assert report.quiescent > 0 and report.states > 100


def test_it_finds_a_release_before_the_transfer_is_quiet(tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put back the bug of freeing the pages of a transfer whose cancellation was not acknowledged."""
    monkeypatch.setattr(Pages, "quarantine", lambda self, w, lease, now: w.table.release(lease))
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
    from kvfence.scheduler.core.actions import StartTransfer

    def whole_prompt(self: Transfers, req):  # type: ignore[no-untyped-def]
        end = self.config.pages_for(req.prefill_target)
        return StartTransfer(key=req.transfer, request_id=req.request_id, num_tokens=req.prefill_target,
                             src_lease=req.prefill_lease, src_pages=req.prefill_pages[:end], dst_lease=req.decode_lease,
                             dst_pages=req.decode_pages[:end])

    monkeypatch.setattr(Transfers, "plan", whole_prompt)
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
            self.pages.seal(req.pair.decode, req, req.decode_lease, req.decode_pages, req.shared_decode)
        real(self, req, token, logprobs, now)

    monkeypatch.setattr(SchedulerCore, "_prefilled", seal_early)
    with pytest.raises(Violation) as found:
        explore(world_factory(tiny, True, Budget(restarts=0, aborts=0, ticks=0, transfer_faults=0), cache=True,
                              prompts=SHARED_PROMPTS))
    print(found.value)
    assert any(w in found.value.what for w in ("did not write", "no longer holds", "freed or given away"))


def test_it_finds_requests_left_behind_by_a_lost_prefill_worker(tiny: Checkpoint,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Forgetting that a request still prefilling needs its prefill worker: it never ends."""
    monkeypatch.setattr(WorkerEvents, "needs_worker", staticmethod(
        lambda req, w: req.pair is not None and req.pair.decode is w))
    with pytest.raises(Violation) as found:
        explore(world_factory(tiny, True, Budget(restarts=0, transfer_faults=0, aborts=0, ticks=0, losses=1),
                              decodes=2))
    print(found.value)
    assert "not terminal" in found.value.what
