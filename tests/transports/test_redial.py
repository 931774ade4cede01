"""Re-pairing's guard (transports/wire/redial.py): one dial at a time, and a caller arriving during
it does not wait (a peer that stalls the dial must not stall every push); after a failed dial none
before the backoff, which doubles; a success resets it."""

from __future__ import annotations

import anyio
import pytest

from kvfence.transports.wire.redial import Redial

pytestmark = pytest.mark.anyio


async def test_a_caller_during_a_dial_gets_nothing_at_once_and_the_dial_goes_on() -> None:
    redial, release, calls = Redial("peer"), anyio.Event(), []

    async def slow_dial() -> str:
        calls.append("dial")
        await release.wait()
        return "link"

    results: list[str | None] = []
    async with anyio.create_task_group() as tg:
        async def first() -> None:
            results.append(await redial.attempt(slow_dial))

        tg.start_soon(first)
        await anyio.sleep(0.01)
        with anyio.fail_after(0.5):  # does not queue behind the stalled dial
            assert await redial.attempt(slow_dial) is None
        release.set()
    assert results == ["link"] and calls == ["dial"]


async def test_a_failed_dial_backs_off_doubling_and_a_success_resets_it() -> None:
    redial, calls = Redial("peer", first_s=0.05, max_s=1.0), []

    async def failing() -> str:
        calls.append("dial")
        raise OSError("unreachable")

    async def working() -> str:
        calls.append("dial")
        return "link"

    assert await redial.attempt(failing) is None and redial.backoff_s == 0.05
    assert await redial.attempt(working) is None  # within the backoff: not even tried
    assert calls == ["dial"]
    await anyio.sleep(0.06)
    assert await redial.attempt(failing) is None and redial.failures == 2 and redial.backoff_s == 0.1
    assert await redial.attempt(working) is None and calls == ["dial", "dial"]
    await anyio.sleep(0.11)
    assert await redial.attempt(working) == "link" and redial.failures == 0 and redial.backoff_s == 0
    assert await redial.attempt(working) == "link"  # no backoff left after a success
