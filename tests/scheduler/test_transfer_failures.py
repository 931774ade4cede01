"""FAILURES.md through the real scheduler, workers and transports, with faults injected on the
sending side: every request ends within a bounded time, a failed transfer is an error (never
`length` or `stop`), no token of it is sent, other requests are undisturbed, and the pools return
to their baseline."""

from __future__ import annotations


import logging

import anyio
import pytest
from serving_harness import Serving, start_serving, until_transferring, wait_idle

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.handle import RequestHandle
from kvfence.scheduler.core.lifecycle import State
from kvfence.scheduler.core.tenants import Tenant

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]
ACME = Tenant(name="acme")
OTHER_PROMPT = [21, 22, 23, 24, 25, 26, 27, 28, 29]  # no prefix in common with PROMPT: nothing cached


async def outcome(handle: RequestHandle) -> tuple[list[int], str | None, str | None]:
    ids: list[int] = []
    async for d in handle.deltas():
        ids += d.token_ids
        if d.finish_reason or d.error:
            return ids, d.finish_reason, d.error.code if d.error else None
    return ids, None, None


@pytest.fixture(params=["tcp", "inprocess"])
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


async def serve(tg: anyio.abc.TaskGroup, tiny: Checkpoint, transport: str, faults: str,
                transfer_timeout_s: float = 0.5) -> Serving:
    config = SchedulerConfig(page_size_tokens=4, max_context_tokens=64, chunk_tokens=16, disaggregated=True,
                             transfer_timeout_s=transfer_timeout_s)
    return await start_serving(tg, tiny, transport, config, num_pages=64, faults=faults)


