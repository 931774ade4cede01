"""The worker protocol carries a request's SamplingParams as they are: no second description of
sampling exists, and what a worker decodes is what the scheduler sent, checked as on creation."""

from __future__ import annotations

import msgspec
import pytest

from kvfence.engine.grammar import Compiled, grammar_spec
from kvfence.engine.protocol import RunStep, SeqStep, decode_request, encode
from kvfence.engine.sampling import SamplingParams

FULL = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=123, max_tokens=17, stop=("END",),
                      stop_token_ids=(2,), presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2,
                      min_p=0.05, logit_bias=((5, -3.5), (9, 100.0)), logprobs=3, prompt_logprobs=1)


def step(sampling: SamplingParams | None) -> RunStep:
    return RunStep(step_id=7, seqs=[SeqStep(lease=(1 << 127) | 3, token_ids=[1, 2, 3], context_tokens=0,
                                            new_pages=[4], sampling=sampling)])


@pytest.mark.parametrize("sampling", [FULL, SamplingParams(temperature=0), None], ids=["every field", "greedy", "none"])
def test_sampling_params_cross_the_wire_unchanged(sampling: SamplingParams | None) -> None:
    decoded = decode_request(encode(step(sampling)))
    assert isinstance(decoded, RunStep)
    assert decoded == step(sampling)
    assert decoded.seqs[0].sampling is None or type(decoded.seqs[0].sampling) is SamplingParams


def test_steps_carry_a_grammar_by_its_key_not_its_text() -> None:
    spec = grammar_spec("json_object")
    params = SamplingParams(temperature=0, grammar=spec, compiled_grammar=Compiled.__new__(Compiled))
    carried = params.for_steps()
    assert carried.grammar is None and carried.compiled_grammar is None
    assert carried.grammar_key == params.grammar_key != "" and carried.tracks_history
    assert spec.encode() not in encode(step(carried))
    assert FULL.for_steps() is FULL  # nothing to leave out


def test_a_step_whose_sampling_is_out_of_range_is_refused_on_decoding() -> None:
    wire = encode(step(FULL)).replace(b'"temperature":0.7', b'"temperature":-1.0')
    with pytest.raises(msgspec.ValidationError, match="temperature must be a finite number >= 0"):
        decode_request(wire)
