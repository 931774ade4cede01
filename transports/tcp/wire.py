"""The TCP transport's protocol: the frames of wire/framing.py carrying these messages of
wire/messages.py, page bytes raw between them.

Connection (sender connects, receiver listens): first the mutual authentication of
wire/handshake.py (fixed-size raw messages, no frame), then
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

from kvfence.transports.wire.messages import (Cancel, Hello, HelloReply, Page, Ping, PushAbort, PushEnd, PushHeader,
                                              Verdict)

MAX_HELLO = 64 << 10  # bytes of a frame before the connection is paired

Frame = Hello | HelloReply | PushHeader | Page | PushEnd | PushAbort | Verdict | Cancel | Ping
