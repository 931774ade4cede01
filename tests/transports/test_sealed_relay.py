"""A relay on the path of a transport connection (FAILURES 22, invariant 9): it forwards the
handshake unchanged, so the two ends authenticate each other through it, and then it learns and
changes nothing. It sees no page byte, no record and no message in clear; whatever it does to any
message of either protocol (flip a bit, replay, reorder, drop, cut short) closes the connection
(with a log line naming the peer where a record failed its check), and nothing it did is accepted:
a push is reported landed only with exactly the source bytes in place."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
from tamper_relay import OPS, TO_CONNECTOR, TO_LISTENER, TamperingRelay, frame_namer, keylog_in_use
from transport_harness import Pair, page_bytes, paired

from kvfence.transports.base import EndpointInfo, PairingRefused, TransferResult
from kvfence.transports.onesided.wire import Message
from kvfence.transports.tcp.wire import Frame

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("keylog")]
KEEPALIVE_S = 0.4  # pings follow soon after any message, so a dropped or held last record is noticed
HANDSHAKE_S = 1.0  # a pairing message dropped or held has no ping after it: the pairing times out
NOTICED = ("failed authentication", "did not finish", "silent for")  # how an end says it closed
PROTOCOLS = {"tcp": Frame, "nixl": Message, "mooncake": Message}


@asynccontextmanager
async def relayed(transport: str, *tampering: str) -> AsyncIterator[tuple[Pair, TamperingRelay]]:
    """An unpaired pair of `transport` and a relay in front of its receiver; `tampering`:
    TamperingRelay's (kind, op, direction)."""
    async with paired(transport, pair=False, keepalive_s=KEEPALIVE_S, handshake_timeout_s=HANDSHAKE_S) as p:
        with TamperingRelay(p.rx_info.address, keylog_in_use(), transport, frame_namer(PROTOCOLS[transport]),
                            *tampering) as relay:
            yield p, relay


async def relayed_push(p: Pair, relay: TamperingRelay) -> tuple[bool, TransferResult | None, TransferResult | None]:
    """Pair through the relay and push pages 0-1 into 2-3: (paired, the sender's result, the
    receiver's verdict; None where there is none within a few seconds)."""
    try:
        p.peer = await p.tx.pair(EndpointInfo(p.kind, relay.address, p.rx_info.record))
    except (PairingRefused, ConnectionError, TimeoutError):
        return False, None, None
    with anyio.fail_after(10):
        manifest, result = await p.expect_and_push([0, 1], [2, 3])
    verdict = None
    with anyio.move_on_after(3):
        verdict = await p.rx.completion(manifest.transfer_id)
    return True, result, verdict


async def test_a_relay_that_forwards_the_handshake_reads_nothing_and_the_push_lands() -> None:
    async with relayed("tcp") as (p, relay):
        was_paired, result, verdict = await relayed_push(p, relay)
        assert was_paired and result is not None and result.ok and verdict is not None and verdict.ok
        p.assert_landed([0, 1], [2, 3])
        await anyio.sleep(3 * KEEPALIVE_S)  # a healthy relayed connection stays up
        assert await p.tx.health() and await p.rx.health()
        assert {"Hello", "PushHeader", "Page", "page bytes", "PushEnd", "Ping"} <= set(relay.names[TO_LISTENER])
        assert {"HelloReply", "Verdict", "Ping"} <= set(relay.names[TO_CONNECTOR])
        seen = bytes(relay.wire[TO_LISTENER] + relay.wire[TO_CONNECTOR])
        for page in (0, 1):  # not a 32-byte run of a page in clear
            sent = page_bytes(p.src, page).numpy().tobytes()
            assert not any(sent[i:i + 32] in seen for i in range(0, len(sent), 512))
        assert p.rx_info.record.model.encode() not in seen and p.rx_info.record.incarnation.encode() not in seen


CASES = [(TO_LISTENER, kind) for kind in ("Hello", "PushHeader", "Page", "page bytes", "PushEnd", "Ping")] + \
        [(TO_CONNECTOR, kind) for kind in ("HelloReply", "Verdict", "Ping")]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("direction", "kind"), CASES)
async def test_whatever_a_relay_does_to_a_tcp_message_closes_the_connection(direction: str, kind: str, op: str,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    await tampered_session("tcp", direction, kind, op, caplog)


ONESIDED_CASES = [("nixl", TO_LISTENER, kind) for kind in ("Hello", "PushHeader", "Ping")] + \
                 [("nixl", TO_CONNECTOR, kind) for kind in ("HelloReply", "Go", "Verdict", "Ping")] + \
                 [("mooncake", TO_LISTENER, "Landed")]  # nixl's plane notifies the landing itself


@pytest.mark.parametrize("op", ["flip", "replay", "drop"])
@pytest.mark.parametrize(("transport", "direction", "kind"), ONESIDED_CASES)
async def test_whatever_a_relay_does_to_a_one_sided_control_message_closes_the_link(
        transport: str, direction: str, kind: str, op: str, caplog: pytest.LogCaptureFixture) -> None:
    await tampered_session(transport, direction, kind, op, caplog)


async def tampered_session(transport: str, direction: str, kind: str, op: str,
                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with relayed(transport, kind, op, direction) as (p, relay):
        was_paired, result, verdict = await relayed_push(p, relay)
        with anyio.fail_after(10):
            while not relay.tampered.is_set():
                await anyio.sleep(0.02)
            while was_paired and await p.tx.health():  # the connection is closed by an end
                await anyio.sleep(0.02)
        if result is not None and result.ok:  # the tampering came after the verdict reached the sender
            assert verdict is not None and verdict.ok
        if verdict is not None and verdict.ok:  # accepted: exactly the source bytes
            p.assert_landed([0, 1], [2, 3])
        if op != "truncate":  # an end says it closed the connection, naming the relay as it sees it
            assert any(any(n in r.getMessage() for n in NOTICED) and
                       (relay.upstream_local in r.getMessage() or relay.address in r.getMessage())
                       for r in caplog.records), [r.getMessage() for r in caplog.records]
