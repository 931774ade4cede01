"""A seq that fails inside a batched step fails alone, through the worker's real message path
(RunStep) over a tiny model: its reply names it in `failed` and gives it no token, and every other
seq of the step gets exactly the token it gets in a step of its own."""

from __future__ import annotations

import torch

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.grammar import grammar_spec
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.registry import build_model
from kvfence.engine.protocol import PageGrant, RunStep, SeqStep, StepDone
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.runner import ModelRunner
from kvfence.engine.worker import Worker

A, B, C = (7 << 100) | 1, (9 << 90) | 5, (3 << 80) | 9  # leases
PROMPTS = {A: [5, 6, 7, 8, 9], B: [10, 11, 12, 13], C: [14, 15, 16]}
PAGES = {A: [0, 1], B: [2], C: [3]}
GRAMMAR = grammar_spec("json_object")


def worker(tiny: Checkpoint) -> Worker:
    model = build_model(tiny, torch.float32)
    return Worker("colocated", ModelRunner(model, KVPool(model.config, 8, 4, torch.float32)), tokenizer=tiny.tokenizer)


def seq(lease: int, broken: bool = False) -> SeqStep:
    if not broken:
        return SeqStep(lease=lease, token_ids=PROMPTS[lease], context_tokens=0, new_pages=PAGES[lease],
                       sampling=SamplingParams(temperature=0))
    # a penalized first sampling step whose history does not reach its position: it cannot be built
    return SeqStep(lease=lease, token_ids=PROMPTS[lease], context_tokens=0, new_pages=PAGES[lease],
                   sampling=SamplingParams(temperature=0, presence_penalty=1.0), history=[1, 2],
                   prompt_tokens=len(PROMPTS[lease]))


def run(w: Worker, seqs: list[SeqStep]) -> StepDone:
    reply = w.execute(RunStep(step_id=1, seqs=seqs, grants=[PageGrant(s.lease, s.new_pages) for s in seqs]))
    assert isinstance(reply, StepDone), reply
    return reply


def test_a_seq_that_cannot_be_built_fails_alone(tiny: Checkpoint) -> None:
    solo = {lease: run(worker(tiny), [seq(lease)]).tokens[0] for lease in (A, C)}
    reply = run(worker(tiny), [seq(A), seq(B, broken=True), seq(C)])
    assert reply.tokens == [solo[A], None, solo[C]]
    assert [(f.seq_index, f.request_fault) for f in reply.failed] == [(1, False)]
    assert "history of 2 tokens" in reply.failed[0].message
    assert reply.violations == []


def test_a_step_of_only_failing_seqs_still_answers(tiny: Checkpoint) -> None:
    reply = run(worker(tiny), [seq(B, broken=True)])
    assert reply.tokens == [None] and [f.seq_index for f in reply.failed] == [0]


def test_a_seq_whose_grammar_is_compiling_is_left_out_and_the_others_run(tiny: Checkpoint) -> None:
    """A worker with no compiled copy of a grammar (one in another process than the front end)
    compiles it in the background and leaves that seq out of its steps meanwhile: the other seqs
    get the tokens they get alone, and the same seq sent again runs once the grammar is ready."""
    solo = {lease: run(worker(tiny), [seq(lease)]).tokens[0] for lease in (A, C)}
    w = worker(tiny)
    bound = SeqStep(lease=B, token_ids=PROMPTS[B], context_tokens=0, new_pages=PAGES[B],
                    sampling=SamplingParams(temperature=0, grammar_key="key-b"), history=[], prompt_tokens=len(PROMPTS[B]),
                    grammar=GRAMMAR)
    reply = run(w, [seq(A), bound, seq(C)])
    assert reply.tokens == [solo[A], None, solo[C]] and reply.deferred == [1] and reply.failed == []
    assert w.page_tables.extend(B, []) == PAGES[B]  # its pages were taken in all the same
    for attempt in range(1200):  # each waits up to 50 ms for the compile: a minute at most
        again = w.execute(RunStep(step_id=2 + attempt,
                                  seqs=[SeqStep(lease=B, token_ids=PROMPTS[B], context_tokens=0, new_pages=[],
                                                sampling=bound.sampling, history=[],
                                                prompt_tokens=len(PROMPTS[B]), grammar=GRAMMAR)]))
        assert isinstance(again, StepDone)
        if not again.deferred:
            break
    assert again.tokens[0] is not None and again.failed == []
