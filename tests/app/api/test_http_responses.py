"""What a client of the HTTP layer sees after its request was admitted: 5xx messages in user
terms (the detail only in the log), and the stall timeout of a client that stopped reading.
`StubEngine` (test_routes) stands in for the scheduler; the ASGI app is driven directly."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

import anyio
import pytest
from kvfence.app.api.routes import build_app
from kvfence.scheduler.core.errors import RequestError
from kvfence.scheduler.core.output import OutputDelta
from kvfence.scheduler.handle import RequestHandle
from test_routes import (
    CHAT,
    COMPLETIONS,
    ENDPOINTS,
    StubEngine,
    chat_body,
    completion_body,
    post_scope,
)


def drive(engine: StubEngine, path: str, body: dict, admitted: Callable[[RequestHandle], Awaitable[None]], *,
          stall_timeout_s: float = 30.0, send_blocks_after: int | None = None) -> list[dict]:
    """Run the ASGI app on one request; once it is admitted, `admitted(handle)` runs as a task on
    the loop (what the scheduler would push). `send` blocks for good after `send_blocks_after`
    messages (a client that stopped reading). Returns the messages sent, once the app returned."""
    sent: list[dict] = []

    async def main() -> None:
        messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop()
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

        async def send(message: dict) -> None:
            if send_blocks_after is not None and len(sent) >= send_blocks_after:
                await anyio.sleep_forever()
            sent.append(message)
        scope = post_scope(path)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                app_done = anyio.Event()

                async def app() -> None:
                    await build_app(engine, stall_timeout_s=stall_timeout_s)(scope, receive, send)
                    app_done.set()
                tg.start_soon(app)
                while not engine.handles:
                    await anyio.sleep(0.005)
                tg.start_soon(admitted, engine.handles[0])
                await app_done.wait()
                tg.cancel_scope.cancel()

    anyio.run(main)
    return sent


def sse_events(sent: list[dict]) -> list[bytes]:
    return [m["body"] for m in sent if m["type"] == "http.response.body" and m["body"]]


def last_json(sent: list[dict]) -> dict:
    return json.loads(sse_events(sent)[-1].removeprefix(b"data: "))


@pytest.mark.parametrize("code,status", [("worker_error", 500), ("kv_transfer_failed", 502), ("something_new", 500)])
@pytest.mark.parametrize("stream", [False, True])
def test_worker_exception_text_never_reaches_the_client(code: str, status: int, stream: bool,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    secret = "RuntimeError: CUDA error at /srv/build/attn.cu:412 (lease 0x5eed)"
    engine = StubEngine("idle")

    async def fail(handle: RequestHandle) -> None:
        handle.push(OutputDelta(text="partial", token_ids=[5]))
        handle.push(OutputDelta(text="", token_ids=[],
                                error=RequestError(status, code, f"the model step failed: {secret}")))

    with caplog.at_level(logging.WARNING, logger="kvfence.app.api.routes"):
        sent = drive(engine, CHAT, chat_body(stream=stream), fail)
    everything = b"".join(sse_events(sent))
    assert secret.encode() not in everything and b"CUDA" not in everything
    error = last_json(sent)["error"]
    assert (error["code"], error["type"]) == (code, "server_error") and "Retry the request" in error["message"]
    if not stream:
        assert sent[0]["status"] == status
    assert secret in caplog.text and "r0" in caplog.text  # the log keeps the detail, with the request id
    assert engine.aborts == 0  # it ended on its own


@pytest.mark.parametrize("code", ["overloaded", "worker_restarted", "kv_pages_quarantined"])
def test_client_worded_server_errors_keep_their_message(code: str) -> None:
    engine = StubEngine("idle")
    error = RequestError(503, code, "waited 60 s for KV pages; retry shortly", retry_after_s=1)

    async def fail(handle: RequestHandle) -> None:
        handle.push(OutputDelta(text="", token_ids=[], error=error))

    sent = drive(engine, COMPLETIONS, completion_body(), fail)
    assert sent[0]["status"] == 503
    assert last_json(sent)["error"]["message"] == "waited 60 s for KV pages; retry shortly"


@pytest.mark.parametrize("path,make", ENDPOINTS)
def test_a_stream_whose_client_stopped_reading_is_aborted_at_the_stall_timeout(path: str, make) -> None:
    engine = StubEngine("idle")

    async def generate(handle: RequestHandle) -> None:
        for i in range(10_000):  # the decode loop carries on: push never blocks or raises
            handle.push(OutputDelta(text="tok", token_ids=[i]))
            await anyio.lowlevel.checkpoint()

    sent = drive(engine, path, make(stream=True), generate, stall_timeout_s=0.2, send_blocks_after=2)
    assert engine.aborts == 1  # through the normal abort path
    assert sent[0]["type"] == "http.response.start" and all(m.get("more_body", True) for m in sent)


def test_a_whole_response_the_client_does_not_read_is_dropped_without_an_abort() -> None:
    engine = StubEngine("idle")

    async def finish(handle: RequestHandle) -> None:
        handle.push(OutputDelta(text="x", token_ids=[1], finish_reason="stop"))

    sent = drive(engine, COMPLETIONS, completion_body(), finish, stall_timeout_s=0.2, send_blocks_after=0)
    assert sent == [] and engine.aborts == 0  # the request had ended; only its response was dropped


def test_waiting_for_tokens_is_not_a_stall() -> None:
    engine = StubEngine("idle")

    async def slowly(handle: RequestHandle) -> None:
        for i in range(3):
            await anyio.sleep(0.15)  # longer than the stall timeout, between tokens
            handle.push(OutputDelta(text=str(i), token_ids=[i]))
        handle.push(OutputDelta(text="", token_ids=[], finish_reason="length"))

    sent = drive(engine, COMPLETIONS, completion_body(stream=True), slowly, stall_timeout_s=0.1)
    assert engine.aborts == 0
    texts = [json.loads(e.removeprefix(b"data: "))["choices"][0]["text"] for e in sse_events(sent)[:-1]]
    assert "".join(texts) == "012" and sse_events(sent)[-1] == b"data: [DONE]\n\n"
