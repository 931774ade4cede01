"""RequestHandle: push never blocks or raises whatever the reader does, what it buffers stays one
request's output (coalesced, in order), and the terminal delta always comes last."""

from __future__ import annotations

import anyio
import pytest

from kvfence.scheduler.core.errors import RequestError
from kvfence.scheduler.handle import RequestHandle
from kvfence.scheduler.core.output import OutputDelta


def handle() -> RequestHandle:
    return RequestHandle("r1", [1, 2], on_abort=lambda: None)


async def read_all(h: RequestHandle) -> list[OutputDelta]:
    return [d async for d in h.deltas()]


def test_a_reader_that_never_reads_costs_one_pending_entry_and_loses_nothing() -> None:
    h = handle()
    for i in range(100_000):  # far more than any buffer: push must neither raise nor block
        h.push(OutputDelta(text=f"<{i}>", token_ids=[i]))
    assert h.pending_tokens == 100_000
    h.push(OutputDelta(text="end", token_ids=[7], finish_reason="length"))
    deltas = anyio.run(read_all, h)
    assert len(deltas) == 2  # everything new in one delta, then the terminal one
    assert deltas[0].text == "".join(f"<{i}>" for i in range(100_000))
    assert deltas[0].token_ids == list(range(100_000)) and deltas[0].finish_reason is None
    assert deltas[1] == OutputDelta(text="end", token_ids=[7], finish_reason="length")


def test_a_reader_that_keeps_up_gets_every_delta_as_pushed() -> None:
    async def main() -> list[OutputDelta]:
        h = handle()
        got: list[OutputDelta] = []

        async def reader() -> None:
            got.extend(await read_all(h))

        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            for i in range(5):
                await anyio.sleep(0.01)  # the reader is waiting each time
                h.push(OutputDelta(text=str(i), token_ids=[i]))
            await anyio.sleep(0.01)
            h.push(OutputDelta(text="", token_ids=[], finish_reason="stop"))
        return got

    got = anyio.run(main)
    assert [(d.text, d.token_ids) for d in got[:-1]] == [(str(i), [i]) for i in range(5)]
    assert got[-1].finish_reason == "stop"


@pytest.mark.parametrize("terminal", [OutputDelta(text="", token_ids=[], finish_reason="stop"),
                                      OutputDelta(text="", token_ids=[], error=RequestError(500, "worker_error", "x"))])
def test_nothing_after_the_terminal_delta(terminal: OutputDelta) -> None:
    h = handle()
    h.push(OutputDelta(text="a", token_ids=[1]))
    h.push(terminal)
    h.push(OutputDelta(text="late", token_ids=[9]))
    h.push(OutputDelta(text="", token_ids=[], finish_reason="length"))
    assert anyio.run(read_all, h) == [OutputDelta(text="a", token_ids=[1]), terminal]


def test_output_after_the_reader_left_is_dropped() -> None:
    async def main() -> RequestHandle:
        h = handle()
        h.push(OutputDelta(text="a", token_ids=[1]))
        deltas = h.deltas()
        assert (await deltas.__anext__()).text == "a"
        await deltas.aclose()  # the HTTP response went away
        for i in range(1000):
            h.push(OutputDelta(text="b", token_ids=[i]))
        h.push(OutputDelta(text="", token_ids=[], finish_reason="stop"))
        return h

    assert anyio.run(main).pending_tokens == 0


def test_abort_calls_the_scheduler_every_time() -> None:
    calls: list[int] = []
    h = RequestHandle("r1", [1], on_abort=lambda: calls.append(1))
    h.abort()
    h.abort()
    assert calls == [1, 1]  # the scheduler's abort is the idempotent one
