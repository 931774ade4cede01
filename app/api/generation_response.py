"""The response to one admitted completion request, streamed or whole, over the handles of its
samples (one, or `n`).

- A request that fails after admission never reports success: non-stream answers with the error's
  status, a stream sends one `data: {"error": ...}` event and ends without a finish_reason or
  [DONE]. One sample that fails fails the request; the other samples are aborted.
- Samples run side by side; a stream interleaves their chunks as they come, each naming its
  choice (a chat stream first sends every choice's role), and ends with every choice's finish,
  then the usage chunk when asked for, then [DONE]. A whole response has one choice per sample.
- Completions' `echo` sends the prompt before each choice's output (a stream: with its first
  chunk), and with `logprobs` the prompt tokens' logprobs too (null for the first token).
- Completions' `best_of` draws more samples than it returns: the n with the highest sum of token
  log-probabilities, whole responses only.
- Usage counts the prompt once and every sample's tokens, `best_of` ones included (OpenAI's
  rule); `cached_tokens` is the
  first sample's: the prompt pages earlier requests had cached (the other samples share the
  first one's).
- When the client goes away before every terminal delta (stream or not), the handles still
  running are aborted; so are they when the response is cancelled for any other reason, and when
  the client reads nothing for the stall timeout (`app/api/stall.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectSendStream
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvfence.app.api import openai_responses as r
from kvfence.app.api.http_errors import error_envelope, error_response, for_client, internal_error
from kvfence.app.api.logprobs_shape import TokenPieces
from kvfence.app.api.response_shape import ResponseShape
from kvfence.app.api.stall import SendWatch
from kvfence.app.api.tool_calls import ToolPlan
from kvfence.app.api.tool_parsers import CallHoldback
from kvfence.engine.logprobs import TokenLogprobs
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.errors import RequestError
from kvfence.scheduler.core.output import OutputDelta
from kvfence.scheduler.handle import RequestHandle

log = logging.getLogger(__name__)

_SSE_HEADERS = ((b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"))
_DONE = b"data: [DONE]\n\n"


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A request that passed every check: what to submit and how to answer."""

    prompt_ids: list[int]
    sampling: SamplingParams
    chat: bool
    stream: bool
    include_usage: bool
    model: str
    user: str | None = None  # the client's `user` field: logged, never used
    cache_salt: str = ""  # partitions the tenant's prefix cache; never chooses a tenant
    tools: ToolPlan | None = None  # the output is tool calls (app/api/tool_calls.py)
    n: int = 1  # choices returned
    echo: str | None = None  # completions' echo: the prompt's text, sent before each choice's output
    best_of: int = 1  # samples drawn (>= n; more only on a whole response): the n most likely are returned

    def samples(self) -> list[SamplingParams]:
        """The sampling parameters of each sample (SamplingParams.for_sample). Ranking `best_of`
        samples needs each sampled token's log-probability, so they carry it even when the
        request did not ask for logprobs (the response then leaves them out)."""
        base = self.sampling
        if self.best_of > self.n and base.logprobs is None:
            base = dataclasses.replace(base, logprobs=0)
        return [base.for_sample(i) for i in range(self.best_of)]


@dataclasses.dataclass
class _Choice:
    """What one sample has produced so far (a stream keeps only its count, and a tool call's text)."""

    num_tokens: int = 0
    texts: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    echoed: bool = False  # a stream sent the prompt (echo)
    holdback: CallHoldback = dataclasses.field(default_factory=CallHoldback)  # a stream's calls in a syntax (auto)
    ended: bool = False  # its terminal delta was seen
    finish_reason: str | None = None
    cached_tokens: int = 0


