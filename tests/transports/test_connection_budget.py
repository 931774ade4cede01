"""Budgets of a transport's listening socket before and after authentication (pending.py):
connections that never speak cost the endpoint no more than a socket each, the oldest of them is
closed to make room for a new one, and they are counted apart from the paired links, so a flood
of them never stops a pairing or a push; authenticated connections have a cap of their own."""

from __future__ import annotations

import socket

import anyio
import pytest
from flood import FLOOD, connect, enough_descriptors
from transport_harness import LISTENING, paired, raw_authenticate, recv_until_closed

pytestmark = pytest.mark.anyio
@pytest.mark.parametrize("kind", LISTENING)
async def test_a_thousand_silent_connections_stop_no_pairing_and_no_push(kind: str) -> None:
    enough_descriptors(FLOOD)
    async with paired(kind) as p:  # a pair formed before the flood keeps pushing through it
        flood: list[socket.socket] = []
        try:
            for _ in range(FLOOD):
                flood.append(await anyio.to_thread.run_sync(connect, p.rx_info.address))
            _, result = await p.expect_and_push([0, 1], [2, 3])
            assert result.ok, result
            p.assert_landed([0, 1], [2, 3])
            peer = await p.tx.pair(p.rx_info)  # and a new pairing goes through it
            p.peer = peer
            _, result = await p.expect_and_push([4], [5])
            assert result.ok, result
            p.assert_landed([0, 1, 4], [2, 3, 5])
            assert len(p.rx._unauthenticated) <= p.rx._unauthenticated.cap
            assert p.rx._unauthenticated.evicted >= FLOOD - p.rx._unauthenticated.cap
        finally:
            for s in flood:
                s.close()


@pytest.mark.parametrize("kind", LISTENING)
async def test_one_connection_past_the_unauthenticated_cap_closes_the_oldest(kind: str) -> None:
    async with paired(kind, pair=False, max_unauthenticated=2, handshake_timeout_s=30.0) as p:
        oldest, second = [await anyio.to_thread.run_sync(connect, p.rx_info.address) for _ in range(2)]
        with anyio.fail_after(2):
            while len(p.rx._unauthenticated) < 2:
                await anyio.sleep(0.01)
        newest = await anyio.to_thread.run_sync(connect, p.rx_info.address)
        oldest.settimeout(2)  # closed at once, long before its handshake timeout
        with oldest, second, newest:
            assert await anyio.to_thread.run_sync(recv_until_closed, oldest) == b""
            p.peer = await p.tx.pair(p.rx_info)  # a member's handshake gets through the full budget
            _, result = await p.expect_and_push([1], [2])
            assert result.ok, result


@pytest.mark.parametrize("kind", LISTENING)
async def test_authenticated_connections_past_their_cap_are_closed_after_the_handshake(kind: str) -> None:
    async with paired(kind, max_connections=1) as p:  # the pair holds the only authenticated slot
        def another_member() -> bytes:
            with connect(p.rx_info.address) as s:
                s.settimeout(5)
                sealed = raw_authenticate(s, transport=kind.split("+")[0])
                return recv_until_closed(sealed.sock)

        assert await anyio.to_thread.run_sync(another_member) == b""
        _, result = await p.expect_and_push([1], [2])  # the pair is untouched
        assert result.ok, result
