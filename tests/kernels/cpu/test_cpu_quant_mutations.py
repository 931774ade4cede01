"""The quantized-panel tests catch what they are for: each mutation below (another row's scale, a
wrong offset, a bit of the wrong k, a lost sign, a sign flipped, a chunk left undecoded) is
built into a library of its own, and the bitwise comparison of tests/kernels/cpu/test_cpu_quant.py
finds it; the same sources unmutated, built the same way, pass."""

from __future__ import annotations

import concurrent.futures
import ctypes
import shutil
from pathlib import Path

import pytest
import torch
from quant_cases import random_tensor, same_bits

from kvfence.kernels.cpu import gemm as cpu_gemm, library as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")

# name: (file, text, replacement, block type it shows on)
MUTATIONS = {
    "Q4_1 mins of the other rows": ("quant.c", "m = f16x8(b + 32 + 16 * h)", "m = f16x8(b + 32)", "Q4_1"),
    "Q4_0 offset 7": ("quant.c", "eight = _mm256_set1_epi32(8)", "eight = _mm256_set1_epi32(7)", "Q4_0"),
    "Q5_0 fifth bit of the other k": ("quant.c", "BIT16(bits, 2 * i + 1)", "BIT16(bits, 2 * i)", "Q5_0"),
    "Q8_0 unsigned": ("quant.c", "fl(i8x8(b + 32 + 16 * kk + 8 * h))", "fl(u8x8(b + 32 + 16 * kk + 8 * h))",
                      "Q8_0"),
    "Q4_K min added": ("quant.c", "_mm256_fmsub_ps(scale, fl(HIGH4(v)), dm)",
                       "_mm256_fmadd_ps(scale, fl(HIGH4(v)), dm)", "Q4_K"),
    "Q6_K high bits of the other k": ("quant.c", "BITS2x16(bits, 3)", "BITS2x16(bits, 2)", "Q6_K"),
    "a decoded panel's last chunk left out": ("kernels.c", "data, 0, w->k / CHUNK, into)",
                                              "data, 0, w->k / CHUNK - 1, into)", "Q4_1"),
    "Q4_1 in registers: the second k decoded from the first": (
        "kernels.c", "*w1 = _mm512_fmadd_ps(a, _mm512_cvtepi32_ps(hi), b);",
        "*w1 = _mm512_fmadd_ps(a, _mm512_cvtepi32_ps(lo), b);", "Q4_1"),
    "Q8_0 in registers: pairs a row apart": ("kernels.c", "(q + 32 * i + 16)", "(q + 32 * i + 8)", "Q8_0"),
    "Q5_0 in registers: the fifth bit of the other k": ("kernels.c", "z_high(bits, 2 * (i % 4), 1)",
                                                        "z_high(bits, 2 * (i % 4) + 1, 1)", "Q5_0"),
    "Q6_K in registers: a sub-block's scale one pair early": ("kernels.c", "i < 8 ? a : b", "i < 7 ? a : b",
                                                              "Q6_K"),
}
KERNELS = Path(cpu_kernels.__file__).parent


def _build(root: Path, name: str, mutation: tuple[str, str, str] | None) -> ctypes.CDLL:
    folder = root / name.replace(" ", "-")
    folder.mkdir()
    sources = []
    for source in cpu_kernels.SOURCES:
        text = source.read_text()
        if mutation is not None and mutation[0] == source.name:
            assert text.count(mutation[1]) >= 1, f"the mutation {name!r} no longer applies: update it"
            text = text.replace(mutation[1], mutation[2])
        (folder / source.name).write_text(text)
        sources.append(folder / source.name)
    return cpu_kernels.load(cpu_kernels._build(folder / "build", tuple(sources)))


def _differs(lib: ctypes.CDLL, kind: str) -> bool:
    """Whether the GEMM over `kind` panels gives other bits than float32, at any row count 1-70,
    with either block family."""
    tensor = random_tensor(kind, 136, 512, seed=9)  # nine panels: four at once, then one alone, per thread
    native = cpu_gemm.PackedWeight(tensor, lib=lib)
    reference = cpu_gemm.PackedWeight(tensor.dequantize(), lib=lib)
    g = torch.Generator().manual_seed(4)
    for wide in (1, 0):
        lib.kvfence_wide_blocks(wide)
        for m in range(1, 71):
            x = torch.randn(m, 512, generator=g)
            if not same_bits(native(x), reference(x)):
                return True
    return False


def test_every_mutation_is_caught(tmp_path: Path) -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    jobs = {name: (name, (f, a, b)) for name, (f, a, b, _) in MUTATIONS.items()}
    jobs["unmutated"] = ("unmutated", None)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        libs = dict(zip(jobs, pool.map(lambda job: _build(tmp_path, *job), jobs.values())))
    assert not any(_differs(libs["unmutated"], kind) for kind in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"))
    missed = [name for name, (_, _, _, kind) in MUTATIONS.items() if not _differs(libs[name], kind)]
    assert not missed, f"the bitwise tests miss: {missed}"
