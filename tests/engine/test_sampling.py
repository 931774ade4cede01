"""Sampler: greedy, top-k, top-p, seeded reproducibility, the sampled distribution, validation."""

from __future__ import annotations

import pytest
import torch

from kvfence.engine.sampling import Sampler, SamplingParams

VOCAB = 1000


def _logits(num_rows: int, vocab: int = VOCAB, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=gen) * scale  # [N, V] float32


def test_greedy_is_argmax() -> None:
    logits = _logits(16)
    tokens = Sampler(seed=0).sample(logits, [SamplingParams(temperature=0.0)] * 16, list(range(16)))
    assert tokens.dtype == torch.int64 and tokens.shape == (16,)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    logits = _logits(8, scale=0.1)  # flat: sampled rows rarely hit the argmax
    params = [SamplingParams(temperature=0.0) if row % 2 == 0 else SamplingParams(temperature=1.0)
              for row in range(8)]
    tokens = Sampler(seed=0).sample(logits, params, [0] * 8)
    assert torch.equal(tokens[0::2], logits[0::2].argmax(dim=-1))
    assert not torch.equal(tokens[1::2], logits[1::2].argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0, 100.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature: float) -> None:
    logits = _logits(32, scale=0.5)
    params = [SamplingParams(temperature=temperature, top_k=1)] * 32
    tokens = Sampler(seed=1).sample(logits, params, list(range(32)))
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_tiny_top_p_is_greedy() -> None:
    logits = _logits(32, scale=0.5)
    params = [SamplingParams(temperature=2.0, top_p=1e-6)] * 32
    tokens = Sampler(seed=2).sample(logits, params, list(range(32)))
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_top_k_2_never_leaves_the_top_2_and_k_off_rows_are_untouched() -> None:
    row = torch.tensor([0.0, 1.0, 0.9, 0.95, -1.0, 0.5])  # top 2: ids 1 and 3
    num_rows = 2000
    logits = row.expand(num_rows, -1).contiguous()  # [N, 6]
    # Even rows top_k=2; odd rows alternate off spellings (0 and -1).
    params = [SamplingParams(temperature=3.0, top_k=2 if r % 2 == 0 else (0 if r % 4 == 1 else -1))
              for r in range(num_rows)]
    tokens = Sampler(seed=3).sample(logits, params, [0] * num_rows)
    kept = set(tokens[0::2].tolist())
    assert kept == {1, 3}
    assert len(set(tokens[1::2].tolist())) == 6  # k off: every token can come out


def test_top_k_is_per_row() -> None:
    row = torch.tensor([0.0, 1.0, 0.9, 0.95, -1.0, 0.5])  # ranks: ids 1, 3, 2, 5, 0, 4
    num_rows = 2000
    logits = row.expand(num_rows, -1).contiguous()  # [N, 6]
    params = [SamplingParams(temperature=3.0, top_k=1 if r % 2 == 0 else 3) for r in range(num_rows)]
    tokens = Sampler(seed=10).sample(logits, params, [0] * num_rows)
    assert set(tokens[0::2].tolist()) == {1}
    assert set(tokens[1::2].tolist()) == {1, 3, 2}


def test_top_p_half_never_leaves_the_nucleus() -> None:
    probs = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])  # nucleus for p=0.5: ids 1 (0.4) and 3 (0.3)
    num_rows = 2000
    logits = probs.log().expand(num_rows, -1).contiguous()  # [N, 5]
    params = [SamplingParams(top_p=0.5) if r % 2 == 0 else SamplingParams() for r in range(num_rows)]
    tokens = Sampler(seed=4).sample(logits, params, [0] * num_rows)
    assert set(tokens[0::2].tolist()) == {1, 3}
    assert len(set(tokens[1::2].tolist())) == 5  # p = 1 rows keep the whole distribution


