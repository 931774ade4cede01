"""Greedy generation of the default model in fp32 through the paged cache equals the references.

Page size 16 and prefill in chunks of 64, so prompts cross many pages and chunk boundaries.
"""

from __future__ import annotations

import pytest
import torch

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.registry import build_model
from kvfence.scheduler.offline import GenerationOutput, OfflineEngine
from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams

PAGE_SIZE = 16
CHUNK_TOKENS = 64
GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(smollm2: Checkpoint) -> OfflineEngine:
    model = build_model(smollm2, torch.float32)
    pool = KVPool(model.config, num_pages=1024, page_size_tokens=PAGE_SIZE, dtype=torch.float32)
    return OfflineEngine(ModelRunner(model, pool), smollm2.tokenizer, chunk_tokens=CHUNK_TOKENS)


@pytest.fixture(scope="module")
def solo(engine: OfflineEngine, reference: dict) -> dict[str, GenerationOutput]:
    """Each reference case generated alone, with the logits of every step."""
    return {c["id"]: engine.generate([c["prompt_token_ids"]], [GREEDY_32], return_logits=True)[0]
            for c in reference["cases"]}


def test_greedy_ids_equal_reference(solo: dict[str, GenerationOutput], reference: dict) -> None:
    for case in reference["cases"]:
        out = solo[case["id"]]
        assert out.generated_token_ids == case["greedy_ids"], case["id"]
        assert out.finish_reason == "length"
        assert out.text.startswith(case["text_until_eos"]), case["id"]


def test_batched_decode_equals_solo(engine: OfflineEngine, solo: dict[str, GenerationOutput],
                                    reference: dict) -> None:
    cases = reference["cases"]
    batched = engine.generate([c["prompt_token_ids"] for c in cases], [GREEDY_32] * len(cases),
                              return_logits=True)
    for case, out in zip(cases, batched):
        alone = solo[case["id"]]
        assert out.generated_token_ids == alone.generated_token_ids == case["greedy_ids"], case["id"]
        assert out.logits is not None and alone.logits is not None
        torch.testing.assert_close(out.logits, alone.logits, atol=1e-3, rtol=0)


def test_pages_return_to_baseline(engine: OfflineEngine, reference: dict) -> None:
    engine.generate([c["prompt_token_ids"] for c in reference["cases"][:3]], [GREEDY_32] * 3)
    assert engine.ledger.num_in_use == 0 and engine.ledger.num_cached > 0  # the prompts' full pages stay cached
    assert engine.flush_cache() > 0
    assert engine.ledger.num_free == engine.ledger.num_pages
    engine.ledger.check_integrity()
    assert not engine.runner.pool.owner_tags.any()  # every tag cleared


def test_stop_token_ids_and_stop_strings(engine: OfflineEngine, reference: dict) -> None:
    case = reference["cases"][0]
    ids, text = case["greedy_ids"], case["text_until_eos"]
    stop_tok = ids[5]
    out = engine.generate([case["prompt_token_ids"]],
                          [SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=(stop_tok,))])[0]
    assert out.generated_token_ids == ids[: ids.index(stop_tok) + 1]
    assert out.finish_reason == "stop"
    stop_str = text[40:47]
    out = engine.generate([case["prompt_token_ids"]],
                          [SamplingParams(temperature=0.0, max_tokens=32, stop=(stop_str,))])[0]
    assert out.text == text[: text.index(stop_str)]
    assert out.finish_reason == "stop"


def test_eos_ends_generation(engine: OfflineEngine, smollm2: Checkpoint) -> None:
    tok = smollm2.tokenizer
    prompt = tok.encode("<|im_start|>user\nReply with one word: yes or no? Is water wet?<|im_end|>\n"
                        "<|im_start|>assistant\n")
    out = engine.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=64)])[0]
    assert out.finish_reason == "stop"
    assert out.generated_token_ids[-1] in tok.eos_token_ids
    assert len(out.generated_token_ids) < 64
    assert "<|im_end|>" not in out.text and out.text.strip()
    with_eos = engine.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=len(out.generated_token_ids) + 3,
                                                         ignore_eos=True)])[0]
    assert with_eos.generated_token_ids[: len(out.generated_token_ids)] == out.generated_token_ids
    assert with_eos.finish_reason == "length"
