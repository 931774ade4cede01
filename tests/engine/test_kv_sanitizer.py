"""The KV sanitizer: every slot a step reads was written by the reading lease, or the step refuses it.

The worker-level tests build the case owner tags cannot see: pages correctly tagged with the
reader's lease whose slots hold bytes the reader never wrote (a previous tenant's, or a transfer's
that never landed)."""

from __future__ import annotations

import pytest
import torch

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.kv_sanitizer import KvSanitizer
from kvfence.engine.models.registry import build_model
from kvfence.engine.runner import ModelRunner, SeqWork
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.worker import Worker
from kvfence.engine.protocol import Landing, PageGrant, RunStep, SeqStep, StepDone

A, B = (7 << 100) | 1, (9 << 90) | 5  # two 128-bit leases
GREEDY = SamplingParams(temperature=0)


def test_reads_of_own_writes_pass_and_others_are_reported() -> None:
    s = KvSanitizer(num_pages=8, page_size_tokens=4)
    s.record_write(A, [3, 1], 0, 6)  # positions 0..5: page 3 slots 0..3, page 1 slots 0..1
    assert s.check_reads([SeqWork.local(token_ids=[9], context_tokens=6, page_table=[3, 1], lease=A, sampling=GREEDY)]) == []
    assert s.written_by(1, 1) == A and s.written_by(1, 2) == 0
    # one position further was never written
    (v,) = s.check_reads([SeqWork.local(token_ids=[9], context_tokens=7, page_table=[3, 1], lease=A, sampling=GREEDY)])
    assert (v.work_index, v.position, v.page, v.slot, v.lease, v.writer) == (0, 6, 1, 2, A, 0)
    # B overwrote one of A's slots: A's next read names B
    s.record_write(B, [3], 2, 1)
    (v,) = s.check_reads([SeqWork.local(token_ids=[9], context_tokens=6, page_table=[3, 1], lease=A, sampling=GREEDY)])
    assert (v.position, v.page, v.slot, v.writer) == (2, 3, 2, B)


def test_release_unwrites_every_slot_and_only_the_first_bad_slot_is_reported() -> None:
    s = KvSanitizer(num_pages=4, page_size_tokens=4)
    s.record_write(A, [0, 2], 0, 8)
    s.forget([2])
    works = [SeqWork.local(token_ids=[1], context_tokens=8, page_table=[0, 2], lease=A, sampling=GREEDY),
             SeqWork.local(token_ids=[1], context_tokens=4, page_table=[0], lease=A, sampling=GREEDY),
             SeqWork.local(token_ids=[1], context_tokens=0, page_table=[3], lease=B, sampling=GREEDY)]
    violations = s.check_reads(works)
    assert [(v.work_index, v.position, v.page, v.writer) for v in violations] == [(0, 4, 2, 0)]


def test_a_page_table_naming_a_page_outside_the_pool_is_an_error() -> None:
    s = KvSanitizer(num_pages=4, page_size_tokens=4)
    with pytest.raises(ValueError, match="outside 0..3"):
        s.record_write(A, [4], 0, 1)


def worker(tiny: Checkpoint) -> Worker:
    model = build_model(tiny, torch.float32)
    pool = KVPool(model.config, 8, 4, torch.float32)
    return Worker("decode", ModelRunner(model, pool, sanitizer=KvSanitizer(8, 4)))


def seq(lease: int, tokens: list[int], context: int, new_pages: list[int]) -> SeqStep:
    return SeqStep(lease=lease, token_ids=tokens, context_tokens=context, new_pages=new_pages,
                   sampling=SamplingParams(temperature=0))


def run(w: Worker, step_id: int, seqs: list[SeqStep], **fields: object) -> StepDone:
    reply = w.execute(RunStep(step_id=step_id, seqs=seqs, **fields))  # type: ignore[arg-type]
    assert isinstance(reply, StepDone), reply
    return reply


def test_stale_slots_of_a_correctly_tagged_page_are_refused(tiny: Checkpoint) -> None:
    """A's prefill fills pages 0-1; they are released and granted to B, who claims 6 cached tokens it
    never wrote. Owner tags pass (the pages are B's now); the sanitizer refuses the read."""
    w = worker(tiny)
    first = run(w, 1, [seq(A, [5, 6, 7, 8, 9, 10], 0, [0, 1])], grants=[PageGrant(A, [0, 1])])
    assert first.tokens[0] is not None and first.violations == []
    reply = run(w, 2, [seq(B, [3], 6, [0, 1])], released=[0, 1], grants=[PageGrant(B, [0, 1])])
    assert reply.tokens == [None]
    (v,) = reply.violations
    assert (v.check, v.seq_index, v.page, v.owner) == ("sanitizer", 0, 0, 0) and "token 0" in v.detail


def test_a_landed_transfer_counts_as_the_leases_writes_and_only_up_to_its_tokens(tiny: Checkpoint) -> None:
    w = worker(tiny)
    grant = PageGrant(A, [2, 5])
    # The transfer landed 5 tokens; decoding at context 5 reads exactly those.
    ok = run(w, 1, [seq(A, [4], 5, [2, 5])], grants=[grant], landed=[Landing(lease=A, pages=[2, 5], num_tokens=5)])
    assert ok.tokens[0] is not None and ok.violations == []
    # Another sequence whose transfer claimed 3 tokens but decodes from 5 is refused, alone.
    grant_b = PageGrant(B, [3, 4])
    reply = run(w, 2, [seq(A, [7], 6, []), seq(B, [4], 5, [3, 4])], grants=[grant_b],
                landed=[Landing(lease=B, pages=[3, 4], num_tokens=3)])
    assert reply.tokens[0] is not None and reply.tokens[1] is None
    (v,) = reply.violations
    assert (v.check, v.seq_index, v.page) == ("sanitizer", 1, 3) and "token 3" in v.detail


def test_the_owner_check_still_runs_and_refused_steps_record_no_writes(tiny: Checkpoint) -> None:
    w = worker(tiny)
    # B names A's page: the owner check refuses it; the sanitizer must not count B's would-be write.
    reply = run(w, 1, [seq(A, [1, 2, 3], 0, [0]), seq(B, [4, 5], 0, [0])], grants=[PageGrant(A, [0])])
    assert reply.tokens[0] is not None and reply.tokens[1] is None
    (v,) = reply.violations
    assert v.check == "owner_tag" and v.owner == A
    assert w.sanitizer is not None and w.sanitizer.written_by(0, 0) == A
