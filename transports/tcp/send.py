"""The sending end of one paired TCP connection.

Pushes share the connection: each streams its header, pages and end frame under the channel's
send lock (so one push's bytes are contiguous on the wire), then releases the lock and waits for
its verdict, which the connection's reader task (`run`, in the transport's task group) routes by
transfer id. Several pushes can thus await verdicts at once while the next one streams.

Page bytes are sent from the pool without a copy (a staged pool: from the host buffer its pages
are copied into, a chunk at a time, while the push holds the send lock; see core/staging.py); the
digest is computed over each chunk the kernel accepted, i.e. over exactly the bytes sent. Stopping
(transport `cancel`) is checked before every read of a source page; a stopped or interrupted push
pads the current page with zeros and sends PushAbort (so does one whose staging copy failed, then
between two pages), keeping the stream in sync. If even that fails within `abort_timeout`, the
connection is dropped and every push on it fails with "peer_lost".
"""

from __future__ import annotations

import anyio

from kvfence.transports.base import EndpointInfo, TransferManifest, TransferResult
from kvfence.transports.core.digest import new_hasher
from kvfence.transports.core.pool_bytes import PoolBytes
from kvfence.transports.core.sender_state import OutgoingPush
from kvfence.transports.core.staging import SourcePages
from kvfence.transports.tcp.wire import Frame
from kvfence.transports.wire.channel import Channel, ConnectionGone
from kvfence.transports.wire.framing import ProtocolError
from kvfence.transports.wire.messages import Cancel, Page, Ping, PushAbort, PushEnd, PushHeader, Verdict


class SenderConnection:
    def __init__(self, channel: Channel, peer: EndpointInfo, abort_timeout: float = 5.0) -> None:
        self.channel = channel
        self.peer = peer
        self.abort_timeout = abort_timeout
        self.lost_reason = ""
        self._waiting: dict[str, OutgoingPush] = {}

    @property
    def alive(self) -> bool:
        return not self.lost_reason

    def lose(self, reason: str) -> None:
        """Drop the connection: every push waiting on it fails with `reason`; idempotent."""
        if self.lost_reason:
            return
        self.lost_reason = reason
        for out in self._waiting.values():
            out.settle(False, reason)
        self.channel.close()

    async def run(self) -> None:
        """Reader task: route verdicts until the connection ends."""
        try:
            while True:
                frame = await self.channel.recv_frame(Frame)
                if isinstance(frame, Ping):
                    continue
                if not isinstance(frame, Verdict):
                    raise ProtocolError(f"unexpected {type(frame).__name__} from the receiver")
                if (out := self._waiting.get(frame.result.transfer_id)) is not None:
                    out.settle_with(frame.result)
        except ConnectionGone:  # includes ProtocolError
            pass
        finally:
            self.lose("peer_lost")

    async def push(self, out: OutgoingPush, pool_bytes: PoolBytes, manifest: TransferManifest,
                   src_pages: list[int], dst_pages: list[int]) -> TransferResult:
        """Stream the push and return its verdict (or "cancelled" / "peer_lost")."""
        tid = manifest.transfer_id
        if not self.alive:
            return TransferResult(tid, False, self.lost_reason)
        self._waiting[tid] = out
        try:
            await self._send(out, pool_bytes, manifest, src_pages, dst_pages)
            await out.done.wait()
            assert out.result is not None
            return out.result
        finally:
            del self._waiting[tid]

    async def _send(self, out: OutgoingPush, pool_bytes: PoolBytes, manifest: TransferManifest,
                    src_pages: list[int], dst_pages: list[int]) -> None:
        ch, tid = self.channel, manifest.transfer_id
        async with ch.send_lock:
            if not self.alive:
                return
            streaming = False
            try:
                if out.cancelled:  # nothing sent yet: tell the receiver to drop the expectation
                    await ch.send_frame(Cancel(tid))
                    return
                source = SourcePages(pool_bytes, src_pages)  # a staged pool's buffer: before anything is sent
                streaming = True
                await ch.send_frame(PushHeader(manifest=manifest, dst_pages=list(dst_pages),
                                               page_nbytes=pool_bytes.page_nbytes))
                digests = []
                for index in range(len(src_pages)):
                    if out.cancelled:
                        break
                    try:
                        page = source.page(index)  # a staged pool's only read: right after the check
                    except Exception:  # the staging copy failed, between two pages: end the push
                        streaming = False
                        await ch.send_frame(PushAbort(tid, "staging_failed"))
                        raise
                    await ch.send_frame(Page(index))
                    hasher = new_hasher(pool_bytes.digest)
                    if not await ch.send_page(page, hasher, lambda: out.cancelled):
                        break
                    digests.append(hasher.hexdigest())
                else:
                    streaming = False  # from here on, settling completes the push's last frame
                    await ch.send_frame(PushEnd(tid, digests))
                    return
                await ch.settle()
                streaming = False
                await ch.send_frame(PushAbort(tid, "cancelled"))
            except ConnectionGone:
                self.lose("peer_lost")
            except anyio.get_cancelled_exc_class():
                await self._abort_shielded(tid, streaming)
                raise

    async def _abort_shielded(self, tid: str, streaming: bool) -> None:
        """After the pushing task was cancelled mid-stream: put the stream back in sync."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.abort_timeout) as scope:
            try:
                await self.channel.settle()
                if streaming:
                    await self.channel.send_frame(PushAbort(tid, "cancelled"))
            except ConnectionGone:
                self.lose("peer_lost")
        if scope.cancelled_caught:
            self.lose("peer_lost")
