"""Shared helpers for the transport tests: records, manifests, and a started, paired sender and
receiver of one kind ("tcp" or "inprocess") over real torch pools.

Pools: `num_pages` pages of `page_floats` float32 (default 32 x 4 KiB); random on the sender,
zeros on the receiver. Both endpoints are closed when the context exits.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import torch

from kvfence.transports.base import EndpointInfo, PairingRecord, Peer, TransferManifest, Transport
from kvfence.transports.digest import page_digest
from kvfence.transports.inprocess import InProcessHub
from kvfence.transports.registry import create_transport

KINDS = ["tcp", "inprocess"]


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


def make_transport(kind: str, hub: InProcessHub) -> Transport:
    return create_transport(kind, hub=hub) if kind == "inprocess" else create_transport(kind)


def page_bytes(pool: torch.Tensor, page: int) -> torch.Tensor:
    return pool[page].reshape(-1).view(torch.uint8)


def digests_of(pool: torch.Tensor, pages: list[int]) -> list[str]:
    return [page_digest(page_bytes(pool, p).numpy().tobytes(), "xxh3_64") for p in pages]


@dataclass
class Pair:
    kind: str
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
            assert torch.equal(page_bytes(self.dst, d), page_bytes(self.src, s)), f"dst page {d} != src page {s}"
        self.assert_untouched(exclude=dst_pages)

    def assert_untouched(self, exclude: list[int] = ()) -> None:  # type: ignore[assignment]
        others = [p for p in range(self.dst.shape[0]) if p not in set(exclude)]
        changed = [p for p in others if page_bytes(self.dst, p).any()]
        assert not changed, f"dst pages {changed} were written"

    async def expect_and_push(self, src_pages: list[int], dst_pages: list[int], **changes: object):
        manifest = make_manifest(len(src_pages), **changes)
        self.rx.expect(manifest, dst_pages)
        assert self.peer is not None
        return manifest, await self.tx.push(self.peer, manifest, src_pages, dst_pages)


@asynccontextmanager
async def paired(kind: str, *, num_pages: int = 32, page_floats: int = 1024, pair: bool = True,
                 rx_record: PairingRecord | None = None, dst: torch.Tensor | None = None) -> AsyncIterator[Pair]:
    hub = InProcessHub()
    src = torch.randn(num_pages, page_floats, generator=torch.Generator().manual_seed(num_pages))
    dst = torch.zeros_like(src) if dst is None else dst
    with anyio.fail_after(30):  # a hang is a failure, not a stuck test run
        async with anyio.create_task_group() as tg:
            tx, rx = make_transport(kind, hub), make_transport(kind, hub)
            try:
                rx_info = await rx.start(tg, dst, rx_record or make_record(page_floats * 4))
                tx_info = await tx.start(tg, src, make_record(page_floats * 4))
                peer = await tx.pair(rx_info) if pair else None
                yield Pair(kind, hub, tx, rx, src, dst, tx_info, rx_info, peer)
            finally:
                await tx.aclose()
                await rx.aclose()
