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
    decode_kv_mask: torch.Tensor  # [num_decode, 1, 1, max_pages * page_size] bool: valid keys
    prefills: list[PrefillSpan]


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
        spans.append(PrefillSpan(row, n, ctx, torch.tensor(table[:used], dtype=torch.int64, device=device)))
        row += n
    max_pages = max((len(t) for t, _ in decode), default=1)
    padded = [t + [0] * (max_pages - len(t)) for t, _ in decode]
    decode_table = torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(decode), max_pages)
    kv_lens = torch.tensor([n for _, n in decode], dtype=torch.int64, device=device)
    key_pos = torch.arange(max_pages * page_size, device=device)
    mask = (key_pos[None, :] < kv_lens[:, None]).reshape(len(decode), 1, 1, max_pages * page_size)
    return AttentionBatch(
        slot_pages=torch.tensor(pages, dtype=torch.int64, device=device),
        slot_offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
        num_decode=len(decode),
        decode_page_table=decode_table,
        decode_kv_mask=mask,
        prefills=spans,
    )


def store_kv(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             batch: AttentionBatch) -> None:
    """keys/values: [num_pages, page_size, kv_heads, head_dim] pool views; k, v: [T, kv_heads, head_dim]."""
    keys[batch.slot_pages, batch.slot_offsets] = k
    values[batch.slot_pages, batch.slot_offsets] = v


def paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    batch: AttentionBatch) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim], reading K/V through the page tables."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = keys.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.empty_like(q)
    nd = batch.num_decode
    if nd:
        table = batch.decode_page_table  # [B, P]
        b = table.shape[0]
        # index_select on whole pages is several times faster than advanced indexing here.
        k = keys.index_select(0, table.flatten()).view(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        v = values.index_select(0, table.flatten()).view(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        # k, v: [B, kvh, P*S, D]. One query token per sequence: fold the query heads of a KV group
        # into the query axis so GQA needs no expanded copy of K/V.
        qd = q[:nd].reshape(b, num_kv_heads, group, head_dim)  # [B, kvh, G, D]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=batch.decode_kv_mask, scale=scale)
        out[:nd] = o.reshape(b, num_heads, head_dim)
    for span in batch.prefills:
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        kv_len = span.context_tokens + span.num_tokens
        k = keys.index_select(0, span.page_table).view(-1, num_kv_heads, head_dim)[:kv_len].transpose(0, 1)
        v = values.index_select(0, span.page_table).view(-1, num_kv_heads, head_dim)[:kv_len].transpose(0, 1)
        qp = q[rows].transpose(0, 1)  # [heads, n, D]
        q_pos = torch.arange(span.context_tokens, kv_len, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]  # [n, kv_len]
        o = F.scaled_dot_product_attention(qp.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out
