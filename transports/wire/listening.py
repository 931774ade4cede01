"""`ListeningEndpoint`: what the built-in transports that talk over sockets share (tcp and the
one-sided ones), on top of core/endpoint.py: a listening socket and its accept loop, the guards
of every accepted connection (a cap on connections, the peer handshake of handshake.py and the
pairing exchange inside the handshake timeout, the keep-alive of a paired one), and both sides of
pairing: dialing a peer and answering its Hello.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ClassVar

import anyio
from anyio.abc import TaskGroup, TaskStatus

from kvfence.transports.base import EndpointInfo, PairingRecord, PairingRefused, TransportUnavailable
from kvfence.transports.core.endpoint import Endpoint, check_pair, pairing_problem
from kvfence.transports.core.secret import AuthenticationFailed
from kvfence.transports.wire.channel import Channel, accept_forever, connect, listen, split_address
from kvfence.transports.wire.framing import ProtocolError
from kvfence.transports.wire.handshake import authenticate_as_connector, authenticate_as_listener
from kvfence.transports.wire.keepalive import keep_alive
from kvfence.transports.wire.messages import Hello, HelloReply
from kvfence.transports.wire.pending import DEFAULT_MAX_UNAUTHENTICATED, Unauthenticated

log = logging.getLogger(__name__)


class ListeningEndpoint(Endpoint):
    """A Endpoint that listens on `host`:`port` (port 0: an ephemeral one) and serves from a
    task group of its own, started inside the caller's: `_loops()` run there until `aclose`
    cancels it, then `_stop_serving()` closes what they used. `_tg` is that task group while it
    runs; `_stopped` is set once it ended. A subclass names the messages its connections carry
    (`_messages`, a union of tagged structs) and how long a frame may be before pairing
    (`_max_hello_bytes`), and serves each accepted connection in `_serve_connection`.

    `handshake_timeout_s`: the authentication and the pairing exchange of a connection, together,
    or it is closed. `keepalive_s`: a paired connection on which nothing arrives for this long is
    closed (keepalive.py). `max_connections`: authenticated connections open at once; one more is
    closed after its handshake. `max_unauthenticated`: connections not yet authenticated, counted
    apart (pending.py): one more closes the oldest of them. `sealed=False`: its connections are
    authenticated but not sealed (handshake.py), only with the sealing guard off (app/serve/guards.py)."""

    _messages: ClassVar[Any]
    _max_hello_bytes: ClassVar[int]

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, handshake_timeout_s: float = 10.0,
                 keepalive_s: float = 30.0, max_connections: int = 64,
                 max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED, sealed: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for what, value in (("handshake_timeout_s", handshake_timeout_s), ("keepalive_s", keepalive_s),
                            ("max_connections", max_connections)):
            if not value > 0:
                raise ValueError(f"{what} must be positive, got {value!r}")
        self.host, self.port = host, port
        self.handshake_timeout_s = handshake_timeout_s
        self.keepalive_s = keepalive_s
        self.max_connections = max_connections
        self.sealed = sealed
        self.refused_peers = 0  # connections closed because they did not authenticate
        self._listener: socket.socket | None = None
        self._authenticated: set[Channel] = set()  # counted against `max_connections`
        self._unauthenticated = Unauthenticated(f"{self.name} endpoint", max_unauthenticated)
        self._tg: TaskGroup | None = None
        self._stopped = anyio.Event()

    # -- listening ---------------------------------------------------------------------------
    def _listen(self, record: PairingRecord) -> EndpointInfo:
        """Listen on host:port and name the endpoint. TransportUnavailable when the address
        cannot be bound."""
        try:
            self._listener = listen(self.host, self.port)
        except OSError as e:
            raise TransportUnavailable(f"{self.name} transport cannot listen on {self.host}:{self.port}: {e}") from e
        shown = f"[{self.host}]" if ":" in self.host else self.host
        self._info = EndpointInfo(self.name, f"{shown}:{self._listener.getsockname()[1]}", record)
        return self._info

    def _serving(self) -> bool:
        """Listening, its task group running, and not closed."""
        return (self._listener is not None and self._listener.fileno() != -1 and self._tg is not None
                and not self._closed and not self._stopped.is_set())

    def _serving_group(self) -> TaskGroup:
        """The task group `_serve` runs (RuntimeError before `start` served)."""
        if self._tg is None:
            raise RuntimeError(f"{self.name} transport is not serving")
        return self._tg

    def _close_listener(self) -> None:
        """Close the listening socket and every accepted connection still unauthenticated."""
        if self._listener is not None and self._listener.fileno() != -1:
            anyio.notify_closing(self._listener)
            self._listener.close()
        self._unauthenticated.close_all()

    async def _accept_loop(self) -> None:
        assert self._listener is not None and self._tg is not None
        await accept_forever(self._listener, self._on_accept)

    # -- accepted connections ----------------------------------------------------------------
    def _on_accept(self, sock: socket.socket) -> None:
        """Serve an accepted socket with `_serve_connection` (which answers the pairing first,
        see `_answer_hello`), counted as unauthenticated until its handshake passed."""
        channel = Channel(sock)
        if self._tg is None:
            channel.close()
            return
        self._unauthenticated.admit(channel)
        self._tg.start_soon(self._serve_accepted, channel)

    async def _serve_accepted(self, channel: Channel) -> None:
        try:
            await self._serve_connection(channel)
        finally:
            self._authenticated.discard(channel)
            self._unauthenticated.authenticated(channel)
            channel.close()

    async def _serve_connection(self, channel: Channel) -> None:
        raise NotImplementedError

    async def _answer_hello(self, channel: Channel, plane: bytes = b"") -> EndpointInfo | None:
        """The listening side of pairing, within the handshake timeout: authenticate the peer (one
        that does not prove the deployment secret gets nothing more), then answer its Hello:
        refuse another transport or any byte-defining record mismatch (naming the field; the
        connection then ends), else send this endpoint's info and `plane` (a one-sided
        transport's data-plane descriptor). The peer's info when paired, else None.
        ProtocolError for anything but a Hello, TimeoutError (logged, naming the peer) when the
        handshake stalls."""
        try:
            with anyio.fail_after(self.handshake_timeout_s):
                if not await self._authenticate(channel):
                    return None
                hello = await channel.recv_frame(self._messages, self._max_hello_bytes)
                if not isinstance(hello, Hello):
                    raise ProtocolError(f"expected hello, got {type(hello).__name__}")
                problem = pairing_problem(self.info, hello.info)
                reply = HelloReply(accepted=problem is None, reason=problem or "", info=self.info,
                                   plane=b"" if problem else plane)
                async with channel.send_lock:
                    await channel.send_frame(reply)
        except TimeoutError:
            log.warning("%s endpoint %s: connection from %s did not finish pairing within %g s; closing it",
                        self.name, self.info.address, channel.peer, self.handshake_timeout_s)
            raise
        return None if problem else hello.info

    async def _authenticate(self, channel: Channel) -> bool:
        """The listening side of the handshake (call inside the handshake timeout). False, logged,
        when the peer did not prove the deployment secret: send it nothing more."""
        try:
            await authenticate_as_listener(channel, self.secret, self.name, sealed=self.sealed)
        except AuthenticationFailed as e:
            self.refused_peers += 1
            log.warning("%s endpoint %s: refused a connection from %s: %s", self.name, self.info.address,
                        channel.peer, e)
            return False
        self._unauthenticated.authenticated(channel)
        if len(self._authenticated) >= self.max_connections:
            log.warning("%s endpoint %s: %d authenticated connections open (the cap): closing a new one from %s",
                        self.name, self.info.address, len(self._authenticated), channel.peer)
            return False
        self._authenticated.add(channel)
        return True

    def _keep_alive(self, channel: Channel, ping: Callable[[], Awaitable[None]], what: str) -> None:
        """Run the keep-alive of a paired connection in the endpoint's task group."""
        if self._tg is not None:
            self._tg.start_soon(keep_alive, channel, ping, self.keepalive_s, f"{self.name} {what} ({channel.peer})")

    # -- dialing -------------------------------------------------------------------------------
    async def _dial(self, peer: EndpointInfo) -> tuple[Channel, HelloReply]:
        """The connecting side of pairing: connect to `peer`, authenticate both ways and send our
        Hello, within the handshake timeout; the channel and the peer's reply, checked (see
        `_check_hello_reply`). The channel is closed when anything fails: RuntimeError when not
        serving, PairingRefused, AuthenticationFailed (a ConnectionError) when the peer does not
        prove the deployment secret, OSError when unreachable or not speaking this protocol,
        TimeoutError when the handshake stalls."""
        self._check_pairable(peer)
        with anyio.fail_after(self.handshake_timeout_s):  # an address that drops SYNs, too
            channel = Channel(await connect(*split_address(peer.address)))
        try:  # ProtocolError (an undecodable reply) is a ConnectionError too
            with anyio.fail_after(self.handshake_timeout_s):
                try:
                    await authenticate_as_connector(channel, self.secret, self.name, sealed=self.sealed)
                except AuthenticationFailed as e:
                    raise AuthenticationFailed(f"{peer.address}: {e}") from None
                async with channel.send_lock:
                    await channel.send_frame(Hello(self.info))
                reply = self._check_hello_reply(peer, await channel.recv_frame(self._messages, self._max_hello_bytes))
        except BaseException as e:
            if isinstance(e, TimeoutError):
                log.warning("%s endpoint %s: pairing with %s did not finish within %g s; closing the connection",
                            self.name, self.info.address, channel.peer, self.handshake_timeout_s)
            channel.close()
            raise
        return channel, reply

    def _check_pairable(self, peer: EndpointInfo) -> None:
        """Before dialing `peer`: RuntimeError when not serving, PairingRefused for another transport."""
        if self._tg is None or self._closed or self._stopped.is_set():
            raise RuntimeError(f"{self.name} transport is not serving")
        if peer.transport != self.name:
            raise PairingRefused(f"transport: {self.name!r} != {peer.transport!r}")

    def _check_hello_reply(self, peer: EndpointInfo, reply: object) -> HelloReply:
        """The peer's answer to our Hello, checked: ConnectionError for anything but a HelloReply,
        PairingRefused when it refused, its record does not match ours, or it is another incarnation
        than `peer` announced; RuntimeError when this endpoint closed meanwhile."""
        if not isinstance(reply, HelloReply):
            raise ConnectionError(f"{peer.address}: expected hello_reply, got {type(reply).__name__}")
        check_pair(self.info, peer, None if reply.accepted else reply.reason, reply.info)
        if self._closed or self._stopped.is_set():
            raise RuntimeError(f"{self.name} transport closed while pairing")
        return reply

    # -- serving -------------------------------------------------------------------------------
    def _loops(self) -> list[Callable[[], Coroutine[Any, Any, None]]]:
        return [self._accept_loop]

    def _stop_serving(self) -> None:
        raise NotImplementedError

    async def _serve(self, *, task_status: TaskStatus[None]) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for loop in self._loops():
                    tg.start_soon(loop)
                task_status.started()
        finally:
            self._stop_serving()
            self._stopped.set()

