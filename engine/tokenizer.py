"""Tokenizers built with the `tokenizers` library, from GGUF metadata or a tokenizer.json.

One class, `Tokenizer`, whatever the source: `encode`/`decode`, the ids that end generation, the
BOS policy, and the model's chat template (rendered by `chat_template.render_chat`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from kvfence.engine.json_file import read_json_object

# Control tokens that end generation in every family we run (llama.cpp uses the same list).
END_OF_GENERATION_TEXTS = frozenset({
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>", "<|end|>", "<end_of_turn>",
})

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split patterns for the byte-level BPE families, by GGUF `tokenizer.ggml.pre`.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenizerError(ValueError):
    """The tokenizer cannot be built from what the checkpoint provides."""


class Tokenizer:
    """Encode and decode text for one model.

    `eos_token_ids` are every id that ends generation (unless a request sets ignore_eos);
    `add_bos` says whether a raw completion prompt starts with BOS.
    """

    def __init__(self, inner: RustTokenizer, *, bos_token_id: int | None, eos_token_ids: Iterable[int],
                 add_bos: bool, chat_template: str | None) -> None:
        self.inner = inner
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        self.vocab_size = inner.get_vocab_size(with_added_tokens=True)
        # byte-level BPE: the character each byte is spelled with, inverted (token_bytes)
        self._byte_of = ({c: b for b, c in enumerate(_byte_level_alphabet())}
                         if isinstance(inner.decoder, decoders.ByteLevel) else None)
        self._special_ids = frozenset(inner.get_added_tokens_decoder())
        specials = sorted((t.content for t in inner.get_added_tokens_decoder().values() if t.special and t.content),
                          key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._as_text: RustTokenizer | None = None  # encodes special tokens' text as text (encode_as_text)

    def has_special_text(self, text: str) -> bool:
        """Whether `text` spells out a special token (e.g. "<|im_start|>")."""
        return self._special_text is not None and self._special_text.search(text) is not None

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of `text` read as what a user wrote: a special token's text in it is encoded
        as ordinary text, never as the special token (releases the GIL, like `encode`)."""
        if self._as_text is None:  # a race only builds it twice
            plain = RustTokenizer.from_str(self.inner.to_str())
            plain.encode_special_tokens = True
            self._as_text = plain
        return self._as_text.encode_batch([text], add_special_tokens=False)[0].ids

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised as such.

        Through `encode_batch`: the `tokenizers` binding releases the GIL there but holds it in
        `encode`, so a megabyte tokenized by `encode`, even in a worker thread, would stop the
        event loop for the second it takes (and for short texts it is no slower)."""
        ids: list[int] = self.inner.encode_batch([text], add_special_tokens=False)[0].ids
        bos = self.bos_token_id
        want_bos = self.add_bos if add_bos is None else add_bos
        if want_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        return self.inner.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE token may hold part of a UTF-8
        character, which no decoded string can show); a special token's own text."""
        piece = self.inner.id_to_token(token_id) or ""
        if self._byte_of is None or token_id in self._special_ids:
            return self.inner.decode([token_id], skip_special_tokens=False).encode("utf-8", "replace")
        return bytes(self._byte_of[c] for c in piece if c in self._byte_of)

    def special_token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.inner.id_to_token(token_id) or ""


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet, in byte order: printable bytes stand for themselves, the
    others for chr(256 + n) in order (the mapping byte-level BPE spells every byte with)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def _end_of_generation_ids(inner: RustTokenizer, explicit: Iterable[int | None]) -> set[int]:
    ids = {i for i in explicit if i is not None and i >= 0}
    for text in END_OF_GENERATION_TEXTS:
        tid = inner.token_to_id(text)
        if tid is not None:
            ids.add(tid)
    return ids


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":
        # Every digit on its own, then GPT-2's byte-level split (llama.cpp's "smollm" pre-type).
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    pattern = {"llama-bpe": _LLAMA3_PATTERN, "llama3": _LLAMA3_PATTERN,
               "qwen2": _QWEN2_PATTERN}.get(pre)
    if pattern is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def spm_merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to a SentencePiece vocabulary: every split of a piece whose halves are
    both pieces, ordered by the piece's score (higher merges first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str, float, int, int]] = []
    for piece, score in zip(tokens, scores):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right, score, vocab[left], vocab[right]))
    merges.sort(key=lambda m: (-m[2], m[3], m[4]))
    return [(m[0], m[1]) for m in merges]


_LONE_SURROGATES = re.compile("[\udc80-\udcff]")


class _SentencePieceDecoder:
    """Pieces to text as sentencepiece decodes them: "▁" is a space, each run of <0xXX> byte pieces
    is UTF-8 with one U+FFFD per invalid byte, and one leading space (the dummy prefix) is dropped.

    tokenizers' ByteFallback decoder turns a whole run of byte pieces into U+FFFDs when any byte in
    it is invalid, so a window that starts inside a character (as the incremental detokenizer's
    does) would also lose the newlines after it, which SentencePiece vocabularies spell <0x0A>.
    """

    def __init__(self, strip_leading_space: bool) -> None:
        self.strip_leading_space = strip_leading_space

    def decode_chain(self, tokens: list[str]) -> list[str]:
        parts: list[str] = []
        run = bytearray()
        for token in tokens:
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                try:
                    run.append(int(token[3:5], 16))
                    continue
                except ValueError:
                    pass
            if run:
                parts.append(_utf8_per_byte_replacement(bytes(run)))
                run.clear()
            parts.append(token.replace("▁", " "))
        if run:
            parts.append(_utf8_per_byte_replacement(bytes(run)))
        text = "".join(parts)
        if self.strip_leading_space and text.startswith(" "):
            text = text[1:]
        return [text]

    def decode(self, tokens: list[str]) -> str:
        return "".join(self.decode_chain(tokens))


