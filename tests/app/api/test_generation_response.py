"""The answer to an admitted request over its samples' handles (app/api/generation_response.py),
driven through the ASGI app with a stub engine whose handles the test feeds: `n` choices
interleaved in a stream with usage once, a failed sample failing the request, `best_of`
ranking, `echo` with prompt logprobs, `tool_choice: "auto"` calls read from the output, and every
sample aborted when the client leaves."""

from __future__ import annotations

import json

import anyio
import pytest
from test_routes import CHAT, CHAT_TEMPLATE, COMPLETIONS, StubEngine, chat_body, completion_body, make_tokenizer, \
    post_scope, run_until_disconnect

from kvfence.app.api.routes import build_app
from kvfence.engine.logprobs import TokenLogprobs
from kvfence.scheduler.core.errors import RequestError
from kvfence.scheduler.core.output import OutputDelta
from kvfence.scheduler.handle import RequestHandle


def run_fed(engine: StubEngine, path: str, body: dict, feed) -> tuple[list[dict], list[dict]]:  # type: ignore[no-untyped-def]
    """Drive the ASGI app directly: send the body, and once the request is admitted call
    `feed(handles)` (it pushes their deltas); run until the response is complete. Returns the ASGI
    messages the app sent and the SSE events (or the whole body) they carried."""
    sent: list[dict] = []

    async def main() -> None:
        messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
        never = anyio.Event()

        async def receive() -> dict:
            if messages:
                return messages.pop()
            await never.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        async def fed() -> None:
            while not engine.handles:
                await anyio.sleep(0.01)
            feed(engine.handles)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(fed)
                await build_app(engine)(post_scope(path), receive, send)

    anyio.run(main)
    data = b"".join(m.get("body", b"") for m in sent)
    if not body.get("stream"):
        return sent, [json.loads(data)]
    events = [e[len(b"data: "):] for e in data.split(b"\n\n") if e]
    return sent, [json.loads(e) if e != b"[DONE]" else "[DONE]" for e in events]


