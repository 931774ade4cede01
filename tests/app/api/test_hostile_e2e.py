"""No request stalls, starves or fails another: hostile requests against the real server
(disaggregated over tcp) on a real socket, driven by the official openai client, while an
ordinary tenant's stream keeps going. Each test leaves both KV pools at their baseline.

Nothing here asserts a wall-clock time: "keeps going" is counted (tokens that arrived while a
hostile request was being refused, /health answered before it was), never timed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_process import ServerProcess, serving

MODEL = "SmolLM2-135M-Instruct"
# default pools (4 contexts of decode pages, 2 of prefill) over a short context, so that sixteen
# chats run the decode pool out as the default ones do over the model's full context
ARGS = ("--transport", "tcp", "--canary-interval", "3600", "--max-context", "256")
BOMB = {"type": "string", "pattern": "a{20000}"}  # 60 bytes; took 22 s to check before the shape limits
# within every shape limit (2 KB, repetitions of 200-239): about 15 s to compile on this CPU, so
# only the compile budget (0.75 s by default) stops it
SLOW = {"anyOf": [{"type": "string", "pattern": "([a-z]{200}){%d}" % (200 + i)} for i in range(40)]}
DEAD_END = {"type": "string", "pattern": "[^\\s\\S]"}  # '"' is allowed, then nothing


@pytest.fixture(scope="module")
def server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serving(ServerProcess(default_model_path, *ARGS,
                                     log_path=tmp_path_factory.mktemp("server") / "server.log"))


@pytest.fixture(autouse=True)
def baseline(server: ServerProcess) -> Iterator[None]:
    yield
    deadline = time.monotonic() + 10
    while any(server.pages_in_use().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(server.pages_in_use().values()), server.pages_in_use()


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def chat(content: str, **extra: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def refused(c: openai.AsyncOpenAI, body: dict) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        await c.chat.completions.create(**body)
    return info.value


def test_grammar_and_tool_bombs_are_refused_while_another_stream_flows(server: ServerProcess) -> None:
    """The 60-byte pattern in response_format, the same in each of 20 tools (with tool_choice
    none), and a schema within every shape limit that compiles past the budget: each gets its 400
    naming the field; the slow one is compiled in a process the server kills, so while it is, the
    other stream keeps receiving tokens and /health answers first."""
    events: list[str] = []

    async def stream(c: openai.AsyncOpenAI) -> int:
        s = await c.chat.completions.create(**chat("Count from one to two hundred in words.", max_tokens=200,
                                                   temperature=0, stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}))
        tokens = 0
        async for chunk in s:
            if chunk.choices and chunk.choices[0].delta.content:
                events.append("token")
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    async def health() -> None:
        async with httpx.AsyncClient() as h:
            assert (await h.get(server.base_url + "/health", timeout=30)).status_code == 200
        events.append("health")

    async def run() -> tuple[int, list[openai.BadRequestError]]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
            flowing = asyncio.create_task(stream(c))
            while "token" not in events:
                await asyncio.sleep(0.01)
            tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": BOMB}} for i in range(20)]
            errors = [await refused(c, chat("hi", response_format=schema_format(BOMB))),
                      await refused(c, chat("hi", tools=tools, tool_choice="none"))]
            events.append("slow sent")
            slow = asyncio.create_task(refused(c, chat("hi", response_format=schema_format(SLOW))))
            await asyncio.sleep(0.05)
            await health()
            errors.append(await slow)
            events.append("slow refused")
            return await flowing, errors

    tokens, errors = asyncio.run(run())
    codes = [(e.status_code, e.body["code"], e.body["param"]) for e in errors]  # type: ignore[index]
    assert codes == [(400, "grammar_too_complex", "response_format.json_schema.schema"),
                     (400, "grammar_too_complex", "tools[0].function.parameters"),
                     (400, "grammar_too_complex", "response_format.json_schema.schema")]
    assert "20000" in errors[0].message and "longer than 0.75 s" in errors[2].message
    window = events[events.index("slow sent"):events.index("slow refused")]
    assert "health" in window and window.count("token") >= 3, window
    assert tokens == 200


def test_a_dead_end_grammar_fails_alone_among_six(server: ServerProcess) -> None:
    """A schema no output can satisfy, co-batched with six ordinary chats: it ends with 400
    grammar_dead_end (never an arbitrary token), and the six produce what they produce alone."""
    prompts = [f"Name {k} fruits." for k in range(2, 8)]

    async def one(c: openai.AsyncOpenAI, prompt: str) -> str:
        r = await c.chat.completions.create(**chat(prompt, max_tokens=24, temperature=0,
                                                   extra_body={"ignore_eos": True}))
        return r.choices[0].message.content or ""

    async def run() -> tuple[list[str], list[object]]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
            alone = [await one(c, p) for p in prompts]
            dead = c.chat.completions.create(**chat("Say something.", max_tokens=24, temperature=0,
                                                    response_format=schema_format(DEAD_END)))
            together = await asyncio.gather(dead, *(one(c, p) for p in prompts), return_exceptions=True)
            return alone, together

    alone, together = asyncio.run(run())
    dead = together[0]
    assert isinstance(dead, openai.BadRequestError), dead
    assert dead.body["code"] == "grammar_dead_end"  # type: ignore[index]
    assert together[1:] == alone


def test_three_hundred_half_sent_bodies_stop_neither_health_nor_a_chat(server: ServerProcess) -> None:
    """300 connections each send a request's headers and the start of its body, then nothing:
    each waits for its body (bounded by --body-timeout, its bytes by the bodies' budget), and
    meanwhile /health answers and an ordinary chat streams to its end."""
    import socket

    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{\"model\": \"")
    held = []
    try:
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(head)
            held.append(sock)
        assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
            done = c.chat.completions.create(**chat("Say hello.", max_tokens=16, temperature=0,
                                                    extra_body={"ignore_eos": True}))
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 16
        assert all(s.fileno() >= 0 for s in held)  # still held open: nothing was refused to make room
    finally:
        for sock in held:
            sock.close()


def test_sixteen_chats_without_max_tokens_all_finish_none_mid_stream(server: ServerProcess) -> None:
    """Sixteen official-client chats with no max_tokens, each generating to the end of the
    context: together they need four times the decode pool, so requests are preempted after they
    have streamed text. Each keeps its place, resumes, and ends with its whole output; none ends
    mid-stream with an error."""
    async def one(c: openai.AsyncOpenAI, k: int) -> tuple[str | None, int]:
        s = await c.chat.completions.create(**chat(f"Tell story number {k} about a lighthouse.", stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}))
        finish, tokens = None, 0
        async for chunk in s:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                tokens = chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        return finish, tokens

    async def run() -> list[tuple[str | None, int]]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(one(c, k) for k in range(16)))

    results = asyncio.run(run())
    assert all(finish == "length" and tokens == 256 for finish, tokens in results), results
    assert server.metric("kvfence_preemptions_total") > 0  # the pool did run out
