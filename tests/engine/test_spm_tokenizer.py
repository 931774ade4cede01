"""The GGUF "llama" (SentencePiece) tokenizer path against the real SentencePiece library.

A small SentencePiece BPE model is trained here the way Llama 2's was (byte fallback, split digits,
identity normalization, whitespace kept as is), converted to `tokenizer.ggml.*` fields exactly as
llama.cpp's converter writes them, and built with `tokenizer_from_gguf_fields`; its ids and text
must then be SentencePiece's own.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import sentencepiece as spm

from kvfence.engine.detokenizer import IncrementalDetokenizer
from kvfence.engine.tokenizer import Tokenizer, tokenizer_from_gguf_fields

# GGUF token types, as llama.cpp's converter assigns them.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

CORPUS = """\
The quick brown fox jumps over the lazy dog. Hello, world! How are you today?
Machine learning models tokenize text into subword units before processing them.
She said: "It's 5 o'clock -- time for tea!" (Really?) Yes; really.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(f"value {i}: {i * i}")
    x = [1, 2, 3]; y = {"a": 1, "b": 2}
Le renard brun rapide saute par-dessus le chien paresseux. Élève, café, naïve.
Der schnelle braune Fuchs springt über den faulen Hund. Straße, Grüße.
El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la biblioteca?
Быстрая коричневая лиса прыгает через ленивую собаку.
東京は日本の首都です。今日はいい天気ですね。
The year 2024 had 366 days; pi is about 3.14159 and e is about 2.71828.
    indented line with    several   spaces and\ttabs\t.
"""

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Machine learning models tokenize text.",
    "",
    " ",
    "   ",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "multiple    spaces   between     words",
    "\n",
    "line one\nline two\n\n\nline five\n",
    "\ttab\tseparated\tvalues\t",
    "12345678901234567890",
    "The year 2024 had 366 days; 3.14159 ≈ π",
    "Punctuation!?.,;:'\"()[]{}<>-_=+*&^%$#@~`|\\/",
    "東京は日本の首都です。",
    "中文测试，한국어 텍스트",  # characters the model never saw: byte fallback
    "emoji 👋🏽 family 👨‍👩‍👧‍👦 🚀",
    "Straße über café naïve Élève",
    "Быстрая лиса",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\nclass A:\n    pass\n",
    "for i in range(10):\n\tprint(f\"{i * i}\")",
    "e\u0301 combining, \u200b zero width, \x00 nul, \x7f del",
]


def _train(directory: Path, **options: Any) -> spm.SentencePieceProcessor:
    corpus = directory / "corpus.txt"
    corpus.write_text(CORPUS * 20, encoding="utf-8")
    prefix = directory / "spm"
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(prefix), model_type="bpe", vocab_size=500,
        byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, character_coverage=0.995,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, hard_vocab_limit=False, num_threads=1, minloglevel=2,
        **options)
    return spm.SentencePieceProcessor(model_file=f"{prefix}.model")


def _token_type(sp: spm.SentencePieceProcessor, i: int) -> int:
    """llama.cpp's convert_hf_to_gguf.py `_create_vocab_sentencepiece`."""
    if sp.is_unknown(i):
        return UNKNOWN
    if sp.is_control(i):
        return CONTROL
    if sp.is_unused(i):
        return UNUSED
    if sp.is_byte(i):
        return BYTE
    return NORMAL


