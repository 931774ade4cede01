"""kernels/cpu/gemm.py: the packed fp32 GEMM equals a float64 reference, a row's result does not
depend on the batch around it or on the thread count (bitwise), bad arguments are refused, and
where it is switched off the linears fall back to oneDNN with the same answers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfence.app.config.environment import cpu_kernels_setting, kernel_place, kvfence_home
from kvfence.engine.linear import Linear
from kvfence.kernels.cpu import gemm as cpu_gemm, library as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available() and cpu_kernels.unavailable_as_expected(),
                                reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return (y + b.double() if b is not None else y).float()


@pytest.mark.parametrize("n,k", [(16, 8), (37, 19), (960, 576), (576, 1536), (1000, 3)])
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_the_float64_product(m: int, n: int, k: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    got = cpu_gemm.PackedWeight(w, b)(x)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(x, w, b), rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_a_row_does_not_depend_on_its_batch_or_the_threads() -> None:
    """Batch invariance: the same row alone, first, last or in the middle of 1..33 rows, with one
    thread or two, gives the same bits (the sum over k runs in one order everywhere)."""
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(200, 576, generator=g), torch.randn(200, generator=g)
    packed = cpu_gemm.PackedWeight(w, b)
    row = torch.randn(1, 576, generator=g)
    alone = packed(row)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (1, 2, 6, 7, 12, 33):
                for at in {0, m // 2, m - 1}:
                    x = torch.randn(m, 576, generator=g)
                    x[at] = row[0]
                    assert torch.equal(packed(x)[at], alone[0]), (t, m, at)
    finally:
        torch.set_num_threads(threads)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="float32"):
        cpu_gemm.PackedWeight(torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D"):
        cpu_gemm.PackedWeight(torch.zeros(4))
    packed = cpu_gemm.PackedWeight(torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"x \[M, 8\]"):
        packed(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="float32"):
        packed(torch.zeros(2, 8, dtype=torch.float64))


def test_a_non_contiguous_input_is_multiplied_as_it_reads() -> None:
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(48, 32, generator=g), torch.randn(32, 10, generator=g).T  # [10, 32], transposed view
    torch.testing.assert_close(cpu_gemm.PackedWeight(w)(x), reference(x, w, None), rtol=1e-5, atol=1e-4)


def test_switched_off_the_linears_use_onednn_with_the_same_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(11)
    w, b, x = torch.randn(100, 64, generator=g), torch.randn(100, generator=g), torch.randn(9, 64, generator=g)
    packed = Linear(w, b)
    assert packed.packed is not None
    on = kernel_place({"KVFENCE_HOME": str(kvfence_home())})
    cpu_kernels.use(kernel_place({"KVFENCE_HOME": str(kvfence_home()), "KVFENCE_CPU_KERNELS": "off"}))
    try:
        assert not cpu_kernels.available() and cpu_kernels.unavailable_reason() == "KVFENCE_CPU_KERNELS=off"
        fallback = Linear(w, b)
        assert fallback.packed is None
        torch.testing.assert_close(packed(x), fallback(x), rtol=1e-5, atol=1e-5)
    finally:
        cpu_kernels.use(on)
    assert cpu_kernels.available()


def test_the_environment_places_and_switches_the_kernels(tmp_path: Path) -> None:
    place = kernel_place({"KVFENCE_HOME": str(tmp_path)})
    assert place.cache_dir == tmp_path / "cache" / "kernels" and not place.off
    assert kernel_place({"KVFENCE_HOME": str(tmp_path), "KVFENCE_CPU_KERNELS": "Off"}).off == "KVFENCE_CPU_KERNELS=off"


def test_a_setting_other_than_auto_or_off_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="auto or off"):
        cpu_kernels_setting({"KVFENCE_CPU_KERNELS": "fast"})
    assert cpu_kernels_setting({}) == "auto"


def test_the_kernels_build_where_the_machine_allows() -> None:
    """A compiler error is a failure here, never a silent fallback to the slower paths."""
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()


@pytest.mark.skipif(not cpu_kernels.available() or not cpu_gemm.wide_blocks(),
                    reason="16-row and two-panel blocks need a CPU with AVX-512")
@pytest.mark.parametrize("n", [53, 37], ids=["panel-pairs", "odd-last-panel"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_avx512_blocks_give_the_six_row_blocks_bits(n: int, with_bias: bool) -> None:
    """Every M from 1 to 70: four-panel blocks up to 4 rows, 16-row blocks for 5 to 7, 8-row blocks over two panels from 8 on
    (whole and partial groups, a partial last panel, an odd panel left alone): exactly what the
    AVX2 6-row blocks write (the fused layers' accumulating projections:
    tests/kernels/cpu/test_cpu_layer.py)."""
    g = torch.Generator().manual_seed(n)
    w, b = torch.randn(n, 96, generator=g), torch.randn(n, generator=g) if with_bias else None
    packed = cpu_gemm.PackedWeight(w, b)
    try:
        for m in range(1, 71):
            x = torch.randn(m, 96, generator=g)
            assert cpu_gemm.wide_blocks(True)
            wide = packed(x)
            assert not cpu_gemm.wide_blocks(False)
            assert torch.equal(wide, packed(x)), m
            torch.testing.assert_close(wide, reference(x, w, b), rtol=1e-5, atol=1e-4)
    finally:
        cpu_gemm.wide_blocks(True)
