"""Which implementation stores K/V and runs paged attention: `--attention-backend auto|torch|cpu|triton`.

Every backend has the torch path's signatures (engine/attention.py), so the model calls
`backend.store_kv(keys, values, k, v, batch)` and `backend.paged_attention(q, keys, values, batch)`
whichever runs:
- torch: engine/attention.py itself, on any device.
- cpu: the KV store and decode attention by kernels/cpu/attention.py over the pages in place
  (float32 pools on a CPU with AVX2 and FMA where the CPU kernels build; anything else runs the
  torch path), prefill attention as torch.
- triton: the kernels in kernels/ (paged decode, paged prefill, KV store), reading the pool in
  place. Compiled on CUDA; on the CPU only under TRITON_INTERPRET=1 (set before the kernel
  modules are first imported), which is for tests: it is about 1000x slower than torch.
- auto: triton when the device is CUDA and triton (3.4 or later) imports; on the CPU, cpu where
  the CPU kernels build (kernels/cpu/library.py), else torch.

The kernels can also check page ownership themselves (their violation flags); these entry points
run them without it, because AttentionBatch carries no leases, and never read the flags (that
would be a host sync per layer): the runner's owner check (engine/owner_check.py) still runs before
every step and keeps every sequence with a foreign or out-of-range page out of the batch.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any, Protocol

import torch

from kvfence.engine import attention
from kvfence.engine.attention import AttentionBatch

BACKEND_NAMES = ("auto", "torch", "cpu", "triton")


class LayerTables(Protocol):
    """A backend's capability to check a step's slots and page tables once, for a model that runs
    each whole layer in one kernel call (kernels/cpu/layer.py) instead of calling the backend."""

    def checked(self, batch: AttentionBatch, keys: torch.Tensor) -> tuple[Any, Any]:
        """(StoreSlots, DecodeTables) of `batch` (kernels/cpu/attention.py), checked against the
        pool whose layer-0 keys are `keys`."""
        ...


class AttentionBackend(Protocol):
    name: str
    # The capabilities a backend advertises; a model uses what is not None and never asks which
    # backend it has. `layer_tables`: whole-layer kernels may read the pool through it.
    layer_tables: LayerTables | None

    def store_kv(self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 batch: AttentionBatch) -> None:
        """keys/values: [num_pages, kv_heads, page_size, head_dim] pool views; k, v: [T, kv_heads, head_dim]."""

    def paged_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        batch: AttentionBatch, window: int = 0) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads, head_dim], reading K/V through the page tables;
        `window` (0: none): each token attends only to its last `window` positions (engine/attention.py)."""


class TorchBackend:
    name = "torch"
    layer_tables: LayerTables | None = None

    def store_kv(self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 batch: AttentionBatch) -> None:
        attention.store_kv(keys, values, k, v, batch)

    def paged_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        batch: AttentionBatch, window: int = 0) -> torch.Tensor:
        return attention.paged_attention(q, keys, values, batch, window)


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self) -> None:
        from kvfence.kernels.cpu import attention as cpu_attention

        self._kernel = cpu_attention
        # The last batch's checked slots and tables: every layer of a step passes the same
        # AttentionBatch. A tuple swapped whole, so threads sharing this backend at worst check twice.
        self._last: tuple[AttentionBatch, Any, Any] | None = None
        self.layer_tables = self

    def checked(self, batch: AttentionBatch, keys: torch.Tensor) -> tuple[Any, Any]:
        """(StoreSlots, DecodeTables) of `batch`, checked against this pool once per step: a table
        row per sequence, and every token row (decode tokens first, then each chunk's tokens)
        reading its sequence's row up to its own position."""
        last = self._last
        if last is not None and last[0] is batch:
            return last[1], last[2]
        num_pages, page_size = keys.shape[0], keys.shape[2]
        slots = self._kernel.StoreSlots.checked(batch.slot_pages, batch.slot_offsets, num_pages, page_size)
        table, kv_lens, rows = row_tables(batch)
        tables = self._kernel.DecodeTables.checked(table, kv_lens, num_pages, page_size, rows)
        self._last = (batch, slots, tables)
        return slots, tables

    def store_kv(self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 batch: AttentionBatch) -> None:
        if not self._kernel.usable(k, keys):
            return attention.store_kv(keys, values, k, v, batch)
        self._kernel.store_kv(keys, values, k, v, self.checked(batch, keys)[0])

    def paged_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        batch: AttentionBatch, window: int = 0) -> torch.Tensor:
        if window or not self._kernel.usable(q, keys):  # the kernel has no window yet: the torch path
            return attention.paged_attention(q, keys, values, batch, window)
        return self._kernel.decode_attention(q, keys, values, self.checked(batch, keys)[1],
                                             1.0 / math.sqrt(q.shape[2]))


