"""vLLM's `POST /tokenize` and `POST /detokenize`, over the served model's own tokenizer.

Contracts:
- /tokenize takes `{"model", "prompt", "add_special_tokens"?}` or `{"model", "messages",
  "add_generation_prompt"? (default true), "add_special_tokens"?}`, and `"return_token_strs"?`;
  it answers `{"count", "max_model_len", "tokens", "token_strs"}`. The ids are exactly what a
  generation request would submit for the same input: a prompt is encoded as /v1/completions
  encodes it, messages are rendered by the model's chat template (`render_chat`, `chat_messages`)
  and encoded as /v1/chat/completions encodes them. `add_special_tokens` (vLLM's defaults: true
  for a prompt, false for messages) lets the tokenizer add its BOS when true and never when false.
  `token_strs` is null unless asked for, then each token as the vocabulary spells it.
- /detokenize takes `{"model", "tokens": [int]}` and answers `{"prompt": text}`, special tokens
  kept, so `tokenize(detokenize(ids)) == ids` for any ids the tokenizer itself produced.
- Both are guarded like the /v1 routes (`_Api.answer_body`): 401 `invalid_api_key` before the
  body is read, 413 past the body limit, long bodies worked on in a worker thread, never on the
  event loop. Refusals are OpenAI error envelopes naming the field: 404 `model_not_found` for
  another model, 400 for a field of the wrong type, ids outside the vocabulary (`tokens`), a
  transfer / tenant field (`FORBIDDEN_FIELDS`, refused exactly as the generation routes refuse
  it), or a text so long that it cannot fit the context whatever it tokenizes to (`prompt` or
  `messages`, refused untokenized as generation refuses it). A shorter text longer than the
  context is tokenized: `count` > `max_model_len` says it would not fit. Other unknown fields
  are ignored, as everywhere in the API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgspec
from msgspec import UNSET, Struct
from starlette.requests import Request
from starlette.responses import Response

from kvfence.app.api import openai_schemas as s
from kvfence.app.api.engine_client import EngineClient
from kvfence.app.api.http_errors import decode_body, model_not_found
from kvfence.app.api.prompt_tokens import PromptEncoder

# The refused transfer / tenant fields, each UNSET unless the body carries it (even as null), so
# that a body carrying one is refused by name; built from FORBIDDEN_FIELDS so the two never differ.
# A class made at run time is opaque to a type checker (not a valid base, no Struct keywords):
# the subclasses below say so in their ignores.
_CarriesForbidden = msgspec.defstruct("_CarriesForbidden", [(f, Any, UNSET) for f in s.FORBIDDEN_FIELDS],
                                      kw_only=True)


class TokenizeRequest(_CarriesForbidden, kw_only=True):  # type: ignore[misc, valid-type, call-arg]  # a defstruct base: see above
    """Exactly one of `prompt` and `messages`; null counts as absent."""

    model: str
    prompt: str | None = None
    messages: list[s.ChatMessage] | None = None
    add_generation_prompt: bool | None = None  # messages only; null: true
    add_special_tokens: bool | None = None  # null: true for a prompt, false for messages
    return_token_strs: bool | None = None
    extra_body: dict[str, Any] | None = None


class DetokenizeRequest(_CarriesForbidden, kw_only=True):  # type: ignore[misc, valid-type, call-arg]  # a defstruct base: see above
    model: str
    tokens: list[int]
    extra_body: dict[str, Any] | None = None


class TokenizeResponse(Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(Struct, kw_only=True):
    prompt: str


class TokenRouteHost(Protocol):
    """What the routes need from the app (`routes._Api`)."""

    engine: EngineClient
    prompts: PromptEncoder
    allow_special_tokens: bool

    async def answer_body(self, request: Request, answer: Callable[[bytes], Struct]) -> Response:
        """Authenticate, read the body under its limit, run `answer(body)` (inline or in a worker
        thread by its size) and send its struct as JSON, or the envelope of what it raised."""
        ...

    def check_token_ids(self, param: str, ids: list[int]) -> None:
        """RequestError 400 naming `param` for an id outside the vocabulary."""
        ...


class TokenRoutes:
    """The two route handlers of one app; every check and all the work runs in `answer_body`'s
    callback, so a long body is decoded and tokenized off the event loop."""

    def __init__(self, host: TokenRouteHost) -> None:
        self.host = host
        self.tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
        self.detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)

    async def tokenize(self, request: Request) -> Response:
        return await self.host.answer_body(request, self._tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self.host.answer_body(request, self._detokenize)

    def _check(self, req: TokenizeRequest | DetokenizeRequest) -> None:
        s.check_forbidden(req)
        served = self.host.engine.model_name
        if req.model != served:
            raise model_not_found(req.model, served)

    def _tokenize(self, body: bytes) -> TokenizeResponse:
        req: TokenizeRequest = decode_body(self.tokenize_decoder, body)
        self._check(req)
        if req.prompt is not None and req.messages is not None:
            raise s.invalid("messages", "send either 'prompt' or 'messages', not both")
        engine = self.host.engine
        tok = engine.tokenizer
        if req.messages is not None:
            chat = s.chat_messages(s.ChatCompletionRequest(model=req.model, messages=req.messages))
            ids = self.host.prompts.encode_chat(chat, None, allow_special=self.host.allow_special_tokens,
                                                max_context_tokens=engine.max_context_tokens,
                                                add_generation_prompt=req.add_generation_prompt is not False,
                                                add_bos=None if req.add_special_tokens else False)  # chat: False
        elif req.prompt is not None:
            add_bos = False if req.add_special_tokens is False else None  # completions: None
            ids = self.host.prompts.encode(req.prompt, add_bos=add_bos, where="prompt",
                                           max_context_tokens=engine.max_context_tokens)
        else:
            raise s.invalid("prompt", "send 'prompt' (a text) or 'messages' (a chat) to tokenize",
                            "missing_required_parameter")
        strs = [tok.token_text(i) or "" for i in ids] if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_context_tokens, tokens=ids,
                                token_strs=strs)

    def _detokenize(self, body: bytes) -> DetokenizeResponse:
        req: DetokenizeRequest = decode_body(self.detokenize_decoder, body)
        self._check(req)
        self.host.check_token_ids("tokens", req.tokens)
        return DetokenizeResponse(prompt=self.host.engine.tokenizer.decode(req.tokens, skip_special_tokens=False))