def gguf_fields(sp: spm.SentencePieceProcessor, **extra: Any) -> dict[str, Any]:
    n = sp.get_piece_size()
    fields: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [_token_type(sp, i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }
    fields.update({f"tokenizer.ggml.{k}": v for k, v in extra.items()})
    return fields


def build(fields: dict[str, Any]) -> Tokenizer:
    return tokenizer_from_gguf_fields(fields.get, "test.gguf")


@pytest.fixture(scope="module")
def sp(tmp_path_factory: pytest.TempPathFactory) -> spm.SentencePieceProcessor:
    return _train(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="module")
def tok(sp: spm.SentencePieceProcessor) -> Tokenizer:
    return build(gguf_fields(sp))


@pytest.fixture(scope="module")
def sp_no_prefix(tmp_path_factory: pytest.TempPathFactory) -> spm.SentencePieceProcessor:
    return _train(tmp_path_factory.mktemp("spm_no_prefix"), add_dummy_prefix=False)


@pytest.fixture(scope="module")
def tok_no_prefix(sp_no_prefix: spm.SentencePieceProcessor) -> Tokenizer:
    return build(gguf_fields(sp_no_prefix, add_space_prefix=False))


def fuzz_texts(seed: int, count: int) -> list[str]:
    """Slices of the corpus and random strings over its characters, whitespace and unseen ones."""
    rng = random.Random(seed)
    alphabet = sorted(set(CORPUS)) + list("  \n\t") * 4 + ["👋", "Ω", "\u00ff", "€", "ñ", "测"]
    texts = []
    for k in range(count):
        if k % 2:
            texts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))))
        else:
            start = rng.randrange(len(CORPUS))
            texts.append(CORPUS[start:start + rng.randint(0, 200)])
    return texts


def test_model_is_what_the_tests_need(sp: spm.SentencePieceProcessor, tok: Tokenizer) -> None:
    types = [_token_type(sp, i) for i in range(sp.get_piece_size())]
    assert types[:3] == [UNKNOWN, CONTROL, CONTROL] and types.count(BYTE) == 256
    normal = [sp.id_to_piece(i) for i, kind in enumerate(types) if kind == NORMAL]
    assert "▁▁" in normal and any(len(p) > 3 and "▁" not in p for p in normal)  # real merges
    assert tok.vocab_size == sp.get_piece_size()
    # byte fallback is exercised: characters the model lacks come out as <0xXX> pieces
    assert any(sp.is_byte(i) for i in sp.encode("中文测试 👋🏽"))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_sentencepiece(sp: spm.SentencePieceProcessor, tok: Tokenizer, text: str) -> None:
    expected = sp.encode(text)
    assert tok.encode(text, add_bos=False) == expected, sp.id_to_piece(expected)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_sentencepiece(sp: spm.SentencePieceProcessor, tok: Tokenizer, text: str) -> None:
    ids = sp.encode(text)
    assert tok.decode(ids) == sp.decode(ids)
    assert tok.decode([sp.bos_id(), *ids, sp.eos_id()]) == sp.decode(ids)  # control tokens skipped


def test_fuzz_matches_sentencepiece(sp: spm.SentencePieceProcessor, tok: Tokenizer) -> None:
    rng = random.Random(7)
    for text in fuzz_texts(seed=1, count=600):
        ids = sp.encode(text)
        assert tok.encode(text, add_bos=False) == ids, repr(text)
        assert tok.decode(ids) == sp.decode(ids), repr(text)
        if ids:  # any slice, including ones that start mid-word or cut a byte sequence
            i = rng.randrange(len(ids))
            j = rng.randrange(i, len(ids)) + 1
            assert tok.decode(ids[i:j]) == sp.decode(ids[i:j]), (repr(text), i, j)


