"""Logit bias, penalties, min-p and logprobs, batched, against slow per-row references written
from their definitions (OpenAI for presence/frequency/logit_bias, vLLM for repetition/min-p)."""

from __future__ import annotations

import math

import pytest
import torch
from sampling_reference import slow_processed

from kvfence.engine.logits_processing import apply_logit_bias, apply_min_p, apply_penalties
from kvfence.engine.logprobs import token_logprobs
from kvfence.engine.sampling import Sampler, SamplingParams
from kvfence.engine.token_counts import LeaseTokenCounts

VOCAB = 37


def counts_for(prompt: list[int], output: list[int], lease: int, table: LeaseTokenCounts):
    return table.observe(lease, 0, prompt + output, [], len(prompt))


CASES = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, presence_penalty=1.5),
    SamplingParams(temperature=0, frequency_penalty=-0.7),
    SamplingParams(temperature=0, repetition_penalty=1.8),
    SamplingParams(temperature=0, repetition_penalty=0.6, frequency_penalty=0.4, presence_penalty=-1.0,
                   logit_bias=((3, 5.0), (30, -100.0))),
    SamplingParams(temperature=0, logit_bias=((0, 2.5), (36, -1.0), (0, 1.0))),
]


def test_bias_and_penalties_equal_the_slow_reference_row_by_row() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), VOCAB, generator=g) * 3  # [M, V]
    table = LeaseTokenCounts(VOCAB, torch.device("cpu"))
    histories = [(torch.randint(0, VOCAB, (7,), generator=g).tolist(), torch.randint(0, VOCAB, (9,), generator=g).tolist())
                 for _ in CASES]
    counts = [counts_for(prompt, output, lease + 1, table) if p.penalized else None
              for lease, (p, (prompt, output)) in enumerate(zip(CASES, histories))]
    got = apply_penalties(apply_logit_bias(logits.clone(), CASES), CASES, counts)
    for row, (p, (prompt, output)) in enumerate(zip(CASES, histories)):
        want = slow_processed(logits[row].tolist(), p, prompt, output)
        assert got[row].tolist() == pytest.approx(want, abs=1e-5), row


def test_rows_that_ask_for_nothing_are_untouched_bit_for_bit() -> None:
    logits = torch.randn(3, VOCAB)
    plain = [SamplingParams(temperature=0)] * 3
    assert apply_penalties(apply_logit_bias(logits, plain), plain, [None] * 3) is logits
    assert apply_min_p(logits, [0.0] * 3) is logits


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, VOCAB, generator=g) * 2
    min_ps = [0.0, 0.05, 0.3, 1.0]
    got = apply_min_p(logits.clone(), min_ps)
    for row, min_p in enumerate(min_ps):
        probs = torch.softmax(logits[row].double(), -1).tolist()
        top = max(probs)
        for v in range(VOCAB):
            kept = not math.isinf(got[row, v].item())
            assert kept == (min_p == 0 or probs[v] >= min_p * top - 1e-12), (row, v)


def test_greedy_picks_the_argmax_of_the_processed_logits() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 1.0
    params = [SamplingParams(temperature=0, logit_bias=((9, 2.0),)), SamplingParams(temperature=0)]
    assert Sampler(0).sample(logits, params, [0, 0]).tolist() == [9, 5]


def test_counts_follow_a_lease_step_by_step_and_need_their_history() -> None:
    table = LeaseTokenCounts(VOCAB, torch.device("cpu"))
    counts = table.observe(7, 3, [4], [1, 2, 3], prompt_tokens=3)  # prompt 1 2 3, first output 4
    table.observe(7, 4, [4], None, prompt_tokens=3)
    table.observe(7, 5, [1], None, prompt_tokens=3)
    assert counts.output[4].item() == 2 and counts.output[1].item() == 1 and counts.output[2].item() == 0
    assert counts.seen[[1, 2, 3, 4]].all() and counts.seen.sum().item() == 4
    with pytest.raises(ValueError, match="no history"):
        table.observe(8, 5, [1], None, prompt_tokens=3)  # never started
    with pytest.raises(ValueError, match="no history"):
        table.observe(7, 9, [1], None, prompt_tokens=3)  # a gap
    table.forget([7])
    assert len(table) == 0


def test_logprobs_are_the_raw_log_softmax_with_the_top_alternatives() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, VOCAB, generator=g)
    tokens = torch.tensor([4, 0, 36])
    got = token_logprobs(logits, tokens, [2, None, 0])
    lp = torch.log_softmax(logits.double(), -1)
    assert got[1] is None
    assert got[0].logprob == pytest.approx(lp[0, 4].item(), abs=1e-6)
    assert got[0].top_ids == lp[0].topk(2).indices.tolist()
    assert got[0].top_logprobs == pytest.approx(lp[0].topk(2).values.tolist(), abs=1e-6)
    assert got[2].top_ids == [] and got[2].logprob == pytest.approx(lp[2, 36].item(), abs=1e-6)


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                 dict(min_p=1.5), dict(logit_bias=((1, 101.0),)), dict(logit_bias=((-1, 1.0),)),
                                 dict(logprobs=21), dict(logprobs=True)])
def test_sampling_params_refuse_values_out_of_range(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
