"""Tool plans: which grammar a tool_choice asks for, what is refused and why, and how an output
becomes tool calls (app/api/tool_calls.py)."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest

from kvfence.app.api import openai_schemas as s
from kvfence.app.api.tool_calls import Tool, ToolPlan, plan_tools, read_calls
from kvfence.app.api.tool_parsers import CallHoldback, split_calls
from kvfence.scheduler.core.errors import RequestError

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "required": ["city"], "additionalProperties": False, "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "time"}}  # no parameters: an empty object
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# renders tools and teaches Hermes' <tool_call> blocks, as Qwen2.5's template does
HERMES_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> Call one as "
                   "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>{% endif %}"
                   "{% for m in messages %}{{ m['content'] }}{% endfor %}")
OTHER_SYNTAX = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def tools(*defs: dict) -> list[Tool]:
    return msgspec.convert(list(defs), list[Tool])


def schema_of(plan: ToolPlan) -> dict:
    return json.loads(plan.grammar)["schema"]


def test_a_named_function_asks_for_its_arguments() -> None:
    plan = plan_tools(tools(WEATHER, TIME), msgspec.convert({"type": "function", "function": {"name": "weather"}},
                                                            s.NamedToolChoice), None, TEMPLATE)
    assert plan is not None and plan.named == "weather"
    assert schema_of(plan) == WEATHER["function"]["parameters"]
    content, calls = read_calls(plan, '{"city":"Oslo"}')
    assert content is None and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("weather", {"city": "Oslo"})]
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29


def test_required_asks_for_a_list_of_calls_of_the_given_tools() -> None:
    plan = plan_tools(tools(WEATHER, TIME), "required", None, TEMPLATE)
    assert plan is not None and plan.named is None
    schema = schema_of(plan)
    good = [{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    _, calls = read_calls(plan, json.dumps(good))
    assert [c.function.name for c in calls] == ["weather", "time"]
    single = plan_tools(tools(WEATHER, TIME), "required", False, TEMPLATE)
    assert single is not None and schema_of(single)["maxItems"] == 1
    cut = '[{"name": "weather", "parameters": {"ci'  # cut short by max_tokens: text, no call
    assert read_calls(plan, cut) == (cut, [])


@pytest.mark.parametrize("defs,choice,param,code", [
    ((WEATHER,), None, "tool_choice", "unsupported_value"),  # auto, and the template renders no tools
    ((WEATHER,), "auto", "tool_choice", "unsupported_value"),
    ((WEATHER, WEATHER), "required", "tools[1].function.name", "invalid_value"),
    (({"type": "code_interpreter", "function": {"name": "x"}},), "required", "tools[0].type", "invalid_value"),
    (({"type": "function", "function": {"name": "f", "parameters": {"type": "string", "pattern": "a{20000}"}}},),
     "none", "tools[0].function.parameters", "grammar_too_complex"),  # bounded even when no call is asked for
    ((WEATHER,), {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name", "invalid_value"),
    ((), "required", "tool_choice", "invalid_value"),
    ((WEATHER,), "sometimes", "tool_choice", "invalid_value"),
])
def test_what_cannot_be_planned_is_a_400_naming_the_field(defs: tuple, choice: object, param: str, code: str) -> None:
    if isinstance(choice, dict):
        choice = msgspec.convert(choice, s.NamedToolChoice)
    with pytest.raises(RequestError) as info:
        plan_tools(tools(*defs) if defs else None, choice, None, TEMPLATE)  # type: ignore[arg-type]
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)


def test_auto_reads_the_calls_of_a_template_that_teaches_tool_call_blocks() -> None:
    for choice in (None, "auto"):  # auto is the default with tools
        plan = plan_tools(tools(WEATHER, TIME), choice, None, HERMES_TEMPLATE)
        assert plan is not None and (plan.syntax, plan.grammar, plan.names) == ("hermes", None, ("weather", "time"))
    with pytest.raises(RequestError) as info:  # renders tools, but in a syntax nothing here reads
        plan_tools(tools(WEATHER), "auto", None, OTHER_SYNTAX)
    assert (info.value.param, info.value.code) == ("tool_choice", "unsupported_value")
    assert "<tool_call>" in info.value.message


NAMES = ("weather", "time")
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.mark.parametrize("text,want", [
    ("It is sunny.", ("It is sunny.", [])),
    (CALL, (None, [("weather", '{"city": "Oslo"}')])),
    ("Let me look.\n" + CALL + CALL.replace("weather", "time").replace('{"city": "Oslo"}', "{}"),
     ("Let me look.", [("weather", '{"city": "Oslo"}'), ("time", "{}")])),
    (CALL.removesuffix("</tool_call>"), (None, [("weather", '{"city": "Oslo"}')])),  # ended right after the call
    (CALL.replace("weather", "stocks"), (CALL.replace("weather", "stocks"), [])),  # not a tool it was given
    (CALL[:40], (CALL[:40], [])),  # cut short
    ('<tool_call>{"name": "time", "arguments": 3}</tool_call>', ('<tool_call>{"name": "time", "arguments": 3}</tool_call>', [])),
])
def test_tool_call_blocks_are_read_or_the_whole_output_is_content(text: str, want: tuple) -> None:
    assert split_calls(text, NAMES) == want


def test_a_stream_holds_back_only_what_may_start_a_call() -> None:
    hold = CallHoldback()
    assert [hold.feed(t) for t in ("Let me", " look <", "b>. <tool", "_call>{\"na", "me\"")] == [
        "Let me", " look ", "<b>. ", "", ""]
    assert hold.calling and hold.held() == '<tool_call>{"name"'
    plain = CallHoldback()
    assert [plain.feed(t) for t in ("a <", "tool")] == ["a ", ""] and plain.held() == "<tool" and not plain.calling


def test_none_only_renders_the_tools() -> None:
    assert plan_tools(tools(WEATHER), "none", None, TEMPLATE) is None


def test_tool_messages_and_earlier_calls_reach_the_template() -> None:
    req = msgspec.convert({"model": "m", "messages": [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"}]}, s.ChatCompletionRequest)
    messages = s.chat_messages(req)
    assert messages[1]["tool_calls"][0]["function"]["name"] == "weather"
    assert json.loads(messages[1]["content"]) == [{"name": "weather", "arguments": '{"city": "Oslo"}'}]
    assert messages[2] == {"role": "tool", "content": "rain, 4 C", "tool_call_id": "call_1"}


def test_completions_refuse_tools() -> None:
    req = msgspec.convert({"model": "m", "prompt": "x", "tools": [WEATHER]}, s.CompletionRequest)
    with pytest.raises(RequestError) as info:
        s.check_common(req)
    assert (info.value.param, info.value.code) == ("tools", "unsupported_value")
