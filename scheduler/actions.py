"""What the scheduler core asks its driver to do, and the answer to a transfer it started.

The core (scheduler/core.py) takes events as method calls and queues these actions; a driver
(scheduler/driver.py async, scheduler/offline.py synchronous) carries them out and feeds the
results back as events. Plain data: no I/O here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from kvfence.engine.protocol import RunStep
from kvfence.scheduler.output import OutputDelta


@dataclasses.dataclass(frozen=True)
class SendStep:
    """Send `message` to the worker named `worker`; its reply comes back as `step_replied`."""

    worker: str
    message: RunStep


@dataclasses.dataclass(frozen=True)
class StartTransfer:
    """Move the KV of `num_tokens` tokens from `src_pages` of `src_lease` (prefill pool) into
    `dst_pages` of `dst_lease` (decode pool); the outcome comes back as `transfer_finished(key, ...)`."""

    key: int
    request_id: str
    num_tokens: int
    src_lease: int
    src_pages: list[int]
    dst_lease: int
    dst_pages: list[int]


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


Action = SendStep | StartTransfer | Emit | WatchQuiet


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
