"""What a request sends its client: text out of tokens, stop checks and finish reasons.

One module for the server's scheduler core and the offline engine, so both end a request the
same way: an EOS id (unless `ignore_eos`) or a stop token id ends it with "stop" and its text is
flushed; a stop string ends it with "stop" and is cut from the text (OpenAI semantics); reaching
`max_tokens` ends it with "length" (or "stop" when the flushed tail completes a stop string).

Plain Python (no I/O, no clock): `OutputDelta` is what travels to the reader of a request.
"""

from __future__ import annotations

import dataclasses

from kvfence.engine.logprobs import TokenLogprobs
from kvfence.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.tokenizer import Tokenizer
from kvfence.scheduler.core.errors import RequestError


@dataclasses.dataclass(frozen=True)
class OutputDelta:
    """New output of one request. The last delta has `finish_reason` set ("stop" or "length"),
    or `error` set when the request failed after admission (never both); the last successful
    one also says how many prompt tokens came from the prefix cache."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: RequestError | None = None
    cached_tokens: int = 0
    # one per token of `token_ids` when the request asked for logprobs, else empty
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    # the first token's delta of a request that asked for prompt logprobs: prompt tokens 1, 2, ...
    prompt_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class TextOutput:
    """The output state of one request: its detokenizer, its stop matcher and its token count.

    It outlives a preemption (the next attempt's tokens continue the same stream)."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], params: SamplingParams, max_tokens: int) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt)
        self._stops = StopStringMatcher(params.stop)
        self._stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(tokenizer.eos_token_ids))
        self.max_tokens = max_tokens
        self.num_generated = 0

    def accept(self, token: int, logprobs: TokenLogprobs | None = None) -> OutputDelta:
        """The delta `token` (with its `logprobs`, when asked for) produces; terminal when it ends the request."""
        text, reason = self._accept(token)
        return OutputDelta(text=text, token_ids=[token], finish_reason=reason,
                           logprobs=[] if logprobs is None else [logprobs])

    def _accept(self, token: int) -> tuple[str, str | None]:
        self.num_generated += 1
        if token in self._stop_ids:
            return self._stops.push(self._detok.flush())[0] + self._stops.flush(), "stop"
        text, matched = self._stops.push(self._detok.push(token))
        if matched:
            return text, "stop"
        if self.num_generated < self.max_tokens:
            return text, None
        text += self._stops.push(self._detok.flush())[0]
        if self._stops.matched:
            return text, "stop"
        return text + self._stops.flush(), "length"
