"""The real server on a real socket, driven by the official openai client.

Greedy outputs equal the references (fp32), disaggregated equals colocated, concurrent streams
equal solo runs, and every test leaves both KV pools at their baseline (read from /metrics).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from sampling_reference import slow_greedy, slow_prompt_logprobs
from server_process import ServerProcess, serving

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.registry import build_model
from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.offline import OfflineEngine

MODEL = "SmolLM2-135M-Instruct"
COMMON = ("--canary-interval", "3600", "--max-context", "2048", "--prefill-num-pages", "256",
          "--decode-num-pages", "512", "--chunk-tokens", "256")


# Disaggregated over every transport (each passes the same references, equivalence and page
# baselines), and colocated, the baseline the disaggregated outputs must equal. Mooncake on loopback only.
MODES = {"tcp": ("--transport", "tcp"), "nixl": ("--transport", "nixl", "--nixl-unauthenticated-ports-ok"), "colocated": ("--disaggregation", "off"),
         "mooncake": ("--transport", "mooncake", "--mooncake-unauthenticated-ports-ok")}


@pytest.fixture(scope="module", params=list(MODES))
def server(request: pytest.FixtureRequest, default_model_path: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(default_model_path, *MODES[request.param], *COMMON,
                        log_path=tmp_path_factory.mktemp("server") / "server.log")
    srv.mode = request.param  # type: ignore[attr-defined]
    yield from serving(srv)


def over_tcp_and_colocated(srv: ServerProcess, why: str) -> None:
    """Skip in the nixl and mooncake modes a test whose subject is not the KV transport (they
    move the same pages as tcp: the references, streams, disconnects and refusals run over them)."""
    if srv.mode not in ("tcp", "colocated"):  # type: ignore[attr-defined]
        pytest.skip(f"{why}: tested over tcp and colocated")


def wait_baseline(srv: ServerProcess) -> None:
    deadline = time.monotonic() + 10
    while any(srv.pages_in_use().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(srv.pages_in_use().values()), srv.pages_in_use()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c
    wait_baseline(server)


def greedy(case: dict) -> dict:
    return {"model": MODEL, "max_tokens": 32, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_chat_references_non_stream(client: openai.OpenAI, reference: dict) -> None:
    for case in [c for c in reference["cases"] if c["kind"] == "chat"]:
        r = client.chat.completions.create(messages=case["messages"], **greedy(case))
        assert r.choices[0].message.content.startswith(case["text_until_eos"]), case["id"]
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == case["num_prompt_tokens"]
        assert r.usage.completion_tokens == 32
        assert r.usage.total_tokens == case["num_prompt_tokens"] + 32


def test_completion_references_stream(client: openai.OpenAI, reference: dict) -> None:
    for case in [c for c in reference["cases"] if c["kind"] == "completion"]:
        stream = client.completions.create(prompt=case["prompt"], stream=True,
                                           stream_options={"include_usage": True}, **greedy(case))
        text, reasons, usage = "", [], None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.text
                reasons.append(choice.finish_reason)
        assert text.startswith(case["text_until_eos"]), case["id"]
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
        assert usage is not None and usage.completion_tokens == 32
        assert usage.prompt_tokens == case["num_prompt_tokens"]


def test_async_chat_stream_equals_non_stream(server: ServerProcess, reference: dict) -> None:
    case = reference["cases"][1]

    async def run() -> tuple[str, str]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused") as c:
            whole = await c.chat.completions.create(messages=case["messages"], **greedy(case))
            parts = []
            async for chunk in await c.chat.completions.create(messages=case["messages"], stream=True, **greedy(case)):
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
            return whole.choices[0].message.content or "", "".join(parts)

    whole, streamed = asyncio.run(run())
    assert whole == streamed and whole.startswith(case["text_until_eos"])
    wait_baseline(server)


@pytest.fixture(scope="module")
def solo_outputs() -> dict[str, list[str]]:
    """Solo outputs of the first mode that ran, shared by the others: greedy fp32 output is the
    same in every mode, so each mode's concurrent streams must equal them (and the solo runs, the
    slow part, happen once)."""
    return {}


def test_sixteen_concurrent_streams_equal_solo(server: ServerProcess, reference: dict,
                                               solo_outputs: dict[str, list[str]]) -> None:
    over_tcp_and_colocated(server, "batching across requests is the scheduler's, not the transport's")
    prompts = [(c["messages"] if c["kind"] == "chat" else c["prompt"], 4 + 2 * i)
               for i, c in enumerate(reference["cases"] * 2)]

    async def one(c: openai.AsyncOpenAI, prompt: object, n: int) -> str:
        kwargs = {"model": MODEL, "max_tokens": n, "temperature": 0, "stream": True}
        out = []
        if isinstance(prompt, list):
            async for ch in await c.chat.completions.create(messages=prompt, **kwargs):  # type: ignore[arg-type]
                if ch.choices and ch.choices[0].delta.content:
                    out.append(ch.choices[0].delta.content)
        else:
            async for ch in await c.completions.create(prompt=prompt, **kwargs):  # type: ignore[arg-type]
                out.extend(x.text for x in ch.choices)
        return "".join(out)

    async def run() -> tuple[list[str], list[str]]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused") as c:
            if "solo" not in solo_outputs:
                solo_outputs["solo"] = [await one(c, p, n) for p, n in prompts]
            together = await asyncio.gather(*(one(c, p, n) for p, n in prompts))
            return solo_outputs["solo"], list(together)

    solo, together = asyncio.run(run())
    assert len(prompts) == 16 and together == solo
    wait_baseline(server)


def test_disconnect_mid_stream_returns_pages(server: ServerProcess, reference: dict) -> None:
    case = reference["cases"][0]
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": case["messages"], "max_tokens": 400, "stream": True,
                "temperature": 0, "ignore_eos": True}) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i >= 6:
                    break  # leaving the block closes the connection mid-stream
    wait_baseline(server)
    assert server.metric("kvfence_requests_total", tenant="anonymous", status="aborted") >= 1


@pytest.mark.parametrize("body, param, code", [
    ({"messages": [{"role": "user", "content": "x " * 3000}], "max_tokens": 4}, "messages", "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, "max_tokens", "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "max_tokens", None),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature", None),
    ({"messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": {"x": 1}}, "kv_transfer_params", None),
])
def test_bad_requests_are_400_and_reserve_nothing(server: ServerProcess, body: dict, param: str,
                                                  code: str | None) -> None:
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
    if code:
        assert err["code"] == code
    assert not any(server.pages_in_use().values())


def test_malformed_json_is_400(server: ServerProcess) -> None:
    r = httpx.post(server.base_url + "/v1/chat/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_the_kv_moved_through_the_chosen_transport(server: ServerProcess, client: openai.OpenAI) -> None:
    mode = server.mode  # type: ignore[attr-defined]
    before = server.metric("kvfence_kv_transfers_total", result="ok") if mode != "colocated" else 0.0
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length"
    if mode == "colocated":
        assert "paired prefill -> decode" not in server.log()
        return
    assert f"paired prefill -> decode over {mode}" in server.log()
    assert server.metric("kvfence_kv_transfers_total", result="ok") == before + 1
    assert server.metric("kvfence_kv_handoff_seconds_count") >= 1


def test_models_health_ready(server: ServerProcess) -> None:
    models = httpx.get(server.base_url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 2048
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.base_url + "/ready", timeout=10).status_code == 200


def test_retrieve_model_and_tokenize_a_reference_chat(server: ServerProcess, client: openai.OpenAI,
                                                      reference: dict) -> None:
    """`client.models.retrieve` parses GET /v1/models/{model}; /tokenize of a reference chat gives
    exactly the prompt ids it was generated from, and /detokenize gives them back."""
    card = client.models.retrieve(MODEL)
    listed = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]
    assert (card.id, card.object, card.owned_by, card.created) == (MODEL, "model", "kvfence", listed["created"])
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.code == "model_not_found"
    case = next(c for c in reference["cases"] if c["kind"] == "chat")
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        out = http.post("/tokenize", json={"model": MODEL, "messages": case["messages"]}).json()
        assert (out["count"], out["max_model_len"]) == (case["num_prompt_tokens"], 2048)
        assert out["tokens"] == case["prompt_token_ids"]
        text = http.post("/detokenize", json={"model": MODEL, "tokens": out["tokens"]}).json()["prompt"]
        again = http.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}).json()
        assert again["tokens"] == out["tokens"]


def test_same_client_request_id_twice(server: ServerProcess, reference: dict) -> None:
    """Client-supplied ids are never used internally: two requests carrying the same one are both
    served correctly, with distinct server-minted ids."""
    cases = [c for c in reference["cases"] if c["kind"] == "chat"][:2]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            rs = await asyncio.gather(*(http.post("/v1/chat/completions", headers={"X-Request-Id": "same"}, json={
                "model": MODEL, "messages": c["messages"], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "user": "same", "request_id": "same"}) for c in cases))
            return list(rs)

    responses = asyncio.run(run())
    out = [r.json() for r in responses]
    assert out[0]["id"] != out[1]["id"]
    for c, r in zip(cases, out):
        assert c["text_until_eos"].startswith(r["choices"][0]["message"]["content"])
    # the client's id comes back with each response and is in the log line of each, next to the
    # server's own distinct id: both requests are observably served
    assert [r.headers["x-request-id"] for r in responses] == ["same", "same"]
    admitted = re.findall(r"request ([0-9a-f]{32}) admitted: tenant anonymous, \d+ prompt tokens, 1 samples, "
                          r"client request id 'same', "
                          r"user 'same'", server.log())
    assert {f"chatcmpl-{i}" for i in admitted} >= {r["id"] for r in out}
    wait_baseline(server)


def test_a_growing_conversation_is_cached_every_turn_and_answers_as_a_cold_run(
        server: ServerProcess, client: openai.OpenAI) -> None:
    """One chat growing over 8 turns: every turn after the first finds the conversation so far in the
    prefix cache (`usage.prompt_tokens_details.cached_tokens`, whole pages of it) and answers exactly
    as a cold run of the same turn (a fresh `cache_salt` shares nothing), in every mode."""
    over_tcp_and_colocated(server, "the cache and its transfer plan are the scheduler's (the plan's page moves "
                                   "over every transport: tests/scheduler/test_canary_isolation.py)")
    messages = [{"role": "system", "content": "You are a terse assistant who answers in a few words. " * 4}]
    previous_prompt = 0
    for turn in range(8):
        messages.append({"role": "user", "content": f"Question {turn + 1}: name a colour and a number."})
        kwargs = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
        warm = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})  # type: ignore[arg-type]
        cold = client.chat.completions.create(  # type: ignore[arg-type]
            **kwargs, extra_body={"ignore_eos": True, "cache_salt": f"cold-{turn}-{time.monotonic_ns()}"})
        assert warm.choices[0].message.content == cold.choices[0].message.content, turn
        assert warm.usage is not None and cold.usage is not None
        details = warm.usage.prompt_tokens_details
        assert details is not None and cold.usage.prompt_tokens_details is not None
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        if turn:  # at least every whole page of the previous turn's prompt
            assert previous_prompt // 16 * 16 <= details.cached_tokens < warm.usage.prompt_tokens, turn
            assert details.cached_tokens % 16 == 0
        previous_prompt = warm.usage.prompt_tokens
        messages.append({"role": "assistant", "content": warm.choices[0].message.content or ""})


# ---- logprobs, sampling controls, structured output and tools (issue 15) ---------------------------


@pytest.fixture
def api(server: ServerProcess, client: openai.OpenAI) -> openai.OpenAI:
    """The client, in the two modes these features are tested in: they run where tokens are
    sampled and never touch the KV transport, so disaggregated over tcp and colocated cover them
    (nixl and mooncake move the same KV as tcp, tested above)."""
    over_tcp_and_colocated(server, "sampling features are transport-independent")
    return client

PENALTIES = {"frequency_penalty": 1.0, "presence_penalty": 0.5, "logit_bias": {"30": 4.0},
             "extra_body": {"repetition_penalty": 1.3, "ignore_eos": True}}


@pytest.fixture(scope="module")
def offline(smollm2: Checkpoint, reference: dict) -> dict:
    """The model in this process (fp32): raw logits of 8 greedy tokens of a chat case and a
    completion case, the slow reference of a penalized chat and the completion prompt's
    log-softmax after each of its prefixes (tests/sampling_reference.py)."""
    model = build_model(smollm2, torch.float32)
    engine = OfflineEngine(ModelRunner(model, KVPool(model.config, 256, 16, torch.float32)), smollm2.tokenizer,
                           chunk_tokens=256)
    chat, text = (next(c for c in reference["cases"] if c["kind"] == kind) for kind in ("chat", "completion"))
    eight = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    logits = {c["id"]: engine.generate([c["prompt_token_ids"]], [eight], return_logits=True)[0].logits
              for c in (chat, text)}
    penalized = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=1.0,
                               presence_penalty=0.5, repetition_penalty=1.3, logit_bias=((30, 4.0),))
    ids, _ = slow_greedy(engine, chat["prompt_token_ids"], penalized, 12)
    return {"chat": chat, "completion": text, "logits": logits, "penalized_text": smollm2.tokenizer.decode(ids),
            "prompt_logprobs": slow_prompt_logprobs(engine, text["prompt_token_ids"])}


def test_chat_logprobs_are_the_models_log_softmax_whole_and_streamed(api: openai.OpenAI, offline: dict,
                                                                       smollm2: Checkpoint) -> None:
    case = offline["chat"]
    kw = {**greedy(case), "max_tokens": 8, "messages": case["messages"], "logprobs": True, "top_logprobs": 5}
    whole = api.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    lp = torch.log_softmax(offline["logits"][case["id"]].double(), -1)  # [8, V]
    assert len(content) == 8
    for i, entry in enumerate(content):
        token = case["greedy_ids"][i]
        assert bytes(entry.bytes) == smollm2.tokenizer.token_bytes(token)
        assert entry.logprob == pytest.approx(lp[i, token].item(), abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(lp[i].topk(5).values.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely token
    assert b"".join(bytes(e.bytes) for e in content).decode() == whole.choices[0].message.content
    streamed = [e for chunk in api.chat.completions.create(**kw, stream=True) for c in chunk.choices
                if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    plain = api.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_are_the_models_with_text_offsets(api: openai.OpenAI, offline: dict) -> None:
    case = offline["completion"]
    kw = {**greedy(case), "max_tokens": 8, "prompt": case["prompt"], "logprobs": 3}
    whole = api.completions.create(**kw)
    lp = torch.log_softmax(offline["logits"][case["id"]].double(), -1)
    got = whole.choices[0].logprobs
    assert "".join(got.tokens) == whole.choices[0].text
    assert got.token_logprobs == pytest.approx([lp[i, t].item() for i, t in enumerate(case["greedy_ids"][:8])], abs=1e-4)
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(8)]
    assert all(len(top) <= 3 and max(top.values()) == pytest.approx(lp[i].max().item(), abs=1e-4)
               for i, top in enumerate(got.top_logprobs))
    chunks = [c.logprobs for chunk in api.completions.create(**kw, stream=True) for c in chunk.choices if c.logprobs]
    assert sum((c.tokens for c in chunks), []) == got.tokens
    assert sum((c.text_offset for c in chunks), []) == got.text_offset


def test_penalties_and_bias_equal_the_slow_reference_and_min_p_1_is_greedy(api: openai.OpenAI, offline: dict,
                                                                          reference: dict) -> None:
    case = offline["chat"]
    r = api.chat.completions.create(model=MODEL, messages=case["messages"], max_tokens=12, temperature=0,
                                       **PENALTIES)
    assert r.choices[0].message.content == offline["penalized_text"]
    sampled = api.chat.completions.create(model=MODEL, messages=case["messages"], max_tokens=12, temperature=1.0,
                                             seed=7, extra_body={"min_p": 1.0, "ignore_eos": True})
    greedy_12 = api.chat.completions.create(model=MODEL, messages=case["messages"], max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert greedy_12.choices[0].message.content.startswith(case["text_until_eos"][:16])
    assert sampled.choices[0].message.content == greedy_12.choices[0].message.content  # only the top token survives


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}}}


def test_structured_output_validates_whole_and_streamed(api: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Describe a famous scientist as JSON."}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    whole = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=0,
                                           response_format=schema_format)  # type: ignore[arg-type]
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
    streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=200, temperature=0, response_format=schema_format, stream=True)  # type: ignore[arg-type]
        if c.choices)
    assert streamed == whole.choices[0].message.content
    anything = api.completions.create(model=MODEL, prompt="A JSON object describing a cat:", max_tokens=120,
                                         temperature=0.8, seed=3, extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(anything.choices[0].text), dict) and anything.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, response_format={  # type: ignore[arg-type]
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "properties": 5}}})
    assert info.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
    assert "properties" in info.value.body["message"]  # type: ignore[index]


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "required": ["city"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "additionalProperties": False,
    "properties": {"zone": {"type": "string", "maxLength": 30}}}}}


def test_tool_calls_parse_into_the_functions_schema(api: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,  # type: ignore[arg-type]
                                       tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named)  # type: ignore[list-item]
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls  # type: ignore[misc]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    stream = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0, stream=True,  # type: ignore[arg-type]
                                            tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named)  # type: ignore[list-item]
    chunks = [c.choices[0] for c in stream if c.choices]
    deltas = [tc for c in chunks if c.delta.tool_calls for tc in c.delta.tool_calls]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [(call.function.name, call.function.arguments)]
    assert chunks[-1].finish_reason == "tool_calls" and not any(c.delta.content for c in chunks)
    required = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, temperature=0,  # type: ignore[arg-type]
                                              tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required")  # type: ignore[list-item]
    calls = required.choices[0].message.tool_calls or []
    assert required.choices[0].finish_reason == "tool_calls" and calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    answer = api.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=[  # type: ignore[arg-type]
        *messages, {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}])
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, tools=[WEATHER_TOOL])  # type: ignore[arg-type, list-item]
    assert info.value.body["param"] == "tool_choice" and "chat template" in info.value.body["message"]  # type: ignore[index]


def test_n_samples_are_indexed_reproducible_and_each_a_solo_seeded_request(api: openai.OpenAI, offline: dict) -> None:
    case = offline["chat"]
    kw = {"model": MODEL, "messages": case["messages"], "max_tokens": 12, "temperature": 0.9, "seed": 5,
          "extra_body": {"ignore_eos": True}}
    whole = api.chat.completions.create(**kw, n=3)
    texts = [c.message.content for c in whole.choices]
    assert [c.index for c in whole.choices] == [0, 1, 2] and len(set(texts)) > 1  # seeds 5, 6, 7
    prompt_tokens = whole.usage.prompt_tokens
    assert (whole.usage.completion_tokens, whole.usage.total_tokens) == (36, prompt_tokens + 36)  # prompt once
    assert [c.message.content for c in api.chat.completions.create(**kw, n=3).choices] == texts
    alone = [api.chat.completions.create(**{**kw, "seed": 5 + i}).choices[0].message.content for i in range(3)]
    assert alone == texts  # sample i is seeded seed + i
    streamed = ["", "", ""]
    finishes: dict[int, str] = {}
    usage = None
    for chunk in api.chat.completions.create(**kw, n=3, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert streamed == texts and finishes == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 36


def test_best_of_returns_the_most_likely_samples(api: openai.OpenAI, offline: dict) -> None:
    case = offline["completion"]
    kw = {"model": MODEL, "prompt": case["prompt"], "max_tokens": 10, "temperature": 1.0, "seed": 9,
          "extra_body": {"ignore_eos": True}}
    every = api.completions.create(**kw, n=4, logprobs=0)
    score = {c.text: sum(c.logprobs.token_logprobs) for c in every.choices}
    best = api.completions.create(**kw, n=2, best_of=4)
    assert [c.text for c in best.choices] == sorted(score, key=lambda t: -score[t])[:2]
    assert [c.index for c in best.choices] == [0, 1] and all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == 40  # every sample drawn counts


def test_echo_with_logprobs_scores_every_prompt_token_as_the_model_does(api: openai.OpenAI, offline: dict) -> None:
    """What evaluation harnesses send for log-likelihoods: echo, logprobs=1, max_tokens=1. Asked
    twice: the second time the prompt's pages are cached, and it is scored all the same."""
    case = offline["completion"]
    ids = case["prompt_token_ids"]
    for _ in range(2):
        r = api.completions.create(model=MODEL, prompt=case["prompt"], max_tokens=1, temperature=0, echo=True,
                                   logprobs=1)
        choice, n = r.choices[0], len(ids)
        lp = choice.logprobs
        assert choice.text.startswith(case["prompt"]) and len(lp.tokens) == n + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = [offline["prompt_logprobs"][k][ids[k + 1]].item() for k in range(n - 1)]
        assert lp.token_logprobs[1:n] == pytest.approx(want, abs=1e-4)
        assert [max(top.values()) for top in lp.top_logprobs[1:n]] == pytest.approx(
            [row.max().item() for row in offline["prompt_logprobs"]], abs=1e-4)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 1)]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n, 1)
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model=MODEL, prompt=case["prompt"], max_tokens=4, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed.startswith(case["prompt"])
