"""kernels/triton/kv_store.py against its torch reference and the engine's store_kv."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import make_case  # noqa: E402

from kvfence.engine.attention import build_attention_batch, store_kv  # noqa: E402
from kvfence.engine.attention_backend import TritonBackend  # noqa: E402
from kvfence.kernels.triton.kv_store import store_kv_pages  # noqa: E402
from kvfence.kernels.triton.reference import kv_store_reference  # noqa: E402


def _new_kv(num_tokens: int, kv_heads: int, head_dim: int, heads: int, dtype, device):
    """k, v: [num_tokens, kv_heads, head_dim] strided views of a fused QKV output, as the model has them."""
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, generator=torch.Generator().manual_seed(9))
    qkv = qkv.to(device, dtype)
    return qkv[:, heads: heads + kv_heads], qkv[:, heads + kv_heads:]


@pytest.mark.parametrize(("dtype", "kv_heads", "head_dim", "page_size"), [
    (torch.float32, 3, 64, 16), (torch.bfloat16, 1, 32, 8), (torch.float16, 2, 64, 8)])
def test_matches_reference_and_engine(dtype, kv_heads, head_dim, page_size, device) -> None:
    # Two sequences: a decode token landing mid-page, a prefill chunk crossing pages.
    case = make_case(1, [30, 40], kv_heads, 3, head_dim, page_size, dtype, device)
    batch = build_attention_batch(page_size, [(case.tables[0], 30)], [(case.tables[1], 27, 13)], device)
    k, v = _new_kv(14, kv_heads, head_dim, case.heads, dtype, device)
    pool = case.data.clone()
    engine_pool = case.data.clone()
    reference_pool = case.data.clone()
    flags = store_kv_pages(pool[:, 1, 0], pool[:, 1, 1], k, v, batch.slot_pages, batch.slot_offsets,
                           case.owner_tags, case.leases[[0] + [1] * 13])
    store_kv(engine_pool[:, 1, 0], engine_pool[:, 1, 1], k, v, batch)
    kv_store_reference(reference_pool[:, 1, 0], reference_pool[:, 1, 1], k, v, batch.slot_pages, batch.slot_offsets)
    assert flags.eq(0).all()
    assert torch.equal(pool, engine_pool) and torch.equal(pool, reference_pool)  # exact: a copy
    assert not torch.equal(pool, case.data), "something was written"
    backend_pool = case.data.clone()
    TritonBackend().store_kv(backend_pool[:, 1, 0], backend_pool[:, 1, 1], k, v, batch)
    assert torch.equal(backend_pool, engine_pool)


def test_foreign_and_out_of_pool_slots_are_not_written(device) -> None:
    case = make_case(2, [16, 16], 2, 1, 32, 8, torch.float32, device)
    k, v = _new_kv(4, 2, 32, 2, torch.float32, device)
    pages = torch.tensor([case.tables[0][0], case.tables[1][1], case.data.shape[0], case.tables[0][1]],
                         device=device)
    offsets = torch.tensor([3, 0, 0, 8], device=device)  # the last one is past the page
    leases = case.leases[[0, 0, 0, 0]]  # token 1 writes into sequence 1's page
    pool = case.data.clone()
    reference_pool = case.data.clone()
    flags = store_kv_pages(pool[:, 1, 0], pool[:, 1, 1], k, v, pages, offsets, case.owner_tags, leases)
    want = kv_store_reference(reference_pool[:, 1, 0], reference_pool[:, 1, 1], k, v, pages, offsets,
                              case.owner_tags, leases)
    assert flags.tolist() == want.tolist() == [0, 1, 1, 1]
    assert torch.equal(pool, reference_pool)
    changed = (pool != case.data).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [case.tables[0][0]], "only the one owned, in-range slot was written"


def test_launcher_rejects_bad_arguments(device) -> None:
    case = make_case(3, [8], 1, 1, 32, 8, torch.float32, device)
    k, v = _new_kv(1, 1, 32, 1, torch.float32, device)
    pages = torch.tensor([case.tables[0][0]], device=device)
    offsets = torch.tensor([0], device=device)
    with pytest.raises(ValueError, match="slot_pages must be int64"):
        store_kv_pages(case.keys, case.values, k, v, pages.int(), offsets)
    with pytest.raises(ValueError, match="k must be float32"):
        store_kv_pages(case.keys, case.values, k.half(), v, pages, offsets)
    with pytest.raises(ValueError, match=r"v must have shape \[1, 1, 32\]"):
        store_kv_pages(case.keys, case.values, k, v[:, :, :16], pages, offsets)
    with pytest.raises(ValueError, match="go together"):
        store_kv_pages(case.keys, case.values, k, v, pages, offsets, case.owner_tags)
