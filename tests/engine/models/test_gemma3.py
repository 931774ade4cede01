"""Gemma 3 270M through kvfence's own loader, runner and scheduler (colocated, float32, the CPU
backend: sliding layers on the torch path's window) equals llama.cpp's greedy tokens on its F32
copy with an f32 KV cache, token for token (tests/data/gemma3_greedy.json, made by
scripts/gemma3_references.py). The prompts run chunked through the paged pool; one is past the
512-token window, where attending to the whole context gives other tokens from the first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvfence.engine.chat_template import ChatTemplateError, render_chat
from kvfence.engine.checkpoint import Checkpoint, load_checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.loading import checkpoint_cache
from kvfence.app.config.environment import kvfence_home
from kvfence.engine.models.registry import build_model
from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.offline import OfflineEngine

REFERENCE = json.loads((Path(__file__).parents[2] / "data" / "gemma3_greedy.json").read_text())
# every short case and the first past the window (the two longest, 1,816 and 3,024 tokens, take
# 17 and 25 s here: measured equal by hand, docs/benchmarks.md)
CASES = [c for c in REFERENCE["cases"] if c["num_prompt_tokens"] < 1500]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma3(gemma3_path: Path) -> Checkpoint:
    return load_checkpoint(gemma3_path, cache_dir=checkpoint_cache(kvfence_home()))


@pytest.fixture(scope="module")
def engine(gemma3: Checkpoint) -> OfflineEngine:
    model = build_model(gemma3, torch.float32)
    return OfflineEngine(ModelRunner(model, KVPool(model.config, 128, 16, torch.float32)), gemma3.tokenizer,
                         chunk_tokens=512)


def test_the_file_is_gemma3_with_its_window(gemma3: Checkpoint) -> None:
    c = gemma3.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == \
        ("gemma3", 18, 640, 4, 1, 256)
    assert [i for i in range(c.num_layers) if not c.is_sliding(i)] == [5, 11, 17]  # type: ignore[attr-defined]  # Gemma3Config's


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["id"])
def test_greedy_equals_llama_cpp(engine: OfflineEngine, case: dict) -> None:
    out = engine.generate([case["prompt_token_ids"]], [GREEDY])[0]
    assert out.generated_token_ids == case["greedy_ids"]
    assert engine.ledger.num_in_use == 0


CHATS = {
    "chat_factual": [{"role": "user", "content": "What is the boiling point of water at sea level in degrees Celsius?"}],
    "chat_two_turns": [{"role": "user", "content": "Name a primary colour."}, {"role": "assistant", "content": "Red."},
                       {"role": "user", "content": "Name another one."}],
}


@pytest.mark.parametrize("case_id", sorted(CHATS))
def test_its_turn_format_is_built_in_and_gives_the_references_prompts(gemma3: Checkpoint, case_id: str) -> None:
    """The base model's file carries no chat template: the family's own renders the chats the
    references were made from, to llama.cpp's very ids."""
    tok = gemma3.tokenizer
    case = next(c for c in REFERENCE["cases"] if c["id"] == case_id)
    text = render_chat(tok.chat_template, CHATS[case_id], bos_token=tok.special_token_text(tok.bos_token_id))
    assert text == case["text"]
    assert tok.encode(text, add_bos=False) == case["prompt_token_ids"]


def test_a_system_message_joins_the_first_turn_and_roles_must_alternate(gemma3: Checkpoint) -> None:
    tok = gemma3.tokenizer
    text = render_chat(tok.chat_template, [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": " Hi "}], bos_token="<bos>")
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(tok.chat_template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
