"""The default model's tokenizer and chat template against the reference prompts, and round trips."""

from __future__ import annotations

import pytest

from kvfence.engine.chat_template import ChatTemplateError, render_chat
from kvfence.engine.checkpoint import Checkpoint


def prompt_ids(model: Checkpoint, case: dict) -> list[int]:
    tok = model.tokenizer
    if case["kind"] == "chat":
        text = render_chat(tok.chat_template, case["messages"], bos_token=tok.special_token_text(tok.bos_token_id))
        return tok.encode(text, add_bos=False)
    return tok.encode(case["prompt"])


def test_reference_prompts_tokenize_exactly(smollm2: Checkpoint, reference: dict) -> None:
    for case in reference["cases"]:
        assert prompt_ids(smollm2, case) == case["prompt_token_ids"], case["id"]


def test_reference_texts_decode_exactly(smollm2: Checkpoint, reference: dict) -> None:
    for case in reference["cases"]:
        ids = case["greedy_ids"][: case["first_eos_index"]]
        assert smollm2.tokenizer.decode(ids) == case["text_until_eos"], case["id"]


def test_end_of_generation_ids(smollm2: Checkpoint) -> None:
    tok = smollm2.tokenizer
    assert tok.eos_token_ids == {0, 2}  # <|endoftext|>, <|im_end|>
    assert tok.bos_token_id == 1 and not tok.add_bos


@pytest.mark.parametrize("text", [
    "Hello, world! 👋🏽 family: 👨‍👩‍👧‍👦",
    "東京は日本の首都です。中文测试，한국어 텍스트",
    "π ≈ 3.14159, 2**10 = 1024, 0.000001, 1e-9, ９９",
    "def f(x):\n\treturn {'a': [1, 2, 3]}  # comment\n\n\nclass A:\n    pass\n",
    "  leading spaces, trailing spaces   \n\n\n",
    "e\u0301 (combining), \u200b zero width, \x00 nul",
])
def test_round_trip(smollm2: Checkpoint, text: str) -> None:
    tok = smollm2.tokenizer
    assert tok.decode(tok.encode(text)) == text


def test_digits_are_split_one_by_one(smollm2: Checkpoint) -> None:
    tok = smollm2.tokenizer
    assert tok.encode("12345") == [33, 34, 35, 36, 37]
    assert tok.encode("\n\n1") == [1116, 33]  # llama.cpp's smollm pre-tokenizer, not [198, 198, 33]


def test_special_tokens_in_text(smollm2: Checkpoint) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids) == "user\nhi"


def test_chat_template_system_prompt_default_and_custom(smollm2: Checkpoint) -> None:
    t = smollm2.tokenizer.chat_template
    default = render_chat(t, [{"role": "user", "content": "x"}])
    assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert default.endswith("<|im_start|>assistant\n")
    custom = render_chat(t, [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "x"}])
    assert custom.startswith("<|im_start|>system\nBe terse.<|im_end|>")


def test_chat_template_errors_are_clear() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(None, [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", [])


def test_chat_template_is_sandboxed() -> None:
    # A template must not reach Python internals (templates ship with downloaded models).
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])
