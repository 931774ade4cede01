"""One 256 MiB push per transport kind: 256 pages of 1 MiB on both sides, every page moved, the
destination compared byte for byte. The pages are mapped with a rotation (src i -> dst i + 128),
so the push is two runs of consecutive pages, which one-sided planes merge into long ranges and
then cut into writes. The pools are freed as soon as a kind is done (this is ~0.5-1 GiB each)."""

from __future__ import annotations

import gc

import anyio
import pytest
import torch
from transport_harness import KINDS, make_manifest, paired

pytestmark = pytest.mark.anyio
NUM_PAGES = 256
PAGE_FLOATS = 1 << 18  # 1 MiB pages: 256 MiB pools


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


async def test_a_256_mib_push_lands_byte_for_byte(kind: str) -> None:
    await push_every_page(kind)  # the pools go when it returns
    gc.collect()


async def push_every_page(kind: str) -> None:
    src_pages = list(range(NUM_PAGES))
    dst_pages = [(p + NUM_PAGES // 2) % NUM_PAGES for p in src_pages]
    async with paired(kind, num_pages=NUM_PAGES, page_floats=PAGE_FLOATS) as p:
        assert p.src.nbytes == p.dst.nbytes == 256 << 20
        manifest = make_manifest(NUM_PAGES)
        manifest = p.arm(manifest, dst_pages)
        assert p.peer is not None
        with anyio.fail_after(25):
            result = await p.tx.push(p.peer, manifest, src_pages, dst_pages)
        assert result.ok, result
        assert await p.rx.completion(manifest.transfer_id) == result
        for s, d in zip(src_pages, dst_pages, strict=True):  # page by page: no 256 MiB temporaries
            assert torch.equal(p.dst[d], p.src[s]), f"dst page {d} != src page {s}"
