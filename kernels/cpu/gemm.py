"""y = x @ W.T (+ bias) on the CPU for every batch size of a decode step (kvfence_gemm in
kernels.c): W laid out once in panels of 16 output rows, each read once per call, in order;
a 6 x 16 block of y in registers, or where the CPU has AVX-512 (`wide_blocks`) up to 4 rows over
four panels at once (independent FMA chains, so one row does not wait on one chain's latency),
16 x 16 (5 to 7 rows) and 8 x 32 over two panels (from 8 rows on); OpenMP over the panels. One
summation order over k whatever M and whichever block, so a row's result does not depend on the
rows around it.

A panel is float32, or a GGUF block type kept as the file ships it (kernels/cpu/quant.py,
quant.c), decoded inside the GEMM to exactly the floats the file dequantizes to: the same
GEMM over the same values, so the same bits, at a quarter to an eighth of the bytes per step.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Protocol, TypeGuard

import numpy as np
import torch

from kvfence.kernels.cpu import library as cpu_kernels, quant as cpu_quant

PANEL = 16  # output rows per packed panel (NR in kernels.h)


class BlockTensor(Protocol):
    """A weight as a GGUF file stores it (engine/gguf_tensor.py): rows of blocks of one type."""

    @property
    def kind(self) -> str: ...

    @property
    def raw(self) -> np.ndarray:  # uint8 [rows, row bytes]
        ...

    @property
    def shape(self) -> tuple[int, int]: ...

    def dequantize(self) -> torch.Tensor: ...


Part = torch.Tensor | BlockTensor


class _Weight(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("panel_offset", ctypes.c_void_p), ("panel_format", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


def wide_blocks(enabled: bool | None = None) -> bool:
    """Whether the GEMMs (the fused layers' too) use the AVX-512 blocks (4 rows over four panels, 16 rows
    over one, 8 rows over two from 8 rows on): on where the CPU has AVX-512. `enabled` False turns them off for the
    whole process (the 6-row blocks, the same bits: what the tests and benchmarks compare), True
    back on where the CPU allows."""
    return bool(cpu_kernels.library().kvfence_wide_blocks(-1 if enabled is None else int(enabled)))


def kept_as_shipped(part: Part) -> TypeGuard[BlockTensor]:
    """Whether `part` can stay in its own block format (else it is multiplied as float32)."""
    return not isinstance(part, torch.Tensor) and part.kind in cpu_quant.BLOCKS


class PackedWeight:
    """W [N, K] laid out for `gemm`: the rows of `parts` in order (one tensor, or the Q/K/V or
    gate/up projections of a fused linear), each part float32 or kept in its block format, with
    the bias padded to whole panels. Parts in block formats keep them when every part but the
    last fills whole panels (so no panel mixes two parts); otherwise the whole weight is float32.
    `lib`: the loaded kernel library (tests pass mutated builds)."""

    def __init__(self, parts: Part | Sequence[Part], bias: torch.Tensor | None = None,
                 lib: ctypes.CDLL | None = None) -> None:
        lib = lib or cpu_kernels.library()
        parts = [parts] if isinstance(parts, torch.Tensor) or not isinstance(parts, Sequence) else list(parts)
        if not parts or any(len(p.shape) != 2 for p in parts) or len({int(p.shape[1]) for p in parts}) != 1:
            raise ValueError(f"cpu_gemm packs 2-D weights of one width, got {[tuple(p.shape) for p in parts]}")
        self._lib = lib  # the library it was packed for, whatever `available()` says later
        self.k = int(parts[0].shape[1])
        self.n = sum(int(p.shape[0]) for p in parts)
        if any(int(p.shape[0]) % PANEL for p in parts[:-1]):
            parts = [_float32(p) for p in parts]
        if all(isinstance(p, torch.Tensor) for p in parts) and len(parts) > 1:
            parts = [torch.cat([_float32(p) for p in parts])]
        blobs, formats = [], []
        for part in parts:
            blob, fmt = self._panels(part)
            blobs.append(blob)
            formats += [fmt] * blob.shape[0]
        sizes = [b.shape[1] for b in blobs for _ in range(b.shape[0])]
        self.data = torch.from_numpy(np.concatenate([b.reshape(-1) for b in blobs]))
        self.formats = torch.tensor(formats, dtype=torch.int32)
        self.offsets = torch.tensor(np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)]), dtype=torch.int64)
        self.kinds = sorted({k for k, f in cpu_quant.FORMATS.items() if f in formats})
        self.bias = None
        if bias is not None:
            self.bias = torch.zeros(self.offsets.shape[0] * PANEL + PANEL, dtype=torch.float32)
            self.bias[: self.n] = bias.float()
        self.struct = _Weight(self.data.data_ptr(), self.offsets.data_ptr(), self.formats.data_ptr(),
                              None if self.bias is None else self.bias.data_ptr(), self.n, self.k)

    def _panels(self, part: Part) -> tuple[np.ndarray, int]:
        """(uint8 [panels, panel bytes], format) of one part."""
        if kept_as_shipped(part):
            return cpu_quant.panels(part.kind, part.raw, self.k), cpu_quant.FORMATS[part.kind]
        w = _float32(part)
        if w.dtype != torch.float32 or w.device.type != "cpu":
            raise ValueError(f"cpu_gemm packs float32 CPU weights, got {w.dtype} on {w.device}")
        w = w.contiguous()
        panels = -(-w.shape[0] // PANEL)
        packed = torch.empty(panels * self.k * PANEL, dtype=torch.float32)
        self._lib.kvfence_pack(w.data_ptr(), w.shape[0], self.k, packed.data_ptr())
        return packed.numpy().view(np.uint8).reshape(panels, -1), cpu_quant.FORMATS["F32"]

    @property
    def nbytes(self) -> int:
        """Bytes of the laid-out weight (what a step reads)."""
        return int(self.data.numel())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] float32."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"cpu_gemm wants x [M, {self.k}] float32, got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        self._lib.kvfence_gemm(x.data_ptr(), x.shape[0], ctypes.byref(self.struct), y.data_ptr(),
                               torch.get_num_threads())
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] as float32 [len(ids), K] (an embedding lookup); every id must be in [0, N)."""
        ids = ids.to(torch.int64).contiguous()
        if ids.dim() != 1 or (ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.n)):
            raise ValueError(f"row ids must be a 1-D tensor of values in [0, {self.n})")
        out = torch.empty(ids.shape[0], self.k, dtype=torch.float32)
        self._lib.kvfence_weight_rows(ctypes.byref(self.struct), ids.data_ptr(), ids.shape[0], out.data_ptr(),
                                      torch.get_num_threads())
        return out


def _float32(part: Part) -> torch.Tensor:
    if isinstance(part, torch.Tensor):
        return part
    return part.dequantize()
