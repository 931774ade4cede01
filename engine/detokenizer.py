"""Streaming text out of streaming tokens: incremental detokenization and stop-string matching.

`IncrementalDetokenizer` turns one token at a time into text without ever emitting half a UTF-8
character. `StopStringMatcher` sits after it and cuts the text at the first stop string, holding
back only the characters that could still begin one.
"""

from __future__ import annotations

from kvfence.engine.tokenizer import Tokenizer

# Prompt tokens decoded as context before the first generated token, so that a decoder that
# strips or rewrites the start of the text (SentencePiece's leading space) sees mid-text tokens.
PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of generated tokens, one token at a time (the prefix_offset / read_offset scheme).

    `push(token_id)` returns the text that token completed, possibly "". Text is held back while
    the decoded tail ends in U+FFFD (an incomplete UTF-8 character, or a genuine U+FFFD that
    `flush` releases). `flush()` at the end of the stream returns everything still held back.

    Contract: when `prompt_ids` ends on a character boundary (true of any encoded text) and the
    decoder is byte-level BPE, the concatenation of every push() and the final flush() equals
    `tokenizer.decode(generated_ids, skip_special_tokens=...)`. With a SentencePiece decoder the
    stream keeps the leading space of the first generated word, which decoding the generated ids
    alone would strip. Memory stays bounded: ids before the decode window are dropped.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])  # decode window and what follows
        self._prefix_offset = 0  # start of the window decoded for context; its text was already emitted
        self._read_offset = len(self._ids)  # ids before this have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _pending(self) -> tuple[str, str]:
        """(text of the emitted part of the window, text of the whole window)."""
        emitted = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return emitted, self._decode(self._ids[self._prefix_offset:])

    def _advance(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        del self._ids[:self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly completed text ("" while a character is open)."""
        self._ids.append(token_id)
        emitted, full = self._pending()
        if len(full) <= len(emitted) or full.endswith(_REPLACEMENT_CHAR):
            return ""
        self._advance()
        return full[len(emitted):]

    def flush(self) -> str:
        """End of stream: return the held-back text, incomplete characters as U+FFFD."""
        emitted, full = self._pending()
        if len(full) <= len(emitted):
            return ""
        self._advance()
        return full[len(emitted):]


class StopStringMatcher:
    """Cuts a text stream at the first stop string (OpenAI semantics: the stop string is dropped).

    `push(delta)` returns (text safe to emit, matched). It holds back the longest tail of the text
    that is a proper prefix of some stop string (at most max(len(stop)) - 1 characters). The match
    is the occurrence that ends first in the stream (on a tie, the one that starts first), so the
    result does not depend on how the text was split into deltas. Once matched, push returns
    ("", True) and flush returns "". With no stop strings, text passes through unchanged.
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        if isinstance(stop, str):
            raise ValueError(f"stop must be a tuple of strings, got the string {stop!r}; wrap it: ({stop!r},)")
        self._stops = tuple(stop)
        if any(not isinstance(s, str) or not s for s in self._stops):
            raise ValueError(f"stop must hold non-empty strings, got {self._stops!r}")
        self._max_hold_chars = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.matched_stop: str | None = None  # the stop string that matched, once one has

    @property
    def matched(self) -> bool:
        return self.matched_stop is not None

    def _hold_length(self, text: str) -> int:
        for length in range(min(len(text), self._max_hold_chars), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self._stops):
                return length
        return 0

    def push(self, delta: str) -> tuple[str, bool]:
        if self.matched:
            return "", True
        if not self._stops:
            return delta, False
        text = self._held + delta
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self._stops:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is not None:
            self._held = ""
            self.matched_stop = best[2]
            return text[:best[1]], True
        hold = self._hold_length(text)
        self._held = text[len(text) - hold:]
        return text[:len(text) - hold], False

    def flush(self) -> str:
        """End of stream: the held-back text (it never completed a stop string); "" after a match."""
        held, self._held = self._held, ""  # a match already cleared it
        return held