def test_seeded_row_is_independent_of_batch_and_position() -> None:
    logits_row = _logits(1, scale=0.1, seed=5)[0]  # flat: the noise decides the token
    target = SamplingParams(temperature=1.0, seed=1234)
    alone = [Sampler(seed=0).sample(logits_row[None, :], [target], [i]).item() for i in range(20)]
    assert len(set(alone)) > 10  # the token really depends on the noise

    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.5, top_k=50), SamplingParams(top_p=0.9, seed=99),
              SamplingParams(temperature=1.0)]
    for index in range(20):
        for position in (0, 3, 5):
            batch_params = others[:position] + [target] + others[position:]
            logits = _logits(len(batch_params), scale=0.1, seed=100 + index)
            logits[position] = logits_row
            sampler = Sampler(seed=index)  # a different worker, with a different shared generator
            tokens = sampler.sample(logits, batch_params, [7] * position + [index] + [7] * (6 - position - 1))
            assert tokens[position].item() == alone[index]


def test_different_seeds_give_different_sequences() -> None:
    logits = _logits(1, scale=0.1, seed=6)  # [1, V]
    sampler = Sampler()

    def draws(seed: int) -> list[int]:
        return [sampler.sample(logits, [SamplingParams(seed=seed)], [i]).item() for i in range(50)]

    first = draws(1)
    assert draws(1) == first
    assert draws(2) != first


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = _logits(64, scale=0.1, seed=7)
    params = [SamplingParams()] * 64
    a = Sampler(seed=11).sample(logits, params, [0] * 64)
    b = Sampler(seed=11).sample(logits, params, [0] * 64)
    c = Sampler(seed=12).sample(logits, params, [0] * 64)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("seeded", [True, False])
def test_empirical_distribution_matches_softmax(seeded: bool) -> None:
    logits_row = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3])
    num_draws = 20_000
    logits = logits_row.expand(num_draws, -1).contiguous()  # [N, 5]
    params = [SamplingParams(temperature=1.0, seed=42 if seeded else None)] * num_draws
    tokens = Sampler(seed=8).sample(logits, params, list(range(num_draws)))
    freq = torch.bincount(tokens, minlength=5).float() / num_draws
    expected = torch.softmax(logits_row, dim=-1)
    assert (freq - expected).abs().max().item() < 0.015  # ~4 sigma at 20k draws


def test_temperature_sharpens_the_distribution() -> None:
    logits_row = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3])
    num_draws = 20_000
    logits = logits_row.expand(num_draws, -1).contiguous()
    tokens = Sampler(seed=9).sample(logits, [SamplingParams(temperature=0.5)] * num_draws, [0] * num_draws)
    freq = torch.bincount(tokens, minlength=5).float() / num_draws
    assert (freq - torch.softmax(logits_row / 0.5, dim=-1)).abs().max().item() < 0.015


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": "7"}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": "\n"}, "stop"),
    ({"stop": ("ok", "")}, "stop"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
])
def test_invalid_params_raise_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_valid_params_are_normalized() -> None:
    p = SamplingParams(temperature=0, top_p=1, top_k=-1, max_tokens=1,
                       stop=["a", "b"], stop_token_ids=[3])  # type: ignore[arg-type]
    assert p.temperature == 0.0 and isinstance(p.temperature, float) and p.greedy
    assert p.stop == ("a", "b") and p.stop_token_ids == (3,)
    hash(p)


def test_sample_rejects_mismatched_inputs() -> None:
    logits = _logits(2)
    with pytest.raises(ValueError, match="one SamplingParams"):
        Sampler().sample(logits, [SamplingParams()], [0, 1])
    with pytest.raises(ValueError, match="output_index"):
        Sampler().sample(logits, [SamplingParams()] * 2, [0, -1])
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(logits[0], [SamplingParams()], [0])


def test_params_are_immutable_so_copies_share_them() -> None:
    import copy
    import dataclasses

    p = SamplingParams(temperature=0.5, stop=("x",), logit_bias=((1, 2.0),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]  # the point: it is refused
    assert copy.deepcopy({"a": p})["a"] is p
