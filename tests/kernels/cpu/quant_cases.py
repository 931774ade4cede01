"""GGUF block tensors for the quantized-panel tests: random blocks of every kept type, with scales
that are finite f16 (normal, subnormal, negative and signed zeros among them)."""

from __future__ import annotations

import numpy as np
import torch

from kvfence.engine.gguf_tensor import GGUFTensor
from kvfence.kernels.cpu import quant as cpu_quant

KINDS = tuple(cpu_quant.BLOCKS)
# where each type's f16 scales sit in its block: (d, and dmin/m where the type has one)
SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_tensor(kind: str, rows: int, k: int, seed: int) -> GGUFTensor:
    """`rows` x `k` of `kind`: random bytes for the values (and the K types' sub-block scales),
    f16 scales drawn around 0.02 with a few extremes."""
    rng = np.random.default_rng(seed)
    per_block, block_bytes = cpu_quant.BLOCKS[kind]
    raw = rng.integers(0, 256, size=(rows, k // per_block, block_bytes), dtype=np.uint8)
    for at in SCALES[kind]:
        d = (rng.standard_normal((rows, k // per_block)) * 0.02).astype(np.float16)
        flat = d.reshape(-1)
        flat[::7] = np.float16(-0.0)
        flat[1::11] = np.float16(3e-7)  # subnormal
        flat[2::13] = np.float16(-1.5)
        raw[..., at:at + 2] = d.view(np.uint8).reshape(rows, k // per_block, 2)
    return GGUFTensor(kind, raw.reshape(rows, -1), (rows, k))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))
