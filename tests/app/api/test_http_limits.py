"""Input limits and slow clients against the real server on a real socket (a tiny model, so it
starts in seconds): oversized bodies get 413 before they are sent, huge prompts get their 400,
unsupported fields are refused by name, and a client that stops reading its stream is ended at
the stall timeout (FAILURES 27) while other requests are served; pages always come back.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_process import ServerProcess, serving

# Every stream chunk carries the model name. A long one makes each chunk ~60 KB, so the socket
# buffers between a non-reading client and the server (the kernel grows the server's send buffer
# to about 4 MB on loopback) fill after a hundred chunks or so, not tens of thousands.
MODEL = "tiny-" + "m" * 60_000
STALL_TIMEOUT_S = 1
MiB = 1 << 20
DEFAULT_MAX_BODY_BYTES = 16 * MiB


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from tiny_models import TinySpec, make_tiny_pair

    gguf_path, _, _ = make_tiny_pair(tmp_path_factory.mktemp("tiny"), seed=3, spec=TinySpec(context_length=8192))
    srv = ServerProcess(gguf_path, "--served-model-name", MODEL, "--canary-interval", "3600",
                        "--stall-timeout", str(STALL_TIMEOUT_S),
                        log_path=tmp_path_factory.mktemp("server") / "server.log")
    yield from serving(srv)


def until(predicate, timeout_s: float = 120, what: str = "") -> None:  # type: ignore[no-untyped-def]
    """Poll until `predicate()` holds; the bound only keeps a broken server from hanging the run."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def metric(srv: ServerProcess, name: str, **labels: str) -> float:
    try:
        return srv.metric(name, **labels)
    except KeyError:  # a labelled counter appears with its first increment
        return 0.0


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c
    until(lambda: not any(server.pages_in_use().values()), 10, "pages back to baseline")
    assert httpx.get(server.base_url + "/health", timeout=10).json() == {"status": "ok"}


