"""Byte-level access to a registered KV pool: page i is bytes [i * page_nbytes, (i + 1) * page_nbytes).

The pool must be a contiguous tensor, on any device, whose first dimension is pages, whose page
size in bytes equals the pairing record's `page_nbytes` and whose dtype is the record's (ValueError
otherwise). Built-in transports move host bytes: a CPU pool is read and written in place, a pool on
another device (CUDA) is staged through host buffers (`staged`; see core/staging.py). Staging can be
forced for a CPU pool (`stage_through_host=True`), which is how the staged path is tested without
an accelerator; it cannot be turned off for a pool that is not on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvfence.transports.base import PairingRecord
from kvfence.transports.core.digest import check_digest, page_digest

DEFAULT_STAGE_CHUNK_BYTES = 8 << 20


def check_pages(pages: Sequence[int], num_pages: int, what: str) -> None:
    """ValueError unless `pages` are not empty, distinct, and pages of a pool of `num_pages`."""
    if not pages:
        raise ValueError(f"{what}: no pages")
    if len(set(pages)) != len(pages):
        raise ValueError(f"{what}: repeated page in {pages}")
    bad = [p for p in pages if not (isinstance(p, int) and 0 <= p < num_pages)]
    if bad:
        raise ValueError(f"{what}: pages {bad} outside the pool's {num_pages} pages")


class PoolBytes:
    """Views of each page of `memory` (no copies): uint8 tensors always, writable memoryviews for
    a pool that is not staged.

    `stage_through_host`: None stages iff the pool is not on the CPU. `stage_chunk_bytes`: how much
    of a push a sender stages at once (at least one page). Keeps a reference to `memory`, so the
    views stay valid while this object lives."""

    def __init__(self, memory: torch.Tensor, record: PairingRecord, *, stage_through_host: bool | None = None,
                 stage_chunk_bytes: int = DEFAULT_STAGE_CHUNK_BYTES) -> None:
        on_host = memory.device.type == "cpu"
        staged = not on_host if stage_through_host is None else bool(stage_through_host)
        if not on_host and not staged:
            raise ValueError(f"a pool on {memory.device} must be staged through host memory "
                             "(stage_through_host=False needs a CPU pool)")
        if not memory.is_contiguous() or memory.dim() < 1 or memory.shape[0] < 1:
            raise ValueError("the pool must be a contiguous tensor with at least one page along dim 0")
        page_nbytes = memory[0].numel() * memory.element_size()
        if page_nbytes != record.page_nbytes:
            raise ValueError(f"pool pages are {page_nbytes} bytes, the record says {record.page_nbytes}")
        if str(memory.dtype).removeprefix("torch.") != record.dtype:  # the dtype, whatever the device
            raise ValueError(f"pool dtype {memory.dtype} does not match the record's {record.dtype!r}")
        if stage_chunk_bytes < 1:
            raise ValueError(f"stage_chunk_bytes must be positive, got {stage_chunk_bytes}")
        check_digest(record.digest)
        self.memory = memory
        self.device = memory.device
        self.staged = staged
        self.num_pages = memory.shape[0]
        self.page_nbytes = page_nbytes
        self.stage_chunk_pages = max(1, stage_chunk_bytes // page_nbytes)
        self.digest = record.digest
        self.pages = memory.detach().reshape(self.num_pages, -1).view(torch.uint8)  # (num_pages, page_nbytes)
        self.bytes = self.pages.reshape(-1)
        self._mv = None if staged else self.bytes.numpy().data.cast("B")

    def check_pages(self, pages: list[int], what: str) -> None:
        """ValueError unless `pages` are distinct, in range, and not empty."""
        check_pages(pages, self.num_pages, what)

    def page(self, i: int) -> memoryview:
        """The bytes of page `i`, writable, aliasing the pool. RuntimeError for a staged pool:
        its bytes are only ever moved by `staging.copy_pages`."""
        if self._mv is None:
            raise RuntimeError(f"the pool on {self.device} is staged through host memory; it has no byte view")
        return self._mv[i * self.page_nbytes:(i + 1) * self.page_nbytes]

    def page_tensor(self, i: int) -> torch.Tensor:
        """Page `i` as a uint8 tensor view of the pool (on the pool's device)."""
        return self.pages[i]

    def digest_of(self, i: int) -> str:
        """The paired digest over page `i` as it is now (host pools only, as `page`)."""
        return page_digest(self.page(i), self.digest)
