"""PromptEncoder: the same ids as the tokenizer, and a lower bound on the token count that never
over-counts, so a prompt refused without tokenization could never have fit."""

from __future__ import annotations

import random

import pytest
from test_routes import make_tokenizer

from kvfence.app.api.prompt_tokens import SHORT_TEXT_CHARS, PromptEncoder
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.tokenizer import Tokenizer
from kvfence.scheduler.core.errors import RequestError


def texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = "the quick brown fox 0123456789 \n\t é中🙂<|im_start|><|endoftext|>"
    return ["", "hello", "<|endoftext|>hi", "x" * 70_000, "é" * 1000,
            *("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 3000))) for _ in range(20))]


def test_encode_through_the_batch_call_equals_the_plain_one(tiny: Checkpoint) -> None:
    """Tokenizer.encode goes through `encode_batch` (it releases the GIL): the same ids as the
    binding's plain `encode`, with the tokenizer's BOS policy on top."""
    with_bos = make_tokenizer()
    with_bos.add_bos = True  # a raw prompt starts with BOS
    for tok in (make_tokenizer(), with_bos, tiny.tokenizer):
        for text in texts(1):
            plain = tok.inner.encode(text, add_special_tokens=False).ids
            for add_bos in (None, False, True):
                bos = [tok.bos_token_id] if (tok.add_bos if add_bos is None else add_bos) \
                    and tok.bos_token_id is not None and (not plain or plain[0] != tok.bos_token_id) else []
                assert tok.encode(text, add_bos=add_bos) == bos + plain


@pytest.mark.parametrize("which", ["bytes", "tiny"])
def test_the_lower_bound_never_exceeds_the_real_count(tiny: Checkpoint, which: str) -> None:
    tok: Tokenizer = make_tokenizer() if which == "bytes" else tiny.tokenizer
    encoder = PromptEncoder(tok)
    for text in texts(2):
        nbytes, at_least = encoder.min_tokens(text)
        assert nbytes == len(text.encode()) and at_least <= len(tok.encode(text, add_bos=False)), text[:40]
    long = "the quick brown fox " * 10_000
    assert 0 < encoder.min_tokens(long)[1] <= len(tok.encode(long, add_bos=False))


def test_a_long_text_over_the_bound_is_refused_and_one_under_it_is_encoded(tiny: Checkpoint) -> None:
    tok = tiny.tokenizer
    encoder = PromptEncoder(tok)
    text = "ab1 " * (SHORT_TEXT_CHARS // 2)
    assert encoder.encode(text, add_bos=None, where="prompt", max_context_tokens=10**9) == tok.encode(text)
    with pytest.raises(RequestError) as info:
        encoder.encode(text, add_bos=None, where="messages", max_context_tokens=encoder.min_tokens(text)[1])
    assert (info.value.status, info.value.code, info.value.param) == (400, "context_length_exceeded", "messages")
    assert f"{len(text)} bytes long, which is at least" in info.value.message


def test_no_bound_for_a_tokenizer_with_a_normalizer() -> None:
    from tokenizers import normalizers

    tok = make_tokenizer()
    tok.inner.normalizer = normalizers.Strip()  # could shorten any text to nothing
    assert PromptEncoder(tok).min_tokens(" " * 100_000) == (100_000, 0)
