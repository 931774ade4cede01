"""kernels/cpu/layer.py: a step's layers as one C call each compute exactly what the
one-call-per-op loop computes (logits and every stored K/V row, bit for bit), for decode steps at
batch sizes that span several row blocks and page boundaries and for steps with prefill chunks,
with and without Q/K/V biases; a token's logits do not depend on whether it was prefilled or
decoded; they read and write only the pages the checked tables and slots name; the model takes
them only where they apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfence.engine.attention import build_attention_batch
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.llama import LlamaModel
from kvfence.engine.loading import load_checkpoint
from kvfence.kernels.cpu import gemm as cpu_gemm, library as cpu_kernels
from kvfence.kernels.cpu.attention import DecodeTables, StoreSlots

pytestmark = pytest.mark.skipif(not cpu_kernels.available() and cpu_kernels.unavailable_as_expected(),
                                reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")

PAGE = 16


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    from tiny_models import TinySpec, make_tiny_pair

    path, _, _ = make_tiny_pair(tmp_path_factory.mktemp(request.param), seed=11, spec=TinySpec(arch=request.param))
    return load_checkpoint(Path(path))


def prefilled(model: LlamaModel, lengths: list[int], pages_per_seq: int) -> tuple[KVPool, list[list[int]]]:
    """A pool (its unused pages NaN) holding one prefilled sequence of each length (0: none yet),
    and their tables."""
    pool = KVPool(model.config, 2 + len(lengths) * pages_per_seq, PAGE, torch.float32)
    pool.data.fill_(float("nan"))
    g = torch.Generator().manual_seed(len(lengths))
    tables = [list(range(2 + i * pages_per_seq, 2 + (i + 1) * pages_per_seq)) for i in range(len(lengths))]
    for table, n in zip(tables, lengths):
        if not n:
            continue
        ids = torch.randint(3, model.config.vocab_size, (n,), generator=g)
        batch = build_attention_batch(PAGE, [], [(table, 0, n)], torch.device("cpu"))
        model.forward(ids, torch.arange(n), batch, pool, torch.tensor([n - 1]))
    return pool, tables


def decode(model: LlamaModel, pool: KVPool, tables: list[list[int]], lengths: list[int],
           tokens: list[int]) -> torch.Tensor:
    batch = build_attention_batch(PAGE, [(t, n + 1) for t, n in zip(tables, lengths)], [], torch.device("cpu"))
    return model.forward(torch.tensor(tokens), torch.tensor(lengths), batch, pool, torch.arange(len(tokens)))


@pytest.mark.parametrize("lengths", [[5], [16, 1, 31, 7, 47, 2, 16], [3 * i + 1 for i in range(18)],
                                     [i % 40 + 1 for i in range(34)]], ids=["one", "seven", "eighteen", "thirty-four"])
def test_one_call_per_layer_equals_the_per_op_loop_bit_for_bit(checkpoint: Checkpoint, lengths: list[int]) -> None:
    """The per-op loop runs its GEMMs in 6-row blocks; the fused layers in the AVX-512 blocks where
    the CPU has them (4 rows over four panels, 16 over one, or from 8 rows on 8 over two; the residual projections
    accumulate into y inside the block): the same bits."""
    fused = LlamaModel(checkpoint, torch.float32)
    assert fused.fused_layers is not None
    looped = LlamaModel(checkpoint, torch.float32)
    looped.fused_layers = None  # the same kernels, one call per op
    pool, tables = prefilled(looped, lengths, pages_per_seq=4)
    twin = KVPool(looped.config, pool.num_pages, PAGE, torch.float32)
    twin.data.copy_(pool.data)
    tokens = [7 + i for i in range(len(lengths))]
    for step in range(3):  # the second and third steps read what the fused one stored
        at = [n + step for n in lengths]
        a = decode(fused, pool, tables, at, tokens)
        try:
            cpu_gemm.wide_blocks(False)
            b = decode(looped, twin, tables, at, tokens)
        finally:
            cpu_gemm.wide_blocks(True)
        assert torch.equal(a, b), (a - b).abs().max()
        assert torch.equal(pool.data.nan_to_num(7.0), twin.data.nan_to_num(7.0))
        tokens = a.argmax(-1).tolist()


@pytest.mark.parametrize("chunks", [[(0, 1)], [(0, 37)], [(16, 5), (0, 70)], [(31, 33), (5, 2), (0, 16)]],
                         ids=["one-token", "a-prompt", "two", "three-with-context"])
def test_a_step_with_prefill_chunks_equals_the_per_op_loop_bit_for_bit(checkpoint: Checkpoint,
                                                                        chunks: list[tuple[int, int]]) -> None:
    """A step of decode rows and prefill chunks (context tokens already cached, tokens fed): the
    fused layers give the per-op loop's logits and K/V bit for bit; every chunk token attends
    causally (the chunk's own later tokens are NaN-free but unread: the logits of every row are
    compared)."""
    fused, looped = LlamaModel(checkpoint, torch.float32), LlamaModel(checkpoint, torch.float32)
    looped.fused_layers = None
    lengths = [5, 20]
    pool, tables = prefilled(looped, lengths + [ctx for ctx, _ in chunks], pages_per_seq=7)
    twin = KVPool(looped.config, pool.num_pages, PAGE, torch.float32)
    twin.data.copy_(pool.data)
    g = torch.Generator().manual_seed(len(chunks))
    decode_rows = [(t, n + 1) for t, n in zip(tables, lengths)]
    prefill_rows = [(t, ctx, n) for t, (ctx, n) in zip(tables[len(lengths):], chunks)]
    ids = torch.randint(3, fused.config.vocab_size, (len(lengths) + sum(n for _, n in chunks),), generator=g)
    positions = torch.tensor(lengths + [p for ctx, n in chunks for p in range(ctx, ctx + n)])
    every_row = torch.arange(ids.shape[0])
    batch = build_attention_batch(PAGE, decode_rows, prefill_rows, torch.device("cpu"))
    a = fused.forward(ids, positions, batch, pool, every_row)
    b = looped.forward(ids, positions, build_attention_batch(PAGE, decode_rows, prefill_rows, torch.device("cpu")),
                       twin, every_row)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b), (a - b).abs().max()
    assert torch.equal(pool.data.nan_to_num(7.0), twin.data.nan_to_num(7.0))


def test_a_chunk_token_gets_the_bits_it_gets_decoded_alone(checkpoint: Checkpoint) -> None:
    """Prefilling n tokens in one chunk and decoding them one at a time give every position the
    same logits, bit for bit: a row attends to exactly its own prefix, whatever step it is in."""
    model = LlamaModel(checkpoint, torch.float32)
    n = 21
    ids = torch.randint(3, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(3))
    chunked = KVPool(model.config, 4, PAGE, torch.float32)
    table = [1, 2]
    whole = model.forward(ids, torch.arange(n), build_attention_batch(PAGE, [], [(table, 0, n)], torch.device("cpu")),
                          chunked, torch.arange(n))
    alone = KVPool(model.config, 4, PAGE, torch.float32)
    rows = [model.forward(ids[:1], torch.arange(1),
                          build_attention_batch(PAGE, [], [(table, 0, 1)], torch.device("cpu")), alone,
                          torch.tensor([0]))]
    for pos in range(1, n):
        batch = build_attention_batch(PAGE, [(table, pos + 1)], [], torch.device("cpu"))
        rows.append(model.forward(ids[pos:pos + 1], torch.tensor([pos]), batch, alone, torch.tensor([0])))
    assert torch.equal(whole, torch.cat(rows))
    assert torch.equal(chunked.data, alone.data)


def test_only_the_named_pages_are_read_or_written(checkpoint: Checkpoint) -> None:
    """Every page outside the sequences' tables stays NaN and no NaN reaches the logits; inside
    them, only the new token's slot changes."""
    model = LlamaModel(checkpoint, torch.float32)
    lengths = [9, 20]
    pool, tables = prefilled(model, lengths, pages_per_seq=3)
    before = pool.data.clone()
    logits = decode(model, pool, tables, lengths, [5, 6])
    assert torch.isfinite(logits).all()
    changed = ~((pool.data == before) | (pool.data.isnan() & before.isnan()))
    slots = {(t[n // PAGE], n % PAGE) for t, n in zip(tables, lengths)}
    touched = {(p, o) for p, o in changed.any(dim=(1, 2, 3, 5)).nonzero().tolist()}
    assert touched == slots


def test_the_model_takes_it_only_where_it_applies(checkpoint: Checkpoint) -> None:
    assert LlamaModel(checkpoint, torch.float32).fused_layers is not None
    assert LlamaModel(checkpoint, torch.float32, cpu_kernels=False).fused_layers is None
    assert LlamaModel(checkpoint, torch.float32, attention_backend="torch").fused_layers is None


def test_what_it_does_not_take_is_refused(checkpoint: Checkpoint) -> None:
    model = LlamaModel(checkpoint, torch.float32)
    pool = KVPool(model.config, 4, PAGE, torch.float32)
    slots = StoreSlots.checked(torch.tensor([1]), torch.tensor([0]), 4, PAGE)
    tables = DecodeTables.checked(torch.tensor([[1]]), torch.tensor([1]), 4, PAGE)
    d, hidden = model.config.head_dim, model.config.hidden_size
    with pytest.raises(ValueError, match="fused layers want"):  # two rows, one slot
        model.fused_layers.run(torch.zeros(2, hidden), torch.ones(2, d), torch.ones(2, d), pool.data, slots, tables)
    with pytest.raises(ValueError, match="fused layers want"):
        model.fused_layers.run(torch.zeros(1, hidden, dtype=torch.float64), torch.ones(1, d), torch.ones(1, d),
                                pool.data, slots, tables)
