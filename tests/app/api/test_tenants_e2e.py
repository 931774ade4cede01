"""Tenants end to end: `kvfence serve --api-keys` on a real socket, called with the official
client. A missing or wrong key gets 401; each tenant's limits hold without touching the other;
/metrics (behind the admin key) counts each tenant's tokens and requests."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_process import ServerProcess, serving

from kvfence.app.api.keys import key_digest

MODEL = "tiny-tenants"
KEY_A, KEY_B, ADMIN = "tenant-a-key", "tenant-b-key", "admin-key"


def until(predicate, timeout_s: float = 60, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from tiny_models import TinySpec, make_tiny_pair

    gguf_path, _, _ = make_tiny_pair(tmp_path_factory.mktemp("tiny"), seed=3, spec=TinySpec(context_length=8192))
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(f"""
[tenants.a]
key_sha256 = ["{key_digest(KEY_A)}"]
max_running = 1
max_queued = 1

[tenants.b]
key_sha256 = ["{key_digest(KEY_B)}"]

[admin]
key_sha256 = ["{key_digest(ADMIN)}"]
""")
    srv = ServerProcess(gguf_path, "--served-model-name", MODEL, "--canary-interval", "3600", "--api-keys", str(keys),
                        log_path=tmp_path_factory.mktemp("server") / "server.log")
    srv.admin_key = ADMIN
    yield from serving(srv)


def client(srv: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0)


def chat(c: openai.OpenAI, max_tokens: int = 6):  # type: ignore[no-untyped-def]
    return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count to three"}],
                                     max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})


def metric(srv: ServerProcess, name: str, **labels: str) -> float:
    try:
        return srv.metric(name, **labels)
    except KeyError:  # a labelled counter appears with its first increment
        return 0.0


def test_without_a_valid_key_nothing_is_served(server: ServerProcess) -> None:
    missing = httpx.post(server.base_url + "/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=10)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    for key in ("wrong", ADMIN):  # the admin key is not a tenant's
        with client(server, key) as c, pytest.raises(openai.AuthenticationError) as refused:
            chat(c)
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
        with client(server, key) as c, pytest.raises(openai.AuthenticationError):
            c.models.list()
    assert httpx.get(server.base_url + "/metrics", timeout=5).status_code == 401
    assert httpx.get(server.base_url + "/health", timeout=5).json() == {"status": "ok"}


def test_each_tenant_is_counted_apart(server: ServerProcess) -> None:
    before = {(t, k): metric(server, "kvfence_tokens_total", tenant=t, kind=k)
              for t in ("a", "b") for k in ("prompt", "completion")}
    with client(server, KEY_A) as a, client(server, KEY_B) as b:
        ra, rb1, rb2 = chat(a, 5), chat(b, 7), chat(b, 3)
    assert ra.usage is not None and rb1.usage is not None and rb2.usage is not None
    until(lambda: metric(server, "kvfence_tokens_total", tenant="b", kind="prompt")
          == before["b", "prompt"] + rb1.usage.prompt_tokens + rb2.usage.prompt_tokens, 10, "b's prompt tokens")
    assert metric(server, "kvfence_tokens_total", tenant="a", kind="completion") == before["a", "completion"] + 5
    assert metric(server, "kvfence_tokens_total", tenant="b", kind="completion") == before["b", "completion"] + 10
    assert metric(server, "kvfence_tokens_total", tenant="a", kind="prompt") == \
        before["a", "prompt"] + ra.usage.prompt_tokens
    assert metric(server, "kvfence_requests_total", tenant="b", status="length") >= 2
    assert metric(server, "kvfence_requests_total", tenant="anonymous", status="length") == 0


def test_a_tenant_over_its_limits_gets_429_and_the_other_is_served(server: ServerProcess) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000,
            "ignore_eos": True, "stream": True}
    headers = {"authorization": f"Bearer {KEY_A}"}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # kept: a dropped iterator closes the stream, which aborts the request
            next(lines)  # a's one running request streams
            with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as queued:
                assert queued.status_code == 200  # admitted, waiting: a is at its running limit
                with client(server, KEY_A) as a, pytest.raises(openai.RateLimitError) as refused:
                    chat(a)  # its one queue slot is taken
                assert refused.value.status_code == 429 and refused.value.code == "rate_limit_exceeded"
                assert refused.value.response.headers["retry-after"] == "1"
                with client(server, KEY_B) as b:  # b passes a's waiting request
                    reply = chat(b, 4)
                assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
                assert any(line.startswith("data: {") for line in itertools.islice(lines, 4))  # a1 streams on
    until(lambda: not any(server.pages_in_use().values()), 30, "pages back to baseline")
    with client(server, KEY_A) as a:  # a is served again once its requests ended
        assert chat(a, 2).usage.completion_tokens == 2


SYSTEM = "You are the assistant of one tenant. Keep its secrets. " * 12  # a long shared system prompt


def ask(c: openai.OpenAI, salt: str | None = None):  # type: ignore[no-untyped-def]
    extra: dict[str, object] = {"ignore_eos": True}
    if salt is not None:
        extra["cache_salt"] = salt
    return c.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": SYSTEM},
                                                             {"role": "user", "content": "hello"}],
                                     max_tokens=6, temperature=0, extra_body=extra)


def cached(reply) -> int:  # type: ignore[no-untyped-def]
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens


def flush(srv: ServerProcess, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.base_url + "/admin/flush_cache", headers=headers, timeout=10)


def test_the_prefix_cache_never_crosses_tenants(server: ServerProcess) -> None:
    """FAILURES 24 and 25: b sends exactly a's prompt (and every salt it likes): no cached tokens,
    as much prefill work as a cold request (the server's own count), the same answer; a's second
    request hits. A body naming a tenant or a cache key is refused."""
    assert flush(server, ADMIN).status_code == 200
    prefilled = {t: metric(server, "kvfence_prefill_tokens_total", tenant=t) for t in ("a", "b")}
    with client(server, KEY_A) as a, client(server, KEY_B) as b:
        a1 = ask(a)
        a2 = ask(a)
        b_replies = [ask(b), ask(b, salt=""), ask(b, salt="a")]
    assert (cached(a1), a1.choices[0].message.content) == (0, a2.choices[0].message.content)
    assert cached(a2) >= a1.usage.prompt_tokens - 16 - 1 and cached(a2) % 16 == 0
    assert cached(b_replies[0]) == 0 and all(r.choices[0].message.content == a1.choices[0].message.content
                                             for r in b_replies)
    prompt = a1.usage.prompt_tokens
    # b's first request computed its whole prompt, as a cold one does: its first token is not early
    until(lambda: metric(server, "kvfence_prefill_tokens_total", tenant="b") > prefilled["b"], 10, "b's count")
    assert metric(server, "kvfence_prefill_tokens_total", tenant="b") - prefilled["b"] >= 2 * prompt  # 2 salts cold
    assert metric(server, "kvfence_prefill_tokens_total", tenant="a") - prefilled["a"] == 2 * prompt - cached(a2)
    for field, value in (("tenant", "a"), ("cache_key", "00"), ("page_ids", [0])):
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=10,
                       headers={"authorization": f"Bearer {KEY_B}"},
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_flushing_the_cache_needs_the_admin_key_and_returns_every_page(server: ServerProcess) -> None:
    with client(server, KEY_A) as a:
        ask(a)
    for key in (None, KEY_A, "wrong"):
        refused = flush(server, key)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    until(lambda: metric(server, "kvfence_kv_pages", worker="prefill", state="cached") > 0, 10, "cached pages")
    done = flush(server, ADMIN)
    assert done.status_code == 200 and done.json()["flushed"] is True
    assert sum(done.json()["pages_freed"].values()) > 0
    for role in ("prefill", "decode"):
        until(lambda role=role: metric(server, "kvfence_kv_pages", worker=role, state="free")
              == metric(server, "kvfence_kv_pages", worker=role, state="total"), 10, f"every {role} page free")
        assert metric(server, "kvfence_kv_pages", worker=role, state="cached") == 0
