"""Tool calls (`tools`, `tool_choice`) through the structured-output path.

- `tool_choice` `"required"`: the output is a JSON array of one or more calls
  `{"name": <one of the tools>, "parameters": <that tool's parameters>}` (one at most with
  `parallel_tool_calls: false`), as vLLM shapes it; a named function
  (`{"type": "function", "function": {"name": ...}}`): the output is that function's arguments.
  Either way a grammar (engine/grammar.py) makes the model produce exactly that JSON, and the
  response carries `tool_calls` with `finish_reason: "tool_calls"`.
- `"auto"` (the default when tools are given) needs a chat template that renders tools, so that
  the model can choose, in a call syntax this server reads (app/api/tool_parsers.py: Hermes'
  `<tool_call>` blocks); otherwise it is a 400 that says so. The output is not constrained: the
  calls the model wrote are read from it, and any text before them is the message's content.
  `"none"`: the tools are only rendered.
- Tool schemas are checked at the API: a name used twice, a named choice no tool has, or
  parameters past the shape limits (app/api/grammar_bounds.py) are 400s naming the field; the one
  grammar a call needs is compiled within a budget (app/api/grammar_compiler.py), so a schema that
  cannot be compiled is a 400 only where a grammar is used ("required", a named function).

A call's id is minted here (`call_` + 24 hex digits); nothing of it comes from the client.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any

from msgspec import Struct

from kvfence.app.api.grammar_bounds import check_tools
from kvfence.app.api.tool_parsers import call_syntax, split_calls
from kvfence.engine.grammar import grammar_spec
from kvfence.scheduler.core.errors import RequestError

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionDef(Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    type: str
    function: FunctionDef


class NamedFunction(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: str
    function: NamedFunction


class CalledFunction(Struct, kw_only=True):
    name: str
    arguments: str  # the arguments as a JSON text, as OpenAI sends them


class ToolCall(Struct, kw_only=True):
    id: str
    function: CalledFunction
    type: str = "function"


class ToolCallDelta(Struct, kw_only=True):
    index: int
    id: str
    function: CalledFunction
    type: str = "function"


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How a request's output becomes tool calls: `named` (the output is that function's
    arguments) or every name in `names` (the output is a list of calls), which `grammar` makes
    it; or (`syntax`, with "auto") the calls the model chose to write in that syntax, if any."""

    names: tuple[str, ...]
    named: str | None
    grammar: str | None
    syntax: str | None = None


def _invalid(param: str, message: str, code: str = "invalid_value") -> RequestError:
    return RequestError(400, code, message, param=param)


def plan_tools(tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None, parallel: bool | None,
               chat_template: str | None) -> ToolPlan | None:
    """The tool plan of a chat request, or None when it generates text. Raises RequestError(400)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise _invalid("tool_choice", "tool_choice needs tools")
        return None
    check_tools([EMPTY_PARAMETERS if t.function.parameters is None else t.function.parameters for t in tools])
    params: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise _invalid(f"tools[{i}].type", f"only function tools are supported, got {tool.type!r}")
        if tool.function.name in params:
            raise _invalid(f"tools[{i}].function.name", f"two tools are named {tool.function.name!r}")
        params[tool.function.name] = EMPTY_PARAMETERS if tool.function.parameters is None else tool.function.parameters
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice == "auto":
        if chat_template is None or "tools" not in chat_template:
            raise _invalid("tool_choice", "tool_choice 'auto' needs a chat template that renders tools, and this "
                           "model's does not: send tool_choice 'required' or name a function", "unsupported_value")
        syntax = call_syntax(chat_template)
        if syntax is None:
            raise _invalid("tool_choice", "tool_choice 'auto' needs to read the calls in the model's own syntax, and "
                           "this model's chat template teaches one this server does not read (it reads <tool_call> "
                           "blocks): send tool_choice 'required' or name a function", "unsupported_value")
        return ToolPlan(names=tuple(params), named=None, grammar=None, syntax=syntax)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in params:
            raise _invalid("tool_choice.function.name", f"no tool is named {choice.function.name!r}")
        schema = params[choice.function.name]
        return ToolPlan(names=tuple(params), named=choice.function.name,
                        grammar=grammar_spec("json_schema", schema, strict=True))
    if choice != "required":
        raise _invalid("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}")
    call = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                       "properties": {"name": {"const": name}, "parameters": schema}}
                      for name, schema in params.items()]}
    calls = {"type": "array", "items": call, "minItems": 1, **({"maxItems": 1} if parallel is False else {})}
    return ToolPlan(names=tuple(params), named=None, grammar=grammar_spec("json_schema", calls, strict=True))


def read_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a complete output: with a grammar, no content and the calls its JSON
    holds ((text, []) if it is not complete JSON: it stopped at max_tokens); with a call syntax,
    the text before the calls (app/api/tool_parsers.py) and the calls, if the model made any."""
    if plan.syntax is not None:
        content, pairs = split_calls(text, plan.names)
        return content, [_call(name, args) for name, args in pairs]
    try:
        parsed = json.loads(text)
    except ValueError:
        return text, []
    if plan.named is not None:
        pairs = [(plan.named, json.dumps(parsed))]
    else:
        pairs = [(call["name"], json.dumps(call["parameters"])) for call in parsed]
    return None, [_call(name, args) for name, args in pairs]


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id="call_" + secrets.token_hex(12), function=CalledFunction(name=name, arguments=arguments))


def message_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """An assistant message's earlier calls as a chat template takes them."""
    return [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in calls]
