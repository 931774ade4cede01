"""Wire schemas of the OpenAI-compatible API (msgspec Structs) and the checks a body must pass.

Requests: the transfer / routing fields in `FORBIDDEN_FIELDS` are refused whatever their value:
nothing in a body may choose a peer, a KV page or a transport, so a body that carries any of them
(at the top level or inside `extra_body`) is refused. The OpenAI and vLLM fields kvfence does not
implement (`UNSUPPORTED_FIELDS`: suffix, chat's best_of and echo, ...) are refused
unless they hold a value that changes nothing (null, or their documented default, e.g. `echo: false`),
never silently ignored. Other unknown fields are ignored: clients send extras that do not change
the output (`metadata`, `service_tier`, ...). `check_common` raises `RequestError` (400, `param`
naming the field) for every value the server does not support or that is out of its bounds; it
never changes the request.

The responses are in app/api/openai_responses.py.
"""

from __future__ import annotations

import json
from typing import Any

from msgspec import UNSET, Struct

from kvfence.app.api.grammar_bounds import check_schema
from kvfence.app.api.tool_calls import NamedToolChoice, Tool, ToolCall, message_calls
from kvfence.engine.grammar import grammar_spec
from kvfence.scheduler.core.errors import RequestError

FORBIDDEN_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                    "page_ids", "lease", "transfer_id", "tenant", "tenant_id", "cache_key", "block_hashes")
MAX_CACHE_SALT_CHARS = 256

# Fields kvfence does not implement, each with the values that change nothing (null always counts
# as absent). Any other value is refused with a 400 naming the field. A value matches only if it
# has the same type (so completions' `logprobs: 0`, which asks for logprobs, is not `false`).
UNSUPPORTED_FIELDS: dict[str, tuple[object, ...]] = {
    # OpenAI
    "best_of": (1,), "echo": (False,), "suffix": ("",), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),  # no tools can be given, so either value changes nothing
    "audio": (), "modalities": (["text"],), "prediction": (), "reasoning_effort": (), "web_search_options": (),
    # vLLM's extra parameters
    "min_tokens": (0,), "length_penalty": (1, 1.0),
    "use_beam_search": (False,), "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "prompt_logprobs": (), "allowed_token_ids": (), "bad_words": ([],),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (), "structured_outputs": (),
    "logits_processors": (), "truncate_prompt_tokens": (), "return_tokens_as_token_ids": (False,),
    "add_generation_prompt": (True,), "continue_final_message": (False,), "chat_template": (),
    "chat_template_kwargs": ({},), "documents": (),
}

