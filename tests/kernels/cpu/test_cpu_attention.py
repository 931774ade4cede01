"""kernels/cpu/attention.py: decode attention over the pool's pages in place equals the torch path
(engine/attention.py), reads nothing but the pages a table names (every other page is NaN here),
gives a sequence the same bits whatever else is in the batch (and a prefill chunk's token the bits
it gets alone), and refuses tables that name pages outside the pool. The CPU backend runs it
inside a mixed decode + prefill step."""

from __future__ import annotations

import math

import pytest
import torch

from kvfence.engine.attention import build_attention_batch, paged_attention, store_kv
from kvfence.engine.attention_backend import CpuBackend
from kvfence.kernels.cpu import attention as cpu_attention, library as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available() and cpu_kernels.unavailable_as_expected(),
                                reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")

PAGES, LAYERS = 40, 2


def pool(kv_heads: int, page_size: int, head_dim: int) -> torch.Tensor:
    """[pages, layers, K|V, kv_heads, page_size, head_dim], the engine's layout, every value NaN."""
    return torch.full((PAGES, LAYERS, 2, kv_heads, page_size, head_dim), float("nan"))


def fill(data: torch.Tensor, pages: list[int], g: torch.Generator) -> None:
    for p in pages:
        data[p].copy_(torch.randn(data[p].shape, generator=g))


