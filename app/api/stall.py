"""Noticing a client that has stopped reading a response.

Back-pressure runs from the socket back to the app: a client that stops reading fills its receive
buffer, then the server's socket send buffer, then the transport's write buffer (asyncio pauses
writing above its high-water mark), and from then on hypercorn's `send` of the next chunk does
not return. So a stalled client shows as a `send` that has been pending for long, never as an
error: `SendWatch` wraps `send` and notes when the call in progress started, and `watch()` cancels
a scope once one call has been pending for `stall_timeout_s` seconds. Time the response spends
waiting for output to send does not count: a slow generation is not a stalled client.
"""

from __future__ import annotations

import time

import anyio
from starlette.types import Message, Send


class SendWatch:
    """`send` for one response, timed; `stalled` is True once `watch()` has cancelled."""

    def __init__(self, send: Send, stall_timeout_s: float) -> None:
        if stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
        self._send = send
        self.stall_timeout_s = stall_timeout_s
        self._pending_since: float | None = None  # monotonic start of the send in progress
        self.stalled = False

    async def send(self, message: Message) -> None:
        self._pending_since = time.monotonic()
        try:
            await self._send(message)
        finally:
            self._pending_since = None

    async def watch(self, scope: anyio.CancelScope) -> None:
        """Until cancelled, or until one send has been pending for `stall_timeout_s`: then set
        `stalled` and cancel `scope`. A send is seen within a quarter of the timeout of its start,
        and from then the watch sleeps until its exact deadline."""
        idle_poll_s = self.stall_timeout_s / 4
        while True:
            since, now = self._pending_since, time.monotonic()
            if since is None:
                await anyio.sleep(idle_poll_s)
            elif now - since >= self.stall_timeout_s:
                self.stalled = True
                scope.cancel()
                return
            else:
                await anyio.sleep(since + self.stall_timeout_s - now)
