"""A weight as a GGUF file stores it: rows of quantized blocks of one type, not yet dequantized.

The loader hands these out with `--weights native` (engine/gguf_loader.py) for the block types the
CPU GEMM multiplies in their own format (kernels/cpu/quant.py); wherever a weight is needed as
floats (another device, another dtype, an odd shape) `dequantize()` gives exactly what the
float32 loader gives: the same `gguf` package call on the same bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    kind: str  # the GGUF type's name: "Q4_1", "Q8_0", ...
    raw: np.ndarray  # uint8 [rows, row bytes]: each row its blocks, in the file's order
    shape: tuple[int, int]  # (rows, values per row): [out, in] for a linear's weight

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, values per row], as the float32 loader dequantizes it."""
        import gguf

        values = gguf.quants.dequantize(self.raw, gguf.GGMLQuantizationType[self.kind])
        return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(self.shape).copy())

    def with_rows(self, reorder: Callable[[torch.Tensor], torch.Tensor]) -> GGUFTensor:
        """The same tensor with its rows reordered by `reorder` (a function of a [rows, ...] tensor
        that moves whole rows, such as the loader's Q/K un-permutation)."""
        rows = reorder(torch.from_numpy(np.ascontiguousarray(self.raw)))
        return GGUFTensor(self.kind, rows.numpy(), self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)
