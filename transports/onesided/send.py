"""The sending half of a one-sided transport: pushes, their writes, and the receiver's answers.

A push announces itself, waits for "go" (or a refusal), then posts its writes one chunk at a time
(`write_chunks`), each once the previous one is DONE, so a notification on the last write cannot
overtake the data and a stopped push posts nothing more. Whether the push may go on is checked
right before every post and every read of a source page (digests), with no await in between:
once `cancel` (or a "stop" from the receiver, a lost link, the transport closing) has settled
the push, nothing more is posted or read. Writes are polled by the transport's poller
(`poll_writes`); a push waits for its write in flight to be terminal before it returns, even when
its task is cancelled (then at most `cancel_ack_timeout_s`, shielded, after which the link is
dropped: its receiver cannot trust the pair any more). Every push that was announced and not
answered ends with a PushAbort, sent once its writes are terminal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import anyio.lowlevel

from kvfence.transports.base import TransferManifest, TransferResult
from kvfence.transports.core.pool_bytes import PoolBytes
from kvfence.transports.core.sender_state import OutgoingPush, OutgoingPushes
from kvfence.transports.onesided.data_plane import DataPlane, WriteState
from kvfence.transports.onesided.link import Link, Sending, Write, wait_any, write_chunks
from kvfence.transports.onesided.wire import Message
from kvfence.transports.wire.framing import ProtocolError
from kvfence.transports.wire.messages import Cancel, Go, Landed, Ping, PushAbort, PushHeader, Stop, Verdict

log = logging.getLogger(__name__)


def _as_receiver_sees(out: OutgoingPush) -> str:
    """The reason a PushAbort tells the receiver (this endpoint closing is "peer_lost" there)."""
    assert out.result is not None
    return "cancelled" if out.cancelled else "peer_lost" if out.result.reason == "transport_closed" \
        else out.result.reason


class SenderHalf:
    """The pushes of one endpoint and the writes they posted (`writes`, for the poller)."""

    def __init__(self, plane: DataPlane, outgoing: OutgoingPushes, kick: Callable[[], None], *,
                 write_chunk_bytes: int, cancel_ack_timeout_s: float) -> None:
        self.plane = plane
        self.outgoing = outgoing
        self.kick = kick  # wakes the poller
        self.write_chunk_bytes = write_chunk_bytes
        self.cancel_ack_timeout_s = cancel_ack_timeout_s
        self.writes: list[Write] = []  # posted and not yet terminal
        self.sending: dict[str, Sending] = {}
        # pushes that returned (their task cancelled) with a write still PENDING, by transfer id,
        # until the poller sees that write terminal: what `cancel` and `wait_quiet` consult then
        self.unsettled: dict[str, Write] = {}

    async def push(self, link: Link, pool_bytes: PoolBytes, manifest: TransferManifest, src_pages: list[int],
                   dst_pages: list[int]) -> TransferResult:
        tid = manifest.transfer_id
        if not link.alive:
            return TransferResult(tid, False, link.lost_reason)
        out = self.outgoing.add(tid)
        sending = self.sending[tid] = Sending(out, link)
        try:
            return await self._push(sending, pool_bytes, manifest, src_pages, dst_pages)
        finally:
            del self.sending[tid]
            self.outgoing.remove(out)

    async def _push(self, s: Sending, pool_bytes: PoolBytes, manifest: TransferManifest, src: list[int],
                    dst: list[int]) -> TransferResult:
        out, link, tid = s.out, s.link, manifest.transfer_id
        digests = [] if manifest.digests else await self._source_digests(pool_bytes, src, out)
        if out.result is not None:  # stopped before announcing anything
            if out.cancelled:
                link.send(Cancel(tid))  # the receiver drops the expectation
            return out.result
        link.send(PushHeader(manifest=manifest, dst_pages=dst, page_nbytes=pool_bytes.page_nbytes, digests=digests))
        try:
            await wait_any(s.go, out.done)
            if s.go.is_set() and out.result is None and await self._write(s, pool_bytes, src, dst, tid) \
                    and out.result is None:
                if not self.plane.delivers_notifications:
                    link.send(Landed(tid))  # every write is DONE: it cannot overtake the data
                await out.done.wait()
        except anyio.get_cancelled_exc_class():
            if not s.answered:  # `_write` returned only once its write was terminal
                link.send(PushAbort(tid, "cancelled"))
            raise
        assert out.result is not None
        if not s.answered:  # stopped, failed or closing: no further byte of this push can land
            link.send(PushAbort(tid, _as_receiver_sees(out)))
        return out.result

    async def _source_digests(self, pool_bytes: PoolBytes, src: list[int], out: OutgoingPush) -> list[str]:
        """Digests over the source pages as they are now (what the writes will read)."""
        digests, since = [], 0
        for page in src:
            if out.result is not None:  # right before each read of a source page
                break
            digests.append(pool_bytes.digest_of(page))
            since += pool_bytes.page_nbytes
            if since >= self.write_chunk_bytes:
                since = 0
                await anyio.lowlevel.checkpoint()
        return digests

    async def _write(self, s: Sending, pool_bytes: PoolBytes, src: list[int], dst: list[int], tid: str) -> bool:
        """Post the push's writes one after the other; True when every one is DONE. False when
        the push was settled meanwhile or a write failed (settled "write_failed"); either way
        no write of the push is in flight on return."""
        chunks = write_chunks(src, dst, pool_bytes.page_nbytes, self.write_chunk_bytes)
        for index, ranges in enumerate(chunks):
            if s.out.result is not None:  # right before the post: nothing awaits in between
                return False
            last = index == len(chunks) - 1
            note = tid.encode() if last and self.plane.delivers_notifications else b""
            try:
                handle = self.plane.post_write(s.link.plane_peer, ranges, note)
            except Exception:  # nothing was started
                log.exception("transfer %s: posting a %s write failed", tid, self.plane.name)
                s.out.settle(False, "write_failed")
                return False
            s.write = write = Write(handle)
            self.writes.append(write)
            self.kick()
            await self._until_terminal(s, write, tid)
            if write.state is not WriteState.DONE:
                s.out.settle(False, "write_failed")
                return False
        return True

    async def _until_terminal(self, s: Sending, write: Write, tid: str) -> None:
        try:
            await write.done.wait()
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.cancel_ack_timeout_s):
                await write.done.wait()
            if write.state is WriteState.PENDING:  # unconfirmed: the receiver must stop trusting the pair
                self.unsettled[tid] = write  # the poller keeps watching it: see `wait_quiet`
                s.link.distrusted = True  # and this end does not pair it again by itself
                s.link.lose("peer_lost")
            raise

    def poll_writes(self) -> bool:
        """Poll every write in flight once; True when one became terminal."""
        progressed = False
        for write in list(self.writes):
            state = self.plane.state(write.handle)
            if state is WriteState.PENDING:
                continue
            self.writes.remove(write)
            try:
                self.plane.release(write.handle)
            except Exception:
                log.exception("releasing a terminal %s write failed", self.plane.name)
            write.finish(state)
            progressed = True
        if progressed and self.unsettled:
            for tid in [t for t, w in self.unsettled.items() if w.state is not WriteState.PENDING]:
                log.info("transfer %s: its last write, left pending when the push gave up, is now %s", tid,
                         self.unsettled.pop(tid).state.value)
        return progressed

    def on_message(self, link: Link, message: Message) -> None:
        """A message from the receiver at the other end of `link`."""
        match message:
            case Ping():
                pass
            case Go(transfer_id=tid):
                if (s := self._on(link, tid)) is not None:
                    s.go.set()
            case Verdict(result=result):
                if (s := self._on(link, result.transfer_id)) is not None:
                    s.answered = True
                    s.out.settle_with(result)
            case Stop(transfer_id=tid, reason=reason):
                if (s := self._on(link, tid)) is not None:
                    s.out.settle(False, reason)
            case _:
                raise ProtocolError(f"unexpected {type(message).__name__} from a receiver")

    def _on(self, link: Link, tid: str) -> Sending | None:
        s = self.sending.get(tid)
        return s if s is not None and s.link is link else None

    def drop_link(self, link: Link) -> None:
        """`link` is lost: its pushes end with its reason (after their writes in flight)."""
        for s in self.sending.values():
            if s.link is link:
                s.out.settle(False, link.lost_reason)

    def cancel(self, transfer_id: str) -> Write | None:
        """Stop pushing `transfer_id`; the write that may still read its pages, if any (also one
        its push left pending when it gave up)."""
        s = self.sending.get(transfer_id)
        self.outgoing.cancel(transfer_id)
        return s.write if s is not None else self.unsettled.get(transfer_id)

    async def wait_quiet(self, transfer_id: str) -> bool:
        """Until no write of `transfer_id` is pending: True once they are all terminal (at once if
        none is), False when the transport shut down with one still PENDING (its bytes may still
        land: never quiet)."""
        write = self.unsettled.get(transfer_id)
        if write is None:
            s = self.sending.get(transfer_id)
            write = s.write if s is not None else None
        if write is None:
            return True
        await write.done.wait()
        return write.state is not WriteState.PENDING

    def abandon(self) -> None:
        """Shutting down: wake every push still waiting for a write (which stays unconfirmed)."""
        for write in self.writes:
            write.done.set()
        self.writes.clear()
