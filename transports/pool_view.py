"""Byte-level access to a registered KV pool: page i is bytes [i * page_nbytes, (i + 1) * page_nbytes).

Built-in transports move host memory: the pool must be a contiguous CPU tensor whose first
dimension is pages and whose page size in bytes equals the pairing record's `page_nbytes`
(ValueError otherwise). An accelerator pool needs a transport that registers device memory.
"""

from __future__ import annotations

import torch

from kvfence.transports.base import PairingRecord
from kvfence.transports.digest import check_digest, page_digest


class PoolView:
    """Writable memoryviews and uint8 tensor views of each page of `memory` (no copies).

    Keeps a reference to `memory`, so the views stay valid while this object lives."""

    def __init__(self, memory: torch.Tensor, record: PairingRecord) -> None:
        if memory.device.type != "cpu":
            raise ValueError(f"built-in transports register CPU memory only, got {memory.device}")
        if not memory.is_contiguous() or memory.dim() < 1 or memory.shape[0] < 1:
            raise ValueError("the pool must be a contiguous tensor with at least one page along dim 0")
        page_nbytes = memory[0].numel() * memory.element_size()
        if page_nbytes != record.page_nbytes:
            raise ValueError(f"pool pages are {page_nbytes} bytes, the record says {record.page_nbytes}")
        if str(memory.dtype).removeprefix("torch.") != record.dtype:
            raise ValueError(f"pool dtype {memory.dtype} does not match the record's {record.dtype!r}")
        check_digest(record.digest)
        self.memory = memory
        self.num_pages = memory.shape[0]
        self.page_nbytes = page_nbytes
        self.digest = record.digest
        self.bytes = memory.detach().reshape(-1).view(torch.uint8)
        self._mv = memoryview(self.bytes.numpy()).cast("B")

    def check_pages(self, pages: list[int], what: str) -> None:
        """ValueError unless `pages` are distinct, in range, and not empty."""
        if not pages:
            raise ValueError(f"{what}: no pages")
        if len(set(pages)) != len(pages):
            raise ValueError(f"{what}: repeated page in {pages}")
        bad = [p for p in pages if not (isinstance(p, int) and 0 <= p < self.num_pages)]
        if bad:
            raise ValueError(f"{what}: pages {bad} outside the pool's {self.num_pages} pages")

    def page(self, i: int) -> memoryview:
        """The bytes of page `i`, writable, aliasing the pool."""
        return self._mv[i * self.page_nbytes:(i + 1) * self.page_nbytes]

    def page_tensor(self, i: int) -> torch.Tensor:
        """Page `i` as a uint8 tensor view of the pool."""
        return self.bytes[i * self.page_nbytes:(i + 1) * self.page_nbytes]

    def digest_of(self, i: int) -> str:
        """The paired digest over page `i` as it is now."""
        return page_digest(self.page(i), self.digest)
