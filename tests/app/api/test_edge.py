"""The HTTP edge (app/api/edge.py) at the ASGI level: the Host/Origin check that keeps a web page from
driving a loopback server with keys off, and the cap on requests in flight that never refuses
/health. (Against the real server: tests/app/api/test_hostile_e2e.py.)"""

from __future__ import annotations

import anyio
import pytest
from starlette.testclient import TestClient

from kvfence.app.api.edge import LOOPBACK_NAMES, Edge, allowed_hosts


class Held:
    """An ASGI app whose /slow requests wait until `go` is set; everything else answers 200."""

    def __init__(self) -> None:
        self.go = anyio.Event()
        self.started = 0

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] != "http":  # lifespan
            return
        if scope["path"] == "/slow":
            self.started += 1
            await self.go.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def test_which_hosts_are_answered_by_default() -> None:
    assert allowed_hosts(None, "127.0.0.1", keys_on=False) == LOOPBACK_NAMES
    assert allowed_hosts(None, "::1", keys_on=False) == LOOPBACK_NAMES
    assert allowed_hosts(None, "127.0.0.1", keys_on=True) is None  # a key is what a request needs
    assert allowed_hosts(None, "0.0.0.0", keys_on=False) is None  # not loopback: the operator chose to expose it
    assert allowed_hosts("api.example, Proxy.Local", "127.0.0.1", keys_on=False) == {"api.example", "proxy.local"}
    assert allowed_hosts("*", "127.0.0.1", keys_on=False) is None


@pytest.mark.parametrize("headers,status,code", [
    ({"host": "127.0.0.1:8000"}, 200, None),
    ({"host": "localhost"}, 200, None),
    ({"host": "[::1]:8000"}, 200, None),
    ({"host": "127.0.0.2:8000"}, 200, None),  # all of 127/8 is loopback
    ({"host": "evil.example:8000"}, 403, "host_not_allowed"),  # DNS rebinding: the page's own name
    ({"host": "127.0.0.1.evil.example"}, 403, "host_not_allowed"),
    ({"host": "localhost", "origin": "https://evil.example"}, 403, "origin_not_allowed"),  # a cross-site post
    ({"host": "localhost", "origin": "null"}, 403, "origin_not_allowed"),  # a sandboxed page
    ({"host": "localhost", "origin": "http://localhost:3000"}, 200, None),
])
def test_a_loopback_server_answers_only_loopback_hosts_and_origins(headers: dict, status: int, code: str) -> None:
    c = TestClient(Edge(Held(), hosts=LOOPBACK_NAMES, max_in_flight=8))  # no lifespan: the app has none
    r = c.post("/v1/chat/completions", headers=headers, content=b"{}")
    assert r.status_code == status
    if code is not None:
        assert r.json()["error"]["code"] == code


def test_named_hosts_are_answered_and_others_refused() -> None:
    c = TestClient(Edge(Held(), hosts={"api.example"}, max_in_flight=8))
    assert c.get("/v1/models", headers={"host": "api.example"}).status_code == 200
    assert c.get("/v1/models", headers={"host": "localhost"}).status_code == 403


@pytest.mark.anyio
async def test_past_the_cap_requests_get_503_and_health_still_answers() -> None:
    import httpx

    app = Held()
    edge = Edge(app, hosts=None, max_in_flight=2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=edge), base_url="http://t") as c:
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(c.get, "/slow")
            while app.started < 2:
                await anyio.sleep(0.01)
            busy = await c.get("/v1/models")
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "overloaded"
            assert busy.headers["retry-after"]
            for path in ("/health", "/ready", "/metrics"):
                assert (await c.get(path)).status_code == 200
            assert edge.in_flight == 2
            app.go.set()
        assert edge.in_flight == 0
        assert (await c.get("/v1/models")).status_code == 200
