"""Linear layers with weights laid out once, at load, for the device's fastest GEMM.

On a CPU with AVX2 and FMA, float32 weights are packed for kernels/cpu/gemm.py, which streams each
weight once per step and keeps the FMA units busy at every batch size (one thread, this machine:
1.4-2.2x oneDNN's rate at 1 to 16 rows, level at 128; docs/benchmarks.md). Where it is
unavailable (no AVX2, no C compiler, KVFENCE_CPU_KERNELS=off), CPU weights are reordered into
oneDNN's blocked layout for its `_linear_pointwise` kernel (torch's default `F.linear` sgemm runs
at about half oneDNN's speed). Everywhere else (CUDA, bf16 on a CPU without bf16 kernels) it is
plain `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfence.kernels.cpu import gemm as cpu_gemm, library as cpu_kernels


def _onednn_usable(weight: torch.Tensor) -> bool:
    """oneDNN on a CPU that has it; for bfloat16 only where the CPU can run its bf16 kernels
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): elsewhere (an AVX2-only CPU) packing a bf16 weight
    fails, and plain `F.linear` serves bf16 instead."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


class Linear:
    """y = x @ weight.T + bias, for x: [T, in] -> [T, out]."""

    @classmethod
    def of_parts(cls, parts: list[cpu_gemm.Part], bias: torch.Tensor | None = None) -> Linear:
        """The rows of `parts` (float32 CPU tensors or GGUF block tensors) on the CPU GEMM, block
        types kept as they ship (kernels/cpu/gemm.py); only where the CPU kernels are available."""
        self = cls.__new__(cls)
        self.packed = cpu_gemm.PackedWeight(parts, bias)
        self.out_features, self.in_features = self.packed.n, self.packed.k
        self.bias, self.onednn, self.weight = bias, False, None
        return self

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, cpu_gemm_ok: bool = True) -> None:
        """`cpu_gemm_ok`: False keeps a float32 CPU weight on oneDNN even where the CPU kernels run."""
        self.out_features, self.in_features = weight.shape  # weight: [out, in]
        self.bias = bias
        self.packed = None
        if cpu_gemm_ok and weight.device.type == "cpu" and weight.dtype == torch.float32 and cpu_kernels.available():
            self.packed = cpu_gemm.PackedWeight(weight, bias)
            self.onednn, self.weight = False, None
            return
        self.onednn = _onednn_usable(weight)
        if self.onednn:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        else:
            self.weight = weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        assert self.weight is not None  # None only where `packed` serves
        if self.onednn:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            return out
        return F.linear(x, self.weight, self.bias)
