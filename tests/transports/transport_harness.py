"""Shared helpers for the transport tests: records, manifests, and a started, paired sender and
receiver of one kind over real torch pools.

Kinds: "tcp" and "inprocess", and "tcp+staged" / "inprocess+staged": the same transports with both
pools staged through host memory (`stage_through_host=True`, as a CUDA pool is), the sender staging
`STAGE_CHUNK_PAGES` pages at a time, so every test of a kind also covers the staged path on a CPU.
`Pair.kind` is the transport's name, `Pair.staged` the mode.

"nixl" and "mooncake": one-sided WRITEs through NIXL or the Mooncake transfer engine (skipped
where the package is not installed), with writes of `ONESIDED_WRITE_CHUNK_PAGES` pages so that a
push of several pages is several writes, as a large one is. There is no "nixl+staged": the staged path lands a push in host buffers allocated per transfer
and copies the sender's pages into buffers of its own, but a one-sided write can only go from and
to memory both planes registered (and exchanged) when they paired; a GPU pool would be registered
with NIXL directly instead (the transport refuses pools that are not on the CPU for now).

Pools: `num_pages` pages of `page_floats` float32 (default 32 x 4 KiB); random on the sender,
zeros on the receiver; on the CPU unless `devices` names others (e.g. CUDA, which transports stage
through host memory on their own). Both endpoints are closed when the context exits.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import pytest
import torch

from kvfence.transports.base import EndpointInfo, PairingRecord, Peer, TransferManifest, Transport
from kvfence.transports.core.digest import page_digest
from front_keys import FRONT

from kvfence.transports.core.front_key import FrontKey
from kvfence.transports.core.secret import MAC_BYTES, PART_BYTES, DeploymentSecret
from kvfence.transports.inprocess import InProcessHub
from kvfence.transports.registry import create_transport
from kvfence.transports.wire.handshake import MAGIC, contribution, opening, shared_secret
from kvfence.transports.wire.seal import HEADER_BYTES, Opener, Sealer

# The deployment secret every endpoint these tests make shares (tests of a stranger make their own).
TEST_SECRET = DeploymentSecret.generate()
TEST_FRONT = FRONT  # the test deployment's front end key: it signs capabilities
LISTENING = ["tcp", "nixl", "mooncake"]  # the transports with a listening socket

# A third-party transport runs the same suites on itself: install it (entry point group
# `kvfence.transports`) and name it in KVFENCE_CONFORMANCE_TRANSPORTS (comma-separated), e.g.
#   KVFENCE_CONFORMANCE_TRANSPORTS=mine .venv/bin/python -m pytest tests/transports -k mine
# Its constructor is called with one keyword argument, `secret` (the deployment's DeploymentSecret).
KINDS = ["tcp", "inprocess", "tcp+staged", "inprocess+staged", "nixl", "mooncake",
         *[k.strip() for k in os.environ.get("KVFENCE_CONFORMANCE_TRANSPORTS", "").split(",") if k.strip()]]
ONESIDED_PACKAGES = {"nixl": "nixl", "mooncake": "mooncake"}  # transport -> the module it needs
STAGE_CHUNK_PAGES = 3  # not a divisor of the default 32 pages: the last chunk is partial
ONESIDED_WRITE_CHUNK_PAGES = 5  # neither: the last write of a 32-page push is partial


def make_record(page_nbytes: int = 4096, **changes: object) -> PairingRecord:
    fields: dict[str, object] = dict(
        model="tiny@abc", dtype="float32", page_size_tokens=16, page_nbytes=page_nbytes,
        page_layout="pages,layers,kv,kv_heads,page_size,head_dim", digest="xxh3_64",
        max_context_tokens=2048, incarnation=secrets.token_hex(8))
    fields.update(changes)
    return PairingRecord(**fields)  # type: ignore[arg-type]


def make_manifest(num_pages: int, **changes: object) -> TransferManifest:
    fields: dict[str, object] = dict(
        transfer_id=secrets.token_hex(16), lease=secrets.token_hex(16), nonce=secrets.token_hex(16),
        num_tokens=num_pages * 16 - 3, num_pages=num_pages)
    fields.update(changes)
    return TransferManifest(**fields)  # type: ignore[arg-type]


def split_kind(kind: str) -> tuple[str, bool]:
    """"tcp+staged" -> ("tcp", True); "tcp" -> ("tcp", False)."""
    name, _, mode = kind.partition("+")
    if mode not in ("", "staged"):
        raise ValueError(f"unknown transport test kind {kind!r}")
    return name, mode == "staged"


def signed(manifest: TransferManifest, dst_pages: list[int], receiver: EndpointInfo,
           front_key: FrontKey = TEST_FRONT) -> TransferManifest:
    """`manifest` with the capability the planner would mint for a push into `dst_pages` of `receiver`."""
    import msgspec

    return msgspec.structs.replace(
        manifest, capability=front_key.capability(manifest, dst_pages, receiver.record.incarnation))


def make_transport(kind: str, hub: InProcessHub, page_nbytes: int = 4096, **extra: object) -> Transport:
    name, staged = split_kind(kind)
    options: dict[str, object] = {"hub": hub} if name == "inprocess" else {}
    options.update({"secret": TEST_SECRET, "front_key": TEST_FRONT.public, **extra})
    if name in ONESIDED_PACKAGES:
        if importlib.util.find_spec(ONESIDED_PACKAGES[name]) is None:
            pytest.skip(f"{name} is not installed")
        options.update(write_chunk_bytes=ONESIDED_WRITE_CHUNK_PAGES * page_nbytes)
    if staged:
        options.update(stage_through_host=True, stage_chunk_bytes=STAGE_CHUNK_PAGES * page_nbytes)
    return create_transport(name, **options)


def page_bytes(pool: torch.Tensor, page: int) -> torch.Tensor:
    return pool[page].reshape(-1).view(torch.uint8)


def digests_of(pool: torch.Tensor, pages: list[int]) -> list[str]:
    return [page_digest(page_bytes(pool, p).cpu().numpy().tobytes(), "xxh3_64") for p in pages]


@dataclass
class Pair:
    kind: str  # the transport's name
    staged: bool
    hub: InProcessHub
    tx: Transport
    rx: Transport
    src: torch.Tensor
    dst: torch.Tensor
    tx_info: EndpointInfo
    rx_info: EndpointInfo
    peer: Peer | None

    def assert_landed(self, src_pages: list[int], dst_pages: list[int]) -> None:
        """Each dst page holds its src page's bytes; every other dst page is still zero."""
        for s, d in zip(src_pages, dst_pages, strict=True):
            landed, sent = page_bytes(self.dst, d).cpu(), page_bytes(self.src, s).cpu()  # pools may be on devices
            assert torch.equal(landed, sent), f"dst page {d} != src page {s}"
        self.assert_untouched(exclude=dst_pages)

    def assert_untouched(self, exclude: list[int] = ()) -> None:  # type: ignore[assignment]
        others = [p for p in range(self.dst.shape[0]) if p not in set(exclude)]
        changed = [p for p in others if page_bytes(self.dst, p).any()]
        assert not changed, f"dst pages {changed} were written"

    def receiving(self, manifest: TransferManifest) -> bool:
        """The push of `manifest` is under way at the receiver: its first page shows in the pool,
        or, staged (where bytes reach the pool only once the whole transfer verified), the
        receiver admitted it."""
        if self.staged:
            return self.rx._receiver.state.receiving(manifest.transfer_id)  # type: ignore[attr-defined]
        return bool(page_bytes(self.dst, 0).any())

    def arm(self, manifest: TransferManifest, dst_pages: list[int]) -> TransferManifest:
        """Sign `manifest` for `dst_pages` of the receiver (as the planner does), `expect` it
        there, and return the signed manifest (the one to push)."""
        manifest = signed(manifest, dst_pages, self.rx_info)
        self.rx.expect(manifest, dst_pages)
        return manifest

    async def expect_and_push(self, src_pages: list[int], dst_pages: list[int], **changes: object):
        manifest = self.arm(make_manifest(len(src_pages), **changes), dst_pages)
        assert self.peer is not None
        return manifest, await self.tx.push(self.peer, manifest, src_pages, dst_pages)


