"""The control channel of the one-sided transports (onesided/transport.py): the frames of
wire/framing.py carrying these messages of wire/messages.py. Page bytes never travel here: they
move by one-sided WRITEs through a `DataPlane`.

Pairing (the sender connects, the receiver listens), after the mutual authentication of
wire/handshake.py (fixed-size raw messages, before any frame):
    sender -> Hello(info)        receiver -> HelloReply(accepted, reason, info, plane)
`plane` is the receiver's data-plane descriptor (what the sender's plane `connect`s to); empty
when the pairing is refused.

Per push:
    sender -> PushHeader(manifest, dst_pages, page_nbytes, digests)
    receiver -> Go(transfer_id)  or  Verdict(refusal)        (nothing is written before Go)
    the sender WRITEs the pages; for a plane that delivers notifications the last write carries
    the transfer id and the receiver hears of it from the plane; for one that does not:
    sender -> Landed(transfer_id)  (only once every write is DONE, so it cannot overtake the data)
    receiver -> Verdict(result)
Either side may stop a push:
    sender -> Cancel(transfer_id)             cancelled before its PushHeader: the receiver un-expects it
    sender -> PushAbort(transfer_id, reason)  after its PushHeader, sent only once every write of
                                              the push is terminal: no further byte of it can land
    receiver -> Stop(transfer_id, reason)     the receiver cancelled (or is closing): post no more
                                              writes, answer with PushAbort once they are terminal
Keep-alive: either side -> Ping() while idle (wire/keepalive.py); ignored by its reader.

`PushHeader.digests` are the sender's, over the source pages, when the manifest carries none.
"""

from __future__ import annotations

from kvfence.transports.wire.messages import (Cancel, Go, Hello, HelloReply, Landed, Ping, PushAbort, PushHeader,
                                              Stop, Verdict)

MAX_HELLO = 1 << 20  # bytes of a frame before pairing; a plane descriptor can be a few KiB

Message = Hello | HelloReply | PushHeader | Go | Landed | Verdict | Cancel | PushAbort | Stop | Ping
