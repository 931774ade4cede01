"""Bounded request bodies at the ASGI level: what is read, when the 413 goes out, and the bounded
drain after it. (Against a real socket: tests/app/api/test_http_limits.py.)"""

from __future__ import annotations

import json

import anyio
import pytest
from starlette.requests import ClientDisconnect, Request

from kvfence.app.api import request_body
from kvfence.app.api.request_body import BodyRefusal, RefusedBody, read_body

LIMIT = 1000


class Client:
    """The client side of one request: its body messages, and a record of what was taken when."""

    def __init__(self, chunks: list[bytes], *, ends: bool = True, headers: list[tuple[bytes, bytes]] | None = None):
        self.messages = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
        if ends:
            self.messages.append({"type": "http.request", "body": b"", "more_body": False})
        self.taken = 0
        self.sent: list[tuple[int, dict]] = []  # (body messages taken when it was sent, message)
        self.scope = {"type": "http", "method": "POST", "path": "/", "headers": headers or []}

    async def receive(self) -> dict:
        if self.taken < len(self.messages):
            self.taken += 1
            return self.messages[self.taken - 1]
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(self, message: dict) -> None:
        self.sent.append((self.taken, message))


async def read(client: Client) -> bytes:
    return await read_body(Request(client.scope, client.receive), LIMIT)


def test_a_body_within_the_limit_is_read_whole() -> None:
    client = Client([b"a" * 600, b"b" * 400])
    assert anyio.run(read, client) == b"a" * 600 + b"b" * 400


def test_a_declared_length_over_the_limit_is_refused_before_anything_is_read() -> None:
    client = Client([b"x" * 600] * 4, headers=[(b"content-length", b"2400")])
    with pytest.raises(RefusedBody) as info:
        anyio.run(read, client)
    assert client.taken == 0 and not info.value.body_ended
    assert (info.value.error.status, info.value.error.code) == (413, "request_too_large")
    assert "2400 bytes" in info.value.error.message


def test_a_chunked_body_is_refused_at_the_chunk_that_passes_the_limit() -> None:
    client = Client([b"x" * 600] * 5)
    with pytest.raises(RefusedBody) as info:
        anyio.run(read, client)
    assert client.taken == 2 and not info.value.body_ended


def test_the_413_goes_out_complete_before_the_rest_is_drained_then_the_response_ends() -> None:
    client = Client([b"x" * 600] * 5)

    async def main() -> None:
        try:
            await read(client)
        except RefusedBody as refused:
            await BodyRefusal(refused)(client.scope, client.receive, client.send)

    anyio.run(main)
    (taken0, start), (taken1, body), (taken2, end) = client.sent
    assert (taken0, taken1) == (2, 2)  # status, headers and the whole body before anything more was read
    assert start["status"] == 413 and (b"connection", b"close") in start["headers"]
    assert dict(start["headers"])[b"content-length"] == str(len(body["body"])).encode()
    assert json.loads(body["body"])["error"]["code"] == "request_too_large" and body["more_body"]
    assert taken2 == len(client.messages) and end == {"type": "http.response.body", "body": b"", "more_body": False}


def test_a_body_already_complete_is_not_drained() -> None:
    client = Client([b"x" * 1500])  # one chunk then the end: nothing left to read

    async def main() -> None:
        with anyio.fail_after(5):
            try:
                await read(client)
            except RefusedBody as refused:
                assert not refused.body_ended  # the end comes in its own message here
                await BodyRefusal(refused)(client.scope, client.receive, client.send)

    anyio.run(main)
    whole = Client([])
    whole.messages = [{"type": "http.request", "body": b"x" * 1500, "more_body": False}]

    async def whole_body() -> None:
        with anyio.fail_after(5):
            try:
                await read(whole)
            except RefusedBody as refused:
                assert refused.body_ended
                await BodyRefusal(refused)(whole.scope, whole.receive, whole.send)

    anyio.run(whole_body)
    assert [m["more_body"] for _, m in whole.sent[1:]] == [False]  # complete at once, no drain


def test_the_drain_is_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_body, "LINGER_BYTES", 3000)
    client = Client([b"x" * 600] * 100, ends=False)

    async def main() -> None:
        with anyio.fail_after(5):
            try:
                await read(client)
            except RefusedBody as refused:
                await BodyRefusal(refused)(client.scope, client.receive, client.send)

    anyio.run(main)
    assert client.taken < 10 and client.sent[-1][1]["more_body"] is False


def test_the_drain_is_bounded_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_body, "LINGER_S", 0.05)
    client = Client([b"x" * 600] * 2, ends=False)  # then the client sends nothing more

    async def main() -> None:
        with anyio.fail_after(5):
            try:
                await read(client)
            except RefusedBody as refused:
                await BodyRefusal(refused)(client.scope, client.receive, client.send)

    anyio.run(main)
    assert client.sent[-1][1]["more_body"] is False


def test_a_client_that_leaves_mid_body_is_a_disconnect() -> None:
    client = Client([b"x" * 100], ends=False)
    client.messages.append({"type": "http.disconnect"})
    with pytest.raises(ClientDisconnect):
        anyio.run(read, client)


def test_a_body_that_does_not_arrive_in_time_is_408() -> None:
    client = Client([b"x" * 100], ends=False)  # half sent, then nothing

    async def slow() -> bytes:
        return await read_body(Request(client.scope, client.receive), LIMIT, timeout_s=0.1)

    with pytest.raises(RefusedBody) as info:
        anyio.run(slow)
    assert (info.value.error.status, info.value.error.code) == (408, "request_timeout")
    assert not info.value.body_ended


def test_bodies_being_received_share_one_budget_and_give_it_back() -> None:
    budget = request_body.BodyBudget(1500)
    first, second = Client([b"a" * 600, b"b" * 400], ends=False), Client([b"c" * 600])

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_body, Request(first.scope, first.receive), LIMIT, budget)  # holds 1000 bytes, waits
            await anyio.sleep(0.05)
            assert budget.held == 1000
            with pytest.raises(RefusedBody) as info:
                await read_body(Request(second.scope, second.receive), LIMIT, budget)
            assert (info.value.error.status, info.value.error.code) == (503, "overloaded")
            assert info.value.error.retry_after_s is not None
            tg.cancel_scope.cancel()
        assert budget.held == 0  # the cancelled read gave its bytes back too

    anyio.run(run)