@pytest.mark.anyio
@pytest.mark.parametrize("fault", ["corrupt", "truncate", "drop", "fail_post", "delay=2"])
async def test_failed_transfer_fails_closed_and_the_next_request_is_served(
        tiny: Checkpoint, transport: str, fault: str) -> None:
    async with anyio.create_task_group() as tg:
        s = await serve(tg, tiny, transport, f"{fault}#2")  # only the second push is hit
        want, reason, error = await outcome(s.scheduler.submit(PROMPT, GREEDY))
        assert (reason, error) == ("length", None) and len(want) == 6
        await wait_idle(s.scheduler)
        with anyio.fail_after(10):  # bounded: the transfer timeout is 0.5 s (another prompt: a whole push)
            ids, reason, error = await outcome(s.scheduler.submit(OTHER_PROMPT, GREEDY))
        assert ids == [] and reason is None and error == "kv_transfer_failed"  # no token, no `length`
        await wait_idle(s.scheduler)
        ids, reason, error = await outcome(s.scheduler.submit(PROMPT, GREEDY))
        assert (ids, reason, error) == (want, "length", None)  # the pair is not poisoned (and the cache hit)
        await wait_idle(s.scheduler)
        await s.aclose()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_client_gone_during_a_slow_transfer(tiny: Checkpoint, transport: str) -> None:
    """Abort while the transfer is in flight: the transfer is not torn down, the request ends
    aborted (never `length`), and every page comes back once the transfer is quiet."""
    async with anyio.create_task_group() as tg:
        s = await serve(tg, tiny, transport, "delay=0.3")
        handle = s.scheduler.submit(PROMPT, GREEDY)
        await until_transferring(s.scheduler)
        handle.abort()
        ids, reason, error = await outcome(handle)
        assert reason is None and error == "client_closed" and ids == []
        await wait_idle(s.scheduler)
        await s.aclose()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_an_unacknowledged_cancel_keeps_the_pages_quarantined(tiny: Checkpoint, transport: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """FAILURES 6 and 8: the transfer times out and its cancellation is never acknowledged (a write
    may still land): the request fails, its decode pages stay quarantined and reported, and later
    requests never get them. Every log line about it names its tenant, the quarantine's too."""
    async with anyio.create_task_group() as tg:
        s = await serve(tg, tiny, transport, "stuck#2")
        want, _, _ = await outcome(s.scheduler.submit(PROMPT, GREEDY, ACME))
        await wait_idle(s.scheduler)
        with anyio.fail_after(10), caplog.at_level(logging.INFO, logger="kvfence"):
            handle = s.scheduler.submit(PROMPT, GREEDY, ACME)
            ids, reason, error = await outcome(handle)
        assert (ids, reason, error) == ([], None, "kv_transfer_failed")
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        about = [m for m in lines if handle.request_id in m or " of lease " in m]
        assert any("cancellation not acknowledged" in m for m in about), lines
        assert any("KV transfer failed" in m for m in about), lines
        assert sum("pages of lease" in m and "quarantined" in m for m in about) == 2, lines  # both pools
        assert all("(tenant acme)" in m for m in about), about
        decode = s.scheduler.ledger("decode")
        stuck = decode.num_quarantined
        assert stuck == 3  # what it held: pages for its 9 prompt tokens and its first token, at 4 per page
        # the sender never acknowledged either: a posted write may still read the source pages,
        # so the prompt's prefill pages stay quarantined too (FAILURES 9)
        assert s.scheduler.ledger("prefill").num_quarantined == 3
        assert s.scheduler.pages_in_use() == {"prefill": 3, "decode": stuck}
        s.scheduler.refresh_metrics()
        text = s.scheduler.metrics.render()[0].decode()
        assert f'kvfence_kv_pages{{state="quarantined",worker="decode"}} {float(stuck)}' in text
        # the next request (the third push; the fourth would be stuck again) is served exactly, on
        # other pages
        assert (await outcome(s.scheduler.submit(PROMPT, GREEDY))) == (want, "length", None)
        assert decode.num_quarantined == stuck
        await s.aclose()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
@pytest.mark.parametrize("fault", ["fail_post", "vanish"])
async def test_a_prefill_side_failure_reaches_the_client_at_once(tiny: Checkpoint, transport: str,
                                                                 fault: str) -> None:
    """FAILURES 10: the sending side gives up; the decode side learns at once (not at the 30 s
    transfer timeout), the client gets an error, and the pages come back once quiet."""
    async with anyio.create_task_group() as tg:
        s = await serve(tg, tiny, transport, f"{fault}#1", transfer_timeout_s=30)
        with anyio.fail_after(3):
            ids, reason, error = await outcome(s.scheduler.submit(PROMPT, GREEDY))
        assert (ids, reason, error) == ([], None, "kv_transfer_failed")
        await wait_idle(s.scheduler)
        await s.aclose()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_source_pages_stay_reserved_while_the_transfer_reads_them(tiny: Checkpoint, transport: str) -> None:
    """FAILURES 9: while a push is in flight its prefill pages stay with its lease; a request
    admitted meanwhile gets other pages; they are released once the push returned."""
    async with anyio.create_task_group() as tg:
        s = await serve(tg, tiny, transport, "delay=0.3#1")
        first = s.scheduler.submit(PROMPT, GREEDY)
        await until_transferring(s.scheduler)
        (req,) = s.scheduler.requests_in(State.TRANSFERRING)
        ledger = s.scheduler.ledger("prefill")
        # its own last page, and the full pages it sealed into the prefix cache, still referenced by it
        reading = ledger.shared_pages(req.prefill_lease) + ledger.pages(req.prefill_lease)
        assert reading and set(reading) == set(req.prefill_pages)
        second = s.scheduler.submit(PROMPT[::-1], GREEDY)
        others = [r for r in s.scheduler.requests_in(State.PREFILLING) if r is not req]
        assert others and not set(others[0].prefill_pages) & set(reading)
        assert (await outcome(first))[1] == "length" and (await outcome(second))[1] == "length"
        await wait_idle(s.scheduler)
        await s.aclose()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_client_gone_during_a_transfer_that_never_quiets(tiny: Checkpoint, transport: str) -> None:
    """FAILURES 5 and 11 together: the client leaves mid-transfer and the transfer's cancellation is
    never acknowledged: the request ends aborted, and its decode pages stay quarantined, not freed."""
    async with anyio.create_task_group() as tg:
        s = await serve(tg, tiny, transport, "stuck#1")
        handle = s.scheduler.submit(PROMPT, GREEDY)
        await until_transferring(s.scheduler)
        handle.abort()
        with anyio.fail_after(10):
            ids, reason, error = await outcome(handle)
        assert (ids, reason, error) == ([], None, "client_closed")
        with anyio.fail_after(10):
            while s.scheduler.in_flight():
                await anyio.sleep(0.01)
        held = s.scheduler.ledger("decode").num_quarantined
        # the sender's cancel was not acknowledged either: the source pages stay out too (FAILURES 9)
        assert held == 3 and s.scheduler.pages_in_use() == {"prefill": 3, "decode": held}
        await s.aclose()
        tg.cancel_scope.cancel()
