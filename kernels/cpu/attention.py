"""Attention on the CPU over the pool's pages in place (kvfence_decode_attention in kernels.c):
each query row is one token (a decode sequence's, or one of a prefill chunk's, which reads its
sequence's table up to its own position), each (row, KV head) on one thread, its group of query
heads scored against each key row as it is read, an exact-max softmax, then the weighted sum of
the value rows. No page is copied, and only the pages a row's table names are read.

It computes what engine/attention.py's torch path computes (tests/kernels/cpu/test_cpu_attention.py
holds them to each other); the engine uses it for float32 pools on CPUs where the kernels build.
A row's result depends only on its query and its keys, so a token gets the same bits whether it
was prefilled in a chunk or decoded alone.
"""

from __future__ import annotations

import dataclasses

import torch

from kvfence.kernels.cpu import library as cpu_kernels


def usable(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `decode_attention` takes these: float32 on the CPU, head_dim a multiple of 8, pages
    of [kv_heads, page_size, head_dim] laid out head after head, token after token."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or keys.dtype != torch.float32:
        return False
    _, kv_heads, page_size, head_dim = keys.shape
    return (head_dim % 8 == 0 and keys.stride()[1:] == (page_size * head_dim, head_dim, 1)
            and cpu_kernels.available())


@dataclasses.dataclass(frozen=True)
class DecodeTables:
    """What each query row reads, checked once per step (every layer reuses it): page_table
    [S, max_pages] int64 (pages past a row's keys are never read), rows [B] int64 (the table row
    each query row reads), kv_lens [B] int64 (its keys, its own included)."""

    page_table: torch.Tensor
    kv_lens: torch.Tensor
    longest: int
    rows: torch.Tensor

    @classmethod
    def checked(cls, page_table: torch.Tensor, kv_lens: torch.Tensor, num_pages: int, page_size: int,
                rows: torch.Tensor | None = None) -> DecodeTables:
        """ValueError unless every row names a table row, every length is in 1..max_pages *
        page_size and every page a length reaches is in 0..num_pages - 1. `rows` None: row b reads
        table row b (one row per sequence)."""
        if rows is None:
            rows = torch.arange(page_table.shape[0] if page_table.dim() == 2 else 0, dtype=torch.int64)
        if (page_table.dtype != torch.int64 or kv_lens.dtype != torch.int64 or rows.dtype != torch.int64
                or page_table.dim() != 2 or rows.shape != kv_lens.shape):
            raise ValueError(f"decode tables must be int64, [S, max_pages], [B] and [B], got {page_table.dtype} "
                             f"{tuple(page_table.shape)}, rows {rows.dtype} {tuple(rows.shape)} and kv_lens "
                             f"{kv_lens.dtype} {tuple(kv_lens.shape)}")
        table, lens, rows = page_table.contiguous(), kv_lens.contiguous(), rows.contiguous()
        max_pages = table.shape[1]
        longest = int(lens.max()) if lens.numel() else 0
        if lens.numel():
            if int(rows.min()) < 0 or int(rows.max()) >= table.shape[0]:
                raise ValueError(f"rows must name table rows 0..{table.shape[0] - 1}")
            if int(lens.min()) < 1 or longest > max_pages * page_size:
                raise ValueError(f"kv_lens must be in 1..{max_pages * page_size}, got {lens.tolist()}")
            reach = torch.zeros(table.shape[0], dtype=torch.int64).scatter_reduce_(0, rows, lens, "amax")
            reached = torch.arange(max_pages)[None, :] * page_size < reach[:, None]
            pages = table[reached]
            if int(pages.min()) < 0 or int(pages.max()) >= num_pages:
                raise ValueError(f"the page table names pages outside 0..{num_pages - 1}")
        return cls(page_table=table, kv_lens=lens, longest=longest, rows=rows)


ATTEND_BLOCK = 4  # kernels.c: rows of one table that share their key tiles


def scores_per_thread(group: int, tables: DecodeTables) -> int:
    """The floats of scratch each thread of the kernel scores a block of rows in."""
    return ATTEND_BLOCK * group * (tables.longest + 8)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: DecodeTables,
                     scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, heads, D]; keys/values: [num_pages, kv_heads, page_size, D] layer views of the pool
    (`tables` checked against this num_pages and page_size) -> [B, heads, D] (into `out`, a
    contiguous tensor like q, when given)."""
    b, heads, d = q.shape
    _, kv_heads, page_size, _ = keys.shape
    if not usable(q, keys) or values.stride() != keys.stride() or values.shape != keys.shape:
        raise ValueError(f"decode_attention wants float32 CPU q and same-layout K/V pages with head_dim % 8 == 0, "
                         f"got q {q.dtype} {tuple(q.shape)}, keys {keys.dtype} {tuple(keys.shape)} "
                         f"strides {keys.stride()}, values strides {values.stride()}")
    if heads % kv_heads or tables.rows.shape[0] != b:
        raise ValueError(f"decode_attention wants heads a multiple of kv_heads and one row per query, got "
                         f"{heads} heads, {kv_heads} KV heads, {tables.rows.shape[0]} rows for {b} queries")
    q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    if not out.is_contiguous() or out.shape != q.shape:
        raise ValueError("out must be a contiguous tensor shaped like q")
    threads = torch.get_num_threads()
    per_thread = scores_per_thread(heads // kv_heads, tables)
    scratch = torch.empty(threads * per_thread, dtype=torch.float32)
    cpu_kernels.library().kvfence_decode_attention(
        q.data_ptr(), out.data_ptr(), keys.data_ptr(), values.data_ptr(), tables.page_table.data_ptr(),
        tables.rows.data_ptr(), tables.page_table.shape[1], tables.kv_lens.data_ptr(), b, kv_heads, heads // kv_heads,
        d, page_size, keys.stride(0), keys.stride(1), scale, scratch.data_ptr(), per_thread, threads)
    return out


@dataclasses.dataclass(frozen=True)
class StoreSlots:
    """Where a step's new K/V rows go, checked once per step: slot_pages, slot_offsets [T] int64."""

    pages: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def checked(cls, slot_pages: torch.Tensor, slot_offsets: torch.Tensor, num_pages: int,
                page_size: int) -> StoreSlots:
        """ValueError unless every page is in 0..num_pages - 1 and every offset in 0..page_size - 1."""
        pages, offsets = slot_pages.contiguous(), slot_offsets.contiguous()
        if pages.dtype != torch.int64 or offsets.dtype != torch.int64 or pages.shape != offsets.shape:
            raise ValueError(f"store slots must be two int64 [T] tensors, got {pages.dtype} {tuple(pages.shape)} "
                             f"and {offsets.dtype} {tuple(offsets.shape)}")
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages
                              or int(offsets.min()) < 0 or int(offsets.max()) >= page_size):
            raise ValueError(f"store slots outside the pool's {num_pages} pages of {page_size} tokens")
        return cls(pages, offsets)


def store_kv(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: StoreSlots) -> None:
    """keys/values: [num_pages, kv_heads, page_size, D] layer views (`slots` checked against them);
    k, v: [T, kv_heads, D] float32: row t goes to page slots.pages[t], offset slots.offsets[t]."""
    tokens, kv_heads, d = k.shape
    if (not usable(k, keys) or values.stride() != keys.stride() or v.shape != k.shape
            or keys.shape[1] != kv_heads or keys.shape[3] != d or slots.pages.shape[0] != tokens):
        raise ValueError(f"store_kv wants float32 CPU K/V rows [T, {keys.shape[1]}, {keys.shape[3]}] for "
                         f"{slots.pages.shape[0]} slots, got {k.dtype} {tuple(k.shape)}")
    k, v = k.contiguous(), v.contiguous()
    cpu_kernels.library().kvfence_store_kv(k.data_ptr(), v.data_ptr(), keys.data_ptr(), values.data_ptr(),
                                           slots.pages.data_ptr(), slots.offsets.data_ptr(), tokens, kv_heads, d,
                                           keys.stride(0), keys.stride(1))