def test_byte_runs_decode_like_sentencepiece(sp: spm.SentencePieceProcessor, tok: Tokenizer) -> None:
    """One U+FFFD per invalid byte, and the valid bytes of the same run kept (tokenizers' ByteFallback
    decoder would turn the whole run, newlines included, into U+FFFDs)."""
    ids = sp.encode("😀\n\nx €\n")
    assert [sp.id_to_piece(i) for i in ids[:7]] == ["▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "<0x0A>", "<0x0A>"]
    for i in range(len(ids)):
        for j in range(i + 1, len(ids) + 1):
            assert tok.decode(ids[i:j]) == sp.decode(ids[i:j]), (i, j)
    assert tok.decode(ids[2:7]) == "\ufffd\ufffd\ufffd\n\n"


def test_streaming_keeps_newline_after_cut_character(tok: Tokenizer) -> None:
    """The detokenizer's context window starts inside the emoji; the generated <0x0A> must still be a
    newline, not a U+FFFD."""
    prompt = tok.encode("Smile 😀\n\n")
    generated = [tok.inner.token_to_id("<0x0A>"), *tok.encode("Hello", add_bos=False)]
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(detok.push(i) for i in generated) + detok.flush()
    assert text == "\n Hello"  # the stream keeps the first word's space (see IncrementalDetokenizer)


def test_round_trip(tok: Tokenizer) -> None:
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text


def test_bos(sp: spm.SentencePieceProcessor, tok: Tokenizer) -> None:
    assert tok.bos_token_id == sp.bos_id() == 1
    assert tok.add_bos
    assert tok.encode("Hello world") == [sp.bos_id(), *sp.encode("Hello world")]
    assert tok.encode("") == [sp.bos_id()]
    assert tok.encode("Hello world", add_bos=False) == sp.encode("Hello world")
    no_bos = build(gguf_fields(sp, add_bos_token=False))
    assert not no_bos.add_bos
    assert no_bos.encode("Hello world") == sp.encode("Hello world")
    assert no_bos.encode("Hello world", add_bos=True) == [sp.bos_id(), *sp.encode("Hello world")]
    fields = gguf_fields(sp)
    del fields["tokenizer.ggml.add_bos_token"]
    assert build(fields).add_bos  # llama.cpp's default for SentencePiece models


def test_eos(sp: spm.SentencePieceProcessor, tok: Tokenizer) -> None:
    assert sp.eos_id() in tok.eos_token_ids
    assert sp.bos_id() not in tok.eos_token_ids
    assert tok.special_token_text(sp.bos_id()) == "<s>"
    assert tok.special_token_text(sp.eos_id()) == "</s>"


def test_control_tokens_in_text(sp: spm.SentencePieceProcessor, tok: Tokenizer) -> None:
    """As llama.cpp parses special tokens: control tokens written in the text are those tokens, and
    the text after one starts a new piece of text, with its own space prefix."""
    ids = tok.encode("<s>Hello world</s>", add_bos=False)
    assert ids == [sp.bos_id(), *sp.encode("Hello world"), sp.eos_id()]
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(ids, skip_special_tokens=False) == "<s> Hello world</s>"


@pytest.mark.parametrize("text", TEXTS)
def test_no_space_prefix_matches_sentencepiece(sp_no_prefix: spm.SentencePieceProcessor,
                                               tok_no_prefix: Tokenizer, text: str) -> None:
    """GGUF `tokenizer.ggml.add_space_prefix` False: SentencePiece's add_dummy_prefix=False."""
    ids = sp_no_prefix.encode(text)
    assert tok_no_prefix.encode(text, add_bos=False) == ids, sp_no_prefix.id_to_piece(ids)
    assert tok_no_prefix.decode(ids) == sp_no_prefix.decode(ids)


def test_no_space_prefix_fuzz(sp_no_prefix: spm.SentencePieceProcessor, tok_no_prefix: Tokenizer) -> None:
    for text in fuzz_texts(seed=2, count=300):
        ids = sp_no_prefix.encode(text)
        assert tok_no_prefix.encode(text, add_bos=False) == ids, repr(text)
        assert tok_no_prefix.decode(ids) == sp_no_prefix.decode(ids), repr(text)


def test_space_prefix_field_is_respected(sp: spm.SentencePieceProcessor) -> None:
    with_prefix = build(gguf_fields(sp, add_space_prefix=True))
    without = build(gguf_fields(sp, add_space_prefix=False))
    assert with_prefix.encode("Hello", add_bos=False) == sp.encode("Hello")
    assert [without.token_text(i) for i in without.encode("Hello", add_bos=False)][0][0] != "▁"
    assert without.decode(sp.encode(" Hello")) == " " + sp.decode(sp.encode(" Hello"))
