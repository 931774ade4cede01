"""The front end's grammar compiler (app/api/grammar_compiler.py) with its real probe processes and
a real vocabulary (the tiny model's): a schema is compiled once per tenant, one past the budget is
refused alone (its probe killed and replaced, the next schema compiles), one that cannot compile
is named, and in-process workers find what it compiled by key."""

from __future__ import annotations

import anyio
import pytest

from kvfence.app.api.grammar_compiler import GrammarCompiler
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.grammar import Compiled, grammar_spec
from kvfence.scheduler.core.errors import RequestError

SCHEMA = grammar_spec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                      strict=True)
# within every shape limit, and seconds to compile (forty alternatives of nested repetitions)
SLOW = grammar_spec("json_schema", {"anyOf": [{"type": "string", "pattern": "([a-z]{200}){%d}" % (200 + i)}
                                              for i in range(40)]})


@pytest.fixture(scope="module")
def compiler(tiny: Checkpoint):
    c = GrammarCompiler(tiny.tokenizer, tiny.config.vocab_size, budget_s=0.1, probes=1)
    yield c
    c.close()


@pytest.mark.anyio
async def test_a_schema_compiles_once_per_tenant(compiler: GrammarCompiler) -> None:
    before = compiler.compiled
    a1 = await compiler.compile("alice", SCHEMA, "response_format")
    a2 = await compiler.compile("alice", SCHEMA, "response_format")
    b1 = await compiler.compile("bob", SCHEMA, "response_format")
    assert a1 is a2 and a1.key != b1.key  # a tenant never shares another's entry (nor its timing)
    assert compiler.compiled == before + 2
    assert Compiled.live(a1.key) is a1  # what an in-process worker takes instead of compiling


@pytest.mark.anyio
async def test_over_the_budget_fails_that_request_alone(compiler: GrammarCompiler) -> None:
    with pytest.raises(RequestError) as info:
        await compiler.compile("alice", SLOW, "response_format.json_schema.schema")
    err = info.value
    assert (err.status, err.code, err.param) == (400, "grammar_too_complex", "response_format.json_schema.schema")
    assert "0.1 s" in err.message and compiler.over_budget >= 1
    other = grammar_spec("json_schema", {"type": "array", "items": {"type": "boolean"}})
    with anyio.fail_after(120):  # the killed probe is replaced; the next schema compiles
        assert (await compiler.compile("bob", other, "response_format")).key


@pytest.mark.anyio
async def test_a_schema_that_cannot_compile_is_named(compiler: GrammarCompiler) -> None:
    with pytest.raises(RequestError) as info:
        await compiler.compile("alice", grammar_spec("json_schema", {"type": "foo"}), "tools")
    assert (info.value.status, info.value.code, info.value.param) == (400, "invalid_value", "tools")
    assert "foo" in info.value.message


@pytest.mark.anyio
async def test_past_the_waiting_limit_is_503(tiny: Checkpoint) -> None:
    c = GrammarCompiler(tiny.tokenizer, tiny.config.vocab_size, budget_s=0.1, probes=1, max_waiting=1)
    try:
        results: list[object] = []

        async def one(spec: str) -> None:
            try:
                results.append(await c.compile("t", spec, "response_format"))
            except RequestError as e:
                results.append(e.status)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, SLOW)
            await anyio.sleep(0.05)
            tg.start_soon(one, SCHEMA)
        assert sorted(r for r in results if isinstance(r, int)) == [400, 503]
    finally:
        c.close()
