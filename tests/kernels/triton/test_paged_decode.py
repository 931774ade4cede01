"""kernels/triton/paged_decode.py against its torch reference and against the engine's own decode path."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import assert_close, make_case  # noqa: E402

from kvfence.engine.attention import build_attention_batch, paged_attention  # noqa: E402
from kvfence.engine.attention_backend import TritonBackend  # noqa: E402
from kvfence.kernels.triton.paged_decode import paged_decode_attention  # noqa: E402
from kvfence.kernels.triton.reference import paged_decode_reference  # noqa: E402

LENS = [1, 37, 16, 70]  # ragged: one token, page-aligned, mid-page, several pages


def _run(case, lens, device, check: bool = True, **kw):
    q = torch.randn(len(lens), case.heads, case.keys.shape[-1], generator=torch.Generator().manual_seed(7))
    q = q.to(device=device, dtype=case.keys.dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    tags = (case.owner_tags, case.leases) if check else (None, None)
    got = paged_decode_attention(q, case.keys, case.values, case.page_table, ctx, *tags, **kw)
    want = paged_decode_reference(q, case.keys, case.values, case.page_table, ctx, *tags)
    return got, want


@pytest.mark.parametrize(("dtype", "kv_heads", "group", "head_dim", "page_size", "num_splits"), [
    (torch.float32, 2, 1, 64, 16, 1),
    (torch.float32, 1, 3, 64, 8, 3),
    (torch.float32, 3, 3, 32, 16, 2),
    (torch.bfloat16, 3, 3, 64, 16, 1),
    (torch.bfloat16, 2, 1, 32, 8, 3),
    (torch.float16, 1, 3, 64, 16, 2),
    (torch.float32, 2, 1, 32, 1, 2),  # the engine allows any page size
])
def test_matches_reference(dtype, kv_heads, group, head_dim, page_size, num_splits, device) -> None:
    case = make_case(1, LENS, kv_heads, group, head_dim, page_size, dtype, device)
    (out, flags), (want, want_flags) = _run(case, LENS, device, num_splits=num_splits)
    assert flags.tolist() == want_flags.tolist() == [0] * len(LENS)
    assert_close(out, want, dtype)


@pytest.mark.parametrize(("dtype", "group", "page_size"), [(torch.float32, 3, 16), (torch.bfloat16, 1, 8)])
def test_matches_engine_decode(dtype, group, page_size, device) -> None:
    """The Triton backend computes what engine/attention.paged_attention computes for a decode batch."""
    case = make_case(2, LENS, 3, group, 64, page_size, dtype, device)
    batch = build_attention_batch(page_size, [(t, n) for t, n in zip(case.tables, LENS)], [], device)
    # The engine's q rows are a strided view of its fused QK projection.
    qk = torch.randn(len(LENS), case.heads + 3, 64, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    q = qk[:, : case.heads]
    got = TritonBackend().paged_attention(q, case.keys, case.values, batch)
    assert_close(got, paged_attention(q, case.keys, case.values, batch), dtype, engine=True)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreign_page_flags_only_its_sequence(num_splits, dtype, device) -> None:
    case = make_case(3, LENS, 3, 3, 64, 16, dtype, device)
    case.retag(3, 2)  # the third of five pages of the last sequence belongs to another lease
    (out, flags), (want, want_flags) = _run(case, LENS, device, num_splits=num_splits)
    assert flags.tolist() == want_flags.tolist() == [0, 0, 0, 1]
    assert out[3].eq(0).all(), "a violating sequence's output is zeros"
    assert_close(out[:3], want[:3], dtype)


def test_free_page_and_its_first_token_are_checked(device) -> None:
    """A page's tag is checked even when only its first slot is read."""
    lens = [17, 33]  # each sequence's last page holds one token
    case = make_case(4, lens, 1, 3, 32, 16, torch.float32, device)
    case.owner_tags[case.tables[0][-1]] = 0  # freed under the reader
    (out, flags), _ = _run(case, lens, device)
    assert flags.tolist() == [1, 0]
    assert out[0].eq(0).all() and out[1].abs().sum() > 0


def test_without_the_check_tags_are_ignored(device) -> None:
    case = make_case(5, LENS, 3, 3, 64, 16, torch.float32, device)
    case.retag(1, 0)
    (out, flags), (want, _) = _run(case, LENS, device, check=False, num_splits=2)
    assert flags.tolist() == [0] * len(LENS)
    assert_close(out, want, torch.float32)


def test_out_of_pool_pages_and_bad_lengths_are_flagged(device) -> None:
    lens = [20, 20, 20]
    case = make_case(6, lens, 1, 3, 32, 8, torch.float32, device, spare_columns=0)
    case.page_table[0, 1] = case.data.shape[0]  # one past the pool
    case.page_table[1, 2] = -1
    bad_lens = [20, 20, case.page_table.shape[1] * 8 + 1]  # longer than the table holds
    q = torch.randn(3, 3, 32, device=device)
    out, flags = paged_decode_attention(q, case.keys, case.values, case.page_table,
                                        torch.tensor(bad_lens, dtype=torch.int32, device=device))
    assert flags.tolist() == [1, 1, 1]
    assert out.eq(0).all()


def test_launcher_rejects_bad_arguments(device) -> None:
    case = make_case(7, [5], 1, 3, 32, 8, torch.float32, device)
    q = torch.randn(1, 3, 32, device=device)
    ctx = torch.tensor([5], dtype=torch.int32, device=device)
    args = (case.keys, case.values, case.page_table, ctx)
    with pytest.raises(ValueError, match="page_table must be int32"):
        paged_decode_attention(q, case.keys, case.values, case.page_table.long(), ctx)
    with pytest.raises(ValueError, match="q must be float32"):
        paged_decode_attention(q.half(), *args)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_decode_attention(torch.randn(1, 3, 32, device=device), case.keys.expand(-1, 2, -1, -1),
                               case.values.expand(-1, 2, -1, -1), case.page_table, ctx)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        paged_decode_attention(torch.randn(1, 3, 64, device=device)[..., ::2], *args)
    with pytest.raises(ValueError, match="go together"):
        paged_decode_attention(q, *args, case.owner_tags, None)
    with pytest.raises(ValueError, match="values must match keys"):
        paged_decode_attention(q, case.keys, case.values.contiguous(), case.page_table, ctx)
