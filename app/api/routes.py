"""The OpenAI-compatible HTTP API (starlette) on top of an `EngineClient`.

Contracts:
- Every refusal (bad body, unknown model, context too long, admission rejected) is an OpenAI error
  envelope with a 4xx/5xx status, returned before any stream starts; `engine.submit_samples` is only called
  for a request that passed every check here.
- An admitted request is answered by `app/api/generation_response.py` (its samples, streamed or
  whole, failures after admission, aborts when the client goes or stalls).
- Input limits: a body over `max_body_bytes` gets 413 before it is read past the limit
  (`app/api/request_body.py`); a body over `INLINE_BODY_BYTES` is decoded, rendered and tokenized in
  a worker thread, never on the event loop; a text prompt so long that it cannot fit the context
  whatever it tokenizes to is refused without being tokenized (`app/api/prompt_tokens.py`).
- No exception text of a worker or a transport reaches a client (`http_errors.for_client`); the
  log has it.
- What one request may make the server hold is bounded before submit (app/api/response_budget.py:
  samples x logprob alternatives x max_tokens, and echoed prompt logprobs; 400 past it).
- A grammar (`response_format`, a tool call) is bounded in shape while the body is prepared
  (app/api/grammar_bounds.py) and compiled by `GrammarCompiler` (app/api/grammar_compiler.py) before
  submit: in a process with a time budget, never on the event loop, kept per tenant.
- With API keys on (app/api/keys.py), every /v1 route answers 401 `invalid_api_key` to a missing
  or wrong key before it reads the body, and /metrics wants the admin key; the tenant a request
  runs as is the one its key authenticates, never anything in its body.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from kvfence.app.api import openai_responses as r
from kvfence.app.api import openai_schemas as s
from kvfence.app.api.client_id import EchoRequestId, client_request_id
from kvfence.app.api.edge import Edge
from kvfence.app.api.engine_client import EngineClient
from kvfence.app.api.generation_response import GenerationResponse, Prepared
from kvfence.app.api.grammar_compiler import DEFAULT_BUDGET_S, GrammarCompiler
from kvfence.app.api.http_errors import (context_too_long, decode_body, error_response, from_sampling_error,
                                     http_exception_handler, model_not_found, server_error_handler)
from kvfence.app.api.keys import ApiKeys
from kvfence.app.api.logprobs_shape import TokenPieces
from kvfence.app.api.prompt_tokens import PromptEncoder
from kvfence.app.api.request_body import BodyBudget, BodyRefusal, RefusedBody, read_body
from kvfence.app.api.response_budget import DEFAULT_MAX_RESPONSE_ENTRIES, check_response_budget, response_entries
from kvfence.app.api.token_routes import TokenRoutes
from kvfence.app.api.tool_calls import ToolPlan, plan_tools
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.errors import RequestError, overloaded

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_NOT_READY_RETRY_AFTER_S = 1
DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_STALL_TIMEOUT_S = 30.0
# Bodies up to this size are decoded, rendered and tokenized on the event loop (well under a
# millisecond); longer ones in a worker thread, at most LONG_INPUT_THREADS at once (the others
# wait their turn), so long prompts cannot crowd the compute threads off the cores. A text
# prompt can only be as long as its body.
INLINE_BODY_BYTES = 64 << 10
LONG_INPUT_THREADS = 2
LONG_INPUTS_WAITING = 32  # long inputs waiting for those threads; past it, 503 with Retry-After
BODY_BUDGET_BODIES = 16  # bodies being received may hold this many times --max-body-bytes in all
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_MAX_IN_FLIGHT = 1024


class _Api:
    """The route handlers of one app; holds the engine, one JSON encoder and the decoders."""

    def __init__(self, engine: EngineClient, metrics_text: Callable[[], tuple[bytes, str]] | None,
                 max_body_bytes: int, stall_timeout_s: float, api_keys: ApiKeys, grammars: GrammarCompiler,
                 max_response_entries: int, body_timeout_s: float, allow_special_tokens: bool) -> None:
        if max_body_bytes <= 0 or stall_timeout_s <= 0:
            raise ValueError(f"max_body_bytes and stall_timeout_s must be > 0, got {max_body_bytes} and "
                             f"{stall_timeout_s}")
        self.engine = engine
        self.keys = api_keys
        self.grammars = grammars
        self.max_response_entries = max_response_entries
        self.body_timeout_s, self.allow_special_tokens = body_timeout_s, allow_special_tokens
        self.bodies = BodyBudget(BODY_BUDGET_BODIES * max_body_bytes)
        self.long_waiting = 0
        self.metrics_text = metrics_text
        self.max_body_bytes, self.stall_timeout_s = max_body_bytes, stall_timeout_s
        self.prompts = PromptEncoder(engine.tokenizer)
        self.pieces = TokenPieces(engine.tokenizer)
        self.long_inputs = anyio.CapacityLimiter(LONG_INPUT_THREADS)
        self.encoder = msgspec.json.Encoder()
        self.chat_decoder = msgspec.json.Decoder(s.ChatCompletionRequest)
        self.completion_decoder = msgspec.json.Decoder(s.CompletionRequest)
        self.created = int(time.time())

    def json(self, obj: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
        return Response(self.encoder.encode(obj), status_code=status_code, headers=headers,
                        media_type="application/json")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        tenant = self.keys.tenant(request.headers.get("authorization"))
        if tenant is None:
            return self._unauthorized("a valid API key")
        if not self.keys.enabled and request.client is not None:  # without keys, each client is a share
            tenant = dataclasses.replace(tenant, share=request.client.host)
        try:
            prep = await self._from_body(request, lambda body: self._prepare(body, chat))
            prep = await self._compile_grammar(prep, tenant.name)
            handles = self.engine.submit_samples(prep.prompt_ids, prep.samples(), tenant, prep.cache_salt)
            log.info("request %s admitted: tenant %s, %d prompt tokens, %d samples, client request id %r, user %r",
                     handles[0].request_id, tenant.name, len(prep.prompt_ids), len(handles),
                     client_request_id(request), prep.user)
        except (RefusedBody, ClientDisconnect, RequestError) as refused:
            return self._refusal(refused)
        return GenerationResponse(handles, prep, self.encoder, self.stall_timeout_s, self.pieces)

    async def _compile_grammar(self, prep: Prepared, tenant: str) -> Prepared:
        """`prep` with its grammar compiled for `tenant` (app/api/grammar_compiler.py), or as it is
        when it has none; RequestError when the grammar cannot be compiled within the budget."""
        spec = prep.sampling.grammar
        if spec is None:
            return prep
        param = "tools" if prep.tools is not None else "response_format.json_schema.schema"
        compiled = await self.grammars.compile(tenant, spec, param)
        return dataclasses.replace(prep, sampling=dataclasses.replace(prep.sampling, grammar_key=compiled.key,
                                                                      compiled_grammar=compiled))

    async def _from_body(self, request: Request, work: Callable[[bytes], _T]) -> _T:
        """`work(body)`: on the event loop up to INLINE_BODY_BYTES, else in a worker thread (at most
        LONG_INPUT_THREADS at once, LONG_INPUTS_WAITING waiting: 503 past it): decoding, rendering
        and tokenizing a long input would stall every other stream. Raises RefusedBody past
        `max_body_bytes`, the body timeout or the bodies' budget, ClientDisconnect, or what `work`
        raises."""
        body = await read_body(request, self.max_body_bytes, self.bodies, self.body_timeout_s)
        if len(body) <= INLINE_BODY_BYTES:
            return work(body)
        if self.long_waiting >= LONG_INPUTS_WAITING:
            raise overloaded(f"{self.long_waiting} long requests are waiting to be tokenized; retry shortly")
        self.long_waiting += 1
        try:
            return await anyio.to_thread.run_sync(work, body, limiter=self.long_inputs)
        finally:
            self.long_waiting -= 1

    def _refusal(self, refused: RefusedBody | ClientDisconnect | RequestError) -> Response:
        if isinstance(refused, RefusedBody):
            return BodyRefusal(refused)
        if isinstance(refused, ClientDisconnect):
            return Response(status_code=499)  # nobody is left to read it
        return error_response(refused, self.encoder)

    def _prepare(self, body: bytes, chat: bool) -> Prepared:
        """Everything between the body and `submit` (synchronous: runs on the loop or in a thread)."""
        if chat:
            return self._prepare_chat(decode_body(self.chat_decoder, body))
        return self._prepare_completion(decode_body(self.completion_decoder, body))

    def _check(self, req: s.ChatCompletionRequest | s.CompletionRequest) -> None:
        s.check_common(req)
        if req.model != self.engine.model_name:
            raise model_not_found(req.model, self.engine.model_name)

    def _prepare_chat(self, req: s.ChatCompletionRequest) -> Prepared:
        self._check(req)
        tok = self.engine.tokenizer
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, tok.chat_template)
        if plan is not None and s.grammar(req) is not None:
            raise s.invalid("response_format", "a tool call's output is the call's JSON: leave response_format out "
                            "when tool_choice asks for a call", "unsupported_value")
        tools = msgspec.to_builtins(req.tools) if req.tools else None
        ids = self.prompts.encode_chat(s.chat_messages(req), tools, allow_special=self.allow_special_tokens,
                                       max_context_tokens=self.engine.max_context_tokens)
        return self._finish(req, ids, chat=True, where="messages", tools=plan)

    def _prepare_completion(self, req: s.CompletionRequest) -> Prepared:
        self._check(req)
        prompt = s.completion_prompt(req)
        if isinstance(prompt, str):
            ids = self.prompts.encode(prompt, add_bos=None, where="prompt",
                                      max_context_tokens=self.engine.max_context_tokens)
        else:
            ids = prompt
        echo = None
        if req.echo:
            echo = prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(ids)
        return self._finish(req, ids, chat=False, where="prompt", echo=echo)

    def _finish(self, req: s.ChatCompletionRequest | s.CompletionRequest, ids: list[int], *, chat: bool,
                where: str, tools: ToolPlan | None = None, echo: str | None = None) -> Prepared:
        if not ids:
            raise s.invalid(where, f"the {where} must not be empty (it encodes to no tokens)")
        max_tokens, max_param = s.requested_max_tokens(req)
        n, best_of = s.sample_counts(req)
        logprobs = s.logprobs_requested(req)
        limit = self.engine.max_context_tokens
        too_long = context_too_long(limit, len(ids), max_tokens, prompt_param=where, max_tokens_param=max_param,
                                    where=where)
        if too_long is not None:
            raise too_long
        most = limit - len(ids) if max_tokens is None else max_tokens
        entries = response_entries(samples=best_of, logprobs=logprobs, max_tokens=most, n=n, prompt_tokens=len(ids),
                                   prompt_logprobs=logprobs if echo is not None else None)
        check_response_budget(entries, self.max_response_entries, max_param=max_param, n=n, samples=best_of,
                              logprobs=logprobs, max_tokens=most)
        vocab_size = self.engine.tokenizer.vocab_size
        _check_token_ids(where, ids, vocab_size)  # after the length check: a long list is refused unread
        _check_token_ids("stop_token_ids", req.stop_token_ids or [], vocab_size)
        try:
            sampling = SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                seed=req.seed,
                max_tokens=limit - len(ids) if max_tokens is None else max_tokens,
                stop=s.stop_strings(req),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=bool(req.ignore_eos),
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                min_p=req.min_p or 0.0,
                logit_bias=s.logit_bias(req, vocab_size),
                logprobs=logprobs,
                prompt_logprobs=logprobs if echo is not None else None,
                grammar=tools.grammar if tools is not None else s.grammar(req))
        except ValueError as e:
            raise from_sampling_error(e, max_param) from e
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Prepared(prompt_ids=ids, sampling=sampling, chat=chat, stream=bool(req.stream),
                         include_usage=include_usage, model=self.engine.model_name, user=req.user,
                         cache_salt=req.cache_salt or "", tools=tools, n=n, best_of=best_of, echo=echo)

    def _unauthorized(self, needs: str) -> Response:
        err = RequestError(401, "invalid_api_key", f"this route needs {needs}: send it as 'Authorization: Bearer "
                           "KEY'; the key was missing or is not known")
        response = error_response(err, self.encoder)
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    async def models(self, request: Request) -> Response:
        if self.keys.tenant(request.headers.get("authorization")) is None:
            return self._unauthorized("a valid API key")
        return self.json(r.ModelList(data=[self.model_card()]))

    async def health(self, request: Request) -> Response:
        return self.json({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        if self.engine.is_ready():
            return self.json({"status": "ready"})
        return self.json({"status": "not_ready"}, 503, {"Retry-After": str(_NOT_READY_RETRY_AFTER_S)})

    async def metrics(self, request: Request) -> Response:
        if not self.keys.is_admin(request.headers.get("authorization")):
            return self._unauthorized("the admin key")
        if self.metrics_text is None:
            return error_response(RequestError(404, "not_found", "metrics are not enabled on this server"),
                                  self.encoder)
        body, content_type = self.metrics_text()
        return Response(body, headers={"content-type": content_type})

    async def flush_cache(self, request: Request) -> Response:
        """POST /admin/flush_cache: drop every prefix-cache entry (admin key when keys are on)."""
        if not self.keys.is_admin(request.headers.get("authorization")):
            return self._unauthorized("the admin key")
        return self.json({"flushed": True, "pages_freed": self.engine.flush_cache()})  # the core logs it

    def model_card(self) -> r.ModelCard:
        return r.ModelCard(id=self.engine.model_name, created=self.created,
                           max_model_len=self.engine.max_context_tokens)

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model}: the served model's card, as /v1/models lists it; any other id is
        404 `model_not_found`."""
        if self.keys.tenant(request.headers.get("authorization")) is None:
            return self._unauthorized("a valid API key")
        requested = request.path_params["model"]
        if requested != self.engine.model_name:
            return error_response(model_not_found(requested, self.engine.model_name), self.encoder)
        return self.json(self.model_card())

    async def answer_body(self, request: Request, answer: Callable[[bytes], msgspec.Struct]) -> Response:
        """A route answered from its body alone (app/api/token_routes.py): 401 without a valid API key
        before the body is read, then `answer(body)` as `_generate` prepares (`_from_body`); its
        struct as JSON, or the refusal it raised."""
        if self.keys.tenant(request.headers.get("authorization")) is None:
            return self._unauthorized("a valid API key")
        try:
            return self.json(await self._from_body(request, answer))
        except (RefusedBody, ClientDisconnect, RequestError) as refused:
            return self._refusal(refused)

    def check_token_ids(self, param: str, ids: list[int]) -> None:
        _check_token_ids(param, ids, self.engine.tokenizer.vocab_size)