def row_tables(batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(page_table [S, max_pages], kv_lens [T], rows [T]) of a step for the CPU kernels: the
    decode sequences' table rows, then one per prefill chunk (its sequence's pages); token row t
    reads table row rows[t] up to kv_lens[t] keys (a chunk's token: its own position + 1)."""
    nd, spans = batch.num_decode, batch.prefills
    if not spans:
        return batch.decode_page_table, batch.decode_kv_lens, torch.arange(nd, dtype=torch.int64)
    width = max([batch.decode_page_table.shape[1] if nd else 1, *(span.page_table.shape[0] for span in spans)])
    table = torch.zeros(nd + len(spans), width, dtype=torch.int64)
    table[:nd, :batch.decode_page_table.shape[1]] = batch.decode_page_table
    lens, rows = [batch.decode_kv_lens], [torch.arange(nd, dtype=torch.int64)]
    for i, span in enumerate(spans):
        table[nd + i, :span.page_table.shape[0]] = span.page_table
        lens.append(torch.arange(span.context_tokens + 1, span.context_tokens + span.num_tokens + 1))
        rows.append(torch.full((span.num_tokens,), nd + i, dtype=torch.int64))
    return table, torch.cat(lens), torch.cat(rows)


@dataclasses.dataclass(frozen=True)
class KernelBatch:
    """An AttentionBatch in the kernels' terms, built once per step and reused by every layer."""

    decode_page_table: torch.Tensor  # [num_decode, max_pages] int32
    decode_kv_lens: torch.Tensor  # [num_decode] int32, keys incl. the new token
    prefill_cu_seqlens: torch.Tensor  # [num_prefill + 1] int32, rows relative to the first prefill row
    prefill_cached_lens: torch.Tensor  # [num_prefill] int32
    prefill_page_table: torch.Tensor  # [num_prefill, max_pages] int32
    prefill_max_tokens: int  # the longest chunk
    prefill_num_tokens: int  # all prefill rows


def kernel_batch(batch: AttentionBatch) -> KernelBatch:
    """Translate `batch` (int64 tables, an additive -inf mask) into what the kernels take."""
    device = batch.slot_pages.device
    nd = batch.num_decode
    # The decode bias is 0 for the first kv_len keys and -inf after them.
    decode_lens = (batch.decode_kv_bias.reshape(nd, batch.decode_kv_bias.shape[-1]) == 0).sum(-1).to(torch.int32)
    spans = batch.prefills
    cu = [0]
    for span in spans:
        if span.token_start - nd != cu[-1]:
            raise ValueError(f"prefill spans must follow the decode rows back to back; a span starts at row "
                             f"{span.token_start}, expected {nd + cu[-1]}")
        cu.append(cu[-1] + span.num_tokens)
    if spans:
        table = torch.nn.utils.rnn.pad_sequence([s.page_table for s in spans], batch_first=True)
    else:
        table = torch.zeros(0, 1, dtype=torch.int64, device=device)
    return KernelBatch(
        decode_page_table=batch.decode_page_table.to(torch.int32),
        decode_kv_lens=decode_lens,
        prefill_cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        prefill_cached_lens=torch.tensor([s.context_tokens for s in spans], dtype=torch.int32, device=device),
        prefill_page_table=table.to(torch.int32),
        prefill_max_tokens=max((s.num_tokens for s in spans), default=0),
        prefill_num_tokens=cu[-1],
    )


class TritonBackend:
    name = "triton"
    layer_tables: LayerTables | None = None

    def __init__(self) -> None:
        from kvfence.kernels.triton import kv_store, paged_decode, paged_prefill

        self._store = kv_store.store_kv_pages
        self._decode = paged_decode.paged_decode_attention
        self._prefill = paged_prefill.paged_prefill_attention
        # The last batch translated: every layer of a step passes the same AttentionBatch object.
        # A tuple swapped whole, so threads sharing this backend at worst translate twice.
        self._last: tuple[AttentionBatch, KernelBatch] | None = None

    def _kernel_batch(self, batch: AttentionBatch) -> KernelBatch:
        last = self._last
        if last is not None and last[0] is batch:
            return last[1]
        kb = kernel_batch(batch)
        self._last = (batch, kb)
        return kb

    def store_kv(self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 batch: AttentionBatch) -> None:
        self._store(keys, values, k, v, batch.slot_pages, batch.slot_offsets)

    def paged_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        batch: AttentionBatch, window: int = 0) -> torch.Tensor:
        if window:  # the kernels have no window yet: the torch path, on the same device
            return attention.paged_attention(q, keys, values, batch, window)
        kb = self._kernel_batch(batch)
        out = torch.empty_like(q)  # [T, heads, head_dim]
        nd = batch.num_decode
        if nd:
            self._decode(q[:nd], keys, values, kb.decode_page_table, kb.decode_kv_lens, out=out[:nd])
        if kb.prefill_num_tokens:
            rows = slice(nd, nd + kb.prefill_num_tokens)
            self._prefill(q[rows], keys, values, kb.prefill_cu_seqlens, kb.prefill_cached_lens,
                          kb.prefill_page_table, kb.prefill_max_tokens, out=out[rows])
        return out


