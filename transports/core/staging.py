"""Host staging for pools the built-in transports cannot touch in place (a CUDA pool, or any pool
registered with `stage_through_host=True`): sockets and digests need host bytes, so page bytes go
through host buffers. Which pools are staged is decided by `PoolBytes`.

Sender (`SourcePages`): the pages a push names, and only those, are copied into one host buffer
of at most `PoolBytes.stage_chunk_pages` pages, a chunk at a time; they are digested and sent from
there exactly as a host pool's pages would be. Receiver: see `Receiver` (verify, then copy).

Every copy between a pool and a host buffer is one synchronous step (`copy_pages`): it returns
once every byte is in place, so a caller that checked cancellation right before it still keeps
the transports' "no read / no write after cancel" contracts, and a buffer handed back to its
owner is never still being read or written by the device. CUDA copies run on the pool device's
current stream, so they are ordered after work already queued there (e.g. the forward pass that
wrote the pages), and the event loop waits for them; host buffers for a CUDA pool are pinned
(torch caches pinned blocks, so reallocating one per push or transfer is cheap), plain otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvfence.transports.core.pool_bytes import PoolBytes


def host_pages(num_pages: int, page_nbytes: int, device: torch.device) -> torch.Tensor:
    """An uninitialised (num_pages, page_nbytes) uint8 host buffer for staging a pool on `device`:
    pinned when `device` is a CUDA device (and CUDA is available), plain host memory otherwise."""
    pin = device.type == "cuda" and torch.cuda.is_available()
    return torch.empty((num_pages, page_nbytes), dtype=torch.uint8, pin_memory=pin)


def host_view(page: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous uint8 host tensor (no copy)."""
    return page.numpy().data.cast("B")


def page_runs(dst_pages: Sequence[int], src_pages: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(dst start, src start, count) for each maximal run that is consecutive on both sides."""
    start = 0
    for i in range(1, len(dst_pages) + 1):
        if i == len(dst_pages) or dst_pages[i] != dst_pages[i - 1] + 1 or src_pages[i] != src_pages[i - 1] + 1:
            yield dst_pages[start], src_pages[start], i - start
            start = i


def copy_pages(dst: torch.Tensor, dst_pages: Sequence[int], src: torch.Tensor, src_pages: Sequence[int]) -> None:
    """`dst[dst_pages[i]] = src[src_pages[i]]` for every i; both are (pages, page_nbytes) uint8
    tensors, on any devices. Synchronous: returns once every byte is in place, and touches no
    other page of either tensor."""
    if len(dst_pages) != len(src_pages):
        raise ValueError(f"{len(dst_pages)} dst pages for {len(src_pages)} src pages")
    cuda = {t.device for t in (dst, src) if t.device.type == "cuda"}
    for d, s, n in page_runs(dst_pages, src_pages):
        dst[d:d + n].copy_(src[s:s + n], non_blocking=bool(cuda))  # pinned host <-> CUDA: async...
    for device in cuda:
        torch.cuda.current_stream(device).synchronize()  # ...until here: the bytes are in place


class SourcePages:
    """Host bytes of a push's source pages, by index in the push.

    A host pool hands out views of its own pages (no copy). A staged pool's pages are copied,
    `pool.stage_chunk_pages` at a time, into one host buffer reused for the whole push; a chunk
    is copied when `page(index)` first asks for a page it does not hold, and always starts at that
    index. That copy is the only read of the pool: call `page` right after checking that the push
    may still read its source."""

    def __init__(self, pool_bytes: PoolBytes, src_pages: Sequence[int]) -> None:
        self._pool_bytes = pool_bytes
        self._src = list(src_pages)
        self._buffer: torch.Tensor | None = None
        self._first = 0  # index in the push of the buffer's first page
        self._count = 0  # pages the buffer holds now
        if pool_bytes.staged:
            num_pages = min(len(self._src), pool_bytes.stage_chunk_pages)
            self._buffer = host_pages(num_pages, pool_bytes.page_nbytes, pool_bytes.device)

    def page_tensor(self, index: int) -> torch.Tensor:
        """Source page `index` of the push as a uint8 host tensor (staged: copied in if needed)."""
        if self._buffer is None:
            return self._pool_bytes.page_tensor(self._src[index])
        if not self._first <= index < self._first + self._count:
            count = min(len(self._buffer), len(self._src) - index)
            copy_pages(self._buffer, range(count), self._pool_bytes.pages, self._src[index:index + count])
            self._first, self._count = index, count
        return self._buffer[index - self._first]

    def page(self, index: int) -> memoryview:
        """`page_tensor(index)` as bytes."""
        if self._buffer is None:
            return self._pool_bytes.page(self._src[index])
        return host_view(self.page_tensor(index))