# Bounds (OpenAI takes at most 4 stop sequences; vLLM sets no limit: this is generous but bounded,
# since every stop string is matched against the output after every token).
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TEMPERATURE = 2.0
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat; completions' too here (vLLM's default)
MAX_LOGIT_BIAS_ENTRIES = 1024
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # int64, as vLLM takes it
MAX_SAMPLES = 128  # `n`: OpenAI's bound
# Chat roles the server renders; "developer" (OpenAI's newer name for system) is rendered as system.
MAX_USER_CHARS = 256  # `user` identifies an end user in the log; nothing longer is kept
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
CHAT_TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})  # refused on completions only
COMPLETION_ONLY_FIELDS = frozenset({"best_of", "echo"})  # refused on chat only


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
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class JsonSchemaFormat(Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: Any = None
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


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
    # partitions this tenant's prefix cache further (as vLLM's `cache_salt`); it can never reach
    # another tenant's cache: the tenant comes from the API key
    cache_salt: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_logprobs: int | None = None  # chat only (with logprobs: true)
    response_format: ResponseFormat | None = None
    repetition_penalty: float | None = None  # vLLM's extra parameters
    min_p: float | None = None
    extra_body: dict[str, Any] | None = None
    # UNSUPPORTED_FIELDS not typed above (any value other than their no-op ones is refused)
    echo: Any = UNSET
    best_of: Any = UNSET
    suffix: Any = UNSET
    tools: Any = UNSET
    tool_choice: Any = UNSET
    functions: Any = UNSET
    function_call: Any = UNSET
    parallel_tool_calls: Any = UNSET
    audio: Any = UNSET
    modalities: Any = UNSET
    prediction: Any = UNSET
    reasoning_effort: Any = UNSET
    web_search_options: Any = UNSET
    min_tokens: Any = UNSET
    length_penalty: Any = UNSET
    use_beam_search: Any = UNSET
    include_stop_str_in_output: Any = UNSET
    skip_special_tokens: Any = UNSET
    spaces_between_special_tokens: Any = UNSET
    prompt_logprobs: Any = UNSET
    allowed_token_ids: Any = UNSET
    bad_words: Any = UNSET
    guided_json: Any = UNSET
    guided_regex: Any = UNSET
    guided_choice: Any = UNSET
    guided_grammar: Any = UNSET
    structured_outputs: Any = UNSET
    logits_processors: Any = UNSET
    truncate_prompt_tokens: Any = UNSET
    return_tokens_as_token_ids: Any = UNSET
    add_generation_prompt: Any = UNSET
    continue_final_message: Any = UNSET
    chat_template: Any = UNSET
    chat_template_kwargs: Any = UNSET
    documents: Any = UNSET
    kv_transfer_params: Any = UNSET
    bootstrap_host: Any = UNSET
    bootstrap_port: Any = UNSET
    bootstrap_room: Any = UNSET
    page_ids: Any = UNSET
    lease: Any = UNSET
    transfer_id: Any = UNSET
    tenant: Any = UNSET
    tenant_id: Any = UNSET
    cache_key: Any = UNSET
    block_hashes: Any = UNSET


class ChatCompletionRequest(_RequestBase, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    tools: list[Tool] | None = None  # app/api/tool_calls.py
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_RequestBase, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | bool | None = None
    best_of: int | None = None  # sample_counts
    echo: bool | None = None  # the prompt comes back before the completion (with its logprobs when asked)


def check_common(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuse what kvfence does not do or bound: transfer fields, `UNSUPPORTED_FIELDS` with a value
    that would change the output, too many or too long stop strings, too many stop_token_ids,
    temperature outside [0, 2], a seed outside int64, max_tokens < 1, a `user` over MAX_USER_CHARS
    characters (it is logged). Raises RequestError(400)
    naming the field. (top_p and top_k are bounded by `SamplingParams`; token ids against the
    vocabulary by the API, which knows it.)"""
    check_forbidden(req)
    if req.user is not None and len(req.user) > MAX_USER_CHARS:
        raise invalid("user", f"user must be at most {MAX_USER_CHARS} characters, got {len(req.user)}")
    for field, no_ops in UNSUPPORTED_FIELDS.items():
        if field in CHAT_TOOL_FIELDS and isinstance(req, ChatCompletionRequest):
            continue  # chat takes them (app/api/tool_calls.py)
        if field in COMPLETION_ONLY_FIELDS and isinstance(req, CompletionRequest):
            continue  # sample_counts
        value = getattr(req, field)
        if value is not UNSET and value is not None and not any(_same(value, v) for v in no_ops):
            default = f" or send {_show(no_ops[0])}" if no_ops else ""
            raise invalid(field, f"'{field}' is not supported by this server; leave it out{default} "
                                 f"(got {_show(value)})", "unsupported_value")
    _check_bounds(req)
    if req.cache_salt is not None and len(req.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise invalid("cache_salt", f"cache_salt is at most {MAX_CACHE_SALT_CHARS} characters, got "
                                    f"{len(req.cache_salt)}")
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None \
            and req.max_completion_tokens < 1:
        raise invalid("max_completion_tokens", f"max_completion_tokens must be at least 1, "
                                               f"got {req.max_completion_tokens}")


def check_forbidden(req: Any) -> None:
    """Refuse a body carrying any of FORBIDDEN_FIELDS (an attribute of `req` other than UNSET,
    or a key of its `extra_body`), whatever its value: RequestError(400, "forbidden_parameter")."""
    for field in FORBIDDEN_FIELDS:
        top_level = getattr(req, field) is not UNSET
        if top_level or (req.extra_body is not None and field in req.extra_body):
            raise invalid(field if top_level else f"extra_body.{field}",
                          f"'{field}' is not accepted in a request body: the server alone chooses tenants (from "
                          "the API key), cache keys, peers, KV pages and transports. Remove the field.", "forbidden_parameter")


def _same(value: object, no_op: object) -> bool:
    return type(value) is type(no_op) and value == no_op


def _show(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_bounds(req: ChatCompletionRequest | CompletionRequest) -> None:
    stops = stop_strings(req)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise invalid("stop", f"stop takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}")
    for stop in stops:
        if len(stop) > MAX_STOP_CHARS:
            raise invalid("stop", f"a stop sequence may be at most {MAX_STOP_CHARS} characters, got {len(stop)}")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid("stop_token_ids", f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, "
                                        f"got {len(req.stop_token_ids)}")
    if req.temperature is not None and not 0 <= req.temperature <= MAX_TEMPERATURE:
        raise invalid("temperature", f"temperature must be between 0 and {MAX_TEMPERATURE:g} (0 = greedy), "
                                     f"got {req.temperature}")
    if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
        raise invalid("seed", f"seed must be a 64-bit signed integer, got {req.seed}")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise invalid("max_tokens", f"max_tokens must be at least 1, got {req.max_tokens}")
    sample_counts(req)  # raises for a bad combination
    if req.logit_bias is not None and len(req.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid("logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(req.logit_bias)}")
    logprobs_requested(req)  # raises for a bad combination


def sample_counts(req: ChatCompletionRequest | CompletionRequest) -> tuple[int, int]:
    """(n, best_of): the choices to return and the samples to draw (completions' `best_of`, at
    least n: the n with the highest sum of token log-probabilities are returned). Raises
    RequestError(400) naming the field: n or best_of outside [1, MAX_SAMPLES], best_of < n, or
    best_of > n with `stream` (the best are known only at the end, as OpenAI rules)."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_SAMPLES:
        raise invalid("n", f"n must be between 1 and {MAX_SAMPLES}, got {n}")
    best_of = req.best_of if isinstance(req, CompletionRequest) and req.best_of is not None else n
    if not n <= best_of <= MAX_SAMPLES:
        raise invalid("best_of", f"best_of must be between n ({n}) and {MAX_SAMPLES}, got {best_of}")
    if best_of > n and req.stream:
        raise invalid("best_of", "best_of > n cannot stream: the best samples are known only once all have "
                                 "ended; set stream to false, or best_of to n", "unsupported_value")
    return n, best_of


def logprobs_requested(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many alternatives per token the body asks logprobs for, or None for no logprobs: chat's
    `top_logprobs` (0..20) once `logprobs` is true, completions' integer `logprobs` (0..20).
    Raises RequestError(400) naming the field for values out of range or without their switch."""
    if isinstance(req, ChatCompletionRequest):
        top = req.top_logprobs
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid("top_logprobs", f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}")
        if not req.logprobs:
            if top:
                raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
            return None
        return top or 0
    value = req.logprobs
    if value is None or value is False:
        return None
    if isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise invalid("logprobs", f"logprobs (completions) is the number of alternatives per token, an integer "
                                  f"between 0 and {MAX_TOP_LOGPROBS}; got {value!r}")
    return value


def grammar(req: ChatCompletionRequest | CompletionRequest) -> str | None:
    """The grammar `response_format` asks the output to follow (engine/grammar.py), or None for
    text. Raises RequestError(400) naming the field: an unknown type, a json_schema without a
    schema, a schema past the shape limits (app/api/grammar_bounds.py), or `ignore_eos` beside it (a
    grammar ends with EOS). Compiling it is app/api/grammar_compiler.py's, later."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        spec = grammar_spec("json_object")
    elif fmt.type == "json_schema":
        if fmt.json_schema is None or not isinstance(fmt.json_schema.schema, (dict, bool)):
            raise invalid("response_format.json_schema.schema", "a json_schema response format needs "
                          "json_schema.schema: a JSON Schema object", "missing_required_parameter")
        check_schema(fmt.json_schema.schema, "response_format.json_schema.schema")
        spec = grammar_spec("json_schema", fmt.json_schema.schema, bool(fmt.json_schema.strict))
    else:
        raise invalid("response_format.type", f"response_format.type must be 'text', 'json_object' or "
                                              f"'json_schema', got {fmt.type!r}")
    if req.ignore_eos:
        raise invalid("ignore_eos", "ignore_eos cannot be combined with response_format: the output ends where "
                                    "the grammar is complete", "unsupported_value")
    return spec


def logit_bias(req: ChatCompletionRequest | CompletionRequest, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """The body's logit_bias as (token id, bias) pairs; RequestError(400, "logit_bias") for a key
    that is not a token id of this model or a bias outside [-100, 100]."""
    pairs = []
    for key, bias in (req.logit_bias or {}).items():
        if not key.isdecimal() or not 0 <= int(key) < vocab_size:
            raise invalid("logit_bias", f"logit_bias keys are token ids in [0, {vocab_size}) as strings, got {key!r}")
        if not -100 <= bias <= 100:
            raise invalid("logit_bias", f"logit_bias values are in [-100, 100], got {bias} for token {key}")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


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


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: {"role", "content"} with text content (text
    parts joined with newlines). Raises RequestError(400) for an empty list, an unknown role, or
    a non-text part."""
    if not req.messages:
        raise invalid("messages", "messages must hold at least one message")
    out: list[dict[str, Any]] = []
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
        message: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role, "content": text}
        if msg.tool_calls:
            message["tool_calls"] = message_calls(msg.tool_calls)
            if not text:  # a template that ignores tool_calls still shows the calls
                message["content"] = json.dumps([{"name": c.function.name, "arguments": c.function.arguments}
                                                 for c in msg.tool_calls])
        if msg.tool_call_id is not None:
            message["tool_call_id"] = msg.tool_call_id
        out.append(message)
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
        return str(items[0])
    raise invalid("prompt", "prompt must be a string, a list of token ids (ints), or a list holding one "
                            "string; batched token-id prompts are not supported", "invalid_type")