@asynccontextmanager
async def paired(kind: str, *, num_pages: int = 32, page_floats: int = 1024, pair: bool = True,
                 rx_record: PairingRecord | None = None, dst: torch.Tensor | None = None,
                 devices: tuple[str, str] = ("cpu", "cpu"), **options: object) -> AsyncIterator[Pair]:
    """`options`: passed to both transports' constructors (e.g. keepalive_s)."""
    hub = InProcessHub()
    name, staged = split_kind(kind)
    src = torch.randn(num_pages, page_floats, generator=torch.Generator().manual_seed(num_pages))
    dst = torch.zeros_like(src) if dst is None else dst
    src, dst = src.to(devices[0]), dst.to(devices[1])
    with anyio.fail_after(30):  # a hang is a failure, not a stuck test run
        async with anyio.create_task_group() as tg:
            tx, rx = (make_transport(kind, hub, page_floats * 4, **options),
                      make_transport(kind, hub, page_floats * 4, **options))
            try:
                rx_info = await rx.start(tg, dst, rx_record or make_record(page_floats * 4))
                tx_info = await tx.start(tg, src, make_record(page_floats * 4))
                peer = await tx.pair(rx_info) if pair else None
                yield Pair(name, staged, hub, tx, rx, src, dst, tx_info, rx_info, peer)
            finally:
                await tx.aclose()
                await rx.aclose()


