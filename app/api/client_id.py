"""A client's own request id (`X-Request-Id`), echoed and logged, never used inside.

The server mints the ids it works with (invariant 6); a client's id only helps it find its
request in the server's logs. `EchoRequestId` (ASGI middleware) reads the header, keeps it in the
request's state when it is a plain token (1-128 visible ASCII characters; anything else is
dropped, so nothing a client sends can forge a log line), and adds it to the response's headers.
"""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_TOKEN = re.compile(rb"[!-~]{1,128}")


def client_request_id(request: Request) -> str | None:
    """The client's id of this request (None when it sent none, or one that is not a plain token)."""
    value = request.scope.get("state", {}).get("client_request_id")
    return value if isinstance(value, str) else None


class EchoRequestId:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        value = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        if value is None or not _TOKEN.fullmatch(value):
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["client_request_id"] = value.decode("ascii")

        async def send_echoing(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", value)]}
            await send(message)

        await self.app(scope, receive, send_echoing)
