"""A step cut short between layers (RunStep.cuttable, WorkerChannel.cut) over a real tiny model:
its reply defers every seq that ran and gives none a token, and sending those seqs again gives
exactly the tokens and logits of a worker that never cut them, wherever the cut fell (the layers
that ran wrote K/V only into slots past each seq's context, which the second run writes again
with the same bits); a step not sent cuttable runs whole when asked; a seq refused by the owner
check is still reported, not deferred."""

from __future__ import annotations

import pytest
import torch

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.llama import LlamaModel
from kvfence.engine.protocol import PageGrant, RunStep, SeqStep, StepDone
from kvfence.engine.runner import ModelRunner, SeqWork
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.worker import Worker

A, B = (7 << 100) | 1, (9 << 90) | 5  # leases
PAGE = 4


def runner(tiny: Checkpoint, cpu_kernels: bool) -> ModelRunner:
    model = LlamaModel(tiny, torch.float32, cpu_kernels=cpu_kernels)
    r = ModelRunner(model, KVPool(model.config, 12, PAGE, torch.float32))
    r.pool.data.fill_(float("nan"))  # a slot read before it is written poisons the logits
    return r


def works(context: int = 0) -> list[SeqWork]:
    """A's chunk of 7 tokens after `context` tokens of its own, B's whole 5-token prompt."""
    a = [5 + i for i in range(context + 7)]
    return [SeqWork.local(token_ids=a[context:], context_tokens=context, page_table=[0, 1, 2, 3], lease=A,
                    sampling=SamplingParams(temperature=0)),
            SeqWork.local(token_ids=[40, 41, 42, 43, 44], context_tokens=0, page_table=[4, 5], lease=B,
                    sampling=SamplingParams(temperature=0))]


def prefill_a(r: ModelRunner, context: int) -> None:
    a = [5 + i for i in range(context)]
    r.step([SeqWork.local(token_ids=a, context_tokens=0, page_table=[0, 1, 2, 3], lease=A, sampling=None)])


def tag(r: ModelRunner) -> None:
    r.pool.assign([0, 1, 2, 3], A)
    r.pool.assign([4, 5], B)


class CutAt:
    """Answers True from its `layer`-th question on (0: before the first layer)."""

    def __init__(self, layer: int) -> None:
        self.layer, self.asked = layer, 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.asked > self.layer


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["fused-layers", "per-op"])
def test_a_step_cut_at_any_layer_runs_again_to_the_same_bits(tiny: Checkpoint, cpu_kernels: bool) -> None:
    whole = runner(tiny, cpu_kernels)
    tag(whole)
    prefill_a(whole, 6)
    want = whole.step(works(6), return_logits=True)
    assert (whole.model.fused_layers is not None) == cpu_kernels
    layers = whole.model.config.num_layers
    for layer in sorted({0, 1, layers // 2, layers - 1}):
        r = runner(tiny, cpu_kernels)
        tag(r)
        prefill_a(r, 6)
        cut = CutAt(layer)
        first = r.step(works(6), return_logits=True, cut=cut)
        assert first.cut and first.tokens == [None, None] and first.logits is None, layer
        assert cut.asked == layer + 1  # it stopped at the first True
        again = r.step(works(6), return_logits=True, cut=CutAt(layers + 1))
        assert not again.cut and again.tokens == want.tokens, layer
        assert torch.equal(again.logits, want.logits), layer
        assert torch.equal(r.pool.data.nan_to_num(7.0), whole.pool.data.nan_to_num(7.0)), layer


def worker(tiny: Checkpoint) -> Worker:
    model = LlamaModel(tiny, torch.float32)
    return Worker("prefill", ModelRunner(model, KVPool(model.config, 12, PAGE, torch.float32)),
                  tokenizer=tiny.tokenizer)


def seqs() -> list[SeqStep]:
    return [SeqStep(lease=A, token_ids=[5, 6, 7, 8, 9, 10, 11], context_tokens=0, new_pages=[0, 1],
                    sampling=SamplingParams(temperature=0)),
            SeqStep(lease=B, token_ids=[40, 41, 42, 43, 44], context_tokens=0, new_pages=[4, 5],
                    sampling=SamplingParams(temperature=0))]


def grants() -> list[PageGrant]:
    return [PageGrant(A, [0, 1]), PageGrant(B, [4, 5])]


def test_a_worker_asked_to_cut_a_cuttable_step_defers_every_seq_and_runs_them_again(tiny: Checkpoint) -> None:
    want = worker(tiny).execute(RunStep(step_id=1, seqs=seqs(), grants=grants()))
    assert isinstance(want, StepDone) and None not in want.tokens
    w = worker(tiny)
    w.ask_cut(1)  # asked before it started: it stops before the first layer
    cut = w.execute(RunStep(step_id=1, seqs=seqs(), grants=grants(), cuttable=True))
    assert isinstance(cut, StepDone) and cut.cut and cut.deferred == [0, 1] and cut.tokens == [None, None]
    assert w.page_tables.extend(A, []) == [0, 1]  # its tag changes and page tables were applied all the same
    again = w.execute(RunStep(step_id=2,
                              seqs=[SeqStep(lease=s.lease, token_ids=s.token_ids, context_tokens=0, new_pages=[],
                                            sampling=s.sampling) for s in seqs()], cuttable=True))
    assert isinstance(again, StepDone) and not again.cut and again.tokens == want.tokens


def test_a_step_not_sent_cuttable_runs_whole_when_asked(tiny: Checkpoint) -> None:
    want = worker(tiny).execute(RunStep(step_id=1, seqs=seqs(), grants=grants()))
    w = worker(tiny)
    w.ask_cut(1)
    reply = w.execute(RunStep(step_id=1, seqs=seqs(), grants=grants()))
    assert isinstance(reply, StepDone) and not reply.cut and reply.deferred == [] and reply.tokens == want.tokens


def test_a_cut_for_another_step_does_not_touch_this_one(tiny: Checkpoint) -> None:
    w = worker(tiny)
    w.ask_cut(7)
    reply = w.execute(RunStep(step_id=8, seqs=seqs(), grants=grants(), cuttable=True))
    assert isinstance(reply, StepDone) and not reply.cut and None not in reply.tokens


def test_a_seq_refused_by_the_owner_check_is_reported_not_deferred(tiny: Checkpoint) -> None:
    w = worker(tiny)
    w.ask_cut(1)
    stolen = [seqs()[0], SeqStep(lease=B, token_ids=[40, 41, 42, 43, 44], context_tokens=0, new_pages=[0, 1],
                                 sampling=SamplingParams(temperature=0))]  # A's pages
    reply = w.execute(RunStep(step_id=1, seqs=stolen, grants=[PageGrant(A, [0, 1]), PageGrant(B, [])],
                              cuttable=True))
    assert isinstance(reply, StepDone) and reply.cut
    assert [v.seq_index for v in reply.violations] == [1] and reply.deferred == [0]
