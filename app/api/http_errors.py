"""OpenAI error envelopes, and the mapping of every way a request body can be wrong onto one.

Every error the HTTP layer returns is `{"error": {"message", "type", "param", "code"}}` with the
`RequestError`'s status; `Retry-After` is set when the error carries `retry_after_s`. The helpers
below turn parse / validation failures into `RequestError`s whose `param` names the field at fault.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from kvfence.app.api.openai_responses import ErrorBody, ErrorEnvelope
from kvfence.app.api.openai_schemas import invalid
from kvfence.scheduler.core.errors import RequestError

# msgspec ValidationError messages end with " - at `$.path`" when the error is below the root.
_PATH_RE = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING_RE = re.compile(r"^Object missing required field `(?P<field>[^`]+)`")

# The SamplingParams fields a ValueError message can start with (all have the API's names).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids", "stop",
                   "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                   "logit_bias", "logprobs")


def error_envelope(err: RequestError) -> ErrorEnvelope:
    """The OpenAI envelope of `err`, as clients may see it (`for_client`)."""
    err = for_client(err)
    return ErrorEnvelope(error=ErrorBody(message=err.message, type=err.error_type, param=err.param,
                                         code=err.code))


def error_response(err: RequestError, encoder: msgspec.json.Encoder | None = None) -> Response:
    """The JSON error response for `err`: its status, the OpenAI envelope, and `Retry-After`
    (whole seconds) when `err.retry_after_s` is set."""
    envelope = error_envelope(err)
    body = encoder.encode(envelope) if encoder is not None else msgspec.json.encode(envelope)
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return Response(body, status_code=err.status, headers=headers, media_type="application/json")


def from_validation_error(exc: msgspec.ValidationError) -> RequestError:
    """400 for a body of the wrong shape; `param` is the field path below the root
    ("max_tokens", "messages[0].content"), or None when the body itself is not an object."""
    message = str(exc)
    match = _PATH_RE.search(message)
    path = match.group("path") if match else ""
    missing = _MISSING_RE.match(message)
    if missing:
        field = missing.group("field")
        param = f"{path}.{field}" if path else field
        return invalid(param, f"'{param}' is required", "missing_required_parameter")
    if not path:
        return invalid(None, f"the request body must be a JSON object: {message}", "invalid_type")
    return invalid(path, f"invalid type for '{path}': {message}", "invalid_type")


def decode_body(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    """Decode `body` with `decoder`; raises RequestError 400 "invalid_json" for malformed or too
    deeply nested JSON and
    400 "invalid_type" / "missing_required_parameter" (param = the field) for a wrong shape."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: test it first
        raise from_validation_error(exc) from exc
    except msgspec.DecodeError as exc:
        raise invalid(None, f"the request body is not valid JSON: {exc}", "invalid_json") from exc
    except RecursionError as exc:  # msgspec stops past the interpreter's recursion limit (about 1,000 levels)
        raise invalid(None, "the request body nests JSON arrays or objects deeper than this server reads; "
                      "flatten it", "invalid_json") from exc


def from_sampling_error(exc: ValueError, max_tokens_param: str = "max_tokens") -> RequestError:
    """400 for a `SamplingParams` ValueError; `param` is the field its message starts with
    (`max_tokens_param` for max_tokens, so chat's max_completion_tokens is named right)."""
    message = str(exc)
    for field in SAMPLING_FIELDS:
        if message.startswith(field + " ") or message.startswith(field + ":"):
            return invalid(max_tokens_param if field == "max_tokens" else field, message)
    return invalid(None, message)


def model_not_found(requested: str, served: str) -> RequestError:
    return RequestError(404, "model_not_found",
                        f"The model '{requested}' does not exist; this server serves '{served}' "
                        "(see GET /v1/models)", param="model")


def context_too_long(max_context: int, prompt_tokens: int, max_tokens: int | None, *, prompt_param: str,
                     max_tokens_param: str, where: str) -> RequestError | None:
    """The 400 "context_length_exceeded" error for a prompt that does not fit, or None if it fits.
    `where` is "messages" or "prompt"; the prompt alone over the limit names `prompt_param`, a
    prompt that fits but leaves too little room for `max_tokens` names `max_tokens_param`."""
    if max_tokens is None:
        if prompt_tokens < max_context:
            return None
        return RequestError(400, "context_length_exceeded",
                            f"This model's maximum context length is {max_context} tokens. However, your "
                            f"{where} resulted in {prompt_tokens} tokens, which leaves no room for the "
                            f"completion. Please reduce the length of the {where}.", param=prompt_param)
    total = prompt_tokens + max_tokens
    if prompt_tokens < max_context and total <= max_context:
        return None
    return RequestError(400, "context_length_exceeded",
                        f"This model's maximum context length is {max_context} tokens. However, you "
                        f"requested {total} tokens ({prompt_tokens} in the {where}, {max_tokens} in the "
                        f"completion). Please reduce the length of the {where} or the completion.",
                        param=prompt_param if prompt_tokens >= max_context else max_tokens_param)


def internal_error(message: str) -> RequestError:
    return RequestError(500, "internal_error", message)


def body_too_large(max_bytes: int, declared_bytes: int | None) -> RequestError:
    """413 for a body over `--max-body-bytes` (`declared_bytes`: its Content-Length, if it had one)."""
    size = f"is {declared_bytes} bytes" if declared_bytes is not None else "is longer than that"
    return RequestError(413, "request_too_large", f"The request body {size}; this server accepts at most "
                        f"{max_bytes} bytes. Send a shorter prompt.")


# 5xx codes whose messages the server words for clients itself (limits, retry hints, no exception
# text). Every other 5xx message may carry a worker's or a transport's exception text: the client
# gets the wording below (or the generic one) and the detail stays in the log.
_CLIENT_WORDED_5XX = frozenset({"overloaded", "worker_restarted", "worker_lost", "kv_integrity_error",
                                "kv_pages_quarantined", "internal_error"})
_USER_TERMS_5XX = {
    "worker_error": "The model failed while computing this request; it was stopped and nothing more will be "
                    "sent. Retry the request.",
    "kv_transfer_failed": "Moving this request's KV cache between the prefill and decode workers failed; the "
                          "request was stopped. Retry the request.",
}
_GENERIC_5XX = "The server failed while serving this request. Retry the request."


def for_client(err: RequestError) -> RequestError:
    """`err` as a client may see it: a 5xx whose message is not worded for clients gets its code's
    user-terms message (status, code and retry hint unchanged); anything else is returned as is."""
    if err.status < 500 or err.code in _CLIENT_WORDED_5XX:
        return err
    return RequestError(err.status, err.code, _USER_TERMS_5XX.get(err.code, _GENERIC_5XX), param=err.param,
                        error_type=err.error_type, retry_after_s=err.retry_after_s)


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's 404 / 405 (unknown route, wrong method) as OpenAI error envelopes."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
    detail = exc.detail if isinstance(exc, HTTPException) else "HTTP error"
    return error_response(RequestError(status, code, f"{detail}: {request.method} {request.url.path}"))


async def server_error_handler(request: Request, exc: Exception) -> Response:
    """An unexpected exception as a 500 envelope that names nothing of it (starlette still
    re-raises it, so hypercorn logs it with its traceback)."""
    return error_response(internal_error("The server failed while handling this request. Retry the request."))
