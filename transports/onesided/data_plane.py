"""The byte mover under a one-sided transport (nixl, mooncake): a `DataPlane` registers one
worker's pool memory (all of it at `open`, or only the ranges a push in flight writes: `expose`),
connects to peers' registered memory, posts WRITEs of local byte ranges into a peer's memory, and
reports each write's state.

A data plane knows nothing of pages, manifests, leases or digests: the transport above it
(onesided/transport.py) decides which bytes go where, and only after the receiver admitted the transfer
over the control channel. A WRITE is one-sided, so the receiver cannot refuse bytes once it said
"go": that is why a receiver's cancel after "go" is acknowledged only when the sender reports every
handle terminal (or the write's arrival is seen), and stays unacknowledged (pages quarantined) if
that never happens.

Threading: every method is called from the event loop thread and must return quickly (post and
poll, never wait for a transfer). Planes that need progress threads run their own; a plane may
instead make progress inside `state` and `notifications`, which the transport calls repeatedly
while a write is in flight (`state`, on the writer) or expected (`notifications`, on the target).
"""

from __future__ import annotations

import abc
import enum
from typing import ClassVar

import torch


class WriteState(enum.Enum):
    PENDING = "pending"
    DONE = "done"  # every byte of the write is in the peer's memory
    FAILED = "failed"  # terminal: no further byte of this write will land


class DataPlane(abc.ABC):
    name: ClassVar[str]
    # True when a write's `notification` is delivered to the peer after its bytes (NIXL WRITE with
    # a notification); False when the transport must send it over its control channel once the
    # write is DONE (Mooncake), which also cannot overtake the data.
    delivers_notifications: ClassVar[bool]

    @abc.abstractmethod
    def open(self, memory: torch.Tensor) -> bytes:
        """Register `memory` (contiguous; host or device) and return this plane's descriptor: what
        a peer's `connect` needs to write into it (e.g. agent metadata, or session id + address)."""

    def expose(self, ranges: list[tuple[int, int]]) -> object:
        """Let peers write each `(offset, nbytes)` of local memory from now until `conceal`: the
        receiver calls it for a push's dst pages just before its "go". For a plane whose `open`
        made the memory writable only to peers that were given the descriptor (NIXL: the agent
        metadata travels inside the authenticated pairing) there is nothing to do (None). Raises
        when it cannot, having exposed nothing."""
        return None

    def conceal(self, exposure: object) -> None:
        """End an `expose` (None: nothing to end): no write into those ranges starts from now on.
        Idempotent."""

    @abc.abstractmethod
    def connect(self, descriptor: bytes) -> str:
        """Make a peer's registered memory writable from here; returns its key. Idempotent."""

    @abc.abstractmethod
    def post_write(self, peer: str, ranges: list[tuple[int, int, int]], notification: bytes) -> object:
        """Start writing each `(src_offset, dst_offset, nbytes)` of local memory into the peer's.
        `notification` b"" means none. Returns a handle for `state`/`release`. Raises on a failure
        to post (nothing was started)."""

    @abc.abstractmethod
    def state(self, handle: object) -> WriteState:
        """The write's state now (never blocks)."""

    @abc.abstractmethod
    def release(self, handle: object) -> None:
        """Forget a terminal handle. Releasing a PENDING one is a bug (the write could still land)."""

    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications that arrived with writes into this plane's memory since the last call:
        `(peer, notification)`; each arrives after every byte of its write. Only planes with
        `delivers_notifications` return any, but every plane is polled while writes into it are
        expected (see Threading)."""
        return []

    @abc.abstractmethod
    def close(self) -> None:
        """Deregister memory, drop peers, stop threads; idempotent. Only after every handle is terminal."""
