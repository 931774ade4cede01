"""The HTTP edge, ahead of every route: which hosts the API answers to, and how many requests it
serves at once.

- Host and Origin. A server bound to loopback with API keys off trusts whoever can reach it, and
  a web page the operator opens can reach it: through DNS rebinding (a name of the page's that
  resolves to 127.0.0.1, so the browser sends `Host: evil.example`) or a cross-site form post
  (`Origin: https://evil.example`). So, with keys off and a loopback bind, a request whose Host
  or Origin names anything but a loopback address is refused with 403 before any route runs
  (`allowed_hosts` from `--allowed-hosts`: a deployment behind a proxy names the hosts it is
  reached by, or "*" for any). With keys on, a key is what a request needs; any host is answered.
- A cap on requests in flight (`--max-requests-in-flight`, streams included): past it, 503 with
  Retry-After, at once. /health, /ready and /metrics are never counted or refused by the cap, so a
  load balancer always sees the truth. Hypercorn bounds the rest of a connection's life: its
  headers must arrive within the keep-alive timeout (5 s, the same timer that closes an idle
  connection); a body must arrive in full within `--body-timeout` (app/api/request_body.py).
  (Hypercorn's own read timeout is left off: it would also close a stream whose client, as every
  client does, sends nothing while it reads.)
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from kvfence.app.api.http_errors import error_response
from kvfence.scheduler.core.errors import RequestError, overloaded

ALWAYS_ANSWERED = frozenset({"/health", "/ready", "/metrics"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(setting: str | None, bind_host: str, keys_on: bool) -> frozenset[str] | None:
    """The host names requests may name (None: any). `setting`: `--allowed-hosts` (comma-separated
    names, "*" for any); unset, loopback names when keys are off and the bind is loopback, else any."""
    if setting is not None:
        names = {n.strip().lower() for n in setting.split(",") if n.strip()}
        return None if "*" in names else frozenset(names)
    if not keys_on and is_loopback(bind_host):
        return LOOPBACK_NAMES
    return None


def _hostname(value: str) -> str:
    """The host of a Host header value or an origin, without port or brackets, lowercased."""
    netloc = urlsplit(value).netloc if "://" in value else value
    host = urlsplit(f"//{netloc}").hostname
    return (host or "").lower()


class Edge:
    """ASGI middleware: the Host/Origin check and the cap on requests in flight (module docstring)."""

    def __init__(self, app: ASGIApp, *, hosts: Iterable[str] | None, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.app = app
        self.hosts = None if hosts is None else frozenset(h.lower() for h in hosts)
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    def _host_refusal(self, scope: Scope) -> RequestError | None:
        if self.hosts is None:
            return None
        headers = dict(scope.get("headers") or [])
        host = _hostname(headers.get(b"host", b"").decode("latin-1"))
        if not self._allowed(host):
            return RequestError(403, "host_not_allowed", f"this server does not answer requests for host {host!r}; "
                                "it answers only for its loopback address unless --allowed-hosts names more")
        origin = headers.get(b"origin")
        if origin is not None and origin != b"null" and not self._allowed(_hostname(origin.decode("latin-1"))):
            return RequestError(403, "origin_not_allowed", "requests from a web page of another origin are refused: "
                                "this server answers only its own host unless --allowed-hosts names more")
        if origin == b"null":
            return RequestError(403, "origin_not_allowed", "requests from an opaque origin are refused")
        return None

    def _allowed(self, host: str) -> bool:
        assert self.hosts is not None
        return host in self.hosts or (self.hosts == LOOPBACK_NAMES and is_loopback(host))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._host_refusal(scope)
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        if scope["path"] in ALWAYS_ANSWERED:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_in_flight:
            busy = overloaded(f"this server is serving {self.in_flight} requests, its limit; retry shortly")
            await error_response(busy)(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