def raw_request(srv: ServerProcess, path: str, headers: dict[str, str], rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # before connect, so the window the server sees is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", srv.port))
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(head.encode() + b"\r\n")
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before the response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-response"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def assert_envelope(body: bytes, param: str | None, code: str) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and (error["param"], error["code"]) == (param, code)
    return error


def completion(text: str, max_tokens: int = 24, **fields: object) -> dict:
    return {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "extra_body": {"ignore_eos": True}, **fields}


# ---- bodies ------------------------------------------------------------------------------------


def test_a_64_mib_body_gets_its_413_while_most_of_it_is_still_unsent(server: ServerProcess) -> None:
    declared = 64 * MiB
    sock = raw_request(server, "/v1/completions", {"Content-Length": str(declared)})
    try:
        sent = 0
        sock.sendall(b'{"model": "tiny", "prompt": "' + b"x" * MiB)  # never parsed: refused first
        sent += MiB + 29
        status, headers, body = read_response(sock)  # answered while 63 MiB are still unsent
        assert sent < declared // 32
        assert status == 413 and headers["connection"] == "close"
        error = assert_envelope(body, None, "request_too_large")
        assert str(declared) in error["message"] and str(DEFAULT_MAX_BODY_BYTES) in error["message"]
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200  # meanwhile
    finally:
        sock.close()


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(server: ServerProcess) -> None:
    sock = raw_request(server, "/v1/completions", {"Transfer-Encoding": "chunked"})
    try:
        piece = b"x" * MiB
        for _ in range(DEFAULT_MAX_BODY_BYTES // MiB + 1):  # one chunk past the limit, and no end chunk
            sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
        status, _, body = read_response(sock)
        assert status == 413
        assert_envelope(body, None, "request_too_large")
    finally:
        sock.close()


def test_the_official_client_sees_the_413_of_a_64_mib_body_not_a_connection_error(
        client: openai.OpenAI) -> None:
    # It writes its whole body before it reads: the server drops what follows its 413 instead of
    # closing on it (a reset connection would be reported, and retried, as a connection error).
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="x" * (64 * MiB), max_tokens=4)
    assert info.value.status_code == 413
    assert info.value.body["code"] == "request_too_large"  # type: ignore[index]


# ---- prompts -----------------------------------------------------------------------------------


def test_huge_prompts_get_their_400_and_other_streams_carry_on(server: ServerProcess, client: openai.OpenAI) -> None:
    solo = client.completions.create(**completion("Once upon a time", max_tokens=32))
    results: dict[str, object] = {}

    def stream() -> None:
        chunks = client.completions.create(**completion("Once upon a time", max_tokens=32), stream=True)
        results["text"] = "".join(c.choices[0].text for c in chunks if c.choices)

    other = threading.Thread(target=stream)
    other.start()
    try:
        three_mb = "the quick brown fox " * (3 * MiB // 20)
        for call, param in ((lambda: client.completions.create(**completion(three_mb)), "prompt"),
                            (lambda: client.chat.completions.create(
                                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": three_mb}]),
                             "messages"),
                            (lambda: client.completions.create(**completion("ab1 " * 20_000)), "prompt")):
            with pytest.raises(openai.BadRequestError) as info:
                call()
            assert info.value.status_code == 400
            body = info.value.body
            assert (body["param"], body["code"]) == (param, "context_length_exceeded")  # type: ignore[index]
            assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    finally:
        other.join(120)
    assert results["text"] == solo.choices[0].text  # the stream beside them is unaffected


def test_unsupported_fields_are_refused_by_name_and_the_default_call_is_served(client: openai.OpenAI) -> None:
    for fields, param in (({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
                          # tool_choice "auto", the default with tools: this model's template renders no tools
                          ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool_choice"),
                          ({"extra_body": {"best_of": 2}}, "best_of"), ({"extra_body": {"min_tokens": 3}}, "min_tokens")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           **fields)  # type: ignore[arg-type]
        body = info.value.body
        assert (body["param"], body["code"]) == (param, "unsupported_value")  # type: ignore[index]
    for fields, param in (({"stop": ["x" * 300]}, "stop"), ({"temperature": 2.5}, "temperature"),
                          ({"extra_body": {"stop_token_ids": list(range(100))}}, "stop_token_ids")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           **fields)  # type: ignore[arg-type]
        body = info.value.body
        assert (body["param"], body["code"]) == (param, "invalid_value")  # type: ignore[index]
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           n=1, presence_penalty=0, logprobs=False)
    assert plain.choices[0].finish_reason in ("stop", "length") and plain.usage.completion_tokens >= 1


# ---- slow clients (FAILURES 27) ------------------------------------------------------------------


def test_a_client_that_stops_reading_is_ended_at_the_stall_timeout_and_others_are_served(
        server: ServerProcess, client: openai.OpenAI) -> None:
    solo = client.completions.create(**completion("hello there", max_tokens=64))
    aborted, lengths = metric(server, "kvfence_requests_total", tenant="anonymous", status="aborted"), \
        metric(server, "kvfence_requests_total", tenant="anonymous", status="length")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8000,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    stalled = raw_request(server, "/v1/chat/completions", {"Content-Length": str(len(body))}, rcvbuf=4096)
    try:
        stalled.sendall(body)  # and never reads a byte
        until(lambda: metric(server, "kvfence_requests_running") >= 1, what="the stalled request to run")
        # Served while the non-reading stream is in flight, token for token as when alone.
        beside = client.completions.create(**completion("hello there", max_tokens=64), stream=True)
        assert "".join(c.choices[0].text for c in beside if c.choices) == solo.choices[0].text
        until(lambda: metric(server, "kvfence_requests_total", tenant="anonymous", status="aborted") == aborted + 1,
              what="the stall timeout to end the request")
        until(lambda: not any(server.pages_in_use().values()), 10, "its pages to come back")
        assert metric(server, "kvfence_requests_total", tenant="anonymous", status="length") == lengths + 1  # only the one beside
        assert f"the client read nothing for {STALL_TIMEOUT_S:g} s; aborting it" in server.log()
        after = client.completions.create(**completion("hello there", max_tokens=64))
        assert after.choices[0].text == solo.choices[0].text
    finally:
        stalled.close()
