"""Wire schemas of the OpenAI-compatible API's responses (msgspec Structs): completions, chunks,
logprobs, usage, model cards and the error envelope. `UNSET` fields are left out of the JSON
(msgspec omits them). The requests and their checks are in app/api/openai_schemas.py.
"""

from __future__ import annotations

from msgspec import UNSET, Struct, UnsetType

from kvfence.app.api.tool_calls import ToolCall, ToolCallDelta


class PromptTokensDetails(Struct, kw_only=True):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class AssistantMessage(Struct, kw_only=True):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] | UnsetType = UNSET


class TopLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(Struct, kw_only=True):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: the prompt's first token (echo), which nothing predicts
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(Struct, kw_only=True):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


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
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChatChunkChoice(Struct, kw_only=True):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


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
    logprobs: CompletionLogprobs | None = None


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
