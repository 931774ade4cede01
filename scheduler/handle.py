"""What the HTTP layer holds for one admitted request: its output stream and its abort switch."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvfence.scheduler.errors import RequestError


@dataclasses.dataclass(frozen=True)
class OutputDelta:
    """New output of one request. The last delta has `finish_reason` set ("stop" or "length"),
    or `error` set when the request failed after admission (never both)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: RequestError | None = None


class RequestHandle:
    """Created by the scheduler at admission; consumed by exactly one HTTP response.

    `deltas()` yields until the terminal delta. `abort()` is idempotent and safe from any point
    (also after the request ended): the scheduler ends the request through its abort path.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], on_abort: Callable[[], None]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._on_abort = on_abort
        self._send: MemoryObjectSendStream[OutputDelta]
        self._receive: MemoryObjectReceiveStream[OutputDelta]
        self._send, self._receive = anyio.create_memory_object_stream[OutputDelta](max_buffer_size=1 << 16)

    def push(self, delta: OutputDelta) -> None:
        """Scheduler side: never blocks; output after a terminal delta is dropped."""
        try:
            self._send.send_nowait(delta)
        except anyio.BrokenResourceError:  # the reader is gone: close our side too
            self._send.close()
            return
        except anyio.ClosedResourceError:
            return
        if delta.finish_reason is not None or delta.error is not None:
            self._send.close()

    def abort(self) -> None:
        self._on_abort()

    async def deltas(self) -> AsyncIterator[OutputDelta]:
        async with self._receive:
            async for delta in self._receive:
                yield delta
