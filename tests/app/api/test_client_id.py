"""X-Request-Id: a plain token is echoed (errors included) and readable by the handler; anything
else is dropped, never echoed or logged."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvfence.app.api.client_id import EchoRequestId, client_request_id

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def handler(request: Request) -> JSONResponse:
    return JSONResponse({"seen": client_request_id(request)}, status_code=int(request.query_params.get("s", 200)))


APP = Starlette(routes=[Route("/", handler)], middleware=[Middleware(EchoRequestId)])


async def get(headers: dict[str, str | bytes], status: int = 200) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=APP), base_url="http://t") as c:
        return await c.get(f"/?s={status}", headers=headers)


@pytest.mark.parametrize("status", [200, 400, 503])
async def test_a_plain_id_is_echoed_and_seen(status: int) -> None:
    r = await get({"X-Request-Id": "abc-123_XYZ"}, status)
    assert (r.status_code, r.headers["x-request-id"], r.json()["seen"]) == (status, "abc-123_XYZ", "abc-123_XYZ")


@pytest.mark.parametrize("value", [b"has space", b"x" * 129, b"tab\there", "café".encode()])
async def test_anything_else_is_dropped(value: bytes) -> None:
    r = await get({"X-Request-Id": value})
    assert "x-request-id" not in r.headers and r.json()["seen"] is None


async def test_no_id_no_header() -> None:
    r = await get({})
    assert "x-request-id" not in r.headers and r.json()["seen"] is None
