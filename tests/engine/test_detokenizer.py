"""Incremental detokenization (never half a character) and stop-string matching across deltas."""

from __future__ import annotations

import random

import pytest
from tiny_models import bytes_to_unicode
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from kvfence.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from kvfence.engine.tokenizer import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # 1234567890",
    "Hello world! Hello there, general Kenobi.",
    "你好，世界。今天天气很好。",
    "Café naïve résumé façade",
    "for i in range(10): print(i * 2)",
] * 4

TEXTS = [
    "Hello world, the lazy fox.",
    "emoji 🙂👍🏽 and flags 🇫🇷 mid-text 🚀!",
    "你好，世界。今天天气很好。CJK 漢字かなカナ 한국어",
    "combining: e\u0301 a\u0308 n\u0303 Z\u0351\u0352\u0353 é",
    "def f(x):\n\treturn {'k': [1, 2, 3]} if x else None  # ok\n",
    "digits 3.14159265358979 1e-9 0xDEADBEEF 1,000,000",
    "mixed 🙂你好e\u0301 123 \u200d\u2764\ufe0f end",
]


BYTE_CHAR = bytes_to_unicode()  # GPT-2's byte -> printable character map


@pytest.fixture(scope="module")
def byte_bpe() -> Tokenizer:
    inner = RustTokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    inner.train_from_iterator(CORPUS, trainer)
    return Tokenizer(inner, bos_token_id=None, eos_token_ids=[], add_bos=False, chat_template=None)


def _random_tokenization(tok: Tokenizer, text: str, rng: random.Random) -> list[int]:
    """Ids for `text` cut at random byte positions (often inside a character), each piece a token."""
    data = text.encode("utf-8")
    ids: list[int] = []
    pos = 0
    while pos < len(data):
        for length in range(rng.randint(1, 4), 0, -1):
            token_id = tok.inner.token_to_id("".join(BYTE_CHAR[b] for b in data[pos:pos + length]))
            if token_id is not None:
                break
        assert token_id is not None  # every single byte is in the vocabulary
        ids.append(token_id)
        pos += length
    return ids


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_random_tokenization_is_a_real_tokenization(byte_bpe: Tokenizer) -> None:
    rng = random.Random(0)
    for text in TEXTS:
        assert byte_bpe.decode(_random_tokenization(byte_bpe, text, rng)) == text


@pytest.mark.parametrize("case", range(len(TEXTS)))
def test_concatenation_equals_decode_for_random_splits(byte_bpe: Tokenizer, case: int) -> None:
    text = TEXTS[case]
    rng = random.Random(case)
    prompt = byte_bpe.encode("Hello there, 你好 🙂 ")
    for _ in range(30):
        ids = _random_tokenization(byte_bpe, text, rng)
        # Any prompt cut, even one ending inside the 🙂: the generated text starts on a boundary.
        pieces = _stream(IncrementalDetokenizer(byte_bpe, prompt[: rng.randint(0, len(prompt))]), ids)
        assert "".join(pieces) == byte_bpe.decode(ids) == text
        assert not any(p.endswith("\ufffd") for p in pieces)  # never half a character


def test_multibyte_characters_split_across_tokens_are_held_back(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode("ok 🚀")  # the rocket is not in the corpus: one token per byte
    detok = IncrementalDetokenizer(byte_bpe, byte_bpe.encode("Go "))
    pieces = [detok.push(i) for i in ids]
    assert pieces[-4:] == ["", "", "", "🚀"]
    assert "".join(pieces) == "ok 🚀"
    assert detok.flush() == ""


def test_canonical_encoding_streams_exactly(byte_bpe: Tokenizer) -> None:
    for text in TEXTS:
        ids = byte_bpe.encode(text)
        assert "".join(_stream(IncrementalDetokenizer(byte_bpe, byte_bpe.encode("Q: ")), ids)) == text


def test_arbitrary_token_ids_including_invalid_utf8(byte_bpe: Tokenizer) -> None:
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(byte_bpe.vocab_size) for _ in range(rng.randint(1, 12))]
        pieces = _stream(IncrementalDetokenizer(byte_bpe, byte_bpe.encode("start ")), ids)
        assert "".join(pieces) == byte_bpe.decode(ids)


