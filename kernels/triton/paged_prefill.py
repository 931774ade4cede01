"""Causal paged prefill attention: a chunk of new query tokens per sequence over its cached pages
plus the chunk itself, with the owner check fused in.

The chunk's K/V are already in the pages (kernels.kv_store runs first), so keys are read only
through the page table: query j of sequence i sits at position cached_lens[i] + j and attends keys
0..cached_lens[i] + j, as engine/attention.paged_attention does for prefill spans.

Grid: (query blocks of the longest chunk, num_seqs, heads). One program takes BLOCK_M query tokens
of one sequence and one query head (GQA: it reads the KV head `head // group`), and walks keys in
blocks of BLOCK_N tokens up to its last query's position with an online softmax (FlashAttention
style; blocks past a sequence's chunk exit at once). Keys are addressed as in kernels.paged_decode:
token t is at `page_table[seq, t // page_size]`, offset `t % page_size`, in place in the pool.

The owner check: while reading, every page's tag is compared with the sequence's lease (one load
per page per block, kernels._device.lookup_pages). A program reads only the keys up to its last
query, so it then checks the tags of the sequence's remaining pages too (tags only, no K/V): each
program knows whether any page of its sequence is foreign, and writes zeros instead of its output
rows when one is. The violation flag is raised by every program that finds one.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvfence.kernels.triton._checks import check_cache, check_owner_args, check_tensor, next_pow2
from kvfence.kernels.triton._device import LAUNCH_OPTIONS, dot_config, load_kv_block, lookup_pages


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, cu_ptr, cached_ptr, table_ptr, tags_ptr, lease_ptr,  # inputs
    out_ptr, flag_ptr,  # outputs
    num_pages, max_pages, scale_log2,
    stride_qt, stride_qh, stride_kp, stride_kh, stride_ks, stride_tb, stride_ot, stride_oh,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CHECK_OWNER: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    row_start = tl.load(cu_ptr + seq)
    num_rows = tl.load(cu_ptr + seq + 1) - row_start
    if q_block * BLOCK_M >= num_rows:
        return
    cached = tl.load(cached_ptr + seq)
    bad = (cached < 0) | (cached + num_rows > max_pages * PAGE_SIZE)  # a length the page table cannot hold
    bad = bad | (num_rows > tl.num_programs(0) * BLOCK_M)  # a chunk longer than max_chunk_tokens
    kv_len = tl.minimum(tl.maximum(cached, 0) + num_rows, max_pages * PAGE_SIZE)
    lease_hi = tl.load(lease_ptr + 2 * seq) if CHECK_OWNER else 0
    lease_lo = tl.load(lease_ptr + 2 * seq + 1) if CHECK_OWNER else 0
    table_row = table_ptr + seq * stride_tb

    offs_m = q_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query rows within the chunk
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < num_rows
    d_mask = offs_d < HEAD_DIM
    q_pos = cached + offs_m  # [BLOCK_M]; rows past the chunk see every key and are never stored
    q = tl.load(q_ptr + (row_start + offs_m)[:, None].to(tl.int64) * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scores (log2 units)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(cached + (q_block + 1) * BLOCK_M, kv_len)  # keys this block's queries see
    for tok0 in range(0, kv_end, BLOCK_N):
        tok = tok0 + offs_n  # [BLOCK_N] key positions
        valid = tok < kv_end
        page, readable, bad_block = lookup_pages(table_row, tags_ptr, num_pages, lease_hi, lease_lo,
                                                 tok, valid, offs_n, PAGE_SIZE, CHECK_OWNER)
        bad = bad | bad_block
        k, v = load_kv_block(k_ptr, v_ptr, page, readable, tok, offs_d, d_mask, kv_head, stride_kp, stride_kh,
                             stride_ks, PAGE_SIZE, DOT_DTYPE)  # [BLOCK_N, BLOCK_D] each
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        s = tl.where(valid[None, :] & (tok[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: key 0 is visible to every row
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m = m_new
    # The sequence's pages this block did not read: tags only.
    for tok0 in range(kv_end, kv_len, BLOCK_N):
        tok = tok0 + offs_n
        _, _, bad_block = lookup_pages(table_row, tags_ptr, num_pages, lease_hi, lease_lo,
                                       tok, tok < kv_len, offs_n, PAGE_SIZE, CHECK_OWNER)
        bad = bad | bad_block

    o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    o = tl.where(bad, 0.0, o)
    tl.store(out_ptr + (row_start + offs_m)[:, None].to(tl.int64) * stride_ot + head * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
    tl.store(flag_ptr + seq, 1, mask=bad)  # every program that finds a violation writes the same 1


def paged_prefill_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_seqlens: torch.Tensor, cached_lens: torch.Tensor,
    page_table: torch.Tensor, max_chunk_tokens: int, owner_tags: torch.Tensor | None = None,
    leases: torch.Tensor | None = None, *, out: torch.Tensor | None = None, scale: float | None = None,
    block_m: int | None = None, block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each sequence's chunk over its pages (cached keys, then the chunk's own).

    q: [num_tokens, heads, head_dim], the chunks back to back; keys, values: [num_pages, kv_heads,
    page_size, head_dim] (one layer's views of the pool, the chunks' K/V already stored);
    cu_seqlens: int32 [num_seqs + 1], sequence i's rows are cu_seqlens[i]:cu_seqlens[i + 1]
    (non-decreasing, from 0 to at most num_tokens); cached_lens: int32 [num_seqs], tokens cached
    before each chunk; page_table: int32 [num_seqs, max_pages], pages in token order covering
    cached + chunk tokens; max_chunk_tokens: the longest chunk (sizes the grid, so that no host sync
    is needed); owner_tags: int64 [num_pages, 2] and leases: int64 [num_seqs, 2] to check
    ownership (both, or neither). out: where to write (q's shape and dtype), default a new
    tensor; scale: default 1/sqrt(head_dim); block_m, block_n: tile sizes.

    Returns (out [num_tokens, heads, head_dim] in q's dtype, violations int32 [num_seqs]): a
    violation is 1 when a page covering the sequence's cached + chunk tokens holds a tag other than
    its lease (only with owner_tags), lies outside the pool, or when cached + chunk tokens do not
    fit the page table (or cached < 0), or the chunk is longer than max_chunk_tokens; that
    sequence's output rows are all zeros (rows past max_chunk_tokens unwritten). Rows no
    sequence covers are left unwritten.
    """
    num_pages, kv_heads, page_size, head_dim = check_cache(keys, values)
    device = keys.device
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, heads, head_dim], got {list(q.shape)}")
    heads = q.shape[1]
    check_tensor("q", q, [None, heads, head_dim], [keys.dtype], device)
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be [num_seqs + 1], got {list(cu_seqlens.shape)}")
    num_seqs = cu_seqlens.shape[0] - 1
    check_tensor("cu_seqlens", cu_seqlens, [num_seqs + 1], [torch.int32], device, contiguous=True)
    check_tensor("cached_lens", cached_lens, [num_seqs], [torch.int32], device, contiguous=True)
    check_tensor("page_table", page_table, [num_seqs, None], [torch.int32], device)
    check_owner = check_owner_args(owner_tags, leases, num_pages, num_seqs, device)
    if max_chunk_tokens < 0:
        raise ValueError(f"max_chunk_tokens must be >= 0, got {max_chunk_tokens}")
    if out is None:
        out = torch.empty_like(q)
    else:
        check_tensor("out", out, list(q.shape), [q.dtype], device)
    flags = torch.zeros(num_seqs, dtype=torch.int32, device=device)
    if num_seqs == 0 or max_chunk_tokens == 0:
        return out, flags
    if page_table.shape[1] == 0:
        raise ValueError("page_table must have at least one column")
    block_m = block_m or (64 if device.type == "cuda" else 16)
    block_n = block_n or (64 if device.type == "cuda" else 16)
    for name, block in (("block_m", block_m), ("block_n", block_n)):
        if block < 16 or block != next_pow2(block):
            raise ValueError(f"{name} must be a power of two >= 16, got {block}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    dot_dtype, dot_precision = dot_config(q.dtype)
    grid = (-(-max_chunk_tokens // block_m), num_seqs, heads)
    _prefill_kernel[grid](
        q, keys, values, cu_seqlens, cached_lens, page_table,
        owner_tags if check_owner else flags, leases if check_owner else flags,
        out, flags,
        num_pages, page_table.shape[1], scale * math.log2(math.e),
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), page_table.stride(0),
        out.stride(0), out.stride(1),
        PAGE_SIZE=page_size, GROUP=heads // kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_D=next_pow2(head_dim), BLOCK_N=block_n,
        CHECK_OWNER=check_owner, DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,
        **LAUNCH_OPTIONS,
    )
    return out, flags
