"""A relay between the two ends of a kvfence connection that forwards the handshake unchanged (as
an attacker on the path, or one who redirected an address, would) and then does one thing to one
record: flip a bit of it, replay it, swap it with the next, drop it, or cut it short. Or, as only
an end could (`ALTER`), change a byte of its plaintext and seal it again: what a flip between the
sender's digest and its seal would do, for the digest check behind the seal to catch.

To pick its record the relay reads the traffic with the keys the ends wrote to their key log
(`KVFENCE_KEYLOG_FILE`, the `keylog` fixture): a test oracle, so a test can aim at every kind of
message. A real relay holds no key (not even the deployment secret would do: the keys also come
from the handshake's ephemeral exchange); `wire` keeps every byte it saw
in each direction after the handshake, and `plain` what the oracle opened of them, so a test can
show that the wire contains none of the plaintext. `kind` may be set while it runs (to tamper
from then on).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvfence.app.remote.protocol import HANDSHAKE_LABEL
from kvfence.transports.core.front_key import SIGNATURE_BYTES
from kvfence.transports.core.secret import MAC_BYTES, PART_BYTES
from kvfence.transports.wire.channel import split_address
from kvfence.transports.wire.framing import LEN_SIZE, ProtocolError, decode_frame, frame_length
from kvfence.transports.wire.handshake import KEYLOG_ENV, MAGIC
from kvfence.transports.wire.seal import HEADER_BYTES, TAG_BYTES, Opener, Sealer

OPS = ("flip", "replay", "reorder", "drop", "truncate")
ALTER = "alter"  # only a holder of the keys could: flip a byte of the plaintext and seal it again
TO_LISTENER, TO_CONNECTOR = "to_listener", "to_connector"


def frame_namer(protocol: object) -> Callable[[bytes], str]:
    """What a record's plaintext carries: the class name of the frame of `protocol` (a union of
    tagged structs) it holds whole, else "page bytes"."""
    def name_of(plain: bytes) -> str:
        try:
            if len(plain) == LEN_SIZE + frame_length(plain[:LEN_SIZE]):
                return type(decode_frame(plain[LEN_SIZE:], protocol)).__name__
        except (ProtocolError, ValueError):
            pass
        return "page bytes"
    return name_of


def keylog_in_use() -> Path:
    """The key log this process's connections write to (the `keylog` fixture sets it)."""
    path = os.environ.get(KEYLOG_ENV)
    assert path, f"{KEYLOG_ENV} is not set: use the keylog fixture"
    return Path(path)


