"""Torch references of the kernels, with the launchers' exact contracts (same arguments, same
outputs, same violation rules). Plain loops over sequences, float32 math: slow and obviously right.
"""

from __future__ import annotations

import math

import torch


def _violates(pages: torch.Tensor, num_pages: int, owner_tags: torch.Tensor | None,
              lease: torch.Tensor | None) -> bool:
    """pages: [n] int64 a sequence reads; lease: [2] int64."""
    if bool(((pages < 0) | (pages >= num_pages)).any()):
        return True
    return owner_tags is not None and lease is not None and bool((owner_tags[pages] != lease).any())


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pages: torch.Tensor, kv_len: int,
            scale: float) -> torch.Tensor:
    """q: [n, heads, D], the last n positions of kv_len keys, causal -> [n, heads, D] float32."""
    kv_heads, head_dim = keys.shape[1], keys.shape[3]
    k = keys[pages].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :kv_len].float()  # [kvh, L, D]
    v = values[pages].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :kv_len].float()
    group = q.shape[1] // kv_heads
    k = k.repeat_interleave(group, dim=0)  # [heads, L, D]
    v = v.repeat_interleave(group, dim=0)
    scores = torch.einsum("nhd,hld->hnl", q.float(), k) * scale  # [heads, n, L]
    q_pos = torch.arange(kv_len - q.shape[0], kv_len, device=q.device)
    causal = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]  # [n, L]
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hnl,hld->nhd", probs, v)


def paged_decode_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, page_table: torch.Tensor,
                           context_lens: torch.Tensor, owner_tags: torch.Tensor | None = None,
                           leases: torch.Tensor | None = None, *, scale: float | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels.paged_decode.paged_decode_attention."""
    num_pages, _, page_size, head_dim = keys.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros_like(q)  # [B, heads, D]
    flags = torch.zeros(q.shape[0], dtype=torch.int32, device=q.device)
    for b, kv_len in enumerate(context_lens.tolist()):
        if not 1 <= kv_len <= page_table.shape[1] * page_size:
            flags[b] = 1
            continue
        pages = page_table[b, : -(-kv_len // page_size)].long()
        if _violates(pages, num_pages, owner_tags, None if leases is None else leases[b]):
            flags[b] = 1
            continue
        out[b] = _attend(q[b : b + 1], keys, values, pages, kv_len, scale)[0].to(q.dtype)
    return out, flags


def paged_prefill_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_seqlens: torch.Tensor,
                            cached_lens: torch.Tensor, page_table: torch.Tensor,
                            owner_tags: torch.Tensor | None = None, leases: torch.Tensor | None = None, *,
                            scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels.paged_prefill.paged_prefill_attention."""
    num_pages, _, page_size, head_dim = keys.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros_like(q)  # [T, heads, D]
    flags = torch.zeros(cached_lens.shape[0], dtype=torch.int32, device=q.device)
    bounds = cu_seqlens.tolist()
    for i, cached in enumerate(cached_lens.tolist()):
        start, stop = bounds[i], bounds[i + 1]
        kv_len = cached + stop - start
        if stop == start:
            continue
        if cached < 0 or kv_len > page_table.shape[1] * page_size:
            flags[i] = 1
            continue
        pages = page_table[i, : -(-kv_len // page_size)].long()
        if _violates(pages, num_pages, owner_tags, None if leases is None else leases[i]):
            flags[i] = 1
            continue
        out[start:stop] = _attend(q[start:stop], keys, values, pages, kv_len, scale).to(q.dtype)
    return out, flags


def kv_store_reference(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       slot_pages: torch.Tensor, slot_offsets: torch.Tensor, owner_tags: torch.Tensor | None = None,
                       slot_leases: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as kernels.kv_store.store_kv_pages."""
    num_pages, _, page_size, _ = keys.shape
    flags = torch.zeros(k.shape[0], dtype=torch.int32, device=k.device)
    for t, (page, offset) in enumerate(zip(slot_pages.tolist(), slot_offsets.tolist())):
        ok = 0 <= page < num_pages and 0 <= offset < page_size
        if ok and owner_tags is not None and slot_leases is not None:
            ok = bool((owner_tags[page] == slot_leases[t]).all())
        if not ok:
            flags[t] = 1
            continue
        keys[page, :, offset] = k[t]
        values[page, :, offset] = v[t]
    return flags
