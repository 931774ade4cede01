"""`OneSidedTransport`: page bytes move by one-sided WRITEs through a `DataPlane` (NIXL,
Mooncake); a small TCP control channel (onesided/wire.py, over wire/) pairs endpoints and decides,
per push, whether and when the sender may write.

Pairing is tcp's (wire/listening.py): first the mutual authentication of wire/handshake.py (a
peer that does not prove the deployment secret gets nothing: no record, no plane descriptor),
then the connecting side sends its EndpointInfo, the listener refuses another transport or any
byte-defining record mismatch (naming the field), else answers with its own info and its plane
descriptor; the connecting side re-checks the record and the incarnation and `connect`s its
plane to the listener's registered pool.

A push: the sender announces the manifest and dst pages; the receiver `admit`s it against what it
expected (nothing expected, a duplicate or any mismatch is refused and nothing is written) and
answers "go"; only then does the sender post writes of its source page ranges into the dst page
ranges (pages consecutive on both sides merged), `write_chunk_bytes` at a time, each posted once
the previous one is DONE. The last write carries the transfer id as its notification (or, for a
plane without notifications, the sender sends "landed" once it is DONE); on that the receiver
recomputes the digests over the landed pages (`Receiver.finish`) and answers with the
verdict, which `push` returns. A write that fails (or fails to post) is reported to the receiver
at once ("write_failed"). As with tcp into a host pool, a push that fails verification leaves its
bytes in its dst pages: the verdict is what says they are not KV.

Cancellation: a posted WRITE cannot be stopped. The sender's `cancel` stops before the next write
and returns True once the write in flight is terminal; the receiver's `cancel` after "go" asks the
sender to stop and returns True once the writes are known terminal (the data landed, or the sender
reported every write terminal). Both wait at most `cancel_ack_timeout_s`, else return False: the
pages may still be read or written and must stay quarantined.

One task polls write states and notifications: quickly while writes are in flight or expected
(backing off to `poll_interval_s`), not at all when idle. A lost control connection fails its
transfers with "peer_lost" (a write already posted may still land: the receiver's `cancel` then
returns False); the next push to that peer pairs it again (same address and incarnation, with
backoff: wire/redial.py), unless the link was dropped because a write on it stayed unconfirmed.
Pools must be on the CPU: a CUDA pool would be registered with the plane directly (NIXL writes
VRAM), not staged through host memory, and verified by a digest over device memory; neither is
built yet.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ClassVar

import anyio
import torch
from anyio.abc import TaskGroup

from kvfence.transports.base import (EndpointInfo, PairingRecord, Peer, TransferManifest,
                                     TransferResult, TransportUnavailable)
from kvfence.transports.core.front_key import FrontPublicKey
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.onesided.data_plane import DataPlane, WriteState
from kvfence.transports.onesided.link import Link
from kvfence.transports.onesided.receive import ReceiverHalf
from kvfence.transports.onesided.send import SenderHalf
from kvfence.transports.onesided.wire import MAX_HELLO, Message
from kvfence.transports.wire.channel import Channel, ConnectionGone
from kvfence.transports.wire.framing import ProtocolError
from kvfence.transports.wire.listening import ListeningEndpoint
from kvfence.transports.wire.messages import Ping
from kvfence.transports.wire.pending import DEFAULT_MAX_UNAUTHENTICATED
from kvfence.transports.wire.redial import Redial

log = logging.getLogger(__name__)
LINGER_POLL_S = 0.01  # how often a plane is progressed for pushes that ended unproven only


def _pinger(link: Link) -> Callable[[], Awaitable[None]]:
    async def ping() -> None:
        link.send(Ping())  # queued behind what the link is sending anyway

    return ping


class OneSidedPeer(Peer):
    """`dialed`: what `pair` was given (the address dialed again to re-pair); `info`: what the
    peer answered; `link`: the current control link to it."""

    def __init__(self, owner: OneSidedTransport, dialed: EndpointInfo, info: EndpointInfo, link: Link) -> None:
        self.owner = owner
        self.dialed = dialed
        self.info = info
        self.link = link
        self.redial = Redial(f"{owner.name} peer {dialed.address}")


class OneSidedTransport(ListeningEndpoint):
    """Base of the one-sided transports; a subclass sets `name` and passes its plane (one per
    endpoint, not yet opened). `host`/`port`: where the control channel listens (port 0: an
    ephemeral one). `write_chunk_bytes`: the most a single write of a push moves (at least a
    page): it bounds how long one post or poll can hold the event loop where the plane copies
    inside the call (see nixl/plane.py), and how much a cancelled push still moves."""

    _messages: ClassVar[Any] = Message
    _max_hello_bytes: ClassVar[int] = MAX_HELLO

    def __init__(self, plane: DataPlane, host: str = "127.0.0.1", port: int = 0, *, secret: DeploymentSecret,
                 front_key: FrontPublicKey,
                 handshake_timeout_s: float = 10.0, keepalive_s: float = 30.0, max_connections: int = 64,
                 max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
                 cancel_ack_timeout_s: float = 5.0, write_chunk_bytes: int = 8 << 20,
                 poll_interval_s: float = 0.001) -> None:
        super().__init__(host, port, secret=secret, front_key=front_key, handshake_timeout_s=handshake_timeout_s,
                         keepalive_s=keepalive_s, max_connections=max_connections,
                         max_unauthenticated=max_unauthenticated, stage_through_host=False)
        for what, value in (("write_chunk_bytes", write_chunk_bytes), ("cancel_ack_timeout_s", cancel_ack_timeout_s),
                            ("poll_interval_s", poll_interval_s)):
            if not value > 0:
                raise ValueError(f"{what} must be positive, got {value!r}")
        self.plane = plane
        self.cancel_ack_timeout_s = cancel_ack_timeout_s
        self.poll_interval_s = poll_interval_s
        self._sender = SenderHalf(plane, self._outgoing, self._kick, write_chunk_bytes=write_chunk_bytes,
                                  cancel_ack_timeout_s=cancel_ack_timeout_s)
        self._rx: ReceiverHalf | None = None
        self._descriptor = b""
        self._wake = anyio.Event()
        self._peers: dict[str, Link] = {}  # links this endpoint opened, by peer address
        self._accepted: set[Link] = set()

    # -- serving ---------------------------------------------------------------------------
    async def start(self, task_group: TaskGroup, memory: torch.Tensor, record: PairingRecord) -> EndpointInfo:
        """Register the pool with the plane, listen, and serve in `task_group`.
        TransportUnavailable: a pool not on the CPU, a port that cannot be bound, a plane that
        cannot start."""
        if memory.device.type != "cpu":
            raise TransportUnavailable(
                f"the {self.name} transport takes a CPU pool, not one on {memory.device}: a device pool "
                f"would be registered with the plane directly, which is not supported yet; use tcp")
        pool_bytes = self._register(memory, record)
        self._rx = ReceiverHalf(self._started()[1], self._kick, self.plane)
        self._listen(record)
        try:
            try:
                self._descriptor = self.plane.open(pool_bytes.memory)
            except TransportUnavailable:
                raise
            except Exception as e:
                raise TransportUnavailable(f"the {self.plane.name} data plane did not start: {e}") from e
            await task_group.start(self._serve)
        except BaseException:
            self._shutdown()
            raise
        return self.info

    def _loops(self) -> list[Callable[[], Coroutine[Any, Any, None]]]:
        return [self._accept_loop, self._poll_loop]

    def _stop_serving(self) -> None:
        self._shutdown()

    async def _serve_connection(self, channel: Channel) -> None:
        """A sender connected: authenticate it, pair, then take its messages until the link ends."""
        assert self._tg is not None and self._rx is not None
        rx, reason, link = self._rx, "peer_lost", Link(channel)
        self._accepted.add(link)
        try:
            if (info := await self._answer_hello(channel, self._descriptor)) is not None:
                link.peer = info
                self._tg.start_soon(link.write_loop)
                self._keep_alive(channel, _pinger(link), "receiving link")
                while True:
                    rx.on_message(link, await channel.recv_frame(Message))
        except (ProtocolError, TimeoutError):  # before ConnectionGone: both are OSErrors
            reason = "protocol_error"
        except ConnectionGone:
            pass
        finally:
            self._accepted.discard(link)
            link.lose(reason)
            rx.drop_link(link, link.lost_reason)

    async def _serve_receiver(self, link: Link) -> None:
        """Take the answers of the receiver this endpoint paired with until the link ends."""
        try:
            while True:
                self._sender.on_message(link, await link.channel.recv_frame(Message))
        except ConnectionGone:  # includes ProtocolError
            pass
        finally:
            link.lose("peer_lost")
            self._sender.drop_link(link)

    # -- polling ---------------------------------------------------------------------------
    def _kick(self) -> None:
        self._wake.set()

    async def _poll_loop(self) -> None:
        """Poll write states and notifications while anything is in flight; sleep when idle.
        Pushes into this pool that ended unproven (`ReceiverHalf.lingering`) keep the plane
        progressing, at a slower pace, for a while: a write still in flight into it may need
        this end's progress to complete, and only its completion lets the sender quiet its pages."""
        delay = 0.0
        while True:
            rx = self._rx
            lingering = rx is not None and rx.linger(time.monotonic())
            if not self._sender.writes and not (rx is not None and rx.incoming) and not lingering:
                self._wake = anyio.Event()
                await self._wake.wait()
                delay = 0.0
                continue
            progressed = self._sender.poll_writes()
            if rx is not None and (notes := self.plane.notifications()):
                rx.on_notifications(notes)
                progressed = True
            if progressed:
                delay = 0.0
            elif self._sender.writes or (rx is not None and rx.incoming):
                delay = min(self.poll_interval_s, max(2 * delay, self.poll_interval_s / 16))
            else:
                delay = LINGER_POLL_S
            await anyio.sleep(delay)

    # -- pairing and pushing -----------------------------------------------------------------
    async def pair(self, peer: EndpointInfo) -> Peer:
        """Connect to `peer`, authenticate both ways and pair. PairingRefused on any mismatch
        (either side's verdict); AuthenticationFailed (a ConnectionError) when the peer does not
        prove the deployment secret; OSError (ConnectionError) when unreachable, not speaking this
        protocol (a listener that refused us just closes), or its data plane cannot be reached;
        TimeoutError when the handshake stalls."""
        link = await self._connect(peer)
        assert link.peer is not None
        return OneSidedPeer(self, peer, link.peer, link)

    async def _connect(self, peer: EndpointInfo) -> Link:
        """Dial and pair `peer` (see `pair`); the running link."""
        channel, reply = await self._dial(peer)
        link = Link(channel)
        try:
            link.plane_peer = self.plane.connect(reply.plane)
        except Exception as e:
            link.lose("peer_lost")
            raise ConnectionError(f"{peer.address}: cannot reach its {self.plane.name} data plane: {e}") from e
        link.peer = reply.info
        if (old := self._peers.pop(peer.address, None)) is not None:
            old.lose("peer_lost")
        self._peers[peer.address] = link
        tg = self._serving_group()
        tg.start_soon(link.write_loop)
        tg.start_soon(self._serve_receiver, link)
        self._keep_alive(link.channel, _pinger(link), "sending link")
        return link

    async def _current(self, peer: OneSidedPeer) -> Link:
        """The peer's link, re-paired first when it was lost (redial.py's backoff; a lost one is
        returned when re-pairing is not due or fails, and its pushes fail at once). A link this end
        dropped because a write on it stayed unconfirmed is not re-paired: the pair stays dropped
        until the front end pairs the workers again."""
        if not peer.link.alive and not peer.link.distrusted and not self._closed:
            if (link := await peer.redial.attempt(lambda: self._connect(peer.dialed))) is not None:
                peer.link = link
        return peer.link

    async def push(self, peer: Peer, manifest: TransferManifest, src_pages: list[int],
                   dst_pages: list[int]) -> TransferResult:
        """Write the pages and return the receiver's verdict ("cancelled" when either side
        cancelled it, "write_failed" when a write failed, "peer_lost" / "transport_closed" when a
        side went away). Returns (or raises, or ends cancelled) only once no write of the push is
        in flight: a write its plane keeps PENDING keeps the push waiting, until the pushing task
        is cancelled and `cancel_ack_timeout_s` passes (then the pair is dropped, and the write
        may still read the source pages). ValueError on bad arguments or a peer not paired by
        this endpoint."""
        pool_bytes = self._check_push(manifest, src_pages, dst_pages)
        if not isinstance(peer, OneSidedPeer) or peer.owner is not self:
            raise ValueError(f"push to a peer this {self.name} endpoint did not pair with")
        return await self._sender.push(await self._current(peer), pool_bytes, manifest, list(src_pages),
                                       list(dst_pages))

    async def cancel(self, transfer_id: str) -> bool:
        """Both halves. Receiving: un-expect it at once (a later announcement is refused); if it
        was told "go", ask the sender to stop. Sending: post no further write and read no further
        source page. True once no write of it can still land here or read there; False when that
        was not confirmed within `cancel_ack_timeout_s` (its pages must stay quarantined)."""
        inc = self._rx.cancel(transfer_id) if self._rx is not None else None
        write = self._sender.cancel(transfer_id)
        with anyio.move_on_after(self.cancel_ack_timeout_s):
            if inc is not None:
                await inc.settled.wait()
            if write is not None:
                await write.done.wait()
        return (inc is None or inc.proven) and (write is None or write.state is not WriteState.PENDING)

    async def wait_quiet(self, transfer_id: str) -> bool:
        """After `cancel` returned False: wait until every write this endpoint posted for the
        transfer is terminal (True: from then on none of its bytes can land anywhere or read the
        source), or the transport shut down first (False: never quiet). A receiving endpoint
        cannot learn that itself: for a push it said "go" to and lost track of, False."""
        if self._rx is not None and transfer_id in self._rx.unproven:
            return False
        return await self._sender.wait_quiet(transfer_id)

    # -- health and shutdown -----------------------------------------------------------------
    async def health(self) -> bool:
        """Serving, and every paired link is alive."""
        return self._serving() and all(link.alive for link in self._peers.values())

    async def aclose(self) -> None:
        """Fail everything pending ("transport_closed"); ask the senders writing into this pool to
        stop and wait up to `cancel_ack_timeout_s` for every write in flight, both ways, to be
        terminal; then stop the tasks, close the sockets and the plane. Idempotent."""
        if self._close_once():
            self._fail_pending()
            if self._rx is not None:
                self._rx.stop_all()
            if self._tg is not None:
                with anyio.move_on_after(self.cancel_ack_timeout_s):
                    while self._sender.writes or (self._rx is not None and self._rx.incoming):
                        await anyio.sleep(self.poll_interval_s)
                self._tg.cancel_scope.cancel()  # _serve shuts down on its way out
            else:
                self._shutdown()
        if self._tg is not None:
            await self._stopped.wait()

    def _shutdown(self) -> None:
        """Close links and listener, give up on writes still in flight, close the plane."""
        for link in [*self._peers.values(), *self._accepted]:
            link.lose("transport_closed")
        self._close_listener()
        self._sender.abandon()
        if self._rx is not None:
            self._rx.abandon()
        try:
            self.plane.close()
        except Exception:
            log.exception("closing the %s data plane failed", self.plane.name)
