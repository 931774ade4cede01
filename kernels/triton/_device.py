"""What the kernels share: the page lookup with the owner check (device code) and the dot settings."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Chosen, not left to the version's default (Triton 3.10 turns FMA contraction off by default, and
# 3.9 warns about the change): the kernels are written and tested with it on.
LAUNCH_OPTIONS = {"enable_fp_fusion": True}


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (TRITON_INTERPRET=1; `triton.knobs` is triton >= 3.4)."""
    return bool(triton.knobs.runtime.interpret)


def dot_config(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """(operand dtype, input_precision) for `tl.dot` on tiles of `dtype`.

    float32 runs in full precision ("ieee", not TF32), as torch's float32 matmul does. bfloat16 and
    float16 run natively when compiled; under TRITON_INTERPRET the bfloat16 operands are widened
    to float32, because the interpreter multiplies bfloat16 tiles as their raw 16-bit integers.
    """
    if dtype == torch.float32:
        return tl.float32, "ieee"
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32, "ieee"
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), "tf32"


@triton.jit
def lookup_pages(table_row_ptr, tags_ptr, num_pages, lease_hi, lease_lo, tok, valid, lane,
                 PAGE_SIZE: tl.constexpr, CHECK_OWNER: tl.constexpr):
    """Pages of a block of key positions, and whether the block breaks ownership.

    tok, valid, lane: [BLOCK_N] key positions, which of them exist, and 0..BLOCK_N-1. Returns
    (page [BLOCK_N] int64, readable [BLOCK_N] bool, bad: scalar bool). `bad` is set when a valid
    position's page index lies outside the pool or, with CHECK_OWNER, when its page's owner tag
    differs from (lease_hi, lease_lo). The tag is loaded once per page: only the lane holding a
    page's first position in the block loads it.
    """
    page = tl.load(table_row_ptr + tok // PAGE_SIZE, mask=valid, other=0)
    in_pool = (page >= 0) & (page < num_pages)
    bad = tl.max((valid & ~in_pool).to(tl.int32), axis=0) != 0
    page = page.to(tl.int64)  # pool offsets pass 2**31 elements
    readable = valid & in_pool
    if CHECK_OWNER:
        first = readable & ((tok % PAGE_SIZE == 0) | (lane == 0))
        tag_hi = tl.load(tags_ptr + 2 * page, mask=first, other=0)
        tag_lo = tl.load(tags_ptr + 2 * page + 1, mask=first, other=0)
        wrong = first & ((tag_hi != lease_hi) | (tag_lo != lease_lo))
        bad = bad | (tl.max(wrong.to(tl.int32), axis=0) != 0)
    return page, readable, bad


@triton.jit
def load_kv_block(k_ptr, v_ptr, page, readable, tok, offs_d, d_mask, kv_head, stride_kp, stride_kh, stride_ks,
                  PAGE_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """K and V tiles [BLOCK_N, BLOCK_D] of one KV head for a block of key positions, read in place
    from the pool through `page` (from `lookup_pages`); positions that are not `readable` load 0."""
    kv_off = (page[:, None] * stride_kp + kv_head * stride_kh
              + (tok % PAGE_SIZE)[:, None] * stride_ks + offs_d[None, :])  # [BLOCK_N, BLOCK_D]
    kv_mask = readable[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
    v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
    return k, v
