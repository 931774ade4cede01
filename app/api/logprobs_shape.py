"""OpenAI's logprobs shapes out of the sampled tokens' `TokenLogprobs` (engine/logprobs.py).

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions (legacy): parallel lists `tokens`, `token_logprobs`, `top_logprobs` (token -> logprob),
and `text_offset` (where each token's text starts in the completion, counted across a stream's
chunks). A token's `token` is its bytes decoded as UTF-8 with replacement (a token holding part
of a character shows U+FFFD; `bytes` has the exact bytes). Logprobs are clamped at -9999 so that a
token of probability 0 still encodes as JSON.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfence.app.api import openai_responses as r
from kvfence.engine.logprobs import TokenLogprobs
from kvfence.engine.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0


class TokenPieces:
    """Each token's text and bytes, looked up once per token id for the life of the server."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._pieces: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._pieces.get(token_id)
        if piece is None:
            raw = self._tokenizer.token_bytes(token_id)
            piece = self._pieces[token_id] = (raw.decode("utf-8", "replace"), list(raw))
        return piece


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def chat_logprobs(pieces: TokenPieces, token_ids: list[int], entries: list[TokenLogprobs]) -> r.ChatLogprobs:
    content = []
    for token, entry in zip(token_ids, entries):
        text, raw = pieces(token)
        top = [r.TopLogprob(token=top_text, logprob=_clamp(lp), bytes=top_raw)
               for (top_text, top_raw), lp in zip(map(pieces, entry.top_ids), entry.top_logprobs)]
        content.append(r.ChatTokenLogprob(token=text, logprob=_clamp(entry.logprob), bytes=raw, top_logprobs=top))
    return r.ChatLogprobs(content=content)


class CompletionLogprobsBuilder:
    """Builds the legacy shape chunk by chunk, carrying `text_offset` across a stream. An entry
    of None (the first prompt token of an echo, which nothing predicts) has null logprobs."""

    def __init__(self, pieces: TokenPieces) -> None:
        self._pieces = pieces
        self._offset = 0

    def __call__(self, token_ids: list[int], entries: Sequence[TokenLogprobs | None]) -> r.CompletionLogprobs:
        out = r.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token, entry in zip(token_ids, entries):
            text = self._pieces(token)[0]
            out.tokens.append(text)
            out.text_offset.append(self._offset)
            self._offset += len(text)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_clamp(entry.logprob))
            out.top_logprobs.append({self._pieces(t)[0]: _clamp(lp) for t, lp in zip(entry.top_ids, entry.top_logprobs)})
        return out
