"""The hostile kinds of scripts/soak.py: grammar bombs, dead-end grammars, fan-out past the budget
and half-sent bodies, each with the refusal it must get."""

from __future__ import annotations

import asyncio
import random
import socket
from typing import TYPE_CHECKING

import httpx
from local_server import MODEL, error_code

if TYPE_CHECKING:
    from soak import Outcome, Soak

BODY_TIMEOUT_S = 3.0
BOMBS = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {
        "type": "string", "pattern": "a{20000}"}}}},
    {"tools": [{"type": "function", "function": {"name": f"f{i}",
                                                 "parameters": {"type": "string", "pattern": "a{20000}"}}}
               for i in range(20)], "tool_choice": "none"},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {"anyOf": [  # ~15 s to
        {"type": "string", "pattern": "([a-z]{200}){%d}" % (200 + i)} for i in range(40)]}}}},  # compile: the budget
]
DEAD_END = {"type": "json_schema", "json_schema": {"name": "d", "schema": {"type": "string", "pattern": "[^\\s\\S]"}}}


async def refused_as(http: httpx.AsyncClient, body: dict, out: Outcome, status: int, code: str) -> None:
    r = await http.post("/v1/chat/completions", json=body)
    out.status, out.code = r.status_code, error_code(r)
    if (r.status_code, out.code) != (status, code) and not (out.status in (429, 503) and out.code == "overloaded"):
        out.problem = f"expected {status} {code}, got {r.status_code} {out.code}"


async def bomb(soak: Soak, http: httpx.AsyncClient, rng: random.Random, out: Outcome) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **rng.choice(BOMBS)}
    await refused_as(http, body, out, 400, "grammar_too_complex")


async def dead_end(soak: Soak, http: httpx.AsyncClient, rng: random.Random, out: Outcome) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Say something."}],
            "response_format": DEAD_END}
    r = await http.post("/v1/chat/completions", json=body)
    out.status, out.code = r.status_code, error_code(r)
    if out.code == "kv_transfer_failed":
        out.faulted = True  # an injected fault ended it first
    elif (r.status_code, out.code) != (400, "grammar_dead_end") and out.code != "overloaded":
        out.problem = f"a dead-end grammar got {r.status_code} {out.code}"


async def fan_out(soak: Soak, http: httpx.AsyncClient, rng: random.Random, out: Outcome) -> None:
    body = {"model": MODEL, "n": 128, "logprobs": True, "top_logprobs": 20,
            "messages": [{"role": "user", "content": "hi"}]}
    await refused_as(http, body, out, 400, "response_too_large")


def auth_header(soak: Soak) -> bytes:
    return f"Authorization: Bearer {soak.key}\r\n".encode() if soak.key else b""


async def slow_body(soak: Soak, http: httpx.AsyncClient, rng: random.Random, out: Outcome) -> None:
    host, port = soak.url.removeprefix("http://").rsplit(":", 1)

    def send_half() -> bytes:
        with socket.create_connection((host, int(port)), timeout=BODY_TIMEOUT_S * 4) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      + auth_header(soak) + b"Content-Length: 1000\r\n\r\n{\"model\": \"")  # and nothing more
            return s.recv(4096)

    reply = await asyncio.to_thread(send_half)
    status = reply.split(b" ", 2)[1] if reply.startswith(b"HTTP/1.1 ") else b""
    out.status = int(status) if status.isdigit() else None
    out.code = "request_timeout" if b"request_timeout" in reply else None
    if out.status != 408:
        out.problem = f"a half-sent body got {reply[:40]!r} instead of 408"
