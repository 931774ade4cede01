"""The receiving end of one accepted TCP connection: authentication, pairing handshake, then pushes.

Page bytes are read straight into the destination pool pages, but only while the receiver says the
transfer may be written (`Receiver.target`); otherwise into scratch and dropped. A push cut
off by a lost connection fails with "peer_lost", one cut off by a protocol violation with
"protocol_error"; the connection is then closed. Nothing here raises for peer misbehaviour.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvfence.transports.base import EndpointInfo, TransferResult
from kvfence.transports.core.receiver import Receiver
from kvfence.transports.core.receiver_state import Admission
from kvfence.transports.tcp.wire import Frame
from kvfence.transports.wire.channel import Channel, ConnectionGone
from kvfence.transports.wire.framing import ProtocolError
from kvfence.transports.wire.messages import Cancel, Page, Ping, PushAbort, PushEnd, PushHeader, Verdict


async def serve_connection(channel: Channel, receiver: Receiver,
                           pair: Callable[[], Awaitable[EndpointInfo | None]], on_paired: Callable[[], None]) -> None:
    """Serve `channel` until the peer goes away or the task is cancelled; always closes it.
    `pair` runs first (authentication and the Hello exchange, within the handshake timeout; see
    ListeningEndpoint._answer_hello): a peer it does not pair with gets nothing more; `on_paired`
    is called once the pairing is accepted (to start the keep-alive)."""
    reader = _PushReader(channel, receiver)
    try:
        if await pair() is not None:
            on_paired()
            await reader.run()
    except (ProtocolError, TimeoutError):  # before ConnectionGone: both are OSErrors
        reader.fail("protocol_error")
    except ConnectionGone:
        reader.fail("peer_lost")
    finally:
        reader.fail("peer_lost")
        channel.close()


class _PushReader:
    def __init__(self, channel: Channel, receiver: Receiver) -> None:
        self.channel = channel
        self.receiver = receiver
        self.adm: Admission | None = None  # the push being read, until its verdict is decided

    def fail(self, reason: str) -> None:
        if self.adm is not None:
            self.receiver.abort(self.adm, reason)
            self.adm = None

    async def run(self) -> None:
        while True:
            frame = await self.channel.recv_frame(Frame)
            if isinstance(frame, Ping):
                continue
            if isinstance(frame, Cancel):
                self.receiver.cancel(frame.transfer_id)
            elif isinstance(frame, PushHeader):
                verdict = await self._read_push(frame)
                async with self.channel.send_lock:
                    await self.channel.send_frame(Verdict(verdict))
            else:
                raise ProtocolError(f"unexpected {type(frame).__name__} between pushes")

    async def _read_push(self, header: PushHeader) -> TransferResult:
        manifest = header.manifest
        if header.page_nbytes < 1 or manifest.num_pages < 1:
            raise ProtocolError(f"bad push header for {manifest.transfer_id}")
        self.adm = adm = self.receiver.admit(manifest, header.dst_pages, header.page_nbytes)
        received = 0
        while True:
            frame = await self.channel.recv_frame(Frame)
            if isinstance(frame, Page):
                if frame.index != received or received >= manifest.num_pages:
                    raise ProtocolError(f"page {frame.index} out of order in {manifest.transfer_id}")
                index = received
                await self.channel.recv_page(header.page_nbytes, lambda: self.receiver.target(adm, index))
                received += 1
            elif isinstance(frame, PushEnd) and frame.transfer_id == manifest.transfer_id:
                verdict = self.receiver.finish(adm, received, frame.digests)
                break
            elif isinstance(frame, PushAbort) and frame.transfer_id == manifest.transfer_id:
                verdict = self.receiver.abort(adm, frame.reason or "cancelled")
                break
            else:
                raise ProtocolError(f"unexpected {type(frame).__name__} inside push {manifest.transfer_id}")
        self.adm = None
        return verdict
