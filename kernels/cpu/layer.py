"""Every decoder layer of a step as one C call (kvfence_layer in kernels.c).

A decode step feeds one token per sequence, so at small batches each of a layer's dozen ops is
microseconds of work behind tens of microseconds of dispatch (Python, torch, ctypes, an OpenMP
fork); a prefill chunk's element-wise ops, gathers and copies cost as much again as its GEMMs.
Here one call per layer runs them all inside one OpenMP team: the RMSNorm, the QKV GEMM, rope, the
K/V store, attention over the pages in place (each row, a decode token or a chunk's token, up to
its own position), the output projection added to the residual, the second RMSNorm, gate/up,
SiLU·up and the down projection added to the residual.

Each phase is the same C code as the one-call-per-op path (kernels/cpu/gemm.py,
attention.py, elementwise.py; rope as engine/rope.py computes it, uncontracted), so the
two agree bit for bit (tests/kernels/cpu/test_cpu_layer.py). The store slots and decode tables are
the ones cpu_attention checks once per step: nothing here reads or writes a page they do not name.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence

import torch

from kvfence.kernels.cpu import library as cpu_kernels
from kvfence.kernels.cpu.attention import DecodeTables, StoreSlots, scores_per_thread
from kvfence.kernels.cpu.gemm import PackedWeight

_ptr, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _LayerWeights(ctypes.Structure):
    _fields_ = [("attn_norm", _ptr), ("mlp_norm", _ptr), ("qkv", _ptr), ("o", _ptr), ("gate_up", _ptr),
                ("down", _ptr)]


class _Step(ctypes.Structure):
    _fields_ = [("batch", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("d", _i64),
                ("inter", _i64), ("eps", _f32), ("scale", _f32), ("cos", _ptr), ("sin", _ptr),
                ("slot_pages", _ptr), ("slot_offsets", _ptr), ("table", _ptr), ("rows", _ptr),
                ("max_pages", _i64),
                ("kv_lens", _ptr), ("page_size", _i64), ("page_stride", _i64), ("head_stride", _i64),
                ("h", _ptr), ("qkv", _ptr), ("attn", _ptr), ("gu", _ptr), ("act", _ptr), ("scores", _ptr),
                ("scores_per_thread", _i64), ("threads", ctypes.c_int)]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    fn = lib.kvfence_layer
    if fn.argtypes is None:
        fn.argtypes = [ctypes.POINTER(_LayerWeights), ctypes.POINTER(_Step), _ptr, _ptr, _ptr]
        fn.restype = None
    return lib


class LayerParams:
    """One layer's weights as the C call takes them: the norms' vectors and the packed linears
    (float32 panels or block types kept as they ship, the Q/K/V biases inside `qkv`)."""

    def __init__(self, attn_norm: torch.Tensor, qkv: PackedWeight, o: PackedWeight, mlp_norm: torch.Tensor,
                 gate_up: PackedWeight, down: PackedWeight) -> None:
        self._keep = (attn_norm, qkv, o, mlp_norm, gate_up, down)  # the memory the pointers name
        self.struct = _LayerWeights(attn_norm.data_ptr(), mlp_norm.data_ptr(),
                                    *(ctypes.addressof(lin.struct) for lin in (qkv, o, gate_up, down)))


class FusedLayers:
    """A model's layers for the steps of a CPU worker: `run` takes the embedded tokens and returns
    the last layer's output (the final norm and the LM head are the caller's)."""

    def __init__(self, layers: Sequence[LayerParams], *, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, eps: float) -> None:
        self._lib = _declare(cpu_kernels.library())
        self.layers = list(layers)
        self.hidden, self.heads, self.kv_heads, self.d, self.inter = hidden, heads, kv_heads, head_dim, intermediate
        self.eps = eps

    @staticmethod
    def usable(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> bool:
        """Shapes the C call takes: rows of whole vectors of 8, heads of whole halves of 8."""
        return (cpu_kernels.available() and hidden % 8 == 0 and intermediate % 8 == 0 and head_dim % 16 == 0
                and heads % kv_heads == 0)

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool_data: torch.Tensor,
            slots: StoreSlots, tables: DecodeTables, between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """x: [B, hidden] float32 (the step's token rows, updated in place and returned);
        cos, sin: [B, head_dim] full-width rope tables of each token's position (engine/rope.py);
        pool_data: the pool's [num_pages, layers, 2, kv_heads, page_size, head_dim] float32 tensor,
        which `slots` and `tables` were checked against; `between_layers`: called before each layer
        (it may raise to stop the step there, LlamaModel.forward)."""
        b = x.shape[0]
        num_pages, num_layers, _, kv_heads, page_size, d = pool_data.shape
        if (x.dtype != torch.float32 or not x.is_contiguous() or x.shape != (b, self.hidden)
                or num_layers != len(self.layers) or kv_heads != self.kv_heads or d != self.d
                or not pool_data.is_contiguous() or pool_data.dtype != torch.float32
                or cos.shape != (b, d) or sin.shape != (b, d) or slots.pages.shape[0] != b
                or tables.rows.shape[0] != b):
            raise ValueError(f"fused layers want x [B, {self.hidden}] float32, rope tables [B, {self.d}], one slot "
                             f"and one table row per token row, and a contiguous float32 pool of {len(self.layers)} "
                             f"layers; got x {x.dtype} {tuple(x.shape)}, pool {tuple(pool_data.shape)}")
        cos, sin = cos.contiguous(), sin.contiguous()
        q_size, kv_size = self.heads * d, kv_heads * d
        threads = torch.get_num_threads()
        per_thread = scores_per_thread(self.heads // kv_heads, tables)
        scratch = [torch.empty(b, n, dtype=torch.float32)
                   for n in (self.hidden, q_size + 2 * kv_size, q_size, 2 * self.inter, self.inter)]
        scores = torch.empty(threads * per_thread, dtype=torch.float32)
        step = _Step(b, self.hidden, self.heads, kv_heads, d, self.inter, self.eps, 1.0 / math.sqrt(d),
                           cos.data_ptr(), sin.data_ptr(), slots.pages.data_ptr(), slots.offsets.data_ptr(),
                           tables.page_table.data_ptr(), tables.rows.data_ptr(), tables.page_table.shape[1],
                           tables.kv_lens.data_ptr(),
                           page_size, pool_data.stride(0), pool_data.stride(3),
                           *(t.data_ptr() for t in scratch), scores.data_ptr(), per_thread, threads)
        layer_stride = pool_data.stride(1) * 4  # bytes from one layer's keys to the next
        keys0, values_offset = pool_data.data_ptr(), pool_data.stride(2) * 4
        x_ptr, step_ref, call = x.data_ptr(), ctypes.byref(step), self._lib.kvfence_layer
        for i, layer in enumerate(self.layers):
            if between_layers is not None:
                between_layers()
            keys = keys0 + i * layer_stride
            call(ctypes.byref(layer.struct), step_ref, x_ptr, keys, keys + values_offset)
        return x