@contextlib.asynccontextmanager
async def _merged(handles: list[RequestHandle]) -> AsyncIterator[AsyncIterator[tuple[int, OutputDelta]]]:
    """Every handle's deltas with its index, in the order they come. One handle is read directly;
    several are read by one task each, through an unbuffered stream (each handle coalesces what
    its reader has not taken yet, so nothing piles up)."""
    if len(handles) == 1:
        async def one() -> AsyncGenerator[tuple[int, OutputDelta], None]:
            async with contextlib.aclosing(handles[0].deltas()) as deltas:
                async for delta in deltas:
                    yield 0, delta

        stream = one()
        async with contextlib.aclosing(stream):
            yield stream
        return

    async def forward(index: int, handle: RequestHandle, out: MemoryObjectSendStream[tuple[int, OutputDelta]]) -> None:
        async with out, contextlib.aclosing(handle.deltas()) as deltas:
            async for delta in deltas:
                await out.send((index, delta))

    send, receive = anyio.create_memory_object_stream[tuple[int, OutputDelta]](0)
    async with anyio.create_task_group() as tg, receive:
        for i, handle in enumerate(handles):
            tg.start_soon(forward, i, handle, send.clone())
        send.close()
        try:
            yield receive
        finally:
            tg.cancel_scope.cancel()


