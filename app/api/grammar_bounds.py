"""The shape a request's JSON schema may have, checked before anything compiles it.

Compiling a grammar can cost far more than its text suggests: a 60-byte pattern `a{20000}` took
22 s, growing at least quadratically with the count. So every schema a request brings (its
`response_format`, each tool's `parameters`) is walked once, without recursion, and refused with
400 naming the field and the limit when it passes one of these; what passes is compiled within a
time budget (app/api/grammar_compiler.py), which catches what a shape limit cannot foresee.

The limits are far above what real schemas use (OpenAI's structured outputs allow 5,000
properties and 10 levels of nesting in all; the default model's own tool schemas are a few
hundred bytes), and each one is named in the refusal so a client can act on it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvfence.scheduler.core.errors import RequestError

MAX_SCHEMA_BYTES = 64 << 10  # one schema's JSON text
MAX_TOOLS_SCHEMA_BYTES = 256 << 10  # every tool's parameters together
MAX_DEPTH = 32  # objects and arrays nested within one schema
MAX_PROPERTIES = 1_000  # property names (properties, patternProperties), counted over one schema
MAX_ENUM_VALUES = 1_000  # enum values and consts, counted over one schema
MAX_PATTERN_CHARS = 1_000  # one regular expression (pattern, a patternProperties name)
MAX_REPEAT = 256  # a repetition count in a regular expression: {n}, {n,}, {n,m}
MAX_TOOLS = 128

# a counted repetition not escaped by a backslash: {n}, {n,} or {n,m}
_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _refuse(param: str, message: str) -> RequestError:
    return RequestError(400, "grammar_too_complex", message, param=param)


def check_schema(schema: Any, param: str, max_bytes: int = MAX_SCHEMA_BYTES) -> int:
    """Refuse (RequestError 400 `grammar_too_complex`, naming `param` and the limit) a schema past
    any limit of this module; returns the size of its JSON text. Never recurses: a schema nested
    deeper than Python's stack is refused like any other too deep."""
    depth_seen, properties, values = 0, 0, 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > MAX_DEPTH:
                raise _refuse(param, f"the schema nests objects and arrays more than {MAX_DEPTH} deep; this server "
                              f"compiles schemas up to {MAX_DEPTH} levels")
            depth_seen = max(depth_seen, depth)
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("properties", "patternProperties") and isinstance(value, dict):
                    properties += len(value)
                    if key == "patternProperties":
                        for pattern in value:
                            _check_pattern(pattern, param)
                elif key == "enum" and isinstance(value, list):
                    values += len(value)
                elif key == "const":
                    values += 1
                elif key == "pattern" and isinstance(value, str):
                    _check_pattern(value, param)
                stack.append((value, depth + 1))
        elif isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
    if properties > MAX_PROPERTIES:
        raise _refuse(param, f"the schema names {properties} properties; this server compiles schemas with at most "
                      f"{MAX_PROPERTIES}")
    if values > MAX_ENUM_VALUES:
        raise _refuse(param, f"the schema lists {values} enum and const values; this server compiles schemas with "
                      f"at most {MAX_ENUM_VALUES}")
    size = len(json.dumps(schema, separators=(",", ":")))  # safe now: the depth is bounded
    if size > max_bytes:
        raise _refuse(param, f"the schema is {size} bytes of JSON; this server compiles schemas of at most "
                      f"{max_bytes} bytes")
    return size


def _check_pattern(pattern: str, param: str) -> None:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise _refuse(param, f"a regular expression in the schema is {len(pattern)} characters long; this server "
                      f"compiles patterns of at most {MAX_PATTERN_CHARS}")
    for match in _REPEAT.finditer(pattern):
        for count in match.groups():
            if count and int(count) > MAX_REPEAT:
                raise _refuse(param, f"the pattern {pattern[:80]!r} repeats {count} times ({match.group(0)}); this "
                              f"server compiles repetition counts of at most {MAX_REPEAT}")


def check_tools(schemas: list[Any], param: str = "tools") -> None:
    """Refuse more than MAX_TOOLS tools, any tool's parameters past a limit (named by its index),
    or all of them together past MAX_TOOLS_SCHEMA_BYTES."""
    if len(schemas) > MAX_TOOLS:
        raise _refuse(param, f"the request declares {len(schemas)} tools; this server takes at most {MAX_TOOLS}")
    total = sum(check_schema(schema, f"{param}[{i}].function.parameters") for i, schema in enumerate(schemas))
    if total > MAX_TOOLS_SCHEMA_BYTES:
        raise _refuse(param, f"the tools' parameters schemas are {total} bytes of JSON together; this server "
                      f"compiles at most {MAX_TOOLS_SCHEMA_BYTES}")
