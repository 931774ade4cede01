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
    decode_kv_bias: torch.Tensor  # [num_decode, 1, 1, max_pages * page_size] float32: 0 or -inf
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
        decode_kv_bias=bias.view(len(decode), 1, 1, max_pages * page_size),
        prefills=spans,
    )


def store_kv(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             batch: AttentionBatch) -> None:
    """keys/values: [num_pages, kv_heads, page_size, head_dim] pool views; k, v: [T, kv_heads, head_dim]."""
    keys[batch.slot_pages, :, batch.slot_offsets] = k
    values[batch.slot_pages, :, batch.slot_offsets] = v


def _decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                      bias: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, heads, D]; table: [B, P] -> [B, heads, D].

    Scores are computed page by page on the gathered pages ([B, P, kvh, S, D], no transposed copy
    of K or V), then one softmax runs over all keys of a sequence. The query heads that share a KV
    head form the rows of each small matmul, so GQA needs no expanded K/V.
    """
    b, p = table.shape
    _, kv_heads, page_size, head_dim = keys.shape
    group = q.shape[1] // kv_heads
    k = keys.index_select(0, table.flatten()).view(b, p, kv_heads, page_size, head_dim)
    v = values.index_select(0, table.flatten()).view(b, p, kv_heads, page_size, head_dim)
    qg = q.view(b, 1, kv_heads, group, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2))  # [B, P, kvh, G, S]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group, p * page_size).float()
    probs = torch.softmax(scores * scale + bias, dim=-1).to(q.dtype)  # [B, kvh, G, P*S]
    probs = probs.view(b, kv_heads, group, p, page_size).permute(0, 3, 1, 2, 4)  # [B, P, kvh, G, S]
    return torch.matmul(probs, v).sum(1).view(b, kv_heads * group, head_dim)


def paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    batch: AttentionBatch) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim], reading K/V through the page tables."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = keys.shape[1]
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.empty_like(q)
    nd = batch.num_decode
    if nd:
        out[:nd] = _decode_attention(q[:nd], keys, values, batch.decode_page_table, batch.decode_kv_bias, scale)
    for span in batch.prefills:
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        kv_len = span.context_tokens + span.num_tokens
        # [pages, kvh, S, D] -> [kvh, pages * S, D], cut to the keys that exist.
        k = keys.index_select(0, span.page_table).transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :kv_len]
        v = values.index_select(0, span.page_table).transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :kv_len]
        qp = q[rows].transpose(0, 1)  # [heads, n, D]
        q_pos = torch.arange(span.context_tokens, kv_len, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]  # [n, kv_len]
        o = F.scaled_dot_product_attention(qp.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out
