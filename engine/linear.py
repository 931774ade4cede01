"""Linear layers with weights laid out once, at load, for the device's fastest GEMM.

On the CPU, torch's default `F.linear` calls an sgemm that runs at about half the speed of
oneDNN's on this class of machine (measured: 55 vs 122 GFLOP/s at batch 32 in fp32, 4 vs 8 at
batch 1), so CPU weights are reordered into oneDNN's blocked layout and multiplied with its
`_linear_pointwise` kernel. Everywhere else (CUDA) it is plain `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _onednn_usable(weight: torch.Tensor) -> bool:
    """oneDNN on a CPU that has it; for bfloat16 only where the CPU can run its bf16 kernels
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): elsewhere (an AVX2-only CPU) packing a bf16 weight
    fails, and plain `F.linear` serves bf16 instead."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


class Linear:
    """y = x @ weight.T + bias, for x: [T, in] -> [T, out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape  # weight: [out, in]
        self.bias = bias
        self.onednn = _onednn_usable(weight)
        if self.onednn:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        else:
            self.weight = weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
