"""The control channel of the one-sided transports (onesided.py): tcp_io's framing (4-byte
big-endian length + one msgpack-encoded message) carrying the messages below. Page bytes never
travel here: they move by one-sided WRITEs through a `DataPlane`.

Pairing (the sender connects, the receiver listens), after the mutual authentication of
peer_auth.py (fixed-size raw messages, before any frame):
    sender -> Hello(info)        receiver -> HelloReply(accepted, reason, info, plane)
`plane` is the receiver's data-plane descriptor (what the sender's plane `connect`s to); empty
when the pairing is refused.

Per push:
    sender -> Announce(manifest, dst_pages, page_nbytes, digests)
    receiver -> Go(transfer_id)  or  Verdict(refusal)        (nothing is written before Go)
    the sender WRITEs the pages; for a plane that delivers notifications the last write carries
    the transfer id and the receiver hears of it from the plane; for one that does not:
    sender -> Landed(transfer_id)  (only once every write is DONE, so it cannot overtake the data)
    receiver -> Verdict(result)
Either side may stop a push:
    sender -> Cancel(transfer_id)          cancelled before Announce: the receiver un-expects it
    sender -> Abort(transfer_id, reason)   after Announce, sent only once every write of the push
                                           is terminal: no further byte of it can land
    receiver -> Stop(transfer_id, reason)  the receiver cancelled (or is closing): post no more
                                           writes, answer with Abort once they are terminal
Keep-alive: either side -> Ping() while idle (keepalive.py); ignored by its reader.

`Announce.digests` are the sender's, over the source pages, when the manifest carries none.
"""

from __future__ import annotations

import msgspec

from kvfence.transports.base import TransferManifest, TransferResult
from kvfence.transports.wire.channel import Channel
from kvfence.transports.tcp.wire import LEN_SIZE, MAX_FRAME, Hello, HelloReply, Ping, ProtocolError, frame_length

MAX_HELLO = 1 << 20  # bytes of a frame before pairing; a plane descriptor can be a few KiB


class Announce(msgspec.Struct, tag="announce", frozen=True):
    manifest: TransferManifest
    dst_pages: list[int]
    page_nbytes: int
    digests: list[str] = []


class Go(msgspec.Struct, tag="go", frozen=True):
    transfer_id: str


class Landed(msgspec.Struct, tag="landed", frozen=True):
    transfer_id: str


class Verdict(msgspec.Struct, tag="verdict", frozen=True):
    result: TransferResult


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    transfer_id: str


class Abort(msgspec.Struct, tag="abort", frozen=True):
    transfer_id: str
    reason: str


class Stop(msgspec.Struct, tag="stop", frozen=True):
    transfer_id: str
    reason: str


Message = Hello | HelloReply | Announce | Go | Landed | Verdict | Cancel | Abort | Stop | Ping


async def send_message(channel: Channel, message: Message) -> None:
    """Send one message (hold `channel.send_lock`). tcp_io frames any msgspec struct the same
    way; only decoding is specific to a protocol."""
    await channel.send_frame(message)  # type: ignore[arg-type]


async def recv_message(channel: Channel, limit: int = MAX_FRAME) -> Message:
    """The next message; ProtocolError when it is longer than `limit` or undecodable, OSError /
    anyio.ClosedResourceError when the connection is gone."""
    prefix = bytearray(LEN_SIZE)
    await channel.recv_page(LEN_SIZE, lambda: memoryview(prefix))
    body = bytearray(frame_length(prefix, limit))
    await channel.recv_page(len(body), lambda: memoryview(body))
    try:
        return msgspec.msgpack.decode(body, type=Message)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"undecodable message: {e}") from e
