"""Moving one request's prompt KV from the prefill pool into its reserved decode pages.

The scheduler's half of a transfer: mint the ids and the push's capability (the front end's
signature over the ids, the destination lease and pages and the receiver's incarnation,
transports/core/front_key.py), arm the receiver with the manifest and the destination pages the server
chose, push, and wait for the receiver's verdict. Success needs the receiver's positive verdict;
an error, a timeout or silence is a failure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import msgspec

import anyio

from kvfence.scheduler.core.actions import MoveResult, StartTransfer
from kvfence.engine.ids import id_hex, mint_id
from kvfence.transports.base import Peer, TransferManifest, TransferResult, Transport
from kvfence.transports.core.front_key import FrontKey

log = logging.getLogger(__name__)


_F = TypeVar("_F", bound=Callable[..., Any])


def waits_on_transfer(method: _F) -> _F:
    """Marks a method of a half that waits on the network and the other worker, bounded by the
    transfer's own timeout and quarantine, not by a worker's call deadline (app/remote/client.py)."""
    method.waits_on_transfer = True  # type: ignore[attr-defined]  # a mark app/remote/ends.py reads
    return method


class SendingEnd(Protocol):
    """The sending half of transfers: a prefill worker's paired sender (`LocalSendingEnd` in this
    process; in another, these declarations made calls on its control connection by
    app/remote/ends.py). Transport's contracts. Every argument and return value is a type the
    control connection carries (msgspec)."""

    @waits_on_transfer
    async def push(self, manifest: TransferManifest, src_pages: list[int],
                   dst_pages: list[int]) -> TransferResult: ...

    async def cancel(self, transfer_id: str) -> bool: ...

    @waits_on_transfer
    async def wait_quiet(self, transfer_id: str) -> bool: ...


class ReceivingEnd(Protocol):
    """The receiving half: a decode worker's receiver (`LocalReceivingEnd`, or made remote as
    SendingEnd is). `expect` raises ValueError when it refuses to arm."""

    async def expect(self, manifest: TransferManifest, dst_pages: list[int]) -> None: ...

    @waits_on_transfer
    async def completion(self, transfer_id: str) -> TransferResult: ...

    async def cancel(self, transfer_id: str) -> bool: ...


class LocalSendingEnd:
    """A sender endpoint in this process and the receiver it paired with."""

    def __init__(self, transport: Transport, peer: Peer) -> None:
        self.transport = transport
        self.peer = peer

    async def push(self, manifest: TransferManifest, src_pages: list[int], dst_pages: list[int]) -> TransferResult:
        return await self.transport.push(self.peer, manifest, src_pages, dst_pages)

    async def cancel(self, transfer_id: str) -> bool:
        return await self.transport.cancel(transfer_id)

    async def wait_quiet(self, transfer_id: str) -> bool:
        return await self.transport.wait_quiet(transfer_id)


class LocalReceivingEnd:
    """A receiver endpoint in this process."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    async def expect(self, manifest: TransferManifest, dst_pages: list[int]) -> None:
        self.transport.expect(manifest, dst_pages)

    async def completion(self, transfer_id: str) -> TransferResult:
        return await self.transport.completion(transfer_id)

    async def cancel(self, transfer_id: str) -> bool:
        return await self.transport.cancel(transfer_id)