def case(kv_heads: int, group: int, page_size: int, head_dim: int, lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    data = pool(kv_heads, page_size, head_dim)
    free = torch.randperm(PAGES - 1, generator=g)[: sum(-(-n // page_size) for n in lens)] + 1
    tables, at = [], 0
    for n in lens:
        need = -(-n // page_size)
        tables.append(free[at: at + need].tolist())
        at += need
    fill(data, free.tolist(), g)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g)
    batch = build_attention_batch(page_size, list(zip(tables, lens)), [], torch.device("cpu"))
    return data, q, batch


def torch_reference(data: torch.Tensor, q: torch.Tensor, batch) -> torch.Tensor:  # noqa: ANN001
    clean = torch.nan_to_num(data, nan=0.0)  # the torch path reads the padding page 0: NaN there would spread
    return paged_attention(q, clean[:, 1, 0], clean[:, 1, 1], batch)


def kernel(data: torch.Tensor, q: torch.Tensor, batch) -> torch.Tensor:  # noqa: ANN001
    keys, values = data[:, 1, 0], data[:, 1, 1]
    tables = cpu_attention.DecodeTables.checked(batch.decode_page_table, batch.decode_kv_lens, PAGES,
                                                keys.shape[2])
    return cpu_attention.decode_attention(q, keys, values, tables, 1.0 / math.sqrt(q.shape[2]))


@pytest.mark.parametrize("kv_heads,group,page_size,head_dim", [(3, 3, 16, 64), (2, 4, 4, 8), (1, 1, 8, 24),
                                                               (4, 2, 16, 128)])
def test_equals_the_torch_path_and_reads_only_its_pages(kv_heads: int, group: int, page_size: int,
                                                        head_dim: int) -> None:
    lens = [1, page_size, page_size + 1, 5 * page_size - 3, 37]
    data, q, batch = case(kv_heads, group, page_size, head_dim, lens)
    got = kernel(data, q, batch)
    assert torch.isfinite(got).all()  # no NaN page was read
    torch.testing.assert_close(got, torch_reference(data, q, batch), rtol=2e-5, atol=2e-6)


def test_a_sequence_gets_the_same_bits_in_any_batch() -> None:
    data, q, batch = case(3, 3, 16, 64, [70, 5, 130, 16, 1, 99], seed=4)
    together = kernel(data, q, batch)
    for i, (table, n) in enumerate(zip(batch.decode_page_table.tolist(), batch.decode_kv_lens.tolist())):
        alone = build_attention_batch(16, [(table[: -(-n // 16)], n)], [], torch.device("cpu"))
        assert torch.equal(kernel(data, q[i: i + 1], alone)[0], together[i]), i


def test_a_key_scores_the_same_bits_in_a_block_of_eight_or_alone() -> None:
    """Pages of 16 tokens score keys eight at a time; pages of 5 one by one. The same keys and
    values laid out both ways give the same bits: a score never depends on its neighbours."""
    g = torch.Generator().manual_seed(9)
    n, kv_heads, d = 61, 3, 64
    k, v = torch.randn(n, kv_heads, d, generator=g), torch.randn(n, kv_heads, d, generator=g)
    q = torch.randn(1, kv_heads * 3, d, generator=g)
    outs = []
    for page_size in (16, 5):
        data = pool(kv_heads, page_size, d)
        table = list(range(1, 1 + -(-n // page_size)))
        batch = build_attention_batch(page_size, [(table, n)], [], torch.device("cpu"))
        store_kv(data[:, 1, 0], data[:, 1, 1], k, v, build_attention_batch(page_size, [], [(table, 0, n)],
                                                                           torch.device("cpu")))
        outs.append(kernel(data, q, batch))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("page_size,context,tokens", [(16, 0, 11), (40, 29, 13), (8, 3, 7), (16, 45, 1),
                                                      (5, 12, 9)])
def test_a_chunk_token_gets_the_bits_it_gets_alone(page_size: int, context: int, tokens: int) -> None:
    """A prefill chunk's rows read one table, each up to its own position; they go in blocks that
    share key tiles (a tile never crosses a page; pages of 40 hold several tiles). Every row gets
    the bits it gets alone, the torch path's values within rounding, and no NaN page is read."""
    kv_heads, group, d = 3, 3, 64
    g = torch.Generator().manual_seed(page_size + context)
    data = pool(kv_heads, page_size, d)
    n = context + tokens
    table = (torch.randperm(PAGES - 1, generator=g)[: -(-n // page_size)] + 1).tolist()
    fill(data, table, g)
    keys, values = data[:, 1, 0], data[:, 1, 1]
    q = torch.randn(tokens, kv_heads * group, d, generator=g)
    lens = torch.arange(context + 1, n + 1)
    tables = cpu_attention.DecodeTables.checked(torch.tensor([table]), lens, PAGES, page_size,
                                                rows=torch.zeros(tokens, dtype=torch.int64))
    together = cpu_attention.decode_attention(q, keys, values, tables, 1.0 / math.sqrt(d))
    assert torch.isfinite(together).all()
    for i in range(tokens):
        alone = cpu_attention.DecodeTables.checked(torch.tensor([table]), lens[i: i + 1], PAGES, page_size)
        assert torch.equal(cpu_attention.decode_attention(q[i: i + 1], keys, values, alone, 1.0 / math.sqrt(d))[0],
                           together[i]), i
    step = build_attention_batch(page_size, [], [(table, context, tokens)], torch.device("cpu"))
    torch.testing.assert_close(together, torch_reference(data, q, step), rtol=1e-5, atol=1e-5)


def test_tables_outside_the_pool_are_refused() -> None:
    _, _, batch = case(3, 3, 16, 64, [20, 3])
    bad = batch.decode_page_table.clone()
    bad[0, 1] = PAGES  # a page the sequence reaches, past the pool
    with pytest.raises(ValueError, match=f"outside 0..{PAGES - 1}"):
        cpu_attention.DecodeTables.checked(bad, batch.decode_kv_lens, PAGES, 16)
    bad[0, 1] = -1
    with pytest.raises(ValueError, match="outside"):
        cpu_attention.DecodeTables.checked(bad, batch.decode_kv_lens, PAGES, 16)
    with pytest.raises(ValueError, match="kv_lens must be in 1..32"):
        cpu_attention.DecodeTables.checked(batch.decode_page_table, torch.tensor([33, 3]), PAGES, 16)
    with pytest.raises(ValueError, match="kv_lens must be in"):
        cpu_attention.DecodeTables.checked(batch.decode_page_table, torch.tensor([0, 3]), PAGES, 16)


def test_the_cpu_backend_runs_a_mixed_step_like_the_torch_path() -> None:
    g = torch.Generator().manual_seed(9)
    data = torch.randn(PAGES, LAYERS, 2, 3, 16, 64, generator=g)
    decode = [([3, 7, 9], 40), ([11], 2)]
    prefill = [([20, 21, 22], 16, 20), ([30], 0, 5)]  # (table, cached tokens, chunk)
    batch = build_attention_batch(16, decode, prefill, torch.device("cpu"))
    q = torch.randn(2 + 20 + 5, 9, 64, generator=g)
    keys, values = data[:, 0, 0], data[:, 0, 1]
    torch.testing.assert_close(CpuBackend().paged_attention(q, keys, values, batch),
                               paged_attention(q, keys, values, batch), rtol=2e-5, atol=2e-6)


def test_the_cpu_backend_stores_a_step_like_the_torch_path() -> None:
    g = torch.Generator().manual_seed(2)
    batch = build_attention_batch(16, [([3, 7, 9], 40), ([11], 2)], [([20, 21], 10, 12)], torch.device("cpu"))
    qkv = torch.randn(14, 9 * 64 + 2 * 3 * 64, generator=g)  # the model's fused projection: k, v are strided views
    k = qkv[:, 9 * 64: 12 * 64].view(14, 3, 64)
    v = qkv[:, 12 * 64:].view(14, 3, 64)
    mine, theirs = torch.zeros(PAGES, LAYERS, 2, 3, 16, 64), torch.zeros(PAGES, LAYERS, 2, 3, 16, 64)
    CpuBackend().store_kv(mine[:, 1, 0], mine[:, 1, 1], k, v, batch)
    store_kv(theirs[:, 1, 0], theirs[:, 1, 1], k, v, batch)
    assert torch.equal(mine, theirs) and mine.abs().sum() > 0


def test_store_slots_outside_the_pool_are_refused() -> None:
    with pytest.raises(ValueError, match="outside the pool's 40 pages of 16 tokens"):
        cpu_attention.StoreSlots.checked(torch.tensor([3, 40]), torch.tensor([0, 1]), PAGES, 16)
    with pytest.raises(ValueError, match="outside"):
        cpu_attention.StoreSlots.checked(torch.tensor([3, 4]), torch.tensor([0, 16]), PAGES, 16)
