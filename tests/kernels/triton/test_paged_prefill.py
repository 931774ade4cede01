"""kernels/triton/paged_prefill.py against its torch reference and against the engine's own prefill path."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import assert_close, make_case  # noqa: E402

from kvfence.engine.attention import build_attention_batch, paged_attention  # noqa: E402
from kvfence.engine.attention_backend import TritonBackend  # noqa: E402
from kvfence.kernels.triton.paged_prefill import paged_prefill_attention  # noqa: E402
from kvfence.kernels.triton.reference import paged_prefill_reference  # noqa: E402

# (cached tokens, chunk tokens): a first chunk, a chunk after a mid-page prefix, a one-token
# chunk, a chunk spanning several query blocks after a long prefix.
SPANS = [(0, 20), (13, 7), (5, 1), (33, 35)]


def _run(case, spans, device, check: bool = True, **kw):
    num_tokens = sum(n for _, n in spans)
    q = torch.randn(num_tokens, case.heads, case.keys.shape[-1], generator=torch.Generator().manual_seed(5))
    q = q.to(device=device, dtype=case.keys.dtype)
    cu = torch.tensor([0] + [sum(n for _, n in spans[: i + 1]) for i in range(len(spans))], dtype=torch.int32,
                      device=device)
    cached = torch.tensor([c for c, _ in spans], dtype=torch.int32, device=device)
    tags = (case.owner_tags, case.leases) if check else (None, None)
    max_chunk = max(n for _, n in spans)
    got = paged_prefill_attention(q, case.keys, case.values, cu, cached, case.page_table, max_chunk, *tags, **kw)
    want = paged_prefill_reference(q, case.keys, case.values, cu, cached, case.page_table, *tags)
    return got, want, cu.tolist()


@pytest.mark.parametrize(("dtype", "kv_heads", "group", "head_dim", "page_size"), [
    (torch.float32, 2, 1, 64, 16),
    (torch.float32, 1, 3, 32, 8),
    (torch.bfloat16, 1, 3, 64, 16),
    (torch.bfloat16, 2, 1, 32, 8),
    (torch.float16, 1, 3, 64, 16),
    (torch.float32, 2, 1, 32, 4),
])
def test_matches_reference(dtype, kv_heads, group, head_dim, page_size, device) -> None:
    case = make_case(1, [c + n for c, n in SPANS], kv_heads, group, head_dim, page_size, dtype, device)
    (out, flags), (want, want_flags), _ = _run(case, SPANS, device)
    assert flags.tolist() == want_flags.tolist() == [0] * len(SPANS)
    assert_close(out, want, dtype)


@pytest.mark.parametrize(("dtype", "group", "page_size"), [(torch.float32, 3, 16), (torch.bfloat16, 1, 8)])
def test_matches_engine_mixed_batch(dtype, group, page_size, device) -> None:
    """Decodes then prefill chunks in one flat batch, as the runner builds it: the Triton backend
    computes what engine/attention.paged_attention computes."""
    decodes = [1, 29]  # kv_len incl. the new token
    case = make_case(2, decodes + [c + n for c, n in SPANS], 1, group, 64, page_size, dtype, device)
    batch = build_attention_batch(
        page_size, [(case.tables[i], n) for i, n in enumerate(decodes)],
        [(case.tables[len(decodes) + i], c, n) for i, (c, n) in enumerate(SPANS)], device)
    num_tokens = len(decodes) + sum(n for _, n in SPANS)
    q = torch.randn(num_tokens, case.heads, 64, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    got = TritonBackend().paged_attention(q, case.keys, case.values, batch)
    assert_close(got, paged_attention(q, case.keys, case.values, batch), dtype, engine=True)


@pytest.mark.parametrize(("dtype", "seq", "page_index"), [
    (torch.float32, 1, 0),  # a cached page
    (torch.bfloat16, 3, 4),  # the chunk's last page, read only by the last query block
])
def test_foreign_page_flags_only_its_sequence(dtype, seq, page_index, device) -> None:
    case = make_case(3, [c + n for c, n in SPANS], 1, 3, 32, 16, dtype, device)
    case.retag(seq, page_index)
    (out, flags), (want, want_flags), cu = _run(case, SPANS, device, block_m=16)
    expected = [int(i == seq) for i in range(len(SPANS))]
    assert flags.tolist() == want_flags.tolist() == expected
    rows = slice(cu[seq], cu[seq + 1])
    assert out[rows].eq(0).all(), "every row of a violating sequence is zeros, in every query block"
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    keep[rows] = False
    assert_close(out[keep], want[keep], dtype)


def test_without_the_check_tags_are_ignored(device) -> None:
    case = make_case(4, [c + n for c, n in SPANS], 1, 3, 32, 8, torch.float32, device)
    case.retag(0, 1)
    (out, flags), (want, _), _ = _run(case, SPANS, device, check=False)
    assert flags.tolist() == [0] * len(SPANS)
    assert_close(out, want, torch.float32)


def test_bad_lengths_are_flagged(device) -> None:
    case = make_case(5, [20, 5], 1, 3, 32, 8, torch.float32, device, spare_columns=0)  # tables hold 24 tokens
    q = torch.randn(25, 3, 32, device=device)
    cu = torch.tensor([0, 20, 25], dtype=torch.int32, device=device)
    cached = torch.tensor([0, 0], dtype=torch.int32, device=device)
    out, flags = paged_prefill_attention(q, case.keys, case.values, cu, cached, case.page_table, 20, block_m=16)
    assert flags.tolist() == [0, 0]
    # A chunk longer than max_chunk_tokens says (one query block of 16 rows for 20).
    out, flags = paged_prefill_attention(q, case.keys, case.values, cu, cached, case.page_table, 8, block_m=16)
    assert flags.tolist() == [1, 0] and out[:16].eq(0).all()
    # 20 cached + 5 new tokens do not fit a table of 24.
    cached[1] = 20
    out, flags = paged_prefill_attention(q, case.keys, case.values, cu, cached, case.page_table, 20, block_m=16)
    assert flags.tolist() == [0, 1] and out[20:].eq(0).all()


def test_launcher_rejects_bad_arguments(device) -> None:
    case = make_case(6, [5], 1, 3, 32, 8, torch.float32, device)
    q = torch.randn(5, 3, 32, device=device)
    cu = torch.tensor([0, 5], dtype=torch.int32, device=device)
    cached = torch.zeros(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        paged_prefill_attention(q, case.keys, case.values, cu.long(), cached, case.page_table, 5)
    with pytest.raises(ValueError, match=r"cached_lens must have shape \[1\]"):
        paged_prefill_attention(q, case.keys, case.values, cu, cached.expand(2), case.page_table, 5)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        paged_prefill_attention(q, case.keys, case.values, cu, cached, case.page_table, 5, block_m=24)
