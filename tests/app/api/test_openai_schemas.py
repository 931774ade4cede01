"""The OpenAI wire schemas: what a body may carry, what is refused, and how responses encode."""

from __future__ import annotations

import json

import msgspec
import pytest

from kvfence.app.api import openai_responses as r
from kvfence.app.api import openai_schemas as s
from kvfence.app.api.http_errors import decode_body, error_envelope, from_validation_error
from kvfence.scheduler.core.errors import RequestError

CHAT = msgspec.json.Decoder(s.ChatCompletionRequest)
COMPLETION = msgspec.json.Decoder(s.CompletionRequest)


def chat(**fields: object) -> s.ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return CHAT.decode(json.dumps(body).encode())


def completion(**fields: object) -> s.CompletionRequest:
    return COMPLETION.decode(json.dumps({"model": "m", "prompt": "hi", **fields}).encode())


def refused(req: s.ChatCompletionRequest | s.CompletionRequest) -> RequestError:
    with pytest.raises(RequestError) as info:
        s.check_common(req)
    assert info.value.status == 400
    return info.value


def test_full_chat_body_decodes_and_unknown_fields_are_ignored() -> None:
    req = chat(max_tokens=5, max_completion_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=1,
               stop=["a", "b"], stop_token_ids=[2], n=1, stream=True, stream_options={"include_usage": True},
               ignore_eos=True, user="u", presence_penalty=0, frequency_penalty=0.0, logprobs=False,
               parallel_tool_calls=False, metadata={"x": 1}, service_tier="auto")
    s.check_common(req)
    assert req.stream_options is not None and req.stream_options.include_usage
    assert s.requested_max_tokens(req) == (7, "max_completion_tokens")
    assert s.stop_strings(req) == ("a", "b")


def test_max_tokens_is_used_when_max_completion_tokens_is_absent() -> None:
    assert s.requested_max_tokens(chat(max_tokens=5)) == (5, "max_tokens")
    assert s.requested_max_tokens(chat()) == (None, "max_tokens")
    assert s.requested_max_tokens(completion(max_tokens=9)) == (9, "max_tokens")


def test_stop_accepts_a_string_or_up_to_sixteen_strings_of_bounded_length() -> None:
    assert s.stop_strings(chat(stop="x")) == ("x",)
    assert s.stop_strings(chat()) == ()
    s.check_common(chat(stop=[str(i) for i in range(s.MAX_STOP_SEQUENCES)]))
    assert refused(chat(stop=[str(i) for i in range(s.MAX_STOP_SEQUENCES + 1)])).param == "stop"
    s.check_common(chat(stop="x" * s.MAX_STOP_CHARS))
    for stop in ("x" * (s.MAX_STOP_CHARS + 1), ["a", "x" * (s.MAX_STOP_CHARS + 1)]):
        err = refused(completion(stop=stop))
        assert (err.param, err.code) == ("stop", "invalid_value") and str(s.MAX_STOP_CHARS) in err.message