def _check_token_ids(param: str, ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise s.invalid(param, f"token ids must be in [0, {vocab_size}) for this model, got {bad[:5]}")


def build_app(engine: EngineClient, metrics_text: Callable[[], tuple[bytes, str]] | None = None, *,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
              api_keys: ApiKeys | None = None, grammars: GrammarCompiler | None = None,
              max_response_entries: int = DEFAULT_MAX_RESPONSE_ENTRIES, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
              allow_special_tokens: bool = False, allowed_hosts: frozenset[str] | None = None,
              max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> Starlette:
    """The OpenAI-compatible app: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
    GET /v1/models/{model}, POST /tokenize and POST /detokenize (vLLM's; app/api/token_routes.py),
    GET /health, GET /ready (503 + Retry-After while not ready), GET /metrics (`metrics_text()`
    -> (body, content type); 404 when None). `max_body_bytes`: longest request body (413 past it);
    `stall_timeout_s`: how long a response may be unable to send before its request is aborted;
    `api_keys`: who may call it (None: no keys, every request the anonymous tenant); `grammars`:
    what compiles requests' grammars (None: one for the tokenizer's vocabulary, with the default
    budget); `max_response_entries`: the fan-out budget of one request (app/api/response_budget.py);
    `body_timeout_s`: how long a body may take to arrive (408 past it); `allow_special_tokens`:
    encode special tokens spelled out in chat messages as special tokens (app/api/prompt_tokens.py);
    `allowed_hosts` (None: any) and `max_in_flight`: the edge (app/api/edge.py)."""
    if grammars is None:
        grammars = GrammarCompiler(engine.tokenizer, engine.tokenizer.vocab_size, budget_s=DEFAULT_BUDGET_S)
    api = _Api(engine, metrics_text, max_body_bytes, stall_timeout_s, api_keys or ApiKeys(), grammars,
               max_response_entries, body_timeout_s, allow_special_tokens)
    tokens = TokenRoutes(api)
    routes = [
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/tokenize", tokens.tokenize, methods=["POST"]),
        Route("/detokenize", tokens.detokenize, methods=["POST"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/ready", api.ready, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/admin/flush_cache", api.flush_cache, methods=["POST"]),
    ]
    return Starlette(routes=routes, middleware=[Middleware(Edge, hosts=allowed_hosts, max_in_flight=max_in_flight),
                                                Middleware(EchoRequestId)],
                     exception_handlers={HTTPException: http_exception_handler, Exception: server_error_handler})