class GenerationResponse(Response):
    """ASGI response for one admitted request (stream or not). A task watches `receive` for
    http.disconnect and cancels the response, another (`SendWatch`) cancels it once a send has
    been pending for `stall_timeout_s`; every handle whose terminal delta was not seen is aborted
    in `finally` (abort is idempotent)."""

    def __init__(self, handles: list[RequestHandle], prep: Prepared, encoder: msgspec.json.Encoder,
                 stall_timeout_s: float, pieces: TokenPieces) -> None:
        self.handles, self.prep, self.encoder = handles, prep, encoder
        self.stall_timeout_s = stall_timeout_s
        self.request_id = handles[0].request_id
        self.shape = ResponseShape(chat=prep.chat, model=prep.model, request_id=self.request_id,
                                   include_usage=prep.include_usage, logprobs=prep.sampling.logprobs is not None,
                                   pieces=pieces, tools=prep.tools)
        self.choices = [_Choice() for _ in handles]
        self.status_code, self.background, self.raw_headers = 200, None, list(_SSE_HEADERS if prep.stream else ())

    @property
    def finished(self) -> bool:
        return all(c.ended for c in self.choices)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = SendWatch(send, self.stall_timeout_s)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
                tg.start_soon(watch.watch, tg.cancel_scope)
                if self.prep.stream:
                    await self._stream(watch.send)
                else:
                    await self._whole(scope, receive, watch.send)
                tg.cancel_scope.cancel()
        except OSError:
            pass  # ASGI >= 2.4 servers raise from send() once the client is gone
        finally:
            if watch.stalled:
                log.warning("request %s: the client read nothing for %g s; %s", self.request_id,
                            self.stall_timeout_s, "the response was dropped" if self.finished else "aborting it")
            for handle, choice in zip(self.handles, self.choices):
                if not choice.ended:
                    handle.abort()

    def _failed(self, error: RequestError) -> RequestError:
        """The terminal error; logged with its detail when the client gets other wording."""
        if for_client(error) is not error:
            log.warning("request %s failed (%d %s): %s", self.request_id, error.status, error.code, error.message)
        return error

    def _usage(self) -> r.Usage:
        prompt = len(self.prep.prompt_ids)
        completion = sum(c.num_tokens for c in self.choices)
        return r.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=r.PromptTokensDetails(cached_tokens=self.choices[0].cached_tokens))

    def _take(self, index: int, delta: OutputDelta, *, whole: bool) -> _Choice:
        """Record `delta` of choice `index` (a success; an error is the caller's): everything for a
        `whole` response, the text of a streamed tool call, the count for any other stream."""
        choice = self.choices[index]
        choice.num_tokens += len(delta.token_ids)
        if whole or (self.shape.tools is not None and self.shape.tools.syntax is None):
            choice.texts.append(delta.text)
        if whole:
            choice.token_ids += delta.token_ids
            choice.logprobs += delta.logprobs
            choice.prompt_logprobs += delta.prompt_logprobs
        if delta.finish_reason is not None:
            choice.ended, choice.finish_reason, choice.cached_tokens = True, delta.finish_reason, delta.cached_tokens
        return choice

    def _echoed(self, text: str, token_ids: list[int], logprobs: list[TokenLogprobs],
                prompt_logprobs: list[TokenLogprobs]) -> tuple[str, list[int], list[TokenLogprobs | None]]:
        """A choice's output, or with `echo` its output after the prompt: the prompt's text and
        tokens, and (when logprobs were asked for) a null entry for the first prompt token, which
        nothing predicts, then the prompt's logprobs."""
        if self.prep.echo is None:
            return text, token_ids, list(logprobs)
        entries: list[TokenLogprobs | None] = [None, *prompt_logprobs] if self.shape.logprobs else []
        return self.prep.echo + text, self.prep.prompt_ids + token_ids, entries + list(logprobs)

    def _best(self) -> list[_Choice]:
        """The n choices to return: every sample, or of `best_of` samples the n whose tokens have
        the highest sum of log-probabilities (ties: the earlier sample), in that order."""
        if self.prep.best_of == self.prep.n:
            return self.choices
        ranked = sorted(self.choices, key=lambda c: -sum(e.logprob for e in c.logprobs))
        return ranked[:self.prep.n]

    async def _whole(self, scope: Scope, receive: Receive, send: Send) -> None:
        response: Response = error_response(internal_error("the request ended without a result"), self.encoder)
        async with _merged(self.handles) as deltas:
            async for index, delta in deltas:
                if delta.error is not None:
                    self.choices[index].ended = True
                    response = error_response(self._failed(delta.error), self.encoder)
                    break
                self._take(index, delta, whole=True)
                if self.finished:
                    best = self._best()
                    body = self.shape.whole([self.shape.choice(i, *self._echoed("".join(c.texts), c.token_ids, c.logprobs,
                                                                                c.prompt_logprobs),
                                                               c.finish_reason or "stop")
                                             for i, c in enumerate(best)], self._usage())
                    response = Response(self.encoder.encode(body), media_type="application/json")
                    break
        await response(scope, receive, send)

    async def _stream(self, send: Send) -> None:
        async def event(obj: msgspec.Struct) -> None:
            data = b"data: " + self.encoder.encode(obj) + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})

        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        if self.shape.chat:
            for i in range(len(self.handles)):
                await event(self.shape.chunk("", None, role=True, index=i))
        failure: RequestError = internal_error("the request ended without a result")
        async with _merged(self.handles) as deltas:
            async for index, delta in deltas:
                if delta.error is not None:
                    self.choices[index].ended = True
                    failure = self._failed(delta.error)
                    break
                choice = self._take(index, delta, whole=False)
                plan = self.shape.tools
                text, token_ids = delta.text, delta.token_ids
                logprobs: Sequence[TokenLogprobs | None] = delta.logprobs
                if not choice.echoed:
                    choice.echoed = True
                    text, token_ids, logprobs = self._echoed(text, token_ids, delta.logprobs, delta.prompt_logprobs)
                if plan is not None and plan.syntax is not None:  # text until a call may start
                    text = choice.holdback.feed(text)
                carries_logprobs = self.shape.logprobs and token_ids
                whole_calls = plan is not None and plan.syntax is None  # sent once the grammar completed them
                if not whole_calls and (text or carries_logprobs
                                        or (delta.finish_reason is not None and not self.shape.chat)):
                    await event(self.shape.chunk(text, None if self.shape.chat else delta.finish_reason,
                                                 token_ids=token_ids, logprobs=logprobs, index=index))
                if delta.finish_reason is not None:
                    reason = delta.finish_reason
                    held = "".join(choice.texts) if whole_calls else choice.holdback.held()
                    if plan is not None and (whole_calls or held):
                        calls, reason = self.shape.tool_chunk(held, reason, index)
                        await event(calls)
                    if self.shape.chat:
                        await event(self.shape.chunk(None, reason, index=index))
                    if self.finished:
                        if self.prep.include_usage:
                            await event(self.shape.usage_chunk(self._usage()))
                        await send({"type": "http.response.body", "body": _DONE, "more_body": False})
                        return
        await event(error_envelope(failure))
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
