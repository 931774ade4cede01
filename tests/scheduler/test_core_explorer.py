"""Exhaustive check of the real scheduler core (tests/scheduler/core_explorer.py): every
interleaving of submit, abort, step replies, failed steps, worker restarts, transfer success,
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


def world_factory(tiny: Checkpoint, disaggregated: bool, budget: Budget, pages: int = 4, chunk: int = 4):  # type: ignore[no-untyped-def]
    config = SchedulerConfig(page_size_tokens=2, max_context_tokens=8, max_running=2, max_queue=1, chunk_tokens=chunk,
                             disaggregated=disaggregated, queue_timeout_s=10, heartbeat_s=1, max_preemptions=1)
    return lambda: World(tiny.tokenizer, config, pages, PROMPTS, PARAMS, budget)


@pytest.mark.parametrize(("disaggregated", "budget", "chunk"), [
    (True, Budget(restarts=1, transfer_faults=1, aborts=1, ticks=0), 4),
    (True, Budget(restarts=0, transfer_faults=1, aborts=1, ticks=1, failed_steps=1), 2),
    (False, Budget(restarts=1, transfer_faults=0, aborts=1, ticks=1, failed_steps=1), 2),
], ids=["disaggregated-faults", "disaggregated-chunked", "colocated"])
def test_every_interleaving_keeps_the_invariants(tiny: Checkpoint, disaggregated: bool, budget: Budget,
                                                 chunk: int, capsys: pytest.CaptureFixture[str]) -> None:
    report = explore(world_factory(tiny, disaggregated, budget, chunk=chunk))
    with capsys.disabled():
        print(f"\ncore explorer ({'disaggregated' if disaggregated else 'colocated'}, chunk {chunk}): {report}")
    assert report.quiescent > 0 and report.states > 100


def test_it_finds_a_release_before_the_transfer_is_quiet(tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put back the bug of freeing the pages of a transfer whose cancellation was not acknowledged."""
    monkeypatch.setattr(SchedulerCore, "_quarantine", lambda self, table, lease, now: table.release(lease))
    with pytest.raises(Violation) as found:
        explore(world_factory(tiny, True, Budget(restarts=0, aborts=0, ticks=0, transfer_faults=1)))
    print(found.value)
    assert "freed or given away" in found.value.what or "no longer holds" in found.value.what
    assert len(found.value.trace) <= 10


def test_it_finds_an_emit_before_the_kv_landed(tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put back the bug of a disaggregated request that starts decoding (and streams its first
    token) as soon as its prefill is done, before its KV transfer landed."""
    monkeypatch.setattr(SchedulerCore, "_prefilled", lambda self, req, token, now: self._start_decoding(req, token, now))
    with pytest.raises(Violation) as found:
        explore(world_factory(tiny, True, Budget(restarts=0, aborts=0, ticks=0, transfer_faults=0)))
    print(found.value)
    assert "before its KV landed" in found.value.what or "did not write" in found.value.what
    assert len(found.value.trace) <= 6
