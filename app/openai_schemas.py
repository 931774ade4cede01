"""Wire schemas of the OpenAI-compatible API (msgspec Structs) and the checks a body must pass.

Requests: unknown fields are ignored (OpenAI clients send extras), except the transfer / routing
fields in `FORBIDDEN_FIELDS`: nothing in a body may choose a peer, a KV page or a transport, so a
body that carries any of them (at the top level or inside `extra_body`), whatever its value, is
refused. `check_common` raises `RequestError` (400, `param` naming the field) for every value the
server does not support; it never changes the request.

Responses: `UNSET` fields are left out of the JSON (msgspec omits them).
"""

from __future__ import annotations

from typing import Any

from msgspec import UNSET, Struct, UnsetType

from kvfence.scheduler.errors import RequestError

FORBIDDEN_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                    "page_ids", "lease", "transfer_id")
MAX_STOP_SEQUENCES = 4
# Chat roles the server renders; "developer" (OpenAI's newer name for system) is rendered as system.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})


def invalid(param: str | None, message: str, code: str = "invalid_value") -> RequestError:
    """A 400 `invalid_request_error` about `param`."""
    return RequestError(400, code, message, param=param)


# ---------------------------------------------------------------------------------------------
# Requests.


class StreamOptions(Struct, kw_only=True):
    include_usage: bool | None = None


class ContentPart(Struct, kw_only=True):
    """One part of a message's content; only {"type": "text", "text": ...} is supported."""

    type: str
    text: str | None = None


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _RequestBase(Struct, kw_only=True):
    """Fields both endpoints share, and the refused transfer / routing fields (any value, even
    null, counts as carrying the field: only UNSET means absent)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    extra_body: dict[str, Any] | None = None
    kv_transfer_params: Any = UNSET
    bootstrap_host: Any = UNSET
    bootstrap_port: Any = UNSET
    bootstrap_room: Any = UNSET
    page_ids: Any = UNSET
    lease: Any = UNSET
    transfer_id: Any = UNSET


class ChatCompletionRequest(_RequestBase, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None


class CompletionRequest(_RequestBase, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | bool | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


def check_common(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuse what kvfence does not do: transfer fields, n != 1, penalties, logprobs, > 4 stops,
    max_tokens < 1. Raises RequestError(400) naming the field."""
    for field in FORBIDDEN_FIELDS:
        top_level = getattr(req, field) is not UNSET
        if top_level or (req.extra_body is not None and field in req.extra_body):
            raise invalid(field if top_level else f"extra_body.{field}",
                          f"'{field}' is not accepted in a request body: the server alone chooses peers, "
                          "KV pages and transports. Remove the field.", "forbidden_parameter")
    if req.n is not None and req.n != 1:
        raise invalid("n", f"n must be 1 (one choice per request is supported), got {req.n}", "unsupported_value")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and value != 0:
            raise invalid(name, f"{name} is not supported; send 0 or leave it out (got {value})",
                          "unsupported_value")
    if req.logit_bias:
        raise invalid("logit_bias", "logit_bias is not supported; leave it out", "unsupported_value")
    if req.logprobs is not None and req.logprobs is not False:  # `in (None, False)` would let 0 in
        raise invalid("logprobs", f"logprobs are not supported; send false or leave it out (got {req.logprobs})",
                      "unsupported_value")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP_SEQUENCES:
        raise invalid("stop", f"stop takes at most {MAX_STOP_SEQUENCES} sequences, got {len(req.stop)}")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise invalid("max_tokens", f"max_tokens must be at least 1, got {req.max_tokens}")
    if isinstance(req, ChatCompletionRequest):
        _check_chat_only(req)
    else:
        _check_completion_only(req)


def _check_chat_only(req: ChatCompletionRequest) -> None:
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        raise invalid("max_completion_tokens", f"max_completion_tokens must be at least 1, "
                                               f"got {req.max_completion_tokens}")
    if req.top_logprobs not in (None, 0):
        raise invalid("top_logprobs", "top_logprobs is not supported; leave it out", "unsupported_value")
    if req.tools:
        raise invalid("tools", "tools (function calling) are not supported; leave them out", "unsupported_value")


def _check_completion_only(req: CompletionRequest) -> None:
    if req.echo:
        raise invalid("echo", "echo is not supported; send false or leave it out", "unsupported_value")
    if req.best_of not in (None, 1):
        raise invalid("best_of", f"best_of must be 1, got {req.best_of}", "unsupported_value")
    if req.suffix:
        raise invalid("suffix", "suffix is not supported; leave it out", "unsupported_value")


def requested_max_tokens(req: ChatCompletionRequest | CompletionRequest) -> tuple[int | None, str]:
    """(the completion budget the body asks for or None, the field it came from); for chat,
    max_completion_tokens takes precedence over max_tokens."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def stop_strings(req: ChatCompletionRequest | CompletionRequest) -> tuple[str, ...]:
    if req.stop is None:
        return ()
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as the chat template takes them: {"role", "content"} with text content (text
    parts joined with newlines). Raises RequestError(400) for an empty list, an unknown role, or
    a non-text part."""
    if not req.messages:
        raise invalid("messages", "messages must hold at least one message")
    out: list[dict[str, str]] = []
    for i, msg in enumerate(req.messages):
        if msg.role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role", f"role must be one of {sorted(CHAT_ROLES)}, got {msg.role!r}")
        if msg.content is None or isinstance(msg.content, str):
            text = msg.content or ""
        else:
            texts = []
            for j, part in enumerate(msg.content):
                if part.type != "text" or part.text is None:
                    raise invalid(f"messages[{i}].content[{j}]", "only text content parts "
                                  f'({{"type": "text", "text": ...}}) are supported, got type {part.type!r}')
                texts.append(part.text)
            text = "\n".join(texts)
        out.append({"role": "system" if msg.role == "developer" else msg.role, "content": text})
    return out


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The prompt as text or as token ids. A list of strings is a batch: only one element is
    accepted (n=1 batching is not supported). Raises RequestError(400, param "prompt")."""
    if isinstance(req.prompt, str):
        return req.prompt
    items = req.prompt
    if not items:
        raise invalid("prompt", "prompt must not be empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return list(items)
    if all(isinstance(t, str) for t in items):
        if len(items) > 1:
            raise invalid("prompt", f"prompt holds {len(items)} strings; batched prompts are not supported "
                                    "(one prompt per request, n=1): send one string", "unsupported_value")
        return items[0]
    raise invalid("prompt", "prompt must be a string, a list of token ids (ints), or a list holding one "
                            "string; batched token-id prompts are not supported", "invalid_type")


# ---------------------------------------------------------------------------------------------
# Responses.


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(Struct, kw_only=True):
    content: str
    role: str = "assistant"


class ChatChoice(Struct, kw_only=True):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChatDelta(Struct, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChatChunkChoice(Struct, kw_only=True):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None | UnsetType = UNSET  # null on every chunk when include_usage, else absent
    object: str = "chat.completion.chunk"


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class TextCompletion(Struct, kw_only=True):
    """Both the non-stream body and each stream chunk (OpenAI uses one object type for both)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET
    object: str = "text_completion"


class ModelCard(Struct, kw_only=True):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "kvfence"


class ModelList(Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"


class ErrorBody(Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorEnvelope(Struct, kw_only=True):
    error: ErrorBody
