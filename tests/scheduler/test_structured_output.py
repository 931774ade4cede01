"""Structured output through the real scheduler and workers (tiny random Llama): the grammar's
matcher lives on whichever worker samples (the prefill worker for the first token, the decode
worker for the rest, a new lease's worker after a preemption), built from the lease's history, and
every output parses and validates against its schema, whatever the random model prefers."""

from __future__ import annotations

import json

import anyio
import jsonschema
import pytest
import torch
from serving_harness import assert_baseline, serve_all, small_config, start_serving, wait_idle

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.grammar import LeaseGrammars, compile_spec, grammar_spec, new_compiler, tokenizer_info
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.driver import Scheduler

PAGE = 4
CONTEXT = 128
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "colour", "tags"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "colour": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b"]}}}}


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=80,
                          grammar=grammar_spec("json_schema", SCHEMA, strict=True))


async def run_all(s: Scheduler, ps: list[list[int]]) -> list[tuple[str, str | None]]:
    return [(out.text, out.end) for out in await serve_all(s, ps, [params(i) for i in range(len(ps))])]


def config(mode: str) -> SchedulerConfig:
    return small_config(mode, PAGE, CONTEXT)


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["colocated", "inprocess", "tcp"])
async def test_every_output_validates_against_its_schema(tiny: Checkpoint, mode: str,
                                                         task_group: anyio.abc.TaskGroup) -> None:
    serving = await start_serving(task_group, tiny, mode, config(mode), num_pages=128)
    results = await run_all(serving.scheduler, prompts(6, seed=1))
    for text, reason in results:
        assert reason == "stop", (text, reason)  # the grammar completed and forced the end
        jsonschema.validate(json.loads(text), SCHEMA)
    await wait_idle(serving.scheduler)
    assert_baseline(serving.scheduler)
    await serving.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["colocated", "tcp"])
async def test_preempted_grammar_requests_continue_exactly(tiny: Checkpoint, mode: str,
                                                           task_group: anyio.abc.TaskGroup) -> None:
    """Seeded samples do not depend on the batch, so each output under preemption (a pool of 32
    pages for eight requests) must equal the same request served with room to spare, and validate."""
    ps = prompts(8, seed=2)
    roomy = await start_serving(task_group, tiny, mode, config(mode), num_pages=256)
    want = await run_all(roomy.scheduler, ps)
    await roomy.aclose()
    tight = await start_serving(task_group, tiny, mode, config(mode), num_pages=32)
    got = await run_all(tight.scheduler, ps)
    assert tight.scheduler.metrics.preemptions._value.get() > 0
    assert got == want
    for text, _ in got:
        jsonschema.validate(json.loads(text), SCHEMA)
    await wait_idle(tight.scheduler)
    await tight.aclose()


def test_a_matcher_needs_its_history_and_refuses_what_the_grammar_does(tiny: Checkpoint) -> None:
    spec = grammar_spec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    grammars = LeaseGrammars(tiny.tokenizer, tiny.config.vocab_size)
    prompt = [5, 6, 7]
    out = tiny.tokenizer.encode('{"a":1', add_bos=False)
    grammars.observe(1, spec, 3, out[:1], prompt, prompt_tokens=3)
    grammars.observe(1, spec, 4, out[1:], None, prompt_tokens=3)
    with pytest.raises(ValueError, match="no matcher"):
        grammars.observe(2, spec, 3, out[:1], None, prompt_tokens=3)
    with pytest.raises(ValueError, match="refuses"):
        grammars.observe(3, spec, 3, tiny.tokenizer.encode("[1]", add_bos=False), prompt, prompt_tokens=3)
    grammars.forget([1, 3])
    assert len(grammars) == 0


def test_a_schema_that_cannot_compile_is_named(tiny: Checkpoint) -> None:
    compiler = new_compiler(tokenizer_info(tiny.tokenizer, tiny.config.vocab_size))
    with pytest.raises(ValueError, match="foo"):
        compile_spec(compiler, grammar_spec("json_schema", {"type": "foo"}))
    with pytest.raises(ValueError, match="minimum greater than maximum"):
        compile_spec(compiler, grammar_spec("json_schema", {"type": "integer", "minimum": 5, "maximum": 3}))
    compile_spec(compiler, grammar_spec("json_object"))
    compile_spec(compiler, grammar_spec("json_schema", SCHEMA, strict=True))


DEAD_END = grammar_spec("json_schema", {"type": "string", "pattern": "[^\\s\\S]"}, strict=True)  # '"', then nothing


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["colocated", "tcp"])
async def test_a_dead_end_grammar_fails_alone_in_its_batch(tiny: Checkpoint, mode: str,
                                                          task_group: anyio.abc.TaskGroup) -> None:
    """A schema no output can satisfy passes compiling (its first token, '"', is allowed) and
    leads its request into a state where no token is allowed. Co-batched with six ordinary
    requests, it ends alone with 400 grammar_dead_end, before sampling anything past the dead end,
    and the six produce exactly what they produce without it."""
    ps = prompts(7, seed=4)
    six = [params(i) for i in range(6)]
    alone = await start_serving(task_group, tiny, mode, config(mode), num_pages=128)
    want = await serve_all(alone.scheduler, ps[:6], six)
    await alone.aclose()
    mixed = await start_serving(task_group, tiny, mode, config(mode), num_pages=128)
    dead = SamplingParams(temperature=1.0, seed=9, max_tokens=20, grammar=DEAD_END)
    got = await serve_all(mixed.scheduler, ps, six + [dead])
    assert [(o.ids, o.end) for o in got[:6]] == [(o.ids, o.end) for o in want]
    assert all(o.end == "stop" for o in got[:6])
    assert got[6].end == "grammar_dead_end"
    assert got[6].text == '"'  # the one token the grammar allowed, then nothing
    await wait_idle(mixed.scheduler)
    assert_baseline(mixed.scheduler)
    await mixed.aclose()
