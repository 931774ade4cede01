"""Prompt text to token ids for the HTTP layer, at a cost bounded by what can fit the context.

`PromptEncoder.encode` may run on the event loop (short texts) or in a worker thread (long
ones, see `http_api.INLINE_BODY_BYTES`). A long text is first compared with a bound that needs no
tokenization: no token stands for more bytes than the longest entry of the vocabulary, so a text
of N bytes is at least N / that many tokens; one that cannot fit the context is refused at once
(a 3 MB prompt costs a pass over its bytes, not seconds of BPE). The rest is tokenized by
`Tokenizer.encode`, which releases the GIL, so the event loop runs meanwhile.
"""

from __future__ import annotations

from typing import Any

from kvfence.engine.chat_template import ChatTemplateError, render_chat
from kvfence.engine.tokenizer import Tokenizer
from kvfence.scheduler.errors import RequestError

# Texts up to this many characters are tokenized as they are (well under a millisecond's work).
SHORT_TEXT_CHARS = 64 << 10


class PromptEncoder:
    """Encodes prompts for one tokenizer; safe to call from several threads at once."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._max_token_bytes: int | None = None  # computed on the first long text

    def encode(self, text: str, *, add_bos: bool | None, where: str, max_context_tokens: int) -> list[int]:
        """The ids of `text`, or RequestError 400 `context_length_exceeded` (param `where`) for a
        long text that cannot fit `max_context_tokens` whatever it tokenizes to."""
        if len(text) <= SHORT_TEXT_CHARS:
            return self.tokenizer.encode(text, add_bos=add_bos)
        nbytes, at_least = self.min_tokens(text)
        if at_least >= max_context_tokens:
            raise RequestError(400, "context_length_exceeded",
                               f"This model's maximum context length is {max_context_tokens} tokens. However, your "
                               f"{where} is {nbytes} bytes long, which is at least {at_least} tokens. Please reduce "
                               f"the length of the {where}.", param=where)
        return self.tokenizer.encode(text, add_bos=add_bos)

    def min_tokens(self, text: str) -> tuple[int, int]:
        """(UTF-8 bytes of `text`, a lower bound on its token count). The bound is 0 for a
        tokenizer with a normalizer, which could shorten the text before it is split."""
        nbytes = len(text.encode("utf-8", "surrogatepass"))
        if self.tokenizer.inner.normalizer is not None:
            return nbytes, 0
        if self._max_token_bytes is None:  # ~50 ms for a 49k vocabulary; a race only repeats it
            self._max_token_bytes = self._longest_token_bytes()
        return nbytes, -(-nbytes // self._max_token_bytes)

    def _longest_token_bytes(self) -> int:
        """The most bytes any token stands for, over-estimated: the longer of its vocabulary text
        (byte-level symbols take 1-2 bytes for one byte) and its decoded text (a partial UTF-8
        sequence decodes to a 3-byte replacement character)."""
        tok = self.tokenizer

        def nbytes(i: int) -> int:
            decoded = tok.decode([i], skip_special_tokens=False)
            return max(len((tok.token_text(i) or "").encode()), len(decoded.encode()))
        return max((nbytes(i) for i in range(tok.vocab_size)), default=1)


def chat_text(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
              tools: list[dict[str, Any]] | None = None) -> str:
    """The chat as the model's template renders it (what chat completions and /tokenize encode);
    RequestError 400 (param "messages") when the template refuses it."""
    try:
        return render_chat(tokenizer.chat_template, messages, bos_token=tokenizer.special_token_text(tokenizer.bos_token_id),
                           add_generation_prompt=add_generation_prompt, tools=tools)
    except ChatTemplateError as e:
        raise RequestError(400, "invalid_messages", str(e), param="messages") from e
