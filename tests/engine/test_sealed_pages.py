"""Sealed pages on the worker: the tag rule and the sanitizer for KV shared by the prefix cache.

A read passes only if the page is the reader's own or sealed with the reader's seal (its
tenant's); a write into a sealed page is a violation; a page is sealed only where the sealing
lease's tag is, and the sanitizer keeps only the slots that lease wrote. Each case runs through
the worker's real message path (RunStep) over a tiny model.
"""

from __future__ import annotations

import torch

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.kv_sanitizer import KvSanitizer
from kvfence.engine.models.registry import build_model
from kvfence.engine.owner_check import check_owner_tags
from kvfence.engine.protocol import Landing, PageGrant, RunStep, Seal, SeqStep, StepDone
from kvfence.engine.runner import ModelRunner, SeqWork
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.worker import Worker

A, B, C = (7 << 100) | 1, (9 << 90) | 5, (3 << 80) | 9  # leases
SEAL_T, SEAL_U = (5 << 110) | 2, (6 << 110) | 4  # two tenants' seals
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # two full pages of 4, and one token more
GREEDY = SamplingParams(temperature=0)


def worker(tiny: Checkpoint) -> Worker:
    model = build_model(tiny, torch.float32)
    return Worker("colocated", ModelRunner(model, KVPool(model.config, 8, 4, torch.float32),
                                           sanitizer=KvSanitizer(8, 4)))


def run(w: Worker, step_id: int, seqs: list[SeqStep], **fields: object) -> StepDone:
    reply = w.execute(RunStep(step_id=step_id, seqs=seqs, **fields))  # type: ignore[arg-type]
    assert isinstance(reply, StepDone), reply
    return reply


def seq(lease: int, tokens: list[int], context: int, new_pages: list[int], seal: int) -> SeqStep:
    return SeqStep(lease=lease, token_ids=tokens, context_tokens=context, new_pages=new_pages,
                   sampling=SamplingParams(temperature=0), seal=seal)


def prefill_and_seal(w: Worker) -> int:
    """A prefills PROMPT into pages 0, 1, 2; pages 0 and 1 are sealed for tenant T. Returns A's token."""
    first = run(w, 1, [seq(A, PROMPT, 0, [0, 1, 2], SEAL_T)], grants=[PageGrant(A, [0, 1, 2])])
    run(w, 2, [], sealed=[Seal(A, SEAL_T, [0, 1])])
    assert [w.pool.owner(p) for p in (0, 1, 2)] == [SEAL_T, SEAL_T, A]
    token = first.tokens[0]
    assert token is not None
    return token


def test_a_lease_of_the_same_tenant_reads_sealed_pages_and_gets_the_cold_answer(tiny: Checkpoint) -> None:
    w = worker(tiny)
    cold = prefill_and_seal(w)
    # B (same tenant) shares pages 0-1 and prefills only the last token into its own page 3
    reply = run(w, 3, [seq(B, PROMPT[8:], 8, [0, 1, 3], SEAL_T)], grants=[PageGrant(B, [3])])
    assert reply.violations == [] and reply.tokens == [cold]
    # A keeps decoding over its sealed pages too
    assert run(w, 4, [seq(A, [cold], 9, [], SEAL_T)]).violations == []


def test_another_tenants_seal_is_refused_before_anything_is_read(tiny: Checkpoint) -> None:
    w = worker(tiny)
    prefill_and_seal(w)
    reply = run(w, 3, [seq(C, PROMPT[8:], 8, [0, 1, 3], SEAL_U)], grants=[PageGrant(C, [3])])
    assert reply.tokens == [None]
    (v,) = reply.violations
    assert (v.check, v.page, v.owner) == ("owner_tag", 0, SEAL_T)
    # no seal at all (a request that is not cached) reads only its own pages
    reply = run(w, 4, [seq(C, PROMPT[8:], 8, [], 0)])
    assert reply.tokens == [None] and reply.violations[0].owner == SEAL_T


def test_a_write_into_a_sealed_page_is_a_violation(tiny: Checkpoint) -> None:
    r = worker(tiny).runner
    r.pool.assign([0, 1], SEAL_T)
    r.pool.assign([2], B)
    # context 6 ends inside page 1: the step would write position 6 into a sealed page
    (v,) = check_owner_tags(r.pool, [SeqWork.local(token_ids=[9], context_tokens=6, page_table=[0, 1, 2], lease=B,
                                             sampling=GREEDY, seal=SEAL_T)])
    assert (v.page, v.owner) == (1, SEAL_T)
    # context 8: pages 0-1 are only read, position 8 lands in B's own page 2
    assert check_owner_tags(r.pool, [SeqWork.local(token_ids=[9], context_tokens=8, page_table=[0, 1, 2], lease=B,
                                             sampling=GREEDY, seal=SEAL_T)]) == []


def test_a_seal_applies_only_where_the_sealing_lease_owns_the_page(tiny: Checkpoint) -> None:
    """A seal that names a page tagged with another lease leaves that tag: every read of it still
    fails closed, so a wrong seal can never make a page readable."""
    w = worker(tiny)
    run(w, 1, [seq(A, PROMPT[:4], 0, [0], SEAL_T)], grants=[PageGrant(A, [0]), PageGrant(C, [1])])
    run(w, 2, [], sealed=[Seal(A, SEAL_T, [0, 1])])
    assert w.pool.owner(0) == SEAL_T and w.pool.owner(1) == C


def test_the_sanitizer_keeps_only_slots_the_sealing_lease_wrote(tiny: Checkpoint) -> None:
    """A landing of 6 tokens into pages 4-5 covers page 5 only in part: sealing both hands page 4's
    slots to the seal and leaves page 5's unwritten half unreadable."""
    w = worker(tiny)
    run(w, 1, [], grants=[PageGrant(A, [4, 5])], landed=[Landing(lease=A, pages=[4, 5], num_tokens=6)],
        sealed=[Seal(A, SEAL_T, [4, 5])])
    s = w.sanitizer
    assert s is not None
    assert [s.written_by(4, i) for i in range(4)] == [SEAL_T] * 4
    assert [s.written_by(5, i) for i in range(4)] == [SEAL_T, SEAL_T, 0, 0]
    ok = SeqWork.local(token_ids=[1], context_tokens=6, page_table=[4, 5], lease=B, sampling=GREEDY, seal=SEAL_T)
    assert s.check_reads([ok]) == []
    (v,) = s.check_reads([SeqWork.local(token_ids=[1], context_tokens=7, page_table=[4, 5], lease=B, sampling=GREEDY,
                                  seal=SEAL_T)])
    assert (v.position, v.writer) == (6, 0)
    (v,) = s.check_reads([SeqWork.local(token_ids=[1], context_tokens=6, page_table=[4, 5], lease=B, sampling=GREEDY,
                                  seal=SEAL_U)])  # another tenant's seal
    assert (v.position, v.writer) == (0, SEAL_T)
