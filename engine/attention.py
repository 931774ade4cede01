"""Paged attention on the torch path (the CPU path, and the reference for the Triton kernels).

A forward step holds tokens of many sequences in one flat batch, decode tokens first:
- decode sequences feed one token each and attend over their whole page table, batched;
- prefill sequences feed a chunk of tokens and attend causally over their cached pages plus the
  chunk (the chunk's K/V are written into its pages before attention reads them).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class PrefillSpan:
    """One sequence's chunk inside the flat token batch."""

    token_start: int  # first row of this chunk in the flat batch
    num_tokens: int  # tokens in the chunk
    context_tokens: int  # tokens already cached before the chunk
    page_table: torch.Tensor  # [pages covering context_tokens + num_tokens] int64


@dataclasses.dataclass
class AttentionBatch:
    """Where a step's tokens write their K/V and what each sequence reads."""

    slot_pages: torch.Tensor  # [T] int64: page that token t's K/V goes to
    slot_offsets: torch.Tensor  # [T] int64: offset within that page
    num_decode: int  # rows [0, num_decode) are decode tokens, one per sequence
    decode_page_table: torch.Tensor  # [num_decode, max_pages] int64, padded with page 0
    decode_kv_lens: torch.Tensor  # [num_decode] int64: keys of each decode sequence, incl. the new token
    decode_kv_bias: torch.Tensor  # [num_decode, 1, 1, max_pages * page_size] float32: 0 or -inf
    prefills: list[PrefillSpan]
    _decode_rows: dict[tuple[int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(
        default_factory=dict, repr=False)

    def decode_rows(self, kv_heads: int, page_stride_rows: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """What decode attention reads, made by the first layer of a step and reused by the others.

        rows: [num_decode * kv_heads * max_pages] int64, in (sequence, KV head, page) order, of a
        pool layer seen as rows of [page_size, head_dim] tiles where page p's head h is row
        p * page_stride_rows + h; one index_select then yields every sequence's keys per KV head
        back to back.
        bias: [num_decode * kv_heads, 1, max_pages * page_size], decode_kv_bias per (sequence, KV head)
        in `dtype`."""
        cached = self._decode_rows.get((kv_heads, page_stride_rows, dtype))
        if cached is None:
            table = self.decode_page_table
            heads = torch.arange(kv_heads, device=table.device)
            rows = (table.unsqueeze(1) * page_stride_rows + heads.view(1, kv_heads, 1)).flatten()
            keys = self.decode_kv_bias.shape[-1]
            bias = self.decode_kv_bias.view(-1, 1, 1, keys).expand(-1, kv_heads, 1, keys).reshape(-1, 1, keys)
            cached = self._decode_rows[(kv_heads, page_stride_rows, dtype)] = (rows, bias.to(dtype))
        return cached


def build_attention_batch(
    page_size: int,
    decode: list[tuple[list[int], int]],
    prefill: list[tuple[list[int], int, int]],
    device: torch.device,
) -> AttentionBatch:
    """decode: (page_table, kv_len incl. the new token) per sequence;
    prefill: (page_table, context_tokens, num_tokens) per sequence, in batch order after decodes."""
    pages: list[int] = []
    offsets: list[int] = []
    for table, kv_len in decode:
        pos = kv_len - 1
        pages.append(table[pos // page_size])
        offsets.append(pos % page_size)
    spans: list[PrefillSpan] = []
    row = len(decode)
    for table, ctx, n in prefill:
        for pos in range(ctx, ctx + n):
            pages.append(table[pos // page_size])
            offsets.append(pos % page_size)
        used = (ctx + n + page_size - 1) // page_size
        spans.append(PrefillSpan(token_start=row, num_tokens=n, context_tokens=ctx,
                                 page_table=torch.tensor(table[:used], dtype=torch.int64, device=device)))
        row += n
    # Read only the pages that hold keys: a table may already reserve pages for future tokens.
    used_tables = [t[: (n + page_size - 1) // page_size] for t, n in decode]
    max_pages = max((len(t) for t in used_tables), default=1)
    padded = [t + [0] * (max_pages - len(t)) for t in used_tables]
    decode_table = torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(decode), max_pages)
    kv_lens = torch.tensor([n for _, n in decode], dtype=torch.int64, device=device)
    key_pos = torch.arange(max_pages * page_size, device=device)
    valid = key_pos[None, :] < kv_lens[:, None]  # [num_decode, max_pages * page_size]
    bias = torch.zeros(valid.shape, dtype=torch.float32, device=device).masked_fill_(~valid, float("-inf"))
    return AttentionBatch(
        slot_pages=torch.tensor(pages, dtype=torch.int64, device=device),
        slot_offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
        num_decode=len(decode),
        decode_page_table=decode_table,
        decode_kv_lens=kv_lens,
        decode_kv_bias=bias.view(len(decode), 1, 1, max_pages * page_size),
        prefills=spans,
    )


def store_kv(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             batch: AttentionBatch) -> None:
    """keys/values: [num_pages, kv_heads, page_size, head_dim] pool views; k, v: [T, kv_heads, head_dim]."""
    keys[batch.slot_pages, :, batch.slot_offsets] = k
    values[batch.slot_pages, :, batch.slot_offsets] = v


def _tile_rows(layer: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A [num_pages, kv_heads, S, D] layer view whose pages are evenly spaced in memory (the pool's
    page-major layout, or a plain contiguous tensor) as rows of [S, D] tiles over the same memory,
    and the row stride of one page: page p's head h is row p * stride + h."""
    num_pages, kv_heads, page_size, head_dim = layer.shape
    tile = page_size * head_dim
    if layer.stride()[1:] != (tile, head_dim, 1) or layer.stride(0) % tile:
        raise ValueError(f"decode attention needs [page_size, head_dim] tiles laid out page after page, "
                         f"got strides {layer.stride()} for shape {tuple(layer.shape)}")
    stride = layer.stride(0) // tile
    rows = (num_pages - 1) * stride + kv_heads
    return layer.as_strided((rows, page_size, head_dim), (tile, head_dim, 1)), stride


def _window_bias(batch: AttentionBatch, bias: torch.Tensor, kv_heads: int, window: int) -> torch.Tensor:
    """`bias` ([B * kvh, 1, keys]) with the keys more than `window` - 1 positions before each
    sequence's new token masked too."""
    keys = bias.shape[-1]
    first = (batch.decode_kv_lens - window).clamp(min=0)  # [B]: the first key inside the window
    outside = torch.arange(keys, device=bias.device)[None, :] < first[:, None]  # [B, keys]
    outside = outside.repeat_interleave(kv_heads, 0).unsqueeze(1)  # [B * kvh, 1, keys]
    return bias.masked_fill(outside, float("-inf"))


def _decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: AttentionBatch,
                      scale: float, window: int = 0) -> torch.Tensor:
    """q: [B, heads, D] -> [B, heads, D], one query per sequence over its pages.

    One index_select per K and V gathers each (sequence, KV head)'s pages back to back
    ([B * kvh, P * S, D], no transposed copy); the query heads that share a KV head are the rows
    of one matmul, so GQA needs no expanded K/V. Scores, scale and the -inf bias of keys past a
    sequence's length are one baddbmm, then softmax and one bmm with V.
    """
    kv_heads, head_dim = keys.shape[1], keys.shape[3]
    key_rows, stride = _tile_rows(keys)
    value_rows, value_stride = _tile_rows(values)
    if value_stride != stride:
        raise ValueError(f"keys and values must share a layout, got page strides {stride} and {value_stride}")
    rows, bias = batch.decode_rows(kv_heads, stride, q.dtype)
    if window:
        bias = _window_bias(batch, bias, kv_heads, window)
    b = q.shape[0]
    group = q.shape[1] // kv_heads
    k = key_rows.index_select(0, rows).view(b * kv_heads, -1, head_dim)
    v = value_rows.index_select(0, rows).view(b * kv_heads, -1, head_dim)
    scores = torch.baddbmm(bias, q.reshape(b * kv_heads, group, head_dim), k.transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [B * kvh, G, P * S]
    return torch.bmm(probs, v).view(b, kv_heads * group, head_dim)


def paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    batch: AttentionBatch, window: int = 0) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim], reading K/V through the page tables.
    `window` (0: none): a token at position p attends only to the keys at positions
    p - window + 1 .. p (a sliding-window layer; llama.cpp's standard window)."""
    out = torch.empty_like(q)
    nd = batch.num_decode
    if nd:
        out[:nd] = _decode_attention(q[:nd], keys, values, batch, 1.0 / math.sqrt(q.shape[2]), window)
    prefill_attention(q, keys, values, batch, out, window)
    return out


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: AttentionBatch,
                      out: torch.Tensor, window: int = 0) -> None:
    """The prefill rows of `paged_attention`, written into `out`: each chunk attends causally over
    its sequence's cached pages and itself (within `window` positions, when one is given)."""
    num_kv_heads, head_dim = keys.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(head_dim)
    for span in batch.prefills:
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        kv_len = span.context_tokens + span.num_tokens
        # [pages, kvh, S, D] -> [kvh, pages * S, D], cut to the keys that exist.
        k = keys.index_select(0, span.page_table).transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :kv_len]
        v = values.index_select(0, span.page_table).transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :kv_len]
        qp = q[rows].transpose(0, 1)  # [heads, n, D]
        q_pos = torch.arange(span.context_tokens, kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        mask = k_pos <= q_pos[:, None]  # [n, kv_len]
        if window:
            mask &= k_pos > q_pos[:, None] - window
        o = F.scaled_dot_product_attention(qp.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
