"""The response bodies and stream chunks of one chat or text completion (OpenAI's shapes).

A request with `n` > 1 has one choice per sample, each with its `index`; chunks of different
choices interleave in a stream, each naming its choice. A request that asked for logprobs gets
them on every chunk that carries tokens and on the whole body (app/api/logprobs_shape.py); one that
did not gets `logprobs: null`, as OpenAI sends it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from kvfence.app.api import openai_responses as r
from kvfence.app.api.logprobs_shape import CompletionLogprobsBuilder, TokenPieces, chat_logprobs
from kvfence.app.api.tool_calls import ToolCall, ToolCallDelta, ToolPlan, read_calls
from kvfence.engine.logprobs import TokenLogprobs


class ResponseShape:
    def __init__(self, *, chat: bool, model: str, request_id: str, include_usage: bool, logprobs: bool,
                 pieces: TokenPieces, tools: ToolPlan | None = None) -> None:
        """`logprobs`: the request asked for them (each chunk's tokens come with theirs); `tools`:
        its output is tool calls (app/api/tool_calls.py), answered as `tool_calls`."""
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.model = model
        self.usage_field: Any = None if include_usage else msgspec.UNSET
        self.logprobs = logprobs
        self._pieces = pieces
        self._completion_logprobs: dict[int, CompletionLogprobsBuilder] = {}  # per choice: offsets run on
        self.tools = tools

    def _chat_logprobs(self, token_ids: list[int], entries: Sequence[TokenLogprobs | None]) -> r.ChatLogprobs | None:
        if not self.logprobs:
            return None
        present = [e for e in entries if e is not None]
        if len(present) < len(entries):  # only a completion's echo has a null entry; a chat has no echo
            raise ValueError("a chat response's logprobs have no null entries")
        return chat_logprobs(self._pieces, token_ids, present)

    def _text_logprobs(self, index: int, token_ids: list[int],
                       entries: Sequence[TokenLogprobs | None]) -> r.CompletionLogprobs | None:
        if not self.logprobs:
            return None
        builder = self._completion_logprobs.get(index)
        if builder is None:
            builder = self._completion_logprobs[index] = CompletionLogprobsBuilder(self._pieces)
        return builder(token_ids, entries)

    def chunk(self, text: str | None, finish_reason: str | None, role: bool = False, token_ids: list[int] = [],
              logprobs: Sequence[TokenLogprobs | None] = (), index: int = 0) -> msgspec.Struct:
        """One stream chunk of choice `index`: `text` (None: no content field) of `token_ids`,
        whose `logprobs` it carries when asked for (a chunk without tokens carries none)."""
        if self.chat:
            delta = r.ChatDelta(role="assistant" if role else msgspec.UNSET,
                                content=msgspec.UNSET if text is None else text)
            choice = r.ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason,
                                       logprobs=self._chat_logprobs(token_ids, logprobs) if token_ids else None)
            return r.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, usage=self.usage_field,
                                         choices=[choice])
        text_choice = r.CompletionChoice(index=index, text=text or "", finish_reason=finish_reason,
                                         logprobs=self._text_logprobs(index, token_ids, logprobs) if token_ids else None)
        return r.TextCompletion(id=self.id, created=self.created, model=self.model, usage=self.usage_field,
                                choices=[text_choice])

    def usage_chunk(self, usage: r.Usage) -> msgspec.Struct:
        kind = r.ChatCompletionChunk if self.chat else r.TextCompletion
        return kind(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def choice(self, index: int, text: str, token_ids: list[int], logprobs: list[TokenLogprobs | None],
               finish_reason: str) -> r.ChatChoice | r.CompletionChoice:
        """Choice `index` of a whole response: its output `text` of `token_ids` (with their
        `logprobs` when asked for; None for a completion's echoed first prompt token), ended with
        `finish_reason`."""
        if self.chat:
            made = self._calls(text, finish_reason)
            message = (r.AssistantMessage(content=text) if made is None else
                       r.AssistantMessage(content=made[0], tool_calls=made[1]))
            return r.ChatChoice(index=index, message=message, finish_reason="tool_calls" if made else finish_reason,
                                logprobs=self._chat_logprobs(token_ids, logprobs))
        return r.CompletionChoice(index=index, text=text, finish_reason=finish_reason,
                                  logprobs=self._text_logprobs(index, token_ids, logprobs))

    def whole(self, choices: list[Any], usage: r.Usage) -> msgspec.Struct:
        """The whole response: `choices` from `choice()`, in index order."""
        if self.chat:
            return r.ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
        return r.TextCompletion(id=self.id, created=self.created, model=self.model, usage=usage, choices=choices)

    def _calls(self, text: str, finish_reason: str) -> tuple[str | None, list[ToolCall]] | None:
        """(content, calls) of a completed output that makes tool calls; None: text only (no
        call, or one cut short by max_tokens)."""
        if self.tools is None or finish_reason != "stop":
            return None
        content, calls = read_calls(self.tools, text)
        return (content, calls) if calls else None

    def tool_chunk(self, text: str, finish_reason: str, index: int = 0) -> tuple[msgspec.Struct, str]:
        """The chunk that streams the held output `text` of choice `index` of a tool-call
        request, and the finish reason to send: its calls (and any content before them) and
        "tool_calls", or (no call, or cut short) its text as content and `finish_reason`."""
        made = self._calls(text, finish_reason)
        if made is None:
            return self.chunk(text, None, index=index), finish_reason
        content, calls = made
        deltas = [ToolCallDelta(index=i, id=c.id, function=c.function) for i, c in enumerate(calls)]
        delta = r.ChatDelta(content=msgspec.UNSET if content is None else content, tool_calls=deltas)
        choice = r.ChatChunkChoice(index=index, delta=delta)
        return r.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, usage=self.usage_field,
                                     choices=[choice]), "tool_calls"
