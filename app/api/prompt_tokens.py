"""Prompt text to token ids for the HTTP layer, at a cost bounded by what can fit the context.

`PromptEncoder.encode` may run on the event loop (short texts) or in a worker thread (long
ones, see `routes.INLINE_BODY_BYTES`). A long text is first compared with a bound that needs no
tokenization: no token stands for more bytes than the longest entry of the vocabulary, so a text
of N bytes is at least N / that many tokens; one that cannot fit the context is refused at once
(a 3 MB prompt costs a pass over its bytes, not seconds of BPE). The rest is tokenized by
`Tokenizer.encode`, which releases the GIL, so the event loop runs meanwhile.

A chat's messages are what its users wrote, so a special token's text inside them ("<|im_start|>
system") is encoded as that text, never as the special token: otherwise a message could close its
own turn and open a system one, which the chat template exists to prevent (`encode_chat`). An
operator whose clients must send special tokens in content allows it with
`--allow-special-tokens-in-content`.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from kvfence.engine.chat_template import ChatTemplateError, render_chat
from kvfence.engine.tokenizer import Tokenizer
from kvfence.scheduler.core.errors import RequestError

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
        self._check_fits(text, where, max_context_tokens)
        return self.tokenizer.encode(text, add_bos=add_bos)

    def _check_fits(self, text: str, where: str, max_context_tokens: int) -> None:
        """RequestError 400 for a long text that cannot fit whatever it tokenizes to."""
        if len(text) <= SHORT_TEXT_CHARS:
            return
        nbytes, at_least = self.min_tokens(text)
        if at_least >= max_context_tokens:
            raise RequestError(400, "context_length_exceeded",
                               f"This model's maximum context length is {max_context_tokens} tokens. However, your "
                               f"{where} is {nbytes} bytes long, which is at least {at_least} tokens. Please reduce "
                               f"the length of the {where}.", param=where)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
                    allow_special: bool, max_context_tokens: int, add_generation_prompt: bool = True,
                    add_bos: bool | None = False) -> list[int]:
        """The ids of the chat as its template renders it (`chat_text`). Unless `allow_special`,
        every string of the messages and tools that spells out a special token is encoded as
        text: the chat is rendered with a marker in its place, the template's own text around the
        markers is encoded as usual, and each such string with `Tokenizer.encode_as_text`.
        RequestError 400 as `encode` and `chat_text` raise them, or when the template drops or
        alters a marker (the string could not be kept apart from the template's text)."""
        tok = self.tokenizer
        text = chat_text(tok, messages, add_generation_prompt, tools)
        if allow_special:
            return self.encode(text, add_bos=add_bos, where="messages", max_context_tokens=max_context_tokens)
        user_texts: list[str] = []
        marker = f"\ue000{secrets.token_hex(8)}"

        def guard(value: Any, key: str = "") -> Any:
            if isinstance(value, str):
                if key in ("role", "type") or not tok.has_special_text(value):
                    return value
                user_texts.append(value)
                return f"{marker}{len(user_texts) - 1}\ue001"
            if isinstance(value, dict):
                return {k: guard(v, k) for k, v in value.items()}
            if isinstance(value, list):
                return [guard(v, key) for v in value]
            return value

        guarded_messages, guarded_tools = guard(messages), guard(tools)
        if not user_texts:
            return self.encode(text, add_bos=add_bos, where="messages", max_context_tokens=max_context_tokens)
        self._check_fits(text, "messages", max_context_tokens)
        parts = re.split(f"{marker}(\\d+)\ue001", chat_text(tok, guarded_messages, add_generation_prompt,
                                                              guarded_tools))
        if sorted(int(i) for i in parts[1::2]) != list(range(len(user_texts))):
            raise RequestError(400, "invalid_messages", "a message spells out a special token of this model, and "
                               "its chat template does not keep message text apart from its own: remove the "
                               "special token's text from the message", param="messages")
        ids: list[int] = []
        for k, part in enumerate(parts):
            if k % 2 == 0:
                ids += tok.encode(part, add_bos=add_bos if k == 0 else False) if part or k == 0 else []
            else:
                ids += tok.encode_as_text(user_texts[int(part)])
        return ids

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
