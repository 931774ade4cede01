"""The shape limits of a request's JSON schemas (app/api/grammar_bounds.py): each refusal is a 400
`grammar_too_complex` naming the field and the limit, decided without compiling anything and
without recursion."""

from __future__ import annotations

import pytest

from kvfence.app.api import grammar_bounds as b
from kvfence.app.api.grammar_bounds import check_schema, check_tools
from kvfence.scheduler.core.errors import RequestError

PARAM = "response_format.json_schema.schema"


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def refusal(schema: object) -> RequestError:
    with pytest.raises(RequestError) as info:
        check_schema(schema, PARAM)
    err = info.value
    assert (err.status, err.code, err.param) == (400, "grammar_too_complex", PARAM)
    return err


@pytest.mark.parametrize("schema,limit", [
    ({"type": "string", "pattern": "a{20000}"}, str(b.MAX_REPEAT)),  # the 60-byte bomb
    ({"type": "string", "pattern": "x(ab){3,999}"}, str(b.MAX_REPEAT)),
    ({"type": "string", "pattern": "a{1,}b{0,5000}"}, str(b.MAX_REPEAT)),
    ({"type": "object", "patternProperties": {"^a{9999}$": {}}}, str(b.MAX_REPEAT)),
    ({"type": "string", "pattern": "a" * (b.MAX_PATTERN_CHARS + 1)}, str(b.MAX_PATTERN_CHARS)),
    ({"type": "object", "properties": {f"p{i}": {} for i in range(b.MAX_PROPERTIES + 1)}}, str(b.MAX_PROPERTIES)),
    ({"anyOf": [{"enum": list(range(600))}, {"enum": list(range(401))}]}, str(b.MAX_ENUM_VALUES)),
    ({"type": "string", "description": "x" * b.MAX_SCHEMA_BYTES}, str(b.MAX_SCHEMA_BYTES)),
    (nested(b.MAX_DEPTH + 1), str(b.MAX_DEPTH)),
])
def test_each_limit_is_refused_naming_it(schema: object, limit: str) -> None:
    assert limit in refusal(schema).message


def test_a_schema_nested_past_the_interpreter_stack_is_refused_not_crashed() -> None:
    refusal(nested(100_000))


def test_what_real_schemas_use_passes() -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
              "properties": {"id": {"type": "string", "pattern": "^[a-z]{2,16}-\\d{4}$"},
                             "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 20},
                             "escaped": {"type": "string", "pattern": "\\{99999\\}"}}}
    assert check_schema(schema, PARAM) > 0
    assert check_schema(nested(b.MAX_DEPTH), PARAM) > 0


def test_tools_are_bounded_in_number_each_and_together() -> None:
    small = {"type": "object", "properties": {"x": {"type": "string"}}}
    check_tools([small] * b.MAX_TOOLS)
    with pytest.raises(RequestError) as info:
        check_tools([small] * (b.MAX_TOOLS + 1))
    assert info.value.param == "tools" and str(b.MAX_TOOLS) in info.value.message
    with pytest.raises(RequestError) as info:
        check_tools([small, {"type": "string", "pattern": "a{20000}"}])
    assert info.value.param == "tools[1].function.parameters"
    big = {"type": "string", "description": "x" * (b.MAX_SCHEMA_BYTES - 100)}
    with pytest.raises(RequestError) as info:
        check_tools([big] * (b.MAX_TOOLS_SCHEMA_BYTES // b.MAX_SCHEMA_BYTES + 1))
    assert info.value.param == "tools" and str(b.MAX_TOOLS_SCHEMA_BYTES) in info.value.message
