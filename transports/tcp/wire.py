"""The TCP transport's wire format: 4-byte big-endian length + one msgpack-encoded `Frame`.

Connection (sender connects, receiver listens): first the mutual authentication of peer_auth.py
(fixed-size raw messages, no frame), then
    sender -> Hello(info)                 receiver -> HelloReply(accepted, reason, info)
    then, per push, with nothing else interleaved on the connection while it streams:
    sender -> PushHeader(manifest, dst_pages, page_nbytes)
              num_pages x [Page(index) + page_nbytes raw bytes]
              PushEnd(transfer_id, digests)  -- or PushAbort(transfer_id, reason) instead of a Page
    receiver -> Verdict(result)           (later; verdicts of several pushes may be outstanding)
    sender -> Cancel(transfer_id)         (between pushes: the receiver un-expects it; no reply)
    either -> Ping()                      (keep-alive while idle, between pushes; no reply)

`PushEnd.digests` are computed by the sender over exactly the bytes it sent. A sender that stops
in the middle of a page pads the rest of that page with zeros, then sends PushAbort.
"""

from __future__ import annotations

import struct

import msgspec

from kvfence.transports.base import EndpointInfo, TransferManifest, TransferResult

MAX_FRAME = 16 << 20  # bytes of one encoded frame (a PushHeader carries the dst page list)
MAX_HELLO = 64 << 10  # bytes of a frame before the connection is paired
_LEN = struct.Struct(">I")
LEN_SIZE = _LEN.size


class Hello(msgspec.Struct, tag="hello", frozen=True):
    info: EndpointInfo


class HelloReply(msgspec.Struct, tag="hello_reply", frozen=True):
    accepted: bool
    reason: str
    info: EndpointInfo
    plane: bytes = b""  # one-sided transports (onesided_wire): the data-plane descriptor


class PushHeader(msgspec.Struct, tag="push", frozen=True):
    manifest: TransferManifest
    dst_pages: list[int]
    page_nbytes: int


class Page(msgspec.Struct, tag="page", frozen=True):
    index: int


class PushEnd(msgspec.Struct, tag="push_end", frozen=True):
    transfer_id: str
    digests: list[str]


class PushAbort(msgspec.Struct, tag="push_abort", frozen=True):
    transfer_id: str
    reason: str


class Verdict(msgspec.Struct, tag="verdict", frozen=True):
    result: TransferResult


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    transfer_id: str


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """Keep-alive (keepalive.py), either way, between pushes; ignored by its reader."""


Frame = Hello | HelloReply | PushHeader | Page | PushEnd | PushAbort | Verdict | Cancel | Ping


class ProtocolError(ConnectionError):
    """The peer sent something this protocol does not allow; the connection must be dropped."""


def encode_frame(frame: Frame) -> bytes:
    body = msgspec.msgpack.encode(frame)
    if len(body) > MAX_FRAME:
        raise ValueError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


def frame_length(prefix: bytes | bytearray, limit: int = MAX_FRAME) -> int:
    (n,) = _LEN.unpack(prefix)
    if n > limit:
        raise ProtocolError(f"frame of {n} bytes exceeds {limit}")
    return n


def decode_frame(body: bytes | bytearray | memoryview) -> Frame:
    try:
        return msgspec.msgpack.decode(body, type=Frame)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"undecodable frame: {e}") from e
