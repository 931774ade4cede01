"""A kvfence connection: a raw non-blocking socket (anyio wait_readable / wait_writable, so it
never blocks the event loop) carrying, in clear, only the handshake (handshake.py), which then
`seal`s it: every later byte (frames of framing.py, a control channel's messages, tcp's page bytes)
travels inside the sealed records of seal.py, and a record that fails its check drops the
connection with a log line naming the peer. Also: how such sockets are opened, listened on and
accepted.

Pool memory is never handed to the kernel across an await, and no unauthenticated byte reaches it:
a page is sealed from the pool by a synchronous call made right after asking the caller whether
that is still allowed (`stop()`), and what arrives is opened into the channel's own buffer and
copied into pool memory only after its record passed, right after asking `target()`. So a
cancellation processed between two steps takes effect before the next byte is read from or
written to the pool. Closed or failed sockets surface as OSError (EOF is ConnectionResetError) or
anyio.ClosedResourceError; a broken seal as SealBroken (a ProtocolError, itself an OSError).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgspec

from kvfence.transports.core.digest import Hasher
from kvfence.transports.wire.framing import LEN_SIZE, MAX_FRAME, decode_frame, encode_frame, frame_length
from kvfence.transports.wire.seal import HEADER_BYTES, RECORD_MAX, WIRE_MAX, Opener, SealBroken, Sealer

log = logging.getLogger(__name__)

ConnectionGone = (OSError, anyio.ClosedResourceError, anyio.BrokenResourceError)
_ZEROS = bytes(RECORD_MAX)


class Channel:
    """A connected socket. Sends: one task at a time, holding `send_lock`. Receives: one task.
    Before `seal`, only `send_clear` / `recv_clear` (the handshake); after it, everything else."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.peer = peer_name(sock)
        self.send_lock = anyio.Lock()
        self.closed = False
        self.last_recv_s = self.last_send_s = time.monotonic()  # for keep-alive (keepalive.py)
        self._sealer: Sealer | None = None
        self._opener: Opener | None = None
        self._owed_wire = memoryview(b"")  # rest of sealed bytes whose sending was interrupted
        self._owed_pad = 0  # plaintext bytes of a page whose sending was stopped or interrupted
        # Allocated by `seal`, so a connection that never authenticates costs no more than its
        # socket: one sealed page record at a time, the record being received, the last record
        # opened and how much of it is consumed.
        self._wire_out = self._wire_in = self._plain = memoryview(b"")
        self._plain_at = self._plain_end = 0
        self._prefix = bytearray(LEN_SIZE)

    # -- sealing -----------------------------------------------------------------------------
    @property
    def sealed(self) -> bool:
        return self._sealer is not None

    def seal(self, send_key: bytes, recv_key: bytes) -> None:
        """From now on every byte either way travels sealed (handshake.py calls this once)."""
        self._frame(Sealer(send_key), Opener(recv_key))

    def frame_in_clear(self) -> None:
        """Instead of `seal`, with the sealing guard off (app/serve/guards.py; benchmarks only): from now on
        every byte travels in the same records, unencrypted and unauthenticated."""
        self._frame(Sealer.in_clear(), Opener.in_clear())

    def _frame(self, sealer: Sealer, opener: Opener) -> None:
        if self.sealed:
            raise RuntimeError("the channel is already sealed")
        self._sealer, self._opener = sealer, opener
        self._wire_out, self._wire_in = memoryview(bytearray(WIRE_MAX)), memoryview(bytearray(WIRE_MAX))
        self._plain = memoryview(bytearray(RECORD_MAX))

    def _sealed(self) -> tuple[Sealer, Opener]:
        if self._sealer is None or self._opener is None:
            raise RuntimeError("nothing but the handshake travels unsealed")
        return self._sealer, self._opener

    # -- sending (hold send_lock) ----------------------------------------------------------
    @property
    def settled(self) -> bool:
        """No message or page is half sent: the next one may start."""
        return not self._owed_wire and not self._owed_pad

    def _check_settled(self) -> None:
        if not self.settled:
            raise anyio.BrokenResourceError("a previous send was left unfinished")

    async def send_clear(self, data: bytes) -> None:
        """Send `data` as it is: the handshake, before `seal`."""
        self._check_settled()
        if self.sealed:
            raise RuntimeError("the channel is sealed: nothing more travels in clear")
        self._owed_wire = memoryview(data)
        await self._flush()

    async def send_bytes(self, data: bytes | bytearray) -> None:
        """Send `data` sealed (as many records as it needs, sealed before the first is sent)."""
        self._check_settled()
        sealer, _ = self._sealed()
        self._owed_wire = memoryview(sealer.seal(data))
        await self._flush()

    async def send_frame(self, frame: msgspec.Struct) -> None:
        await self.send_bytes(encode_frame(frame))

    async def send_page(self, page: memoryview, hasher: Hasher, stop: Callable[[], bool]) -> bool:
        """Send `page` sealed, a record at a time, feeding every sealed chunk to `hasher`. Checks
        `stop()` before each read of `page`; when it is True returns False, leaving the rest owed
        (`settle` pads it)."""
        self._check_settled()
        sealer, _ = self._sealed()
        self._owed_pad = len(page)
        sent = 0
        while sent < len(page):
            if stop():
                return False
            chunk = page[sent:sent + RECORD_MAX]
            self._owed_wire = self._wire_out[:sealer.seal_into(chunk, self._wire_out)]  # the page's only read
            hasher.update(chunk)
            sent += len(chunk)
            self._owed_pad -= len(chunk)
            await self._flush()
        return True

    async def settle(self) -> None:
        """Finish an interrupted message and pad an unfinished page with zeros."""
        await self._flush()
        while self._owed_pad:
            sealer, _ = self._sealed()
            n = min(self._owed_pad, RECORD_MAX)
            self._owed_wire = self._wire_out[:sealer.seal_into(_ZEROS[:n], self._wire_out)]
            self._owed_pad -= n
            await self._flush()

    async def _flush(self) -> None:
        while self._owed_wire:
            try:
                k = self.sock.send(self._owed_wire)
            except (BlockingIOError, InterruptedError):
                await anyio.wait_writable(self.sock)
                continue
            self.last_send_s = time.monotonic()
            self._owed_wire = self._owed_wire[k:]

    # -- receiving (one reader task) -------------------------------------------------------
    async def recv_frame(self, protocol: Any, limit: int = MAX_FRAME) -> Any:
        """The next frame, as one of the messages of `protocol` (a union of tagged structs, e.g.
        tcp/wire.py's `Frame`); ProtocolError when it is longer than `limit` or undecodable."""
        await self._recv_plain(len(self._prefix), lambda: memoryview(self._prefix))
        body = bytearray(frame_length(self._prefix, limit))
        await self._recv_plain(len(body), lambda: memoryview(body))
        return decode_frame(body, protocol)

    async def recv_bytes(self, nbytes: int) -> bytes:
        """Exactly `nbytes` bytes of the sealed stream."""
        buffer = bytearray(nbytes)
        await self._recv_plain(nbytes, lambda: memoryview(buffer))
        return bytes(buffer)

    async def recv_clear(self, nbytes: int) -> bytes:
        """Exactly `nbytes` bytes as they are: the handshake, before `seal`."""
        if self.sealed:
            raise RuntimeError("the channel is sealed: nothing more travels in clear")
        buffer = bytearray(nbytes)
        await self._recv_wire(memoryview(buffer))
        return bytes(buffer)

    async def recv_page(self, nbytes: int, target: Callable[[], memoryview | None]) -> None:
        """Read `nbytes` of the sealed stream into `target()` (asked again before every copy into
        it; a view of exactly `nbytes`), or drop them whenever it returns None."""
        await self._recv_plain(nbytes, target)

    async def _recv_plain(self, nbytes: int, target: Callable[[], memoryview | None]) -> None:
        """`nbytes` of plaintext, opened record by record, copied into `target()` (or dropped)."""
        got = 0
        while got < nbytes:
            if self._plain_at == self._plain_end:
                await self._open_record()
            n = min(nbytes - got, self._plain_end - self._plain_at)
            if (dst := target()) is not None:
                dst[got:got + n] = self._plain[self._plain_at:self._plain_at + n]
            self._plain_at += n
            got += n

    async def _open_record(self) -> None:
        _, opener = self._sealed()
        header = self._wire_in[:HEADER_BYTES]
        await self._recv_wire(header)
        body = self._wire_in[HEADER_BYTES:HEADER_BYTES + opener.body_nbytes(header)]
        await self._recv_wire(body)
        try:
            self._plain_end = opener.open_into(header, body, self._plain)
        except SealBroken as e:
            log.warning("connection with %s: %s (altered, injected, replayed, reordered or dropped on the way); "
                        "closing it", self.peer, e)
            self.close()
            raise
        self._plain_at = 0

    async def _recv_wire(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                k = self.sock.recv_into(view[got:])
            except (BlockingIOError, InterruptedError):
                await anyio.wait_readable(self.sock)
                continue
            if k == 0:
                raise ConnectionResetError("the peer closed the connection")
            self.last_recv_s = time.monotonic()
            got += k

    def has_unread(self) -> bool:
        """Bytes from the peer wait in the socket: this process, not the peer, was too busy to read
        them, so the peer is not silent (a keep-alive asks before it gives up on it)."""
        try:
            return bool(select.select([self.sock], [], [], 0)[0])
        except (OSError, ValueError):  # closed meanwhile
            return False

    # -- closing ---------------------------------------------------------------------------
    def close(self) -> None:
        """Close the socket, waking any task waiting on it (idempotent)."""
        if not self.closed:
            self.closed = True
            anyio.notify_closing(self.sock)
            self.sock.close()


def split_address(address: str) -> tuple[str, int]:
    """"host:port" or "[v6 host]:port" -> (host, port); ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"not a host:port address: {address!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


async def connect(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to host:port (OSError when unreachable)."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setblocking(False)
        try:
            sock.connect(addr)
        except (BlockingIOError, InterruptedError):
            await anyio.wait_writable(sock)
            if err := sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                raise OSError(err, f"connect to {host}:{port}: {os.strerror(err)}")
    except BaseException:
        sock.close()
        raise
    return sock


def peer_name(sock: socket.socket) -> str:
    """"host:port" of the socket's peer, for log lines ("an unknown peer" once it is gone)."""
    try:
        host, port = sock.getpeername()[:2]
    except (OSError, ValueError):
        return "an unknown peer"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(host: str, port: int) -> socket.socket:
    """A non-blocking listening socket (port 0: an ephemeral port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=128)
    sock.setblocking(False)
    return sock


async def accept_forever(listener: socket.socket, on_socket: Callable[[socket.socket], object]) -> None:
    """Hand every accepted connection to `on_socket` (e.g. to start a task) until the listener is
    closed. A transient failure (e.g. out of file descriptors) pauses and retries, so the
    connections already open keep being served."""
    while True:
        try:
            sock = await accept(listener)
        except anyio.ClosedResourceError:
            return
        except OSError:
            if listener.fileno() == -1:
                return
            await anyio.sleep(0.1)
            continue
        on_socket(sock)


async def accept(listener: socket.socket) -> socket.socket:
    while True:
        try:
            conn, _ = listener.accept()
            return conn
        except (BlockingIOError, InterruptedError):
            await anyio.wait_readable(listener)