class MooncakeStranger:
    """A Mooncake engine in a process outside the deployment: it knows a plane's session id (the
    engine's own handshake port, which a port scan finds) and nothing else. Its buffer is 0xAB;
    `write` sends a page of it, `read` fetches a page into it (each returns the engine's rc)."""

    PAGE = 4096

    def __init__(self) -> None:
        from mooncake import engine as mooncake_engine

        self.engine = mooncake_engine.TransferEngine()
        assert self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        self.buffer = torch.full((self.PAGE,), 0xAB, dtype=torch.uint8)
        assert self.engine.register_memory(self.buffer.data_ptr(), self.buffer.nbytes) == 0

    def write(self, session: str, address: int) -> int:
        return self.engine.transfer_sync_write(session, self.buffer.data_ptr(), address, self.PAGE)

    def read(self, session: str, address: int) -> int:
        return self.engine.transfer_sync_read(session, self.buffer.data_ptr(), address, self.PAGE)


class SealedSocket:
    """A blocking socket past the handshake, speaking sealed records as a deployment member would:
    `sendall` seals, `recv_until_closed` opens every record that arrives."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes) -> None:
        self.sock = sock
        self.sealer, self.opener = Sealer(send_key), Opener(recv_key)

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(self.sealer.seal(data))

    def recv_record(self) -> bytes:
        """The plaintext of the next record (blocking)."""
        header = recv_exactly(self.sock, HEADER_BYTES)
        body = recv_exactly(self.sock, Opener.body_nbytes(header))
        out = bytearray(len(body))
        return bytes(out[:self.opener.open_into(header, body, memoryview(out))])

    def recv_until_closed(self) -> bytes:
        """The plaintext of every record until the peer closes (a record cut short: dropped)."""
        wire, plain = recv_until_closed(self.sock), b""
        while len(wire) >= HEADER_BYTES:
            header, n = wire[:HEADER_BYTES], Opener.body_nbytes(wire[:HEADER_BYTES])
            if len(wire) < HEADER_BYTES + n:
                break
            out = bytearray(n)
            k = self.opener.open_into(header, wire[HEADER_BYTES:HEADER_BYTES + n], memoryview(out))
            plain, wire = plain + bytes(out[:k]), wire[HEADER_BYTES + n:]
        return plain


def raw_authenticate(sock: socket.socket, secret: DeploymentSecret = TEST_SECRET,
                     transport: str = "tcp") -> SealedSocket:
    """The connecting side of the peer handshake over a blocking socket (what a deployment member
    sends), then sealed as it is; AssertionError when the listener's proof does not verify."""
    mine, ephemeral = contribution()
    sock.sendall(opening(mine))
    answer = recv_exactly(sock, PART_BYTES + MAC_BYTES)
    theirs, mac = answer[:PART_BYTES], answer[PART_BYTES:]
    assert secret.proves(mac, "listener", transport, mine, theirs)
    sock.sendall(secret.proof("connector", transport, mine, theirs))
    return SealedSocket(sock, *secret.session_keys(transport, mine, theirs, shared_secret(ephemeral, theirs)))


def raw_listen_authenticated(conn: socket.socket, secret: DeploymentSecret = TEST_SECRET,
                             transport: str = "tcp") -> SealedSocket:
    """The listening side of the peer handshake over a blocking socket, then sealed."""
    theirs = recv_exactly(conn, len(MAGIC) + PART_BYTES)[len(MAGIC):]
    mine, ephemeral = contribution()
    conn.sendall(mine + secret.proof("listener", transport, theirs, mine))
    assert secret.proves(recv_exactly(conn, MAC_BYTES), "connector", transport, theirs, mine)
    to_listener, to_connector = secret.session_keys(transport, theirs, mine, shared_secret(ephemeral, theirs))
    return SealedSocket(conn, to_connector, to_listener)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def recv_until_closed(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes or resets the connection (the socket's timeout
    bounds each read)."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:  # closed with what we sent still unread: the same to us
        pass
    return b"".join(chunks)
