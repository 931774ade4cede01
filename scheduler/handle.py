"""What the HTTP layer holds for one admitted request: its output stream and its abort switch."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

import anyio

from kvfence.engine.logprobs import TokenLogprobs
from kvfence.scheduler.core.output import OutputDelta


class RequestHandle:
    """Created by the scheduler at admission; consumed by exactly one HTTP response.

    `push()` is called synchronously from the scheduler's loops: it never blocks and never raises.
    Output the reader has not taken yet is coalesced into one pending delta (texts and token ids
    appended in order), so what a handle buffers is at most the request's own output (bounded by
    its max_tokens, checked at admission) plus its terminal delta, however slowly it is read; a
    reader that falls behind gets everything new in one delta. Ending a request whose reader has
    stopped is the reader's side's job (`abort()`; the HTTP layer's stall timeout).

    `deltas()` yields until the terminal delta (pending output first, then the terminal delta).
    `abort()` is idempotent and safe from any point (also after the request ended): the scheduler
    ends the request through its abort path.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], on_abort: Callable[[], None]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._on_abort = on_abort
        self._texts: list[str] = []  # pending output, in order
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprobs] = []
        self._prompt_logprobs: list[TokenLogprobs] = []
        self._terminal: OutputDelta | None = None
        self._reader_gone = False
        self._wakeup: anyio.Event | None = None  # set while the reader waits for output

    def push(self, delta: OutputDelta) -> None:
        """Scheduler side: never blocks, never raises; output after a terminal delta, or after the
        reader left, is dropped."""
        if self._terminal is not None or self._reader_gone:
            return
        if delta.finish_reason is not None or delta.error is not None:
            self._terminal = delta
        else:
            self._texts.append(delta.text)
            self._ids += delta.token_ids
            self._logprobs += delta.logprobs
            self._prompt_logprobs += delta.prompt_logprobs
        if self._wakeup is not None:
            self._wakeup.set()

    @property
    def pending_tokens(self) -> int:
        """Tokens pushed that the reader has not taken yet (tests and metrics)."""
        return len(self._ids)

    def abort(self) -> None:
        self._on_abort()

    async def deltas(self) -> AsyncGenerator[OutputDelta, None]:
        try:
            while True:
                if self._ids or self._texts:
                    text, ids, logprobs, prompt = "".join(self._texts), self._ids, self._logprobs, self._prompt_logprobs
                    self._texts, self._ids, self._logprobs, self._prompt_logprobs = [], [], [], []
                    yield OutputDelta(text=text, token_ids=ids, logprobs=logprobs, prompt_logprobs=prompt)
                elif self._terminal is not None:
                    yield self._terminal
                    return
                else:
                    self._wakeup = anyio.Event()
                    await self._wakeup.wait()
                    self._wakeup = None
        finally:
            self._reader_gone = True
            self._texts, self._ids, self._logprobs, self._prompt_logprobs = [], [], [], []
