"""Reading a request body under a size limit, a time limit and a shared memory budget, and
refusing one past them without reading the rest.

A body longer than `max_bytes` is refused before it is read past the limit: at once when its
Content-Length says so, otherwise as soon as the chunks received pass the limit (chunked bodies);
nothing past the limit is ever kept.

Hypercorn puts no limit on a body of its own (`h11_max_incomplete_size`, 16 KiB, bounds only the
request line and headers): it holds at most `max_app_queue_size` (10) chunks of up to 64 KiB
ahead of what the app has read and stops reading the socket meanwhile. So this limit is what a
client sees, and an unread body costs the server nothing but those chunks.

A body must also arrive in full within `timeout_s` (else 408 `request_timeout`: a client that
trickles its body holds nothing longer than that), and the bytes of every body being received
are counted against one `BodyBudget` (16 times --max-body-bytes): a body that would take it past
that gets 503 with Retry-After, so many connections holding half-sent bodies cannot make the
server hold gigabytes.

How the 413 is sent (and the 408 and 503 of a body, the same way): a client that writes its
whole body before it reads (httpx, requests, the openai client) never sees a response the server
sends and then closes on, because closing with unread bytes makes the kernel reset the
connection; it reports a connection error instead, and the openai client retries those.
Hypercorn closes the connection as soon as a response to a request with an unfinished body is
complete. So `BodyRefusal` sends the whole 413 at once
(headers with `Content-Length` and `Connection: close`, then the body: a client that reads sees
the complete response immediately), then reads and drops what the client is still sending, for
at most `LINGER_S` seconds and `LINGER_BYTES` bytes (a lingering close, as nginx does), and only
then ends the response, which lets hypercorn close the connection.
"""

from __future__ import annotations

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvfence.app.api.http_errors import body_too_large, error_response
from kvfence.scheduler.core.errors import RequestError, overloaded

LINGER_S = 10.0  # longest a refused body is drained after its 413
LINGER_BYTES = 256 << 20  # most bytes of a refused body drained after its 413


class BodyBudget:
    """The bytes of request bodies being received, over every request, and their limit."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.held = max_bytes, 0

    def take(self, n: int) -> bool:
        if self.held + n > self.max_bytes:
            return False
        self.held += n
        return True

    def give_back(self, n: int) -> None:
        self.held -= n


class RefusedBody(Exception):
    """The body is over the limit; `error` is the 413 to send (through `BodyRefusal`), and
    `body_ended` says whether the client has sent all of it already (nothing left to drain)."""

    def __init__(self, error: RequestError, body_ended: bool) -> None:
        super().__init__(error.message)
        self.error, self.body_ended = error, body_ended


async def read_body(request: Request, max_bytes: int, budget: BodyBudget | None = None,
                    timeout_s: float | None = None) -> bytes:
    """The whole body, or `RefusedBody` as soon as it is known to be longer than `max_bytes`
    (from Content-Length before anything is read, else while the chunks arrive), when it has not
    arrived in full within `timeout_s` (408), or when holding it would take `budget` past its
    limit (503); starlette's `ClientDisconnect` when the client leaves first. What it held of
    `budget` is given back when it returns."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:  # h11 refuses a malformed one itself
        raise RefusedBody(body_too_large(max_bytes, int(declared)), body_ended=False)
    chunks: list[bytes] = []
    received, held, more = 0, 0, True
    try:
        with anyio.fail_after(timeout_s):
            while True:
                message = await request.receive()
                if message["type"] != "http.request":
                    raise ClientDisconnect()
                chunk, more = message.get("body", b""), message.get("more_body", False)
                received += len(chunk)
                if received > max_bytes:
                    raise RefusedBody(body_too_large(max_bytes, None), body_ended=not more)
                if budget is not None:
                    if not budget.take(len(chunk)):
                        raise RefusedBody(overloaded("this server is receiving too many request bodies at once; "
                                                     "retry shortly"), body_ended=not more)
                    held += len(chunk)
                chunks.append(chunk)
                if not more:
                    return b"".join(chunks)
    except TimeoutError:
        raise RefusedBody(RequestError(408, "request_timeout", f"the request body did not arrive in full within "
                                       f"{timeout_s:g} s; send it without pausing"), body_ended=not more) from None
    finally:
        if budget is not None:
            budget.give_back(held)


class BodyRefusal(Response):
    """The 413 (or 408, 503) of a refused body: the complete response at once, then a bounded drain of the
    rest of the body (see the module docstring), then the end of the response."""

    def __init__(self, refused: RefusedBody) -> None:
        base = error_response(refused.error)
        super().__init__(base.body, status_code=base.status_code, media_type="application/json",
                         headers={"connection": "close"})
        self.body_ended = refused.body_ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": not self.body_ended})
        if self.body_ended:
            return
        with anyio.move_on_after(LINGER_S):
            await _drain(receive, LINGER_BYTES)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _drain(receive: Receive, max_bytes: int) -> None:
    """Read and drop request body chunks until the body ends, the client leaves, or `max_bytes`."""
    dropped = 0
    while dropped <= max_bytes:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        dropped += len(message.get("body", b""))
