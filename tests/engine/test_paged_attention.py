"""Paged attention through page tables equals plain attention over contiguous K/V, with and
without a sliding window (Gemma 3's sliding layers)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvfence.engine.attention import build_attention_batch, paged_attention, store_kv


def contiguous_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                         window: int = 0) -> torch.Tensor:
    """q: [n, H, D] at positions q_start..; k, v: [L, KVH, D] -> [n, H, D], float64 softmax; with a
    `window`, position p sees only keys p - window + 1 .. p."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(q_start, q_start + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    if window:
        scores = scores.masked_fill(k_pos <= q_pos - window, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window", [0, 1, 5, 17])
@pytest.mark.parametrize("layout", ["contiguous", "page_major"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_equals_contiguous(seed: int, page_size: int, layout: str, window: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kv_heads = rng.choice([1, 2, 3])
    heads = kv_heads * rng.choice([1, 2, 3])
    head_dim = rng.choice([8, 16, 64])
    num_pages = 7 * 64 // page_size + 7  # enough for 7 sequences of up to 64 tokens
    if layout == "contiguous":
        keys = torch.randn(num_pages, kv_heads, page_size, head_dim)
        values = torch.randn(num_pages, kv_heads, page_size, head_dim)
    else:  # one layer of a KVPool: [pages, layers, K|V, kv_heads, page_size, head_dim]
        data = torch.randn(num_pages, 3, 2, kv_heads, page_size, head_dim)
        keys, values = data[:, 1, 0], data[:, 1, 1]
    free = list(range(num_pages))
    rng.shuffle(free)  # page tables are scattered, not contiguous

    # Sequences: some decode one token, some prefill a chunk over cached context; ragged lengths.
    decode, prefill, full_kv = [], [], []
    for i in range(rng.randint(1, 4) + rng.randint(0, 3)):
        is_decode = i % 2 == 0
        ctx = rng.randint(1 if is_decode else 0, 40)
        n = 1 if is_decode else rng.randint(1, 24)
        table = [free.pop() for _ in range(-(-(ctx + n) // page_size))]
        k = torch.randn(ctx + n, kv_heads, head_dim)
        v = torch.randn(ctx + n, kv_heads, head_dim)
        for pos in range(ctx):  # the cached context was written by earlier steps
            keys[table[pos // page_size], :, pos % page_size] = k[pos]
            values[table[pos // page_size], :, pos % page_size] = v[pos]
        (decode if is_decode else prefill).append((table, ctx, n))
        full_kv.append((is_decode, k, v, ctx, n))
    batch = build_attention_batch(page_size, [(t, c + 1) for t, c, _ in decode], prefill, torch.device("cpu"))
    ordered = [x for x in full_kv if x[0]] + [x for x in full_kv if not x[0]]
    new_k = torch.cat([k[ctx:] for _, k, _, ctx, _ in ordered])
    new_v = torch.cat([v[ctx:] for _, _, v, ctx, _ in ordered])
    q = torch.randn(new_k.shape[0], heads, head_dim)
    store_kv(keys, values, new_k, new_v, batch)
    out = paged_attention(q, keys, values, batch, window)
    row = 0
    for _, k, v, ctx, n in ordered:
        want = contiguous_attention(q[row:row + n], k, v, ctx, window)
        torch.testing.assert_close(out[row:row + n].double(), want, atol=1e-5, rtol=1e-5)
        row += n


def test_store_kv_writes_only_named_slots() -> None:
    keys = torch.zeros(4, 1, 4, 2)  # [pages, kv_heads, page_size, head_dim]
    values = torch.zeros(4, 1, 4, 2)
    batch = build_attention_batch(4, [], [([2, 0], 3, 2)], torch.device("cpu"))  # positions 3, 4
    store_kv(keys, values, torch.ones(2, 1, 2), torch.full((2, 1, 2), 2.0), batch)
    written = (keys[:, 0] != 0).any(-1).nonzero().tolist()
    assert written == [[0, 0], [2, 3]]  # page 2 offset 3, then page 0 offset 0
    assert values[2, 0, 3].eq(2).all() and values[0, 0, 0].eq(2).all()


def test_decode_refuses_a_layout_without_page_tiles() -> None:
    keys = torch.randn(4, 16, 2, 8).transpose(1, 2)  # [pages, kv_heads, page_size, head_dim], tokens outermost
    batch = build_attention_batch(16, [([1, 2], 20)], [], torch.device("cpu"))
    with pytest.raises(ValueError, match="page_size, head_dim\\] tiles"):
        paged_attention(torch.randn(1, 2, 8), keys, keys, batch)