def _triton_status() -> tuple[bool, bool]:
    """(a triton the kernels support imports, it runs as the interpreter)."""
    try:
        triton = importlib.import_module("triton")
    except ImportError:
        return False, False
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    return knobs is not None, knobs is not None and bool(knobs.runtime.interpret)


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """'torch' or 'triton' for `name` on `device`; ValueError saying what to do when it cannot run."""
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"--attention-backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    if name == "torch":
        return "torch"
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        from kvfence.kernels.cpu import library as cpu_kernels

        if device.type != "cpu":
            raise ValueError(f"--attention-backend cpu runs on the CPU, not on {device}; use auto, triton or torch")
        if cpu_kernels.available():
            return "cpu"
        if name == "cpu":
            raise ValueError(f"--attention-backend cpu is unavailable here ({cpu_kernels.unavailable_reason()}); "
                             "use --attention-backend torch")
        return "torch"
    available, interpreted = _triton_status()
    if name == "auto":
        return "triton" if device.type == "cuda" and available else "torch"
    if not available:
        raise ValueError("--attention-backend triton needs the triton package (3.4 or later): "
                         "pip install 'kvfence[triton]', or use --attention-backend torch")
    if device.type == "cpu" and not interpreted:
        raise ValueError("--attention-backend triton on the CPU runs only under the Triton interpreter "
                         "(TRITON_INTERPRET=1 in the environment at start-up, ~1000x slower: for tests); "
                         "use --attention-backend torch on the CPU")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--attention-backend triton does not support device {device}; use torch")
    return "triton"


def select_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend `name` resolves to on `device` (see resolve_backend_name)."""
    resolved = resolve_backend_name(name, device)
    backends: dict[str, type[AttentionBackend]] = {"triton": TritonBackend, "cpu": CpuBackend, "torch": TorchBackend}
    return backends[resolved]()
