"""Paged decode attention: one query token per sequence over its pages, with the owner check fused in.

Grid: (num_seqs, kv_heads, num_splits). One program takes one sequence, one KV head and all the
query heads that share it (GQA: the group's heads are the rows of the tile, padded to 16 for
`tl.dot`), and one split of the sequence's keys (split-K). It walks its keys in blocks of BLOCK_N
tokens straight from the pool (no gather copy): token t lives in page `page_table[seq, t //
page_size]` at offset `t % page_size`, so any page size works and pages may come in any order. An
online softmax keeps the running max, sum and output. With one split the program writes the final
output; with more, each writes a normalized partial output and its log-sum-exp, and a second small
kernel (`_combine_kernel`, grid (num_seqs, heads)) merges the splits.

The owner check: for the first token of every page it reads (one 16-byte tag per page, loaded next
to the page's K/V tiles), a program compares the page's owner tag with the sequence's lease, and
raises the sequence's violation flag on a mismatch. A page index outside the pool, or a context longer than the
page table, raises the flag too (and nothing outside the table or the pool is read). A flagged
sequence's output is all zeros: with one split the program saw every page itself, and with several
the combine kernel runs after all of them finished and zeroes the flagged rows. K/V loads do not
wait for the tag (that would serialize two memory round trips per page); what is read from a
foreign page reaches registers and, with splits, the float32 scratch partials, never the output.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvfence.kernels.triton._checks import check_cache, check_owner_args, check_tensor, next_pow2
from kvfence.kernels.triton._device import LAUNCH_OPTIONS, dot_config, load_kv_block, lookup_pages


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, ctx_ptr, tags_ptr, lease_ptr,  # inputs
    out_ptr, part_out_ptr, part_lse_ptr, flag_ptr,  # outputs
    num_pages, max_pages, tokens_per_split, scale_log2,
    stride_qb, stride_qh, stride_kp, stride_kh, stride_ks, stride_tb, stride_ob, stride_oh,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CHECK_OWNER: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g  # [BLOCK_G] query heads of this KV head
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    ctx_len = tl.load(ctx_ptr + seq)
    bad = (ctx_len < 1) | (ctx_len > max_pages * PAGE_SIZE)  # a length the page table cannot hold
    kv_len = tl.minimum(tl.maximum(ctx_len, 0), max_pages * PAGE_SIZE)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, kv_len)
    lease_hi = tl.load(lease_ptr + 2 * seq) if CHECK_OWNER else 0
    lease_lo = tl.load(lease_ptr + 2 * seq + 1) if CHECK_OWNER else 0

    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_G, BLOCK_D]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of scores (log2 units)
    l_sum = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)  # running sum of p * v
    for tok0 in range(start, end, BLOCK_N):
        tok = tok0 + offs_n  # [BLOCK_N] key positions
        valid = tok < end
        page, readable, bad_block = lookup_pages(table_ptr + seq * stride_tb, tags_ptr, num_pages, lease_hi,
                                                 lease_lo, tok, valid, offs_n, PAGE_SIZE, CHECK_OWNER)
        bad = bad | bad_block
        k, v = load_kv_block(k_ptr, v_ptr, page, readable, tok, offs_d, d_mask, kv_head, stride_kp, stride_kh,
                             stride_ks, PAGE_SIZE, DOT_DTYPE)  # [BLOCK_N, BLOCK_D] each
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m = m_new

    has_keys = l_sum > 0
    o = acc / tl.where(has_keys, l_sum, 1.0)[:, None]  # [BLOCK_G, BLOCK_D]
    if NUM_SPLITS == 1:
        o = tl.where(bad, 0.0, o)
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        row = (seq * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split  # [BLOCK_G] into [B, H, S]
        lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l_sum, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=g_mask[:, None] & d_mask[None, :])
    # Every program that finds a violation writes the same 1; none ever writes 0.
    tl.store(flag_ptr + seq, 1, mask=bad)


@triton.jit
def _combine_kernel(part_out_ptr, part_lse_ptr, flag_ptr, out_ptr, stride_ob, stride_oh,
                    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    row = (seq * tl.num_programs(1) + head) * NUM_SPLITS + offs_s  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + row, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=(offs_s < NUM_SPLITS)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    lse_max = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(lse_max > float("-inf"), lse_max, 0.0))  # [BLOCK_S]; empty splits weigh 0
    o = tl.sum(w[:, None] * part, axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)  # [BLOCK_D]
    o = tl.where(tl.load(flag_ptr + seq) != 0, 0.0, o)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def default_num_splits(num_seqs: int, kv_heads: int, max_tokens: int, block_n: int, device: torch.device) -> int:
    """Enough splits that the grid fills the GPU about twice, never more than there are key blocks."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-target // (num_seqs * kv_heads)), -(-max_tokens // block_n), 64))