def _utf8_per_byte_replacement(data: bytes) -> str:
    # surrogateescape maps each invalid byte to its own lone surrogate, which valid UTF-8 never yields
    return _LONE_SURROGATES.sub("\ufffd", data.decode("utf-8", errors="surrogateescape"))


def _add_special_tokens(inner: RustTokenizer, tokens: list[str], types: list[int]) -> None:
    added = [AddedToken(tok, special=(kind == _TOKEN_TYPE_CONTROL), normalized=False)
             for tok, kind in zip(tokens, types)
             if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)]
    inner.add_special_tokens([t for t in added if t.special])
    inner.add_tokens([t for t in added if not t.special])


def tokenizer_from_gguf_fields(field: Callable[[str], Any], source: str) -> Tokenizer:
    """Build from GGUF `tokenizer.ggml.*` metadata; `field(key)` returns a value or None."""
    kind = field("tokenizer.ggml.model")
    tokens: list[str] | None = field("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError(f"{source}: GGUF has no tokenizer.ggml.tokens")
    types = list(field("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in (field("tokenizer.ggml.merges") or [])]
        inner = RustTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        inner.pre_tokenizer = _byte_level_pre_tokenizer(str(field("tokenizer.ggml.pre") or "default"))
        inner.decoder = decoders.ByteLevel()
        default_add_bos = False
    elif kind == "llama":
        scores = list(field("tokenizer.ggml.scores") or [0.0] * len(tokens))
        unk = field("tokenizer.ggml.unknown_token_id")
        inner = RustTokenizer(models.BPE(vocab, spm_merges_from_scores(tokens, scores), fuse_unk=True,
                                         byte_fallback=True,
                                         unk_token=tokens[unk] if unk is not None else None))
        # SentencePiece's add_dummy_prefix: a "▁" before the text, stripped again when decoding.
        space_prefix = field("tokenizer.ggml.add_space_prefix")
        space_prefix = True if space_prefix is None else bool(space_prefix)
        prepend = [normalizers.Prepend("▁")] if space_prefix else []
        inner.normalizer = normalizers.Sequence([*prepend, normalizers.Replace(" ", "▁")])
        inner.decoder = decoders.Decoder.custom(_SentencePieceDecoder(strip_leading_space=space_prefix))
        default_add_bos = True
    else:
        raise TokenizerError(f"{source}: GGUF tokenizer model {kind!r} is not supported "
                             "(supported: gpt2 byte-level BPE, llama SentencePiece)")
    _add_special_tokens(inner, tokens, types)
    bos = field("tokenizer.ggml.bos_token_id")
    add_bos = field("tokenizer.ggml.add_bos_token")
    eos_ids = _end_of_generation_ids(inner, [field("tokenizer.ggml.eos_token_id"),
                                             field("tokenizer.ggml.eot_token_id"),
                                             field("tokenizer.ggml.eom_token_id")])
    return Tokenizer(inner, bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids,
                     add_bos=default_add_bos if add_bos is None else bool(add_bos),
                     chat_template=field("tokenizer.chat_template"))


def _token_content(value: Any) -> str | None:
    """A special token's text: config files give it as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return read_json_object(path, TokenizerError)


def tokenizer_from_hf_dir(directory: Path) -> Tokenizer:
    """Build from tokenizer.json, tokenizer_config.json and generation_config.json."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"{directory}: no tokenizer.json (only fast tokenizers are supported)")
    try:
        inner = RustTokenizer.from_file(str(path))
    except Exception as e:
        raise TokenizerError(f"{path}: cannot load tokenizer ({e})") from e
    cfg = _read_json(directory / "tokenizer_config.json")
    gen = _read_json(directory / "generation_config.json")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    jinja = directory / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    bos_text = _token_content(cfg.get("bos_token"))
    eos_text = _token_content(cfg.get("eos_token"))
    bos = inner.token_to_id(bos_text) if bos_text else gen.get("bos_token_id")
    gen_eos = gen.get("eos_token_id")
    explicit = list(gen_eos) if isinstance(gen_eos, list) else [gen_eos]
    explicit.append(inner.token_to_id(eos_text) if eos_text else None)
    add_bos = cfg.get("add_bos_token")
    if add_bos is None:  # infer from the post-processor, which is what HF encoding would do
        probe = inner.encode("a", add_special_tokens=True).ids
        add_bos = bos is not None and bool(probe) and probe[0] == bos
    return Tokenizer(inner, bos_token_id=bos, eos_token_ids=_end_of_generation_ids(inner, explicit),
                     add_bos=bool(add_bos), chat_template=template)
