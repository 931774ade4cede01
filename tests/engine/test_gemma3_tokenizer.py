"""Gemma 3's SentencePiece tokenizer, built from its GGUF, gives llama.cpp's ids for every
reference prompt (tests/data/gemma3_greedy.json: completions, chats in Gemma's turn format with
its special tokens, texts over 3,000 tokens) and decodes back to the text exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfence.engine.gguf_loader import read_metadata
from kvfence.engine.tokenizer import Tokenizer, tokenizer_from_gguf_fields

REFERENCE = json.loads((Path(__file__).parents[1] / "data" / "gemma3_greedy.json").read_text())
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(gemma3_path: Path) -> Tokenizer:
    return tokenizer_from_gguf_fields(read_metadata(gemma3_path).field, str(gemma3_path))


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: c["id"])
def test_prompt_ids_are_llama_cpps(tokenizer: Tokenizer, case: dict) -> None:
    assert tokenizer.add_bos and case["text"].startswith("<bos>")
    assert tokenizer.encode(case["text"].removeprefix("<bos>")) == case["prompt_token_ids"]


@pytest.mark.parametrize("text", ["plain words", "  two  spaces\nnewline\ttab", "日本語のテキスト",
                                  "emoji 🤖 and \x00 nul", "a\u200bzero width", "tabs\t\t\tand   runs"])
def test_texts_round_trip_exactly(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
