"""Every message of the transports' wire protocols, each defined once: a tagged msgspec struct.
Which of them a connection may carry, and in what order, is its protocol's: tcp/wire.py (pages
stream inline) and onesided/wire.py (a control channel beside a data plane).

    Hello, HelloReply     pairing, after the handshake of handshake.py (both protocols)
    PushHeader            a push announced: manifest, dst pages, page size (both)
    PushAbort             the sender ended a push early; no further byte of it comes (both)
    Verdict               the receiver's result of a push (both)
    Cancel                a push cancelled before it was announced: un-expect it (both)
    Ping                  keep-alive while idle, ignored by its reader (both)
    Page, PushEnd         a page follows; the push's pages all sent, with their digests (tcp)
    Go, Landed, Stop      write now; every write is DONE; stop writing (one-sided)
"""

from __future__ import annotations

import msgspec

from kvfence.transports.base import EndpointInfo, TransferManifest, TransferResult


class Hello(msgspec.Struct, tag="hello", frozen=True):
    info: EndpointInfo


class HelloReply(msgspec.Struct, tag="hello_reply", frozen=True):
    accepted: bool
    reason: str
    info: EndpointInfo
    plane: bytes = b""  # one-sided transports: the receiver's data-plane descriptor ("" when refused)


class PushHeader(msgspec.Struct, tag="push", frozen=True):
    manifest: TransferManifest
    dst_pages: list[int]
    page_nbytes: int
    # one-sided: the sender's digests over the source pages when the manifest carries none; tcp
    # sends its digests in PushEnd instead, computed over exactly the bytes it sent
    digests: list[str] = []


class PushAbort(msgspec.Struct, tag="push_abort", frozen=True):
    transfer_id: str
    reason: str


class Verdict(msgspec.Struct, tag="verdict", frozen=True):
    result: TransferResult


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    transfer_id: str


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """Keep-alive (wire/keepalive.py), either way, while idle; ignored by its reader."""


class Page(msgspec.Struct, tag="page", frozen=True):
    index: int


class PushEnd(msgspec.Struct, tag="push_end", frozen=True):
    transfer_id: str
    digests: list[str]


class Go(msgspec.Struct, tag="go", frozen=True):
    transfer_id: str


class Landed(msgspec.Struct, tag="landed", frozen=True):
    transfer_id: str


class Stop(msgspec.Struct, tag="stop", frozen=True):
    transfer_id: str
    reason: str
