"""KV store: scatter a step's new K/V into their page slots, in place in the pool.

Grid: (num_tokens,). One program copies one token's K and V ([kv_heads, head_dim] each) to
`keys[page, :, offset]` / `values[page, :, offset]`, with the slot given as two tensors
(slot_pages, slot_offsets), as engine/attention.AttentionBatch holds it.

The owner check (optional): a token is written only when its page's owner tag equals the token's
lease, so a wrong page table cannot overwrite another request's KV; a slot outside the pool is
never written either. Either case sets the token's violation flag and leaves the pool untouched
for that token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfence.kernels.triton._checks import check_cache, check_tensor, next_pow2
from kvfence.kernels.triton._device import LAUNCH_OPTIONS


@triton.jit
def _store_kernel(k_ptr, v_ptr, page_ptr, offset_ptr, tags_ptr, lease_ptr, keys_ptr, values_ptr, flag_ptr,
                  num_pages, stride_kt, stride_kh, stride_vt, stride_vh, stride_cp, stride_ch, stride_cs,
                  PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_OWNER: tl.constexpr):
    t = tl.program_id(0)
    page = tl.load(page_ptr + t)  # int64
    offset = tl.load(offset_ptr + t)
    ok = (page >= 0) & (page < num_pages) & (offset >= 0) & (offset < PAGE_SIZE)
    if CHECK_OWNER:
        safe_page = tl.where(ok, page, 0)
        ok = ok & (tl.load(tags_ptr + 2 * safe_page) == tl.load(lease_ptr + 2 * t))
        ok = ok & (tl.load(tags_ptr + 2 * safe_page + 1) == tl.load(lease_ptr + 2 * t + 1))
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads_written = tl.where(ok, KV_HEADS, 0)  # all of the token's heads, or none
    mask = (offs_h < heads_written)[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_H, BLOCK_D]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    slot = page * stride_cp + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(keys_ptr + slot, k, mask=mask)
    tl.store(values_ptr + slot, v, mask=mask)
    tl.store(flag_ptr + t, 1 - ok.to(tl.int32))


def store_kv_pages(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_pages: torch.Tensor, slot_offsets: torch.Tensor, owner_tags: torch.Tensor | None = None,
                   slot_leases: torch.Tensor | None = None) -> torch.Tensor:
    """Write k[t], v[t] to keys/values[slot_pages[t], :, slot_offsets[t]] for every token t.

    keys, values: [num_pages, kv_heads, page_size, head_dim] (one layer's views of the pool,
    written in place); k, v: [num_tokens, kv_heads, head_dim] in the pool's dtype; slot_pages,
    slot_offsets: int64 [num_tokens] (distinct slots: two tokens writing one slot leave either);
    owner_tags: int64 [num_pages, 2] and slot_leases: int64 [num_tokens, 2], the lease each token
    writes for (both, or neither to skip the check).

    Returns violations int32 [num_tokens]: 1 where the token was not written because its slot is
    outside the pool or (with the check) its page belongs to another lease.
    """
    num_pages, kv_heads, page_size, head_dim = check_cache(keys, values)
    device = keys.device
    if k.dim() != 3:
        raise ValueError(f"k must be [num_tokens, kv_heads, head_dim], got {list(k.shape)}")
    num_tokens = k.shape[0]
    check_tensor("k", k, [num_tokens, kv_heads, head_dim], [keys.dtype], device)
    check_tensor("v", v, [num_tokens, kv_heads, head_dim], [keys.dtype], device)
    check_tensor("slot_pages", slot_pages, [num_tokens], [torch.int64], device, contiguous=True)
    check_tensor("slot_offsets", slot_offsets, [num_tokens], [torch.int64], device, contiguous=True)
    if (owner_tags is None) != (slot_leases is None):
        raise ValueError("owner_tags and slot_leases go together: pass both to check ownership, or neither")
    check_owner = owner_tags is not None
    if owner_tags is not None and slot_leases is not None:
        check_tensor("owner_tags", owner_tags, [num_pages, 2], [torch.int64], device, contiguous=True)
        check_tensor("slot_leases", slot_leases, [num_tokens, 2], [torch.int64], device, contiguous=True)
    flags = torch.zeros(num_tokens, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return flags
    _store_kernel[(num_tokens,)](
        k, v, slot_pages, slot_offsets,
        owner_tags if check_owner else flags, slot_leases if check_owner else flags,
        keys, values, flags,
        num_pages, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        PAGE_SIZE=page_size, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(kv_heads), BLOCK_D=next_pow2(head_dim), CHECK_OWNER=check_owner,
        **LAUNCH_OPTIONS,
    )
    return flags
