"""The sending half's bookkeeping shared by the built-in transports.

An `OutgoingPush` lives while `push` runs. `cancel` sets `cancelled`; the pushing task checks it
right before every synchronous read of a source page, so once `cancel` has returned no further
read can happen. The first result settled (verdict, cancellation, peer loss) is the one `push`
returns.
"""

from __future__ import annotations

import anyio

from kvfence.transports.base import TransferResult


class OutgoingPush:
    def __init__(self, transfer_id: str) -> None:
        self.transfer_id = transfer_id
        self.cancelled = False
        self.result: TransferResult | None = None
        self.done = anyio.Event()

    def settle(self, ok: bool, reason: str = "") -> None:
        """Record the outcome unless one is recorded already, and wake the pusher."""
        self.settle_with(TransferResult(self.transfer_id, ok, reason))

    def settle_with(self, result: TransferResult) -> None:
        if self.result is None:
            self.result = result
        self.done.set()

    def cancel(self) -> None:
        self.cancelled = True
        self.settle(False, "cancelled")


class OutgoingPushes:
    """The pushes in flight on one endpoint, by transfer id."""

    def __init__(self) -> None:
        self._pushes: dict[str, OutgoingPush] = {}

    def add(self, transfer_id: str) -> OutgoingPush:
        """Register a push; ValueError when a push with that id is already in flight."""
        if transfer_id in self._pushes:
            raise ValueError(f"transfer {transfer_id} is already being pushed")
        out = self._pushes[transfer_id] = OutgoingPush(transfer_id)
        return out

    def remove(self, out: OutgoingPush) -> None:
        if self._pushes.get(out.transfer_id) is out:
            del self._pushes[out.transfer_id]

    def get(self, transfer_id: str) -> OutgoingPush | None:
        return self._pushes.get(transfer_id)

    def cancel(self, transfer_id: str) -> None:
        if (out := self._pushes.get(transfer_id)) is not None:
            out.cancel()

    def settle_all(self, reason: str) -> None:
        for out in self._pushes.values():
            out.settle(False, reason)
