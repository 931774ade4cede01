"""y = x @ W.T (+ bias) on the CPU for every batch size of a decode step (kvfence_gemm in
cpu_kernels.c): W packed once into panels of 16 output columns, each read once per call, in order;
a 6 x 16 block of y in registers, or where the CPU has AVX-512 (`wide_blocks`) 16 x 16 (under 32
rows) and 8 x 32 over two panels (from 32 rows on); OpenMP over the panels. One summation order
over k whatever M and whichever block, so a row's result does not depend on the rows around it.
"""

from __future__ import annotations

import torch

from kvfence.kernels import cpu_kernels

PANEL = 16  # output columns per packed panel (NR in cpu_kernels.c)


def wide_blocks(enabled: bool | None = None) -> bool:
    """Whether the GEMMs (the fused layers' too) use the AVX-512 blocks (16 rows over a panel, 8 rows
    over two from 32 rows on): on where the CPU has AVX-512. `enabled` False turns them off for the
    whole process (the 6-row blocks, the same bits: what the tests and benchmarks compare), True
    back on where the CPU allows."""
    return bool(cpu_kernels.library().kvfence_wide_blocks(-1 if enabled is None else int(enabled)))


class PackedWeight:
    """W [N, K] float32 packed for `gemm` (and its bias, padded to whole panels)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        lib = cpu_kernels.library()
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"cpu_gemm packs 2-D float32 CPU weights, got {weight.dtype} {tuple(weight.shape)} "
                             f"on {weight.device}")
        w = weight.contiguous()
        self._lib = lib  # the library it was packed for, whatever `available()` says later
        self.n, self.k = w.shape
        panels = -(-self.n // PANEL)
        self.packed = torch.empty(panels * self.k * PANEL, dtype=torch.float32)
        lib.kvfence_pack(w.data_ptr(), self.n, self.k, self.packed.data_ptr())
        self.bias = None
        if bias is not None:
            self.bias = torch.zeros(panels * PANEL, dtype=torch.float32)
            self.bias[: self.n] = bias.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] float32."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"cpu_gemm wants x [M, {self.k}] float32, got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        self._lib.kvfence_gemm(x.data_ptr(), x.shape[0], self.k, self.packed.data_ptr(), self.n,
                               None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                               torch.get_num_threads())
        return y
