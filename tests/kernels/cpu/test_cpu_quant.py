"""Quantized panels (kernels/cpu/quant.py, quant.c): for every GGUF block type kept as it ships,
the GEMM over its panels gives the bits of the float32 GEMM over what the `gguf` package
dequantizes the same bytes to, for every row count 1-70, with the AVX-512 blocks and with the
AVX2 ones; decoded rows equal the dequantized ones; fused linears of mixed types too."""

from __future__ import annotations

import pytest
import torch
from quant_cases import KINDS, random_tensor, same_bits

from kvfence.kernels.cpu import gemm as cpu_gemm, library as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available() and cpu_kernels.unavailable_as_expected(),
                                reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


@pytest.fixture(params=[True, False], ids=["avx512-blocks", "avx2-blocks"])
def wide(request: pytest.FixtureRequest):  # noqa: ANN201
    before = cpu_gemm.wide_blocks()
    if request.param and not cpu_gemm.wide_blocks(True):
        pytest.skip("the CPU has no AVX-512")
    cpu_gemm.wide_blocks(request.param)
    yield request.param
    cpu_gemm.wide_blocks(before)


@pytest.mark.parametrize("kind", KINDS)
def test_every_row_count_gives_the_float32_bits(kind: str, wide: bool) -> None:
    """n = 136 (nine panels, the last part-filled: each of two threads walks four at once and then
    one alone), k = 768 (three decoded pieces of 256); rows 1-70 cover the four-panel blocks (in
    registers or through a buffer), the one-pass blocks, the decoded panel under the six- or
    sixteen-row blocks (5 to 7 rows), and the two-panel blocks from 8 rows on."""
    k = 768
    tensor = random_tensor(kind, 136, k, seed=len(kind) + k)
    dense = tensor.dequantize()
    native, reference = cpu_gemm.PackedWeight(tensor), cpu_gemm.PackedWeight(dense)
    assert native.kinds == [kind] and native.nbytes < reference.nbytes / 3
    g = torch.Generator().manual_seed(11)
    for m in range(1, 71):
        x = torch.randn(m, k, generator=g)
        assert same_bits(native(x), reference(x)), (kind, m)


def test_no_rows_read_nothing(wide: bool) -> None:
    """An empty step (no logits rows) multiplies zero rows: an empty result, no read of x (whose
    storage an empty tensor may not have)."""
    for part in (random_tensor("Q4_1", 64, 256, 1), torch.randn(64, 256)):
        weight = cpu_gemm.PackedWeight(part)
        assert weight(torch.empty(0, 256)).shape == (0, 64)


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_a_width_that_is_not_whole_pieces(kind: str, wide: bool) -> None:
    k = 288  # one decoded piece of 256 and one of 32
    tensor = random_tensor(kind, 33, k, seed=5)
    native, reference = cpu_gemm.PackedWeight(tensor), cpu_gemm.PackedWeight(tensor.dequantize())
    g = torch.Generator().manual_seed(2)
    for m in (1, 3, 16, 17, 40):
        x = torch.randn(m, k, generator=g)
        assert same_bits(native(x), reference(x)), (kind, m)


@pytest.mark.parametrize("kind", KINDS)
def test_decoded_rows_are_the_dequantized_rows(kind: str) -> None:
    tensor = random_tensor(kind, 37, 512, seed=3)
    dense = tensor.dequantize()
    native = cpu_gemm.PackedWeight(tensor)
    ids = torch.tensor([36, 0, 15, 16, 17, 31, 32, 5, 5])
    assert same_bits(native.rows(ids), dense[ids])
    assert same_bits(native.rows(torch.arange(37)), dense)
    for bad in (torch.tensor([37]), torch.tensor([-1]), torch.tensor([[1]])):
        with pytest.raises(ValueError, match=r"\[0, 37\)"):
            native.rows(bad)


def test_a_fused_linear_of_mixed_types_keeps_each_and_its_bias(wide: bool) -> None:
    """Q/K/V as a model's files mix them (Q4_K, Q4_K, Q6_K; a float32 part) with a bias: each part
    keeps its type, and the product is the float32 product of the concatenation, bit for bit."""
    k = 512
    parts = [random_tensor("Q4_K", 64, k, 1), random_tensor("Q4_K", 32, k, 2), random_tensor("Q6_K", 32, k, 3)]
    f32 = torch.randn(16, k)
    bias = torch.randn(144)
    native = cpu_gemm.PackedWeight([*parts, f32], bias)
    assert native.kinds == ["F32", "Q4_K", "Q6_K"] and native.n == 144
    reference = cpu_gemm.PackedWeight(torch.cat([p.dequantize() for p in parts] + [f32]), bias)
    for m in (1, 2, 7, 16, 33, 64):
        x = torch.randn(m, k)
        assert same_bits(native(x), reference(x)), m


def test_parts_that_do_not_fill_whole_panels_are_multiplied_as_float32() -> None:
    parts = [random_tensor("Q4_1", 40, 256, 1), random_tensor("Q8_0", 24, 256, 2)]
    native = cpu_gemm.PackedWeight(parts)
    assert native.kinds == ["F32"]
    reference = cpu_gemm.PackedWeight(torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(5, 256)
    assert same_bits(native(x), reference(x))


def test_unkept_block_types_and_bad_shapes() -> None:
    from kvfence.engine.gguf_tensor import GGUFTensor
    from kvfence.kernels.cpu import quant as cpu_quant

    t = random_tensor("Q4_1", 16, 64, 1)
    other = GGUFTensor("Q5_1", t.raw, t.shape)  # not kept: goes in as float32
    assert not cpu_gemm.kept_as_shipped(other)
    with pytest.raises(ValueError, match="whole blocks"):
        cpu_quant.panels("Q4_1", t.raw[:, :30], 64)
    with pytest.raises(ValueError, match="one width"):
        cpu_gemm.PackedWeight([t, random_tensor("Q4_1", 16, 96, 2)])