def test_truncated_character_comes_out_at_flush(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode("a🚀")[:-1]  # the stream ends inside the rocket
    detok = IncrementalDetokenizer(byte_bpe, [])
    assert "".join(detok.push(i) for i in ids) == "a"
    assert detok.flush() == byte_bpe.decode(ids)[1:] and detok.flush() == ""


def test_special_tokens_are_skipped_or_kept(byte_bpe: Tokenizer) -> None:
    eot = byte_bpe.inner.token_to_id("<|endoftext|>")
    ids = byte_bpe.encode("hi ") + [eot] + byte_bpe.encode("you")
    assert "".join(_stream(IncrementalDetokenizer(byte_bpe, []), ids)) == "hi you"
    kept = "".join(_stream(IncrementalDetokenizer(byte_bpe, [], skip_special_tokens=False), ids))
    assert kept == byte_bpe.decode(ids, skip_special_tokens=False) == "hi <|endoftext|>you"


def test_sentencepiece_leading_space_comes_from_prompt_context() -> None:
    inner = RustTokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    inner.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    inner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    inner.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False)
    inner.train_from_iterator(["Hello world", "hello there world", "world of hello"] * 5, trainer)
    tok = Tokenizer(inner, bos_token_id=None, eos_token_ids=[], add_bos=False, chat_template=None)
    ids = tok.encode("Hello world")
    cut = next(i for i in range(1, len(ids)) if inner.id_to_token(ids[i]).startswith("▁"))
    prompt, generated = ids[:cut], ids[cut:]
    assert tok.decode(generated) == "world"  # decoding alone strips the space...
    assert "".join(_stream(IncrementalDetokenizer(tok, prompt), generated)) == " world"  # ...context keeps it


def _run_matcher(stop: tuple[str, ...], deltas: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stop)
    out = []
    matched = False
    for delta in deltas:
        safe, matched = matcher.push(delta)
        out.append(safe)
        if matched:
            break
    out.append(matcher.flush())
    return "".join(out), matched


def test_stop_string_spanning_deltas() -> None:
    matcher = StopStringMatcher(("<END>",))
    assert matcher.push("abc<") == ("abc", False)
    assert matcher.push("E") == ("", False)
    assert matcher.push("N") == ("", False)
    assert matcher.push("D>tail") == ("", True)
    assert matcher.matched and matcher.matched_stop == "<END>"
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def test_stop_at_the_very_start() -> None:
    assert _run_matcher(("Hi",), ["Hi there"]) == ("", True)
    assert _run_matcher(("Hi",), ["H", "i there"]) == ("", True)


def test_earliest_stop_wins() -> None:
    assert _run_matcher(("world", "hello"), ["say hello world"]) == ("say ", True)
    assert _run_matcher(("world", "hello"), ["say hel", "lo wor", "ld"]) == ("say ", True)
    # The occurrence that ends first wins, however the text is split.
    assert _run_matcher(("abcd", "c"), ["xabcd"]) == ("xab", True)
    assert _run_matcher(("abcd", "c"), ["xab", "cd"]) == ("xab", True)


def test_partial_matches_are_released() -> None:
    matcher = StopStringMatcher(("STOP",))
    assert matcher.push("ST") == ("", False)
    assert matcher.push("OX S") == ("STOX ", False)  # not a stop; only "S" may still start one
    assert matcher.push("T") == ("", False)
    assert matcher.flush() == "ST"
    assert not matcher.matched


def test_holds_at_most_longest_stop_minus_one() -> None:
    matcher = StopStringMatcher(("aaab", "b"))
    assert matcher.push("aaaaaa") == ("aaa", False)  # holds 3 = len("aaab") - 1
    assert matcher.push("x") == ("aaax", False)
    assert matcher.flush() == ""


def test_no_stop_strings_pass_through() -> None:
    matcher = StopStringMatcher(())
    assert matcher.push("any <text>") == ("any <text>", False)
    assert matcher.push("") == ("", False)
    assert matcher.flush() == ""


def test_no_false_positives_and_concatenation_without_match() -> None:
    rng = random.Random(2)
    stop = ("STOP", "\n\n", "</s>")
    text = "ST OP S TOP \n x </ s> </s > STO P\nSTOPS".replace("STOPS", "STOXS")
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 10)))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _run_matcher(stop, deltas) == (text, False)


def test_match_is_independent_of_delta_boundaries() -> None:
    rng = random.Random(3)
    stop = ("ab", "bca", "cab", "aaa")
    for _ in range(300):
        text = "".join(rng.choice("abcx") for _ in range(rng.randint(0, 12)))
        whole = _run_matcher(stop, [text])
        cuts = sorted(rng.sample(range(1, max(len(text), 2)), min(rng.randint(0, 6), max(len(text) - 1, 0))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _run_matcher(stop, deltas) == whole
        if not whole[1]:
            assert whole[0] == text


@pytest.mark.parametrize("stop", ["\n", ("ok", ""), (3,)])
def test_invalid_stop_raises(stop: object) -> None:
    with pytest.raises(ValueError, match="^stop "):
        StopStringMatcher(stop)  # type: ignore[arg-type]
