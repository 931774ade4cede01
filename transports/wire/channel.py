"""A transport connection: a raw non-blocking socket (anyio wait_readable / wait_writable, so it
never blocks the event loop) carrying raw bytes (the handshake), frames (framing.py) and, for tcp,
page bytes; and how such sockets are opened, listened on and accepted.

Pool memory is never handed to the kernel across an await: every `recv_into` into a pool page and
every `send` from one is a synchronous call made right after asking the caller whether that is
still allowed (`target()` / `stop()`). So a cancellation processed between two steps takes effect
before the next byte is read from or written to the pool. Closed or failed sockets surface as
OSError (EOF is ConnectionResetError) or anyio.ClosedResourceError.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgspec

from kvfence.transports.core.digest import Hasher
from kvfence.transports.wire.framing import LEN_SIZE, MAX_FRAME, decode_frame, encode_frame, frame_length

SCRATCH_BYTES = 256 << 10
ConnectionGone = (OSError, anyio.ClosedResourceError, anyio.BrokenResourceError)


class Channel:
    """A connected socket. Sends: one task at a time, holding `send_lock`. Receives: one task."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.send_lock = anyio.Lock()
        self.closed = False
        self.last_recv_s = self.last_send_s = time.monotonic()  # for keep-alive (keepalive.py)
        self._owed_frame = memoryview(b"")  # rest of a frame whose sending was interrupted
        self._owed_pad = 0  # rest of a page whose sending was stopped or interrupted
        self._prefix = bytearray(LEN_SIZE)
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        self._zeros = memoryview(bytes(SCRATCH_BYTES))

    # -- sending (hold send_lock) ----------------------------------------------------------
    @property
    def settled(self) -> bool:
        """No frame or page is half sent: the next frame may start."""
        return not self._owed_frame and not self._owed_pad

    async def send_frame(self, frame: msgspec.Struct) -> None:
        if not self.settled:
            raise anyio.BrokenResourceError("a previous send was left unfinished")
        self._owed_frame = memoryview(encode_frame(frame))
        await self._flush()

    async def send_raw(self, data: bytes) -> None:
        """Send `data` as it is (the handshake before any frame)."""
        if not self.settled:
            raise anyio.BrokenResourceError("a previous send was left unfinished")
        self._owed_frame = memoryview(data)
        await self._flush()

    async def send_page(self, page: memoryview, hasher: Hasher, stop: Callable[[], bool]) -> bool:
        """Send `page`, feeding every sent chunk to `hasher`. Checks `stop()` before each read of
        `page`; when it is True returns False, leaving the rest owed (`settle` pads it)."""
        if not self.settled:
            raise anyio.BrokenResourceError("a previous send was left unfinished")
        self._owed_pad = len(page)
        sent = 0
        while sent < len(page):
            if stop():
                return False
            try:
                k = self.sock.send(page[sent:])
            except (BlockingIOError, InterruptedError):
                await anyio.wait_writable(self.sock)
                continue
            hasher.update(page[sent:sent + k])
            self.last_send_s = time.monotonic()
            sent += k
            self._owed_pad -= k
        return True

    async def settle(self) -> None:
        """Finish an interrupted frame and pad an unfinished page with zeros."""
        await self._flush()
        while self._owed_pad:
            self._owed_pad -= await self._send_some(self._zeros[:min(self._owed_pad, len(self._zeros))])

    async def _flush(self) -> None:
        while self._owed_frame:
            self._owed_frame = self._owed_frame[await self._send_some(self._owed_frame):]

    async def _send_some(self, data: memoryview) -> int:
        while True:
            try:
                k = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                await anyio.wait_writable(self.sock)
                continue
            self.last_send_s = time.monotonic()
            return k

    # -- receiving (one reader task) -------------------------------------------------------
    async def recv_frame(self, protocol: Any, limit: int = MAX_FRAME) -> Any:
        """The next frame, as one of the messages of `protocol` (a union of tagged structs, e.g.
        tcp/wire.py's `Frame`); ProtocolError when it is longer than `limit` or undecodable."""
        await self._recv_exact(len(self._prefix), lambda: memoryview(self._prefix))
        body = bytearray(frame_length(self._prefix, limit))
        await self._recv_exact(len(body), lambda: memoryview(body))
        return decode_frame(body, protocol)

    async def recv_raw(self, nbytes: int) -> bytes:
        """Exactly `nbytes` bytes (the handshake before any frame)."""
        buffer = bytearray(nbytes)
        await self._recv_exact(nbytes, lambda: memoryview(buffer))
        return bytes(buffer)

    async def recv_page(self, nbytes: int, target: Callable[[], memoryview | None]) -> None:
        """Read `nbytes` into `target()` (asked again before every read; a view of exactly
        `nbytes`), or into scratch, discarded, whenever it returns None."""
        await self._recv_exact(nbytes, target)

    async def _recv_exact(self, nbytes: int, target: Callable[[], memoryview | None]) -> None:
        got = 0
        while got < nbytes:
            dst = target()
            view = dst[got:nbytes] if dst is not None else self._scratch[:min(nbytes - got, len(self._scratch))]
            try:
                k = self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                await anyio.wait_readable(self.sock)
                continue
            if k == 0:
                raise ConnectionResetError("the peer closed the connection")
            self.last_recv_s = time.monotonic()
            got += k

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
