"""TCP specifics: what a raw client sees on the wire, and robustness to junk."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import anyio
import msgspec
import pytest
import torch
from transport_harness import (TEST_FRONT, TEST_SECRET, make_manifest, make_record, page_bytes, paired,
                               raw_authenticate, raw_listen_authenticated,
                               recv_until_closed)

from kvfence.transports.base import EndpointInfo, PairingRefused
from kvfence.transports.tcp.transport import TcpTransport
from kvfence.transports.tcp.wire import Frame
from kvfence.transports.wire.channel import split_address
from kvfence.transports.wire.framing import LEN_SIZE, decode_frame, encode_frame, frame_length
from kvfence.transports.wire.messages import Hello, HelloReply

pytestmark = pytest.mark.anyio


def raw_exchange(address: str, payload: bytes, authenticate: bool = False) -> bytes:
    """Blocking helper (run in a thread): authenticate first (as a deployment member) if asked,
    send payload, read until the server closes."""
    with socket.create_connection(split_address(address), timeout=5) as s:
        if not authenticate:
            s.sendall(payload)
            return recv_until_closed(s)
        sealed = raw_authenticate(s)
        sealed.sendall(payload)
        return sealed.recv_until_closed()


async def test_listener_refuses_a_foreign_transport_and_hangs_up() -> None:
    async with paired("tcp", pair=False) as p:
        hello = Hello(EndpointInfo("carrier-pigeon", "nowhere:1", make_record()))
        reply_bytes = await anyio.to_thread.run_sync(raw_exchange, p.rx_info.address, encode_frame(hello), True)
        n = frame_length(reply_bytes[:LEN_SIZE])
        reply = decode_frame(reply_bytes[LEN_SIZE:LEN_SIZE + n], Frame)
        assert isinstance(reply, HelloReply) and not reply.accepted
        assert "transport" in reply.reason and reply.info == p.rx_info
        assert len(reply_bytes) == LEN_SIZE + n  # nothing after the refusal: the connection closed


async def test_junk_is_dropped_and_the_endpoint_keeps_serving() -> None:
    async with paired("tcp", pair=False) as p:
        junk = b"\x00\x00\x00\x05hello" + bytes(64)  # as long as a handshake opening, but not one
        assert await anyio.to_thread.run_sync(raw_exchange, p.rx_info.address, junk) == b""
        after_auth = b"\x00\x00\x00\x05hello"  # an authenticated peer that sends junk is dropped too
        assert await anyio.to_thread.run_sync(raw_exchange, p.rx_info.address, after_auth, True) == b""
        assert await p.rx.health()
        peer = await p.tx.pair(p.rx_info)
        p.peer = peer
        _, result = await p.expect_and_push([0], [0])
        assert result.ok, result


def test_split_address() -> None:
    assert split_address("127.0.0.1:80") == ("127.0.0.1", 80)
    assert split_address("[::1]:9") == ("::1", 9)
    with pytest.raises(ValueError):
        split_address("localhost")


async def test_push_cancelled_while_queued_behind_another_notifies_the_receiver() -> None:
    async with paired("tcp", page_floats=1 << 18) as p:  # 32 x 1 MiB: the first push holds the line
        big, small = make_manifest(31), make_manifest(1)
        big = p.arm(big, list(range(31)))
        results: dict[str, object] = {}

        async def push(name: str, manifest, pages: list[int]) -> None:  # type: ignore[no-untyped-def]
            results[name] = await p.tx.push(p.peer, manifest, pages, pages)

        async with anyio.create_task_group() as tg:
            tg.start_soon(push, "big", big, list(range(31)))
            with anyio.fail_after(10):
                while not page_bytes(p.dst, 0).any():
                    await anyio.sleep(0)
            small = p.arm(small, [31])
            tg.start_soon(push, "small", small, [0])
            await anyio.sleep(0)
            assert not page_bytes(p.dst, 31).any()
            assert await p.tx.cancel(small.transfer_id) is True
        assert results["big"].ok, results["big"]
        assert results["small"].reason == "cancelled"
        assert (await p.rx.completion(small.transfer_id)).reason == "cancelled"
        p.assert_landed(list(range(31)), list(range(31)))


def fake_listener(reply_info: EndpointInfo) -> tuple[socket.socket, Callable[[], None]]:
    """A listener that accepts any Hello and answers 'accepted' with `reply_info` (a liar)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve_one() -> None:
        conn, _ = listener.accept()
        with conn:
            sealed = raw_listen_authenticated(conn)
            sealed.recv_record()  # the Hello
            sealed.sendall(encode_frame(HelloReply(accepted=True, reason="", info=reply_info)))
            conn.recv(1)  # until the client hangs up

    return listener, serve_one


@pytest.mark.parametrize("lie", ["dtype", "incarnation"])
async def test_the_connecting_side_checks_the_reply_too(lie: str) -> None:
    async with paired("tcp", pair=False) as p:
        told = make_record()
        actual = make_record(dtype="bfloat16") if lie == "dtype" else make_record(incarnation="other")
        listener, serve_one = fake_listener(EndpointInfo("tcp", "x:1", actual))
        with listener:
            address = f"127.0.0.1:{listener.getsockname()[1]}"
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, serve_one)
                with pytest.raises(PairingRefused, match=lie):
                    await p.tx.pair(EndpointInfo("tcp", address, told if lie == "dtype" else
                                                 msgspec.structs.replace(actual, incarnation="told")))


async def test_a_failed_start_leaves_no_listener_behind() -> None:
    fds = len(os.listdir("/proc/self/fd"))
    async with anyio.create_task_group() as finished:
        pass
    transport = TcpTransport(secret=TEST_SECRET, front_key=TEST_FRONT.public)
    with pytest.raises(RuntimeError):
        await transport.start(finished, torch.zeros(4, 1024), make_record())
    assert len(os.listdir("/proc/self/fd")) == fds
    await transport.aclose()
