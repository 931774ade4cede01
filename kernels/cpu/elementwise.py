"""A decoder layer's element-wise steps on the CPU, one C call each (kernels.c) instead of
the handful of torch ops each becomes: at decode sizes those ops cost tens of microseconds apiece
in dispatch, a few hundred times per step.

- `rms_norm(x, weight, eps)`: x / sqrt(mean(x²) + eps) * weight, per row.
- `silu_mul(gate_up)`: silu(gate) * up, from the [rows, 2n] output of the fused gate/up projection.

Both take float32 CPU tensors whose last dimension is a multiple of 8 (`usable`); they equal the
torch expressions within float32 rounding (tests/kernels/cpu/test_cpu_elementwise.py).
"""

from __future__ import annotations

import torch

from kvfence.kernels.cpu import library as cpu_kernels


def usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[-1] % 8 == 0 and cpu_kernels.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [rows, d], weight [d] -> [rows, d]."""
    if not usable(x) or x.dim() != 2 or weight.shape != (x.shape[1],) or weight.dtype != torch.float32:
        raise ValueError(f"rms_norm wants float32 CPU x [rows, d] (d % 8 == 0) and weight [d], got {x.dtype} "
                         f"{tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty_like(x)
    cpu_kernels.library().kvfence_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2n] (gate first) -> silu(gate) * up, [rows, n]."""
    if not usable(gate_up) or gate_up.dim() != 2 or gate_up.shape[1] % 16:
        raise ValueError(f"silu_mul wants float32 CPU [rows, 2n] with n % 8 == 0, got {gate_up.dtype} "
                         f"{tuple(gate_up.shape)}")
    gate_up = gate_up.contiguous()
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(rows, n, dtype=torch.float32)
    cpu_kernels.library().kvfence_silu_mul(gate_up.data_ptr(), y.data_ptr(), rows, n)
    return y