@pytest.mark.parametrize("fields,param", [
    ({"stop_token_ids": list(range(s.MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ({"temperature": 2.01}, "temperature"), ({"temperature": -0.1}, "temperature"),
    ({"temperature": 1e300}, "temperature"),
    ({"seed": 1 << 63}, "seed"), ({"seed": -(1 << 63) - 1}, "seed"), ({"seed": 10 ** 30}, "seed"),
])
def test_values_out_of_bounds_are_refused(fields: dict, param: str) -> None:
    for req in (chat(**fields), completion(**fields)):
        err = refused(req)
        assert (err.param, err.code) == (param, "invalid_value")


def test_values_at_the_bounds_are_accepted() -> None:
    s.check_common(chat(temperature=2, seed=(1 << 63) - 1, stop_token_ids=list(range(s.MAX_STOP_TOKEN_IDS))))
    s.check_common(completion(temperature=0.0, seed=-(1 << 63)))


# A value that would change the output, for every field of UNSUPPORTED_FIELDS.
ACTIVE_VALUES: dict[str, object] = {
    "best_of": 3, "echo": True, "suffix": "end",
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto", "functions": [{"name": "f"}],
    "function_call": "auto", "parallel_tool_calls": "yes", "audio": {"voice": "x"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content"}, "reasoning_effort": "high", "web_search_options": {},
    "min_tokens": 5, "length_penalty": 2, "use_beam_search": True,
    "include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "prompt_logprobs": 1, "allowed_token_ids": [1], "bad_words": ["x"], "guided_json": {}, "guided_regex": "a+",
    "guided_choice": ["a"], "guided_grammar": "g", "structured_outputs": {"json": {}}, "logits_processors": ["p"],
    "truncate_prompt_tokens": 5, "return_tokens_as_token_ids": True, "add_generation_prompt": False,
    "continue_final_message": True, "chat_template": "{{ x }}", "chat_template_kwargs": {"a": 1},
    "documents": [{"text": "d"}],
}


def test_every_unsupported_field_has_an_active_value_here() -> None:
    assert set(ACTIVE_VALUES) == set(s.UNSUPPORTED_FIELDS)


@pytest.mark.parametrize("field", sorted(s.UNSUPPORTED_FIELDS))
def test_unsupported_fields_are_refused_by_name_never_ignored(field: str) -> None:
    requests = []
    if field not in s.COMPLETION_ONLY_FIELDS:  # completions take best_of and echo
        requests.append(completion(**{field: ACTIVE_VALUES[field]}))
    if field not in s.CHAT_TOOL_FIELDS:  # chat takes tools (tests/app/api/test_tool_calls.py)
        requests.append(chat(**{field: ACTIVE_VALUES[field]}))
    for req in requests:
        err = refused(req)
        assert (err.param, err.code) == (field, "unsupported_value")
        assert field in err.message


@pytest.mark.parametrize("field", sorted(s.UNSUPPORTED_FIELDS))
def test_unsupported_fields_at_a_value_that_changes_nothing_are_accepted(field: str) -> None:
    for value in (None, *s.UNSUPPORTED_FIELDS[field]):
        if field not in s.CHAT_TOOL_FIELDS:
            s.check_common(chat(**{field: value}))
        s.check_common(completion(**{field: value}))


@pytest.mark.parametrize("field", s.FORBIDDEN_FIELDS)
@pytest.mark.parametrize("value", [None, "10.0.0.1", 7, [1, 2], {"remote_host": "x"}])
def test_transfer_and_routing_fields_are_refused_whatever_their_value(field: str, value: object) -> None:
    for req in (chat(**{field: value}), completion(**{field: value})):
        err = refused(req)
        assert (err.param, err.code) == (field, "forbidden_parameter")
        assert field in err.message


@pytest.mark.parametrize("field", s.FORBIDDEN_FIELDS)
def test_transfer_fields_nested_in_extra_body_are_refused(field: str) -> None:
    err = refused(chat(extra_body={field: 1}))
    assert (err.param, err.code) == (f"extra_body.{field}", "forbidden_parameter")
    s.check_common(chat(extra_body={"something_else": 1}))  # other extras stay ignored


@pytest.mark.parametrize("fields,param", [
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"best_of": 2}, "best_of"),
    ({"top_logprobs": 3}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logit_bias": {str(i): 1.0 for i in range(s.MAX_LOGIT_BIAS_ENTRIES + 1)}}, "logit_bias"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_chat_values_the_server_does_not_support_are_refused(fields: dict, param: str) -> None:
    assert refused(chat(**fields)).param == param


@pytest.mark.parametrize("fields,param", [
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"best_of": 2, "n": 3}, "best_of"), ({"best_of": 129}, "best_of"), ({"best_of": 3, "stream": True}, "best_of"),
    ({"suffix": "end"}, "suffix"), ({"n": 129}, "n"), ({"max_tokens": 0}, "max_tokens"),
])
def test_completion_values_the_server_does_not_support_are_refused(fields: dict, param: str) -> None:
    assert refused(completion(**fields)).param == param


def test_neutral_values_of_unsupported_features_are_accepted() -> None:
    s.check_common(chat(n=1, presence_penalty=0, frequency_penalty=0, logprobs=False, top_logprobs=0,
                        logit_bias={}, tools=[]))
    s.check_common(completion(logprobs=False, echo=False, best_of=1, suffix=""))


def test_samples_are_counted_as_asked() -> None:
    assert s.sample_counts(chat()) == (1, 1)
    assert s.sample_counts(chat(n=3, stream=True)) == (3, 3)
    assert s.sample_counts(completion(n=2, best_of=5)) == (2, 5)
    assert s.sample_counts(completion(n=2, best_of=2, stream=True)) == (2, 2)


@pytest.mark.parametrize("fields,wanted", [
    ({}, None), ({"logprobs": False}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 0}, 0),
    ({"logprobs": True, "top_logprobs": 20}, 20), ({"logprobs": False, "top_logprobs": 0}, None),
])
def test_chat_logprobs_ask_for_top_logprobs_alternatives(fields: dict, wanted: int | None) -> None:
    assert s.logprobs_requested(chat(**fields)) == wanted


@pytest.mark.parametrize("fields,wanted", [({}, None), ({"logprobs": False}, None), ({"logprobs": 0}, 0),
                                           ({"logprobs": 5}, 5), ({"logprobs": 20}, 20)])
def test_completion_logprobs_is_the_number_of_alternatives(fields: dict, wanted: int | None) -> None:
    assert s.logprobs_requested(completion(**fields)) == wanted


def test_logit_bias_keys_are_token_ids_of_the_model_and_values_bounded() -> None:
    assert s.logit_bias(chat(logit_bias={"5": 1.5, "0": -100}), 10) == ((5, 1.5), (0, -100.0))
    for bias in ({"10": 1.0}, {"-1": 1.0}, {"x": 1.0}, {"5": 100.5}, {"5": -101}):
        with pytest.raises(RequestError) as info:
            s.logit_bias(chat(logit_bias=bias), 10)
        assert info.value.param == "logit_bias"


def test_chat_messages_join_text_parts_and_render_developer_as_system() -> None:
    req = chat(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ])
    assert s.chat_messages(req) == [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "a\nb"},
                                    {"role": "assistant", "content": ""}]


@pytest.mark.parametrize("messages,param", [
    ([], "messages"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[1].content[0]"),
])
def test_chat_messages_refusals_name_the_message(messages: list, param: str) -> None:
    with pytest.raises(RequestError) as info:
        s.chat_messages(chat(messages=messages))
    assert (info.value.status, info.value.param) == (400, param)


def test_completion_prompt_forms() -> None:
    assert s.completion_prompt(completion(prompt="text")) == "text"
    assert s.completion_prompt(completion(prompt=[5, 6, 7])) == [5, 6, 7]
    assert s.completion_prompt(completion(prompt=["only one"])) == "only one"


@pytest.mark.parametrize("prompt,needle", [
    (["a", "b"], "n=1"), ([], "empty"), ([[1, 2], [3]], "batched"), ([1, "a"], "list of token ids"),
    ([True, 1], "list of token ids"),
])
def test_completion_prompt_refusals(prompt: list, needle: str) -> None:
    with pytest.raises(RequestError) as info:
        s.completion_prompt(completion(prompt=prompt))
    assert (info.value.status, info.value.param) == (400, "prompt")
    assert needle in info.value.message


@pytest.mark.parametrize("body,param,code", [
    (b'{"model": "m", "messages": [], "max_tokens": "5"}', "max_tokens", "invalid_type"),
    (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "messages[0].content", "invalid_type"),
    (b'{"model": "m", "messages": [{"content": "x"}]}', "messages[0].role", "missing_required_parameter"),
    (b'{"messages": []}', "model", "missing_required_parameter"),
    (b'{"model": "m", "messages": [], "stream_options": {"include_usage": "yes"}}',
     "stream_options.include_usage", "invalid_type"),
    (b'[1, 2]', None, "invalid_type"),
    (b'{"model": "m", "messages": [', None, "invalid_json"),
    (b'', None, "invalid_json"),
])
def test_decode_errors_name_the_field(body: bytes, param: str | None, code: str) -> None:
    with pytest.raises(RequestError) as info:
        decode_body(CHAT, body)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)


def test_validation_error_mapping_handles_messages_without_a_path() -> None:
    err = from_validation_error(msgspec.ValidationError("Expected `object`, got `str`"))
    assert (err.param, err.code) == (None, "invalid_type")


def test_response_encoding_omits_unset_and_keeps_null_usage() -> None:
    enc = msgspec.json.Encoder()
    role = r.ChatCompletionChunk(id="chatcmpl-1", created=1, model="m",
                                 choices=[r.ChatChunkChoice(index=0, delta=r.ChatDelta(role="assistant", content=""))])
    assert json.loads(enc.encode(role)) == {
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                     "logprobs": None}]}
    final = r.ChatCompletionChunk(id="c", created=1, model="m", usage=None,
                                  choices=[r.ChatChunkChoice(index=0, delta=r.ChatDelta(), finish_reason="stop")])
    decoded = json.loads(enc.encode(final))
    assert decoded["choices"][0]["delta"] == {} and decoded["usage"] is None
    usage = r.Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    body = json.loads(enc.encode(r.TextCompletion(id="cmpl-1", created=1, model="m", usage=usage, choices=[
        r.CompletionChoice(index=0, text="hi", finish_reason="length")])))
    assert body["object"] == "text_completion" and body["usage"]["total_tokens"] == 5
    whole = json.loads(enc.encode(r.ChatCompletion(id="c", created=1, model="m", usage=usage, choices=[
        r.ChatChoice(index=0, message=r.AssistantMessage(content="hey"), finish_reason="stop")])))
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"content": "hey", "role": "assistant"}


def test_error_envelope_shape() -> None:
    err = RequestError(400, "invalid_value", "bad", param="top_p")
    assert json.loads(msgspec.json.encode(error_envelope(err))) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": "invalid_value"}}
