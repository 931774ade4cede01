"""What the scheduler core asks its driver to do, and the answer to a transfer it started.

The core (scheduler/core/scheduler.py) takes events as method calls and queues these actions; a driver
(scheduler/driver.py async, scheduler/offline.py synchronous) carries them out and feeds the
results back as events. Plain data: no I/O here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from kvfence.engine.protocol import RunStep
from kvfence.scheduler.core.output import OutputDelta


@dataclasses.dataclass(frozen=True)
class SendStep:
    """Send `message` to the worker named `worker`; its reply comes back as `step_replied`."""

    worker: str
    message: RunStep


@dataclasses.dataclass(frozen=True)
class CutStep:
    """Ask the worker named `worker` to stop its step `step_id` (sent cuttable) between two layers
    (WorkerChannel.cut); its reply still comes back as `step_replied`, cut or whole."""

    worker: str
    step_id: int


@dataclasses.dataclass(frozen=True)
class StartTransfer:
    """Move the KV of token positions [first_token, num_tokens) from the prefill pool into the
    decode pool, page `src_pages[i]` of `src_lease` into page `dst_pages[i]` of `dst_lease`: the
    explicit plan. Positions before `first_token` are pages the decode lease already shares from
    its pool's prefix cache, so nothing moves into them. The outcome comes back as
    `transfer_finished(key, ...)`."""

    key: int
    request_id: str
    num_tokens: int
    src_lease: int
    src_pages: list[int]
    dst_lease: int
    dst_pages: list[int]
    first_token: int = 0
    tenant: str = ""  # whose KV moves (both leases are its own); for log lines
    sender: str = "prefill"  # the names of the prefill and the decode worker (which link moves it)
    receiver: str = "decode"

    @property
    def who(self) -> str:
        return f"request {self.request_id}" + (f" (tenant {self.tenant})" if self.tenant else "")

    def plan_error(self, page_size_tokens: int) -> str | None:
        """Why the plan does not add up (pages per side against the tokens it moves), or None."""
        moved = self.num_tokens - self.first_token
        want = -(-moved // page_size_tokens)
        if self.first_token % page_size_tokens or moved <= 0:
            return f"transfer plan: tokens [{self.first_token}, {self.num_tokens}) do not start a page"
        if len(self.src_pages) != want or len(self.dst_pages) != want:
            return (f"transfer plan: {len(self.src_pages)} source and {len(self.dst_pages)} destination pages "
                    f"for {moved} tokens ({want} pages of {page_size_tokens})")
        return None


@dataclasses.dataclass(frozen=True)
class Emit:
    """Hand `delta` to the reader of request `request_id` (the last one is terminal)."""

    request_id: str
    delta: OutputDelta


@dataclasses.dataclass(frozen=True)
class WatchQuiet:
    """Transfer `key` left pages quarantined: await `until_quiet` (from its MoveResult) and, when
    it says every write is terminal, report `transfer_quiet(key)`; never, if it cannot be learned."""

    key: int
    until_quiet: Callable[[], Awaitable[bool]]


Action = SendStep | CutStep | StartTransfer | Emit | WatchQuiet


@dataclasses.dataclass(frozen=True)
class MoveResult:
    """How a transfer ended."""

    ok: bool
    reason: str = ""
    nbytes: int = 0
    # False when a cancellation was not acknowledged: the destination pages must not be reused.
    quiet: bool = True
    # False when the sender did not acknowledge: a posted one-sided write may still read the
    # source pages, so they must not be reused either (FAILURES 9).
    source_quiet: bool = True
    # When not quiet: waits until the sender learns that every write it posted is terminal (True:
    # both ends' pages may be released then), or that it never will (False: they stay quarantined).
    until_quiet: Callable[[], Awaitable[bool]] | None = None