class TransferLink:
    """A paired sending and receiving end, the receiver incarnation they paired with, and the
    front end's key that signs each push's capability (None: pushes carry none, only with the
    capability guard off, app/serve/guards.py; a receiver that checks refuses them)."""

    def __init__(self, sender: SendingEnd, receiver: ReceivingEnd, receiver_incarnation: str, page_size_tokens: int,
                 page_nbytes: int, front_key: FrontKey | None) -> None:
        self.front_key = front_key
        self.sender = sender
        self.receiver = receiver
        self.receiver_incarnation = receiver_incarnation
        self.page_size_tokens = page_size_tokens
        self.page_nbytes = page_nbytes

    @classmethod
    def local(cls, sender: Transport, receiver: Transport, peer: Peer, page_size_tokens: int, page_nbytes: int,
              front_key: FrontKey | None) -> TransferLink:
        """Both endpoints in this process; `peer`: the receiver as the sender paired with it."""
        return cls(LocalSendingEnd(sender, peer), LocalReceivingEnd(receiver), peer.info.record.incarnation,
                   page_size_tokens, page_nbytes, front_key)

    async def move(self, plan: StartTransfer, timeout_s: float) -> MoveResult:
        """Push the plan's pages (src_pages[i] into dst_pages[i]); returns once both ends are quiet
        or it timed out. A plan whose page counts do not match the tokens it moves is refused before
        anything is armed (and the receiver checks the count again), so a partial prefix hit can
        never shift a page."""
        if (error := plan.plan_error(self.page_size_tokens)) is not None:
            log.error("%s: %s; the transfer is refused", plan.who, error)
            return MoveResult(ok=False, reason=error)
        src, dst, num_pages = list(plan.src_pages), list(plan.dst_pages), len(plan.dst_pages)
        manifest = TransferManifest(transfer_id=id_hex(mint_id()), lease=id_hex(plan.dst_lease),
                                    nonce=id_hex(mint_id()), num_tokens=plan.num_tokens - plan.first_token,
                                    num_pages=num_pages)
        # the receiver incarnation the sender paired with (checked at pairing): a push planned for it
        # is refused by any later incarnation of the receiver
        if self.front_key is not None:
            manifest = msgspec.structs.replace(
                manifest, capability=self.front_key.capability(manifest, dst, self.receiver_incarnation))
        try:
            await self.receiver.expect(manifest, dst)
        except Exception as e:  # nothing is armed: no byte can land for this transfer
            return MoveResult(ok=False, reason=f"the receiver refused the transfer: {e}")
        try:
            with anyio.move_on_after(timeout_s) as scope:
                pushed = await self.sender.push(manifest, src, dst)
                if not pushed.ok:  # the sender gave up: tell the receiver now, not at the timeout
                    return await self._cancelled(manifest.transfer_id, plan.who, pushed.reason)
                verdict = await self.receiver.completion(manifest.transfer_id)
        except Exception as e:  # a transport error is a failed transfer, never a crashed server
            log.warning("transfer %s of %s: transport error: %r", manifest.transfer_id, plan.who, e)
            return await self._cancelled(manifest.transfer_id, plan.who, f"transport error: {e}")
        if scope.cancelled_caught:
            return await self._cancelled(manifest.transfer_id, plan.who, f"timed out after {timeout_s:g} s")
        if not verdict.ok or not pushed.ok:
            return MoveResult(ok=False, reason=verdict.reason or pushed.reason)
        return MoveResult(ok=True, nbytes=num_pages * self.page_nbytes)

    async def _cancelled(self, transfer_id: str, who: str, reason: str) -> MoveResult:
        """A failed move, cancelled on both ends: the destination is quiet only when both
        acknowledged (the receiver writes nothing more, and nothing the sender posted can still
        land: a one-sided WRITE is the sender's, the receiver cannot stop it); the source only
        when the sender did (nothing it posted can still read it)."""
        sender_ack, receiver_ack = await self._cancel(transfer_id, who)
        if sender_ack and receiver_ack:
            return MoveResult(ok=False, reason=reason)

        async def until_quiet() -> bool:
            # every byte either pool can still see moves by a write the sender posted: once those are
            # terminal (which only the sender learns), neither pool can be touched by this transfer
            return await self.sender.wait_quiet(transfer_id)

        return MoveResult(ok=False, reason=reason, quiet=False, source_quiet=sender_ack, until_quiet=until_quiet)

    async def _cancel(self, transfer_id: str, who: str) -> tuple[bool, bool]:
        """Cancel on both ends; each side's acknowledgement (sender, receiver)."""
        acks = []
        for side, endpoint in (("sender", self.sender), ("receiver", self.receiver)):
            try:
                acks.append(await endpoint.cancel(transfer_id))
            except Exception as e:
                log.warning("transfer %s of %s: %s cancel failed: %r", transfer_id, who, side, e)
                acks.append(False)
        if not all(acks):
            log.warning("transfer %s of %s: cancellation not acknowledged by the %s; its %s pages stay quarantined",
                        transfer_id, who, " and ".join(s for s, ok in zip(("sender", "receiver"), acks) if not ok),
                        "destination" if acks[0] else "source and destination")
        return acks[0], acks[1]