def _read(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


class TamperingRelay:
    """Listens on loopback; each accepted connection is relayed to `target`, from a thread that
    runs while the relay is entered as a context manager.

    `name_of(plaintext)`: what a record carries (e.g. a frame's tag). The relay does `op` to the
    first record going `direction` whose name is `kind` (None: tampers with nothing), once; after
    that it forwards everything as it is. `names[direction]` lists what passed, in order.
    `tampered` is set when the op was done; `closed_after_tampering` once the end that got the
    tampered traffic closed its side of the connection."""

    def __init__(self, target: str, keylog: Path, label: str, name_of: Callable[[bytes], str],
                 kind: str | None = None, op: str = "flip", direction: str = TO_LISTENER) -> None:
        if op not in (*OPS, ALTER):
            raise ValueError(f"op {op!r} not in {OPS} or {ALTER!r}")
        self.target, self.keylog, self.label, self.name_of = target, keylog, label, name_of
        self.kind, self.op, self.direction = kind, op, direction
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.names: dict[str, list[str]] = {TO_LISTENER: [], TO_CONNECTOR: []}
        self.wire: dict[str, bytearray] = {TO_LISTENER: bytearray(), TO_CONNECTOR: bytearray()}
        self.plain: dict[str, bytearray] = {TO_LISTENER: bytearray(), TO_CONNECTOR: bytearray()}  # the oracle's
        self.tampered = threading.Event()
        self.closed_after_tampering = threading.Event()
        self.upstream_local = ""  # the relay's address as the listening end sees it (first connection)
        self._stop = threading.Event()
        self._server = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> TamperingRelay:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._server.join(timeout=5)
        self.listener.close()

    def _serve(self) -> None:
        self.listener.settimeout(0.1)  # so the loop sees `_stop`: closing does not wake accept()
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, conn: socket.socket) -> None:
        upstream = socket.create_connection(split_address(self.target))
        host, port = upstream.getsockname()[:2]
        self.upstream_local = self.upstream_local or f"{host}:{port}"
        with conn, upstream:
            try:  # the handshake, unchanged
                opening = _read(conn, len(MAGIC) + PART_BYTES)
                upstream.sendall(opening)
                conn.sendall(_read(upstream, PART_BYTES + MAC_BYTES))
                front_signed = SIGNATURE_BYTES if self.label == HANDSHAKE_LABEL else 0
                upstream.sendall(_read(conn, MAC_BYTES + front_signed))
            except OSError:
                return
            keys = self._logged_keys(opening[len(MAGIC):])
            back = threading.Thread(target=self._pipe, args=(upstream, conn, TO_CONNECTOR, keys[1]), daemon=True)
            back.start()
            self._pipe(conn, upstream, TO_LISTENER, keys[0])
            back.join(timeout=10)

    def _logged_keys(self, connector_part: bytes) -> tuple[bytes, bytes]:
        """(to the listener, to the connector) of the connection that opened with this
        contribution, as its ends logged them."""
        want, deadline = f"{self.label} {connector_part.hex()} ", time.monotonic() + 10
        while time.monotonic() < deadline:
            lines = self.keylog.read_text().splitlines() if self.keylog.exists() else []
            for line in lines:
                if line.startswith(want):
                    to_listener, to_connector = line.split()[2:4]
                    return bytes.fromhex(to_listener), bytes.fromhex(to_connector)
            time.sleep(0.01)
        raise AssertionError(f"no end logged the keys of a {self.label} connection in {self.keylog}: is "
                             f"KVFENCE_KEYLOG_FILE set for the processes under test?")

    def _pipe(self, src: socket.socket, dst: socket.socket, direction: str, key: bytes) -> None:
        oracle, resealer, held = Opener(key), Sealer(key), b""
        try:
            while True:
                header = _read(src, HEADER_BYTES)
                record = header + _read(src, Opener.body_nbytes(header))
                self.wire[direction] += record
                plain = bytearray(len(record))
                n = oracle.open_into(header, record[HEADER_BYTES:], memoryview(plain))
                self.plain[direction] += plain[:n]
                name = self.name_of(bytes(plain[:n]))
                self.names[direction].append(name)
                if self.op == ALTER:  # every record sealed again, so the sequence stays in step
                    if not self.tampered.is_set() and direction == self.direction and name == self.kind:
                        self.tampered.set()
                        plain[n // 3] ^= 0x01
                    dst.sendall(resealer.seal(memoryview(plain)[:n]))
                    continue
                if held:  # a reordered record goes right after the one that followed it
                    dst.sendall(record + held)
                    held = b""
                    continue
                if self.tampered.is_set() or direction != self.direction or name != self.kind:
                    dst.sendall(record)
                    continue
                self.tampered.set()
                if self.op == "flip":
                    dst.sendall(record[:-TAG_BYTES - 1] + bytes([record[-TAG_BYTES - 1] ^ 1]) + record[-TAG_BYTES:])
                elif self.op == "replay":
                    dst.sendall(record + record)
                elif self.op == "reorder":
                    held = record
                elif self.op == "truncate":
                    dst.sendall(record[:len(record) // 2])
                    break
                # drop: nothing
        except OSError:
            pass
        finally:
            for sock in (dst, src):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if self.tampered.is_set():
                self.closed_after_tampering.set()
