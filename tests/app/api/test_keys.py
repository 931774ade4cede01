"""API keys: the keys file, and the HTTP API with keys on (401 before the body is read, the tenant
from the key and never from the body, /metrics behind the admin key, health checks open)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from test_routes import CHAT, MODEL, StubEngine, chat_body

from kvfence.app.api.keys import ApiKeys, ApiKeysError, key_digest
from kvfence.app.api.routes import build_app
from kvfence.app.cli import main
from kvfence.scheduler.core.tenants import ANONYMOUS

KEY_A, KEY_B, ADMIN = "key-of-a", "key-of-b", "the-admin-key"


def keys_file(tmp_path: Path, text: str | None = None) -> Path:
    path = tmp_path / "keys.toml"
    path.write_text(text if text is not None else f"""
[tenants.a]
key_sha256 = ["{key_digest(KEY_A)}"]
max_running = 2
tokens_per_minute = 1000
weight = 3

[tenants.b]
key_sha256 = "{key_digest(KEY_B)}"

[admin]
key_sha256 = ["{key_digest(ADMIN)}"]
""")
    return path


def bearer(key: str) -> str:
    return f"Bearer {key}"


def test_each_key_authenticates_its_tenant_and_nothing_else(tmp_path: Path) -> None:
    keys = ApiKeys.load(keys_file(tmp_path))
    a, b = keys.tenant(bearer(KEY_A)), keys.tenant(bearer(KEY_B))
    assert a is not None and (a.name, a.max_running, a.tokens_per_minute, a.max_queued) == ("a", 2, 1000, None)
    assert b is not None and b.name == "b"
    assert (a.weight, b.weight) == (3, 1)  # its fair share against the others' (default 1)
    for header in (None, "", "Bearer", "Bearer wrong", f"Basic {KEY_A}", KEY_A, bearer(ADMIN), bearer(KEY_A + "x")):
        assert keys.tenant(header) is None, header
    assert keys.is_admin(bearer(ADMIN)) and not keys.is_admin(bearer(KEY_A)) and not keys.is_admin(None)
    assert keys.tenant(f"bearer   {KEY_B}  ") is not None  # the scheme is case-insensitive, spaces trimmed


def test_without_a_file_everyone_is_anonymous_and_admin() -> None:
    keys = ApiKeys.load(None)
    assert keys.tenant(None) is ANONYMOUS and keys.tenant("Bearer anything") is ANONYMOUS and keys.is_admin(None)


@pytest.mark.parametrize("text, complaint", [
    ("[tenants.a]\nkey_sha256 = ['abc']\n", "64 hex digits"),
    ("[tenants.anonymous]\nkey_sha256 = ['" + "0" * 64 + "']\n", "reserved"),
    ("[tenants.a]\nkey_sha256 = ['" + "0" * 64 + "']\nweight = 0\n", "weight must be a positive integer"),
    ("[tenants.a]\nkey_sha256 = ['" + "0" * 64 + "']\n[tenants.b]\nkey_sha256 = ['" + "0" * 64 + "']\n",
     "listed twice"),
    ("[tenants.a]\nkey_sha256 = ['" + "0" * 64 + "']\nmax_runing = 3\n", "unknown keys"),
    ("[tenants.a]\nkey_sha256 = ['" + "0" * 64 + "']\nmax_running = 0\n", "max_running"),
    ("[tenants.a]\n", "needs key_sha256"),
    ("[admin]\nkey_sha256 = ['" + "1" * 64 + "']\n", "no tenant has a key"),
    ("[tenant.a]\n", "unknown tables"),
    ("not toml [", "cannot read it"),
    ("[tenants.a]\nkey_sha256 = ['" + "0" * 64 + "']\n[admin]\nkey_sha256 = ['" + "0" * 64 + "']\n",
     "admin its own"),
])
def test_a_bad_keys_file_is_refused_naming_the_problem(tmp_path: Path, text: str, complaint: str) -> None:
    with pytest.raises(ApiKeysError, match=complaint):
        ApiKeys.load(keys_file(tmp_path, text))


def test_serve_refuses_a_bad_keys_file_before_loading_anything(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = keys_file(tmp_path, "[tenants.a]\nkey_sha256 = ['nope']\n")
    assert main(["serve", "--api-keys", str(path), "--model", str(tmp_path / "no-such-model")]) == 2
    assert "64 hex digits" in capsys.readouterr().err


def test_the_api_key_command_prints_a_working_entry(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["api-key", "team-7"]) == 0
    out = capsys.readouterr().out
    key = out.splitlines()[1].removeprefix("# ")
    path = keys_file(tmp_path, out)
    tenant = ApiKeys.load(path).tenant(bearer(key))
    assert tenant is not None and tenant.name == "team-7"


def client(engine: StubEngine, tmp_path: Path) -> TestClient:
    return TestClient(build_app(engine, lambda: (b"kvfence_x 1\n", "text/plain"),
                                api_keys=ApiKeys.load(keys_file(tmp_path))))


def test_a_missing_or_wrong_key_gets_401_and_reaches_nothing(tmp_path: Path) -> None:
    engine = StubEngine("idle")
    with client(engine, tmp_path) as c:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": bearer(ADMIN)}):
            r = c.post(CHAT, content=json.dumps(chat_body()), headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            error = r.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert "Authorization: Bearer" in error["message"]
            assert c.get("/v1/models", headers=headers).status_code == 401
        # refused before the body is read: even a body that is not JSON gets the 401
        assert c.post(CHAT, content=b"{not json", headers={}).status_code == 401
        assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200
    assert engine.submitted == []


def test_the_tenant_comes_from_the_key_whatever_the_body_says(tmp_path: Path) -> None:
    engine = StubEngine("idle")
    with client(engine, tmp_path) as c:
        body = chat_body(user="b", stream=True)  # `user` is the client's note, never a tenant
        with c.stream("POST", CHAT, content=json.dumps(body), headers={"authorization": bearer(KEY_A)}) as r:
            assert r.status_code == 200
        r = c.get("/v1/models", headers={"authorization": bearer(KEY_B)})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    assert [t.name for t in engine.tenants] == ["a"]


def test_a_cache_salt_only_partitions_and_a_body_never_names_a_tenant(tmp_path: Path) -> None:
    """FAILURES 25: the salt reaches the scheduler as a salt of the key's tenant; a body naming a
    tenant or a cache key is refused before anything is submitted."""
    engine = StubEngine("idle")
    with client(engine, tmp_path) as c:
        body = chat_body(cache_salt="b", stream=True)
        with c.stream("POST", CHAT, content=json.dumps(body), headers={"authorization": bearer(KEY_A)}) as r:
            assert r.status_code == 200
        for field in ("tenant", "cache_key"):
            r = c.post(CHAT, content=json.dumps(chat_body(**{field: "b"})), headers={"authorization": bearer(KEY_A)})
            assert r.status_code == 400 and r.json()["error"]["param"] == field
        r = c.post(CHAT, content=json.dumps(chat_body(cache_salt="x" * 257)), headers={"authorization": bearer(KEY_A)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    assert [(t.name, salt) for t, salt in zip(engine.tenants, engine.salts)] == [("a", "b")]


def test_flushing_the_cache_needs_the_admin_key(tmp_path: Path) -> None:
    engine = StubEngine()
    with client(engine, tmp_path) as c:
        for headers in ({}, {"authorization": bearer(KEY_A)}, {"authorization": "Bearer nope"}):
            r = c.post("/admin/flush_cache", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert engine.flushes == 0
        r = c.post("/admin/flush_cache", headers={"authorization": bearer(ADMIN)})
        assert r.status_code == 200 and r.json() == {"flushed": True, "pages_freed": {"colocated": 3}}
    assert engine.flushes == 1


def test_metrics_need_the_admin_key(tmp_path: Path) -> None:
    with client(StubEngine(), tmp_path) as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"authorization": bearer(KEY_A)}).status_code == 401
        r = c.get("/metrics", headers={"authorization": bearer(ADMIN)})
        assert r.status_code == 200 and r.text == "kvfence_x 1\n"