def paged_decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, page_table: torch.Tensor,
    context_lens: torch.Tensor, owner_tags: torch.Tensor | None = None, leases: torch.Tensor | None = None,
    *, out: torch.Tensor | None = None, scale: float | None = None, num_splits: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new token per sequence over its paged keys and values.

    q: [num_seqs, heads, head_dim]; keys, values: [num_pages, kv_heads, page_size, head_dim] (one
    layer's views of the pool; heads % kv_heads == 0); page_table: int32 [num_seqs, max_pages], the
    pages of each sequence in token order (padding past the used pages is never read);
    context_lens: int32 [num_seqs], keys per sequence including the new token's (its K/V already
    stored); owner_tags: int64 [num_pages, 2] and leases: int64 [num_seqs, 2] to check ownership
    (both, or neither to skip the check). out: where to write (q's shape and dtype, e.g. a slice
    of a larger batch's output), default a new tensor; scale: default 1/sqrt(head_dim);
    num_splits, block_n: launch settings (defaults fill the device).

    Returns (out [num_seqs, heads, head_dim] in q's dtype, violations int32 [num_seqs]): a
    violation is 1 when the sequence's pages hold a tag other than its lease (checked only with
    owner_tags), a page index outside the pool, or a context length not in 1..max_pages*page_size;
    that sequence's output row is all zeros and must not be used.
    """
    num_pages, kv_heads, page_size, head_dim = check_cache(keys, values)
    device = keys.device
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, heads, head_dim], got {list(q.shape)}")
    num_seqs, heads = q.shape[0], q.shape[1]
    check_tensor("q", q, [num_seqs, heads, head_dim], [keys.dtype], device)
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    check_tensor("page_table", page_table, [num_seqs, None], [torch.int32], device)
    check_tensor("context_lens", context_lens, [num_seqs], [torch.int32], device, contiguous=True)
    check_owner = check_owner_args(owner_tags, leases, num_pages, num_seqs, device)
    max_pages = page_table.shape[1]
    if out is None:
        out = torch.empty_like(q)
    else:
        check_tensor("out", out, list(q.shape), [q.dtype], device)
    flags = torch.zeros(num_seqs, dtype=torch.int32, device=device)
    if num_seqs == 0:
        return out, flags
    if max_pages == 0:
        raise ValueError("page_table must have at least one column")
    block_n = block_n or (64 if device.type == "cuda" else 16)
    if block_n < 16 or block_n != next_pow2(block_n):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    max_tokens = max_pages * page_size
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, kv_heads, max_tokens, block_n, device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    tokens_per_split = -(-max_tokens // (num_splits * block_n)) * block_n
    part_out = part_lse = flags  # placeholders the kernel does not touch with one split
    if num_splits > 1:
        part_out = torch.empty(num_seqs, heads, num_splits, head_dim, dtype=torch.float32, device=device)
        part_lse = torch.empty(num_seqs, heads, num_splits, dtype=torch.float32, device=device)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = heads // kv_heads
    dot_dtype, dot_precision = dot_config(q.dtype)
    _decode_kernel[(num_seqs, kv_heads, num_splits)](
        q, keys, values, page_table, context_lens,
        owner_tags if check_owner else flags, leases if check_owner else flags,
        out, part_out, part_lse, flags,
        num_pages, max_pages, tokens_per_split, scale * math.log2(math.e),
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), page_table.stride(0),
        out.stride(0), out.stride(1),
        PAGE_SIZE=page_size, GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_D=next_pow2(head_dim), BLOCK_N=block_n,
        CHECK_OWNER=check_owner, DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,
        **LAUNCH_OPTIONS,
    )
    if num_splits > 1:
        _combine_kernel[(num_seqs, heads)](
            part_out, part_lse, flags, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), BLOCK_D=next_pow2(head_dim),
            **LAUNCH_OPTIONS)
    return out, flags

