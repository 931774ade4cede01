"""The pieces of a one-sided transport (onesided/transport.py) that hold no policy: a control connection
with an outbox, the records of pushes and receptions in flight, and how a push is cut into writes.

A `Link` is one paired control connection. Its outbox is drained, in order, by `write_loop` (a
task in the transport's task group), so synchronous code (the poller, `cancel`) can send: a
message queued after another is sent after it. Losing a link closes its socket; what was queued
is dropped.
"""

from __future__ import annotations

from collections import deque

import anyio

from kvfence.transports.base import EndpointInfo
from kvfence.transports.core.receiver_state import Admission
from kvfence.transports.core.sender_state import OutgoingPush
from kvfence.transports.core.staging import page_runs
from kvfence.transports.onesided.data_plane import WriteState
from kvfence.transports.onesided.wire import Message
from kvfence.transports.wire.channel import Channel, ConnectionGone


class Link:
    """A control connection. `peer`: the other endpoint (after pairing); `plane_peer`: its data
    plane's key on this endpoint's plane (the sending side of a pair only)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.peer: EndpointInfo | None = None
        self.plane_peer = ""
        self.lost_reason = ""
        self.distrusted = False  # dropped because a write on it stayed unconfirmed: never re-paired
        self._outbox: deque[Message] = deque()
        self._ready = anyio.Event()

    @property
    def alive(self) -> bool:
        return not self.lost_reason

    def send(self, message: Message) -> None:
        """Queue `message` (dropped when the link is lost)."""
        if not self.lost_reason:
            self._outbox.append(message)
            self._ready.set()

    async def write_loop(self) -> None:
        """Send queued messages until the link is lost (a send failure loses it: "peer_lost")."""
        try:
            while not self.lost_reason:
                if not self._outbox:
                    self._ready = anyio.Event()
                    await self._ready.wait()
                    continue
                async with self.channel.send_lock:  # the link may be lost (outbox cleared) meanwhile
                    if self._outbox:
                        await self.channel.send_frame(self._outbox.popleft())
        except ConnectionGone:
            self.lose("peer_lost")

    def lose(self, reason: str) -> None:
        """Close the connection for good (idempotent; the first reason stays)."""
        if not self.lost_reason:
            self.lost_reason = reason
            self._outbox.clear()
            self._ready.set()
            self.channel.close()


class Write:
    """One posted `DataPlane` write, polled by the transport until it is terminal. `done` is set
    then, with `state` DONE or FAILED and the handle released; or when the transport shut down
    with the write still PENDING (unconfirmed: its bytes may still land)."""

    __slots__ = ("handle", "state", "done")

    def __init__(self, handle: object) -> None:
        self.handle: object | None = handle
        self.state = WriteState.PENDING
        self.done = anyio.Event()

    def finish(self, state: WriteState) -> None:
        self.handle, self.state = None, state
        self.done.set()


class Sending:
    """A push on the sending side, from its announcement to its return. `go`: the receiver
    admitted it; `write`: the write in flight (or the last one); `answered`: the receiver's
    verdict arrived (so it needs no PushAbort)."""

    def __init__(self, out: OutgoingPush, link: Link) -> None:
        self.out = out
        self.link = link
        self.go = anyio.Event()
        self.write: Write | None = None
        self.answered = False


class Incoming:
    """A push this endpoint said "go" to, until its writes are known terminal (`settled` with
    `proven` True: it landed, or the sender reported every write terminal) or can no longer be
    known to be (`settled` with `proven` False: the link was lost, the transport shut down)."""

    def __init__(self, adm: Admission, link: Link, digests: list[str], exposure: object = None) -> None:
        self.adm = adm
        self.link = link
        self.digests = digests  # the sender's, when the manifest carries none
        self.exposure = exposure  # what the plane's `expose` returned for its dst pages
        self.settled = anyio.Event()
        self.proven = False

    def settle(self, proven: bool) -> None:
        if not self.settled.is_set():
            self.proven = proven
            self.settled.set()


def write_chunks(src_pages: list[int], dst_pages: list[int], page_nbytes: int,
                 chunk_nbytes: int) -> list[list[tuple[int, int, int]]]:
    """A push's bytes as `(src_offset, dst_offset, nbytes)` ranges, pages that are consecutive on
    both sides merged into one range, cut into chunks of at most `chunk_nbytes` (at least one
    page each), in push order."""
    per_chunk = max(1, chunk_nbytes // page_nbytes)
    chunks: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    pages = 0
    for dst, src, count in page_runs(dst_pages, src_pages):
        while count:
            take = min(count, per_chunk - pages)
            current.append((src * page_nbytes, dst * page_nbytes, take * page_nbytes))
            src, dst, count, pages = src + take, dst + take, count - take, pages + take
            if pages == per_chunk:
                chunks.append(current)
                current, pages = [], 0
    if current:
        chunks.append(current)
    return chunks


async def wait_any(*events: anyio.Event) -> None:
    """Return once any of `events` is set."""
    if any(event.is_set() for event in events):
        return
    async with anyio.create_task_group() as tg:
        async def wait(event: anyio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for event in events:
            tg.start_soon(wait, event)