def test_samples_stream_interleaved_each_naming_its_choice_then_usage_once() -> None:
    engine = StubEngine("idle")

    def feed(handles: list[RequestHandle]) -> None:
        second, first = handles[1], handles[0]
        second.push(OutputDelta(text="b", token_ids=[98]))
        first.push(OutputDelta(text="a", token_ids=[97]))
        second.push(OutputDelta(text="", token_ids=[], finish_reason="length", cached_tokens=9))
        first.push(OutputDelta(text="", token_ids=[], finish_reason="stop", cached_tokens=4))

    _, events = run_fed(engine, CHAT, chat_body(n=2, seed=3, stream=True, stream_options={"include_usage": True}),
                        feed)
    assert [p.seed for p in engine.samples[0]] == [3, 4]
    assert events[-1] == "[DONE]"
    choices = [(c["index"], c["delta"], c["finish_reason"]) for e in events[:-1] for c in e["choices"]]
    assert choices[:2] == [(0, {"role": "assistant", "content": ""}, None), (1, {"role": "assistant", "content": ""}, None)]
    assert [(i, d["content"]) for i, d, _ in choices if d.get("content")] in ([(1, "b"), (0, "a")], [(0, "a"), (1, "b")])
    assert {i: f for i, _, f in choices if f} == {0: "stop", 1: "length"}
    usage = events[-2]["usage"]
    assert (usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"]) == (2, 4)  # the first's
    assert engine.aborts == 0


def test_a_failed_sample_fails_the_request_and_aborts_the_others() -> None:
    engine = StubEngine("idle")

    def feed(handles: list[RequestHandle]) -> None:
        handles[0].push(OutputDelta(text="a", token_ids=[97]))
        handles[2].push(OutputDelta(text="", token_ids=[], finish_reason="stop"))
        handles[1].push(OutputDelta(text="", token_ids=[],
                                    error=RequestError(503, "worker_lost", "the worker was lost")))

    sent, [body] = run_fed(engine, COMPLETIONS, completion_body(n=3), feed)
    assert sent[0]["status"] == 503 and body["error"]["code"] == "worker_lost"
    assert "r0" in engine.aborted and "r1" not in engine.aborted  # the one still running; not the failed one


def test_best_of_asks_every_sample_for_its_logprobs_and_returns_the_likeliest() -> None:
    engine = StubEngine("idle")

    def feed(handles: list[RequestHandle]) -> None:
        for h, (text, lp) in zip(handles, [("x", -3.0), ("y", -0.5), ("z", -1.0)]):
            h.push(OutputDelta(text=text, token_ids=[ord(text)], finish_reason="length",
                               logprobs=[TokenLogprobs(lp)]))

    _, [body] = run_fed(engine, COMPLETIONS, completion_body(n=2, best_of=3), feed)
    assert [p.logprobs for p in engine.samples[0]] == [0, 0, 0]
    assert [(c["index"], c["text"], c["logprobs"]) for c in body["choices"]] == [(0, "y", None), (1, "z", None)]
    assert body["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("stream", [False, True])
def test_echo_sends_the_prompt_and_its_logprobs_before_the_output(stream: bool) -> None:
    engine = StubEngine("idle")
    prompt = engine.tokenizer.encode("hello")  # five byte-level tokens
    [bang] = engine.tokenizer.encode("!")

    def feed(handles: list[RequestHandle]) -> None:
        scored = [TokenLogprobs(-float(k), [t], [-0.5]) for k, t in enumerate(prompt[1:], 1)]
        handles[0].push(OutputDelta(text="!", token_ids=[bang], logprobs=[TokenLogprobs(-0.25, [bang], [-0.25])],
                                    prompt_logprobs=scored))
        handles[0].push(OutputDelta(text="", token_ids=[], finish_reason="length"))

    _, events = run_fed(engine, COMPLETIONS, completion_body(echo=True, logprobs=1, stream=stream), feed)
    assert engine.samples[0][0].prompt_logprobs == 1
    choices = [c for e in events if e != "[DONE]" for c in e["choices"]]
    assert "".join(c["text"] for c in choices) == "hello!"
    logprobs = [c["logprobs"] for c in choices if c["logprobs"]]
    tokens = sum((lp["tokens"] for lp in logprobs), [])
    assert tokens == ["h", "e", "l", "l", "o", "!"]
    assert sum((lp["token_logprobs"] for lp in logprobs), []) == [None, -1.0, -2.0, -3.0, -4.0, -0.25]
    assert sum((lp["top_logprobs"] for lp in logprobs), [])[:2] == [None, {"e": -0.5}]
    assert sum((lp["text_offset"] for lp in logprobs), []) == [0, 1, 2, 3, 4, 5]
    plain = StubEngine("idle")
    _, [body] = run_fed(plain, COMPLETIONS, completion_body(echo=True), lambda hs: hs[0].push(
        OutputDelta(text="!", token_ids=[bang], finish_reason="length")))
    assert body["choices"][0]["text"] == "hello!" and body["choices"][0]["logprobs"] is None
    assert plain.samples[0][0].prompt_logprobs is None  # nothing to score without logprobs


WEATHER_TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_reads_the_calls_the_model_wrote(stream: bool) -> None:
    # renders the tools' names and teaches <tool_call> blocks (a short one: the context here is 48 bytes)
    template = "{% if tools %}<tool_call>{% for t in tools %}{{ t.function.name }}{% endfor %}{% endif %}" + CHAT_TEMPLATE
    engine = StubEngine("idle", make_tokenizer(template))
    pieces = ["Checking", ". <tool", '_call>{"name": "weather", ', '"arguments": {"city": "Oslo"}}</tool_call>']

    def feed(handles: list[RequestHandle]) -> None:
        for piece in pieces:
            handles[0].push(OutputDelta(text=piece, token_ids=[1]))
        handles[0].push(OutputDelta(text="", token_ids=[], finish_reason="stop"))

    _, events = run_fed(engine, CHAT, chat_body(tools=[WEATHER_TOOL], stream=stream), feed)
    assert engine.samples[0][0].grammar is None  # auto does not constrain the output
    prompt = engine.tokenizer.decode(engine.submitted[0][0])
    assert prompt.startswith("<tool_call>weather")  # the template rendered the tools
    if stream:
        deltas = [c["delta"] for e in events if e != "[DONE]" for c in e["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == "Checking. "
        [calls] = [d["tool_calls"] for d in deltas if d.get("tool_calls")]
        finish = [c["finish_reason"] for e in events if e != "[DONE]" for c in e["choices"] if c["finish_reason"]]
    else:
        message = events[0]["choices"][0]["message"]
        assert message["content"] == "Checking."
        calls, finish = message["tool_calls"], [events[0]["choices"][0]["finish_reason"]]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Oslo"})]
    assert finish == ["tool_calls"]


def test_a_client_that_leaves_aborts_every_sample() -> None:
    engine = StubEngine("idle")
    run_until_disconnect(engine, CHAT, chat_body(n=3, stream=True))
    assert engine.aborted == {"r0", "r1", "r2"}
