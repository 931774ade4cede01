"""GET /v1/models/{model}, POST /tokenize and POST /detokenize (app/api/token_routes.py): the ids are
what generation would submit, round trips hold, and the routes are guarded and refuse like the
/v1 routes (401 before the body, 404 model_not_found, 400 naming the field, 413, long bodies off
the event loop, X-Request-Id echoed)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from test_keys import ADMIN, KEY_A, bearer, keys_file
from test_routes import (CHAT, CHAT_TEMPLATE, COMPLETIONS, LIMIT, MODEL, TOO_LONG, StubEngine, _SpyInner,
                           assert_error, chat_body, chat_ids)

from kvfence.app.api.keys import ApiKeys
from kvfence.app.api.routes import INLINE_BODY_BYTES, build_app
from kvfence.engine.tokenizer import Tokenizer

TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"
# the special token's text in a message is encoded as text (12 tokens here), in both routes: 44 tokens
MESSAGES = [{"role": "system", "content": "be"}, {"role": "user", "content": "é<|im_end|>"}]


def call(engine: StubEngine, path: str, body: object, headers: dict[str, str] | None = None,
         **app_options: object) -> tuple[int, dict, dict]:
    with TestClient(build_app(engine, **app_options)) as client:  # type: ignore[arg-type]
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = client.post(path, content=data, headers={"content-type": "application/json", **(headers or {})})
        return r.status_code, r.json(), dict(r.headers)


def tokenize(engine: StubEngine, **fields: object) -> dict:
    status, out, _ = call(engine, TOKENIZE, {"model": MODEL, **fields})
    assert status == 200, out
    return out


def detokenize(engine: StubEngine, ids: list[int]) -> str:
    status, out, _ = call(engine, DETOKENIZE, {"model": MODEL, "tokens": ids})
    assert status == 200 and set(out) == {"prompt"}, out
    return out["prompt"]


def test_tokenize_answers_vllms_shape_and_round_trips_through_detokenize() -> None:
    engine = StubEngine()
    text = "héllo <|im_start|>wörld\n"
    out = tokenize(engine, prompt=text)
    ids = engine.tokenizer.encode(text)
    assert out == {"count": len(ids), "max_model_len": LIMIT, "tokens": ids, "token_strs": None}
    assert 257 in ids and len(ids) == len(text.encode()) - len("<|im_start|>") + 1  # the control token is one id
    assert detokenize(engine, ids) == text  # special tokens kept
    assert tokenize(engine, prompt=detokenize(engine, ids))["tokens"] == ids
    # a text longer than the context is still tokenized: count > max_model_len says it cannot fit
    long = tokenize(engine, prompt="x" * (LIMIT + 5), unknown_field={"ignored": True})
    assert (long["count"], long["max_model_len"]) == (LIMIT + 5, LIMIT)
    assert tokenize(engine, prompt="")["count"] == 0


def test_token_strs_spell_each_token_as_the_vocabulary_does() -> None:
    out = tokenize(StubEngine(), prompt="a é<|im_end|>", return_token_strs=True)
    assert out["token_strs"] == ["a", "Ġ", "Ã", "©", "<|im_end|>"]  # byte-level BPE spellings
    assert out["count"] == 5


def test_chat_tokenize_is_what_chat_completions_submits() -> None:
    engine = StubEngine("reject")
    for messages in (MESSAGES, [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                             {"type": "text", "text": "b"}]}]):
        call(engine, CHAT, chat_body(messages=messages))
        submitted = engine.submitted[-1][0]
        assert tokenize(engine, messages=messages)["tokens"] == submitted
        assert tokenize(engine, messages=messages, add_generation_prompt=True)["tokens"] == submitted
    assert tokenize(engine, messages=[{"role": "user", "content": "hi"}])["tokens"] == chat_ids(engine, "hi")
    header = engine.tokenizer.encode("<|im_start|>assistant\n")
    without = tokenize(engine, messages=[{"role": "user", "content": "hi"}], add_generation_prompt=False)["tokens"]
    assert without + header == chat_ids(engine, "hi")
    call(engine, COMPLETIONS, {"model": MODEL, "prompt": "héllo"})
    assert tokenize(engine, prompt="héllo")["tokens"] == engine.submitted[-1][0]


def test_add_special_tokens_follows_vllms_defaults() -> None:
    plain = StubEngine("reject")
    bos = plain.tokenizer.bos_token_id
    engine = StubEngine("reject", tokenizer=Tokenizer(plain.tokenizer.inner, bos_token_id=bos, eos_token_ids=[258],
                                                      add_bos=True, chat_template=CHAT_TEMPLATE))
    text_ids = engine.tokenizer.encode("hi", add_bos=False)
    assert tokenize(engine, prompt="hi")["tokens"] == [bos, *text_ids]  # prompts: true, as completions
    call(engine, COMPLETIONS, {"model": MODEL, "prompt": "hi"})
    assert engine.submitted[-1][0] == [bos, *text_ids]
    assert tokenize(engine, prompt="hi", add_special_tokens=False)["tokens"] == text_ids
    chat = tokenize(engine, messages=MESSAGES)["tokens"]  # messages: false, as chat completions
    call(engine, CHAT, chat_body(messages=MESSAGES))
    assert chat == engine.submitted[-1][0] and chat[0] != bos
    assert tokenize(engine, messages=MESSAGES, add_special_tokens=True)["tokens"] == [bos, *chat]


def test_model_route_is_the_listed_card_and_other_ids_are_404() -> None:
    with TestClient(build_app(StubEngine())) as c:
        (listed,) = c.get("/v1/models").json()["data"]
        r = c.get(f"/v1/models/{MODEL}")
        assert r.status_code == 200 and r.json() == listed
        assert listed["id"] == MODEL and listed["max_model_len"] == LIMIT
        for other in ("gpt-4", "org/tiny-test", f"{MODEL}x"):
            r = c.get(f"/v1/models/{other}")
            assert_error(r.status_code, r.json(), 404, "model", "model_not_found")
            assert f"'{other}' does not exist" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body", [(TOKENIZE, {"prompt": "hi"}), (TOKENIZE, {"messages": MESSAGES}),
                                       (DETOKENIZE, {"tokens": [1, 2]})])
def test_another_model_is_404_model_not_found(path: str, body: dict) -> None:
    status, out, _ = call(StubEngine(), path, {"model": "gpt-4", **body})
    assert_error(status, out, 404, "model", "model_not_found")


@pytest.mark.parametrize("path,body,param,code", [
    (DETOKENIZE, {"tokens": [5, -1]}, "tokens", "invalid_value"),
    (DETOKENIZE, {"tokens": [5, 259 + 3]}, "tokens", "invalid_value"),
    (DETOKENIZE, {"tokens": "abc"}, "tokens", "invalid_type"),
    (DETOKENIZE, {"tokens": [True]}, "tokens[0]", "invalid_type"),
    (DETOKENIZE, {}, "tokens", "missing_required_parameter"),
    (TOKENIZE, {}, "prompt", "missing_required_parameter"),
    (TOKENIZE, {"prompt": "a", "messages": MESSAGES}, "messages", "invalid_value"),
    (TOKENIZE, {"prompt": [1, 2]}, "prompt", "invalid_type"),
    (TOKENIZE, {"prompt": "a", "return_token_strs": "yes"}, "return_token_strs", "invalid_type"),
    (TOKENIZE, {"messages": []}, "messages", "invalid_value"),
    (TOKENIZE, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
])
def test_bad_input_is_400_naming_the_field(path: str, body: dict, param: str, code: str) -> None:
    status, out, _ = call(StubEngine(), path, {"model": MODEL, **body})
    assert_error(status, out, 400, param, code)
    if param == "tokens" and code == "invalid_value":
        assert "token ids must be in [0, 259)" in out["error"]["message"]


@pytest.mark.parametrize("path,body", [(TOKENIZE, {"prompt": "hi"}), (DETOKENIZE, {"tokens": [1]})])
@pytest.mark.parametrize("fields,param", [({"kv_transfer_params": None}, "kv_transfer_params"),
                                          ({"tenant": "b"}, "tenant"),
                                          ({"extra_body": {"page_ids": [1]}}, "extra_body.page_ids")])
def test_transfer_and_tenant_fields_are_refused_as_generation_refuses_them(path: str, body: dict, fields: dict,
                                                                        param: str) -> None:
    status, out, _ = call(StubEngine(), path, {"model": MODEL, **body, **fields})
    assert_error(status, out, 400, param, "forbidden_parameter")
    _, from_chat, _ = call(StubEngine(), CHAT, chat_body(**fields))
    assert out == from_chat


def test_a_text_that_cannot_fit_is_refused_untokenized_and_a_long_body_is_413() -> None:
    engine = StubEngine()
    spy = _SpyInner(engine.tokenizer.inner)
    engine.tokenizer.inner = spy  # type: ignore[assignment]
    for field, value in (("prompt", "x" * (3 << 20)), ("messages", [{"role": "user", "content": "x" * (3 << 20)}])):
        status, out, _ = call(engine, TOKENIZE, {"model": MODEL, field: value})
        assert_error(status, out, 400, field, TOO_LONG)
    assert spy.calls == []
    for path, body in ((TOKENIZE, {"model": MODEL, "prompt": "x" * 2000}),
                       (DETOKENIZE, {"model": MODEL, "tokens": [1] * 1000})):
        status, out, _ = call(engine, path, body, max_body_bytes=1000)
        assert_error(status, out, 413, None, "request_too_large")


def test_long_bodies_are_worked_on_off_the_event_loop_short_ones_on_it() -> None:
    engine = StubEngine()
    spy = _SpyInner(engine.tokenizer.inner)
    engine.tokenizer.inner = spy  # type: ignore[assignment]
    with TestClient(build_app(engine)) as c:
        loop_thread = c.portal.call(threading.get_ident)  # type: ignore[union-attr]
        for padding, on_loop in ((0, True), (INLINE_BODY_BYTES + 1, False)):
            spy.calls.clear()
            r = c.post(TOKENIZE, json={"model": MODEL, "prompt": "abc", "pad": "p" * padding})
            assert r.json()["tokens"] == engine.tokenizer.encode("abc")
            assert (spy.calls[0][1] == loop_thread) is on_loop
        repeats = INLINE_BODY_BYTES // 8  # a body of ids over INLINE_BODY_BYTES
        ids = engine.tokenizer.encode("abc ") * repeats
        assert c.post(DETOKENIZE, json={"model": MODEL, "tokens": ids}).json()["prompt"] == "abc " * repeats


def test_keys_are_needed_before_the_body_is_read(tmp_path: Path) -> None:
    engine = StubEngine()
    app = build_app(engine, api_keys=ApiKeys.load(keys_file(tmp_path)))
    with TestClient(app) as c:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": bearer(ADMIN)}):
            for r in (c.get(f"/v1/models/{MODEL}", headers=headers),
                      c.post(TOKENIZE, content=b"{not json", headers=headers),
                      c.post(DETOKENIZE, content=b"{not json", headers=headers)):
                assert_error(r.status_code, r.json(), 401, None, "invalid_api_key")
                assert r.headers["www-authenticate"] == "Bearer"
        key = {"authorization": bearer(KEY_A)}
        assert c.get(f"/v1/models/{MODEL}", headers=key).json()["id"] == MODEL
        assert c.post(TOKENIZE, json={"model": MODEL, "prompt": "ab"}, headers=key).json()["count"] == 2
        assert c.post(DETOKENIZE, json={"model": MODEL, "tokens": [65]}, headers=key).json() == {"prompt": "b"}


def test_x_request_id_is_echoed_on_answers_and_refusals() -> None:
    with TestClient(build_app(StubEngine())) as c:
        rid = {"X-Request-Id": "trace-42"}
        for r in (c.get(f"/v1/models/{MODEL}", headers=rid), c.get("/v1/models/nope", headers=rid),
                  c.post(TOKENIZE, json={"model": MODEL, "prompt": "a"}, headers=rid),
                  c.post(TOKENIZE, json={"model": MODEL}, headers=rid),
                  c.post(DETOKENIZE, json={"model": MODEL, "tokens": [1]}, headers=rid),
                  c.post(DETOKENIZE, json={"model": MODEL, "tokens": [-1]}, headers=rid)):
            assert r.headers["x-request-id"] == "trace-42", (r.status_code, r.text)
        assert "x-request-id" not in c.post(TOKENIZE, json={"model": MODEL, "prompt": "a"}).headers
