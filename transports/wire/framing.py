"""Framing on a transport connection: a 4-byte big-endian length, then one msgpack-encoded
message (a tagged msgspec struct of messages.py). Which messages a connection may carry is its
protocol's (tcp/wire.py, onesided/wire.py): a reader decodes each frame as that protocol's union.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

MAX_FRAME = 16 << 20  # bytes of one encoded frame (a PushHeader carries the dst page list)
_LEN = struct.Struct(">I")
LEN_SIZE = _LEN.size


class ProtocolError(ConnectionError):
    """The peer sent something this protocol does not allow; the connection must be dropped."""


def encode_frame(message: msgspec.Struct) -> bytes:
    body = msgspec.msgpack.encode(message)
    if len(body) > MAX_FRAME:
        raise ValueError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


def frame_length(prefix: bytes | bytearray, limit: int = MAX_FRAME) -> int:
    n: int = _LEN.unpack(prefix)[0]
    if n > limit:
        raise ProtocolError(f"frame of {n} bytes exceeds {limit}")
    return n


def decode_frame(body: bytes | bytearray | memoryview, protocol: Any) -> Any:
    """`body` as one of the messages of `protocol` (a union of tagged structs); ProtocolError
    when it is not one."""
    try:
        return msgspec.msgpack.decode(body, type=protocol)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"undecodable frame: {e}") from e
