"""Load a GGUF file: config, weights (dequantized, or with `keep_blocks` the matrices of the block
types the CPU GEMM multiplies as they ship, as engine/gguf_tensor.GGUFTensor), tokenizer.

The file's `general.architecture` picks its family (engine/models/registry.py), which maps the
metadata to a config, each tensor name to the canonical name its model reads and each tensor's
layout to the one its model wants (engine/models/family.py); this module reads and dequantizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from kvfence.engine.checkpoint import Checkpoint, CheckpointError, Tensors, check_tensors
from kvfence.engine.gguf_cache import GGUFCache
from kvfence.engine.gguf_metadata import GGUFMetadata, metadata_of
from kvfence.engine.gguf_tensor import GGUFTensor
from kvfence.engine.model_config import ModelConfig
from kvfence.engine.models.family import ModelFamily
from kvfence.engine.models.registry import family_of
from kvfence.engine.tokenizer import tokenizer_from_gguf_fields

# Quantization types this loader dequantizes (through the `gguf` package).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's per-frequency RoPE divisors, kept under the GGUF name


def _open(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on bad files
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def read_metadata(path: Path, cache_dir: Path | None = None) -> GGUFMetadata:
    """`path`'s metadata: from the start-up cache (engine/gguf_cache.py) when `cache_dir` holds
    it, else parsed from the file (and stored there)."""
    return _metadata(path, GGUFCache(cache_dir, path) if cache_dir is not None else None)[0]


def _metadata(path: Path, cache: GGUFCache | None) -> tuple[GGUFMetadata, Any]:
    """The metadata, and the file's reader when it had to be opened (else None)."""
    meta = cache.metadata() if cache is not None else None
    if meta is not None:
        return meta, None
    reader = _open(path)
    meta = metadata_of(reader)
    if cache is not None:
        cache.store_metadata(meta)
    return meta, reader


def family_of_file(meta: GGUFMetadata, path: Path) -> ModelFamily:
    """The family `path`'s general.architecture names (errors name the file)."""
    arch = meta.architecture
    if arch is None:
        raise CheckpointError(f"{path}: GGUF has no general.architecture")
    return family_of(arch, str(path))


def config_of(meta: GGUFMetadata, path: Path) -> ModelConfig:
    """The config `path`'s metadata describes, read by its family."""
    return family_of_file(meta, path).config_from_gguf(meta, path)


def _dequantize(t: Any, path: Path) -> torch.Tensor:
    import gguf

    kind = _kind(t, path)
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except Exception as e:
        raise CheckpointError(f"{path}: tensor {t.name} ({kind}) cannot be dequantized: {e}") from e
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    if not arr.flags.writeable:  # unquantized tensors are read-only views of the memory map
        arr = arr.copy()
    return torch.from_numpy(arr)


def _kind(t: Any, path: Path) -> str:
    kind: str = t.tensor_type.name
    if kind not in SUPPORTED_TENSOR_TYPES:
        raise CheckpointError(f"{path}: tensor {t.name} has unsupported type {kind}; "
                              f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}")
    return kind


def _blocks(t: Any, path: Path) -> GGUFTensor | None:
    """A matrix of a block type the CPU GEMM keeps (kernels/cpu/quant.py) as its rows of blocks
    (copied out of the file's mapping); None for anything else."""
    from kvfence.kernels.cpu.quant import BLOCKS

    kind = _kind(t, path)
    if kind not in BLOCKS or len(t.shape) != 2:
        return None
    cols, rows = (int(d) for d in t.shape)  # GGUF lists dims innermost first
    per_block, block_bytes = BLOCKS[kind]
    if cols % per_block or int(t.n_bytes) != rows * cols // per_block * block_bytes:
        raise CheckpointError(f"{path}: tensor {t.name} ({kind}) has {int(t.n_bytes)} bytes for {rows} x {cols}")
    return GGUFTensor(kind, np.array(t.data, dtype=np.uint8).reshape(rows, -1), (rows, cols))


def _tensors(reader: Any, family: ModelFamily, config: ModelConfig, path: Path,
             keep_blocks: bool = False) -> dict[str, torch.Tensor | GGUFTensor]:
    """Every tensor the model uses under its canonical name and in its layout, plus
    `rope_freqs.weight` when the file has it: dequantized to float32, or with `keep_blocks` the
    matrices of kept block types as GGUFTensor."""
    size = path.stat().st_size
    tensors: dict[str, torch.Tensor | GGUFTensor] = {}
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise CheckpointError(f"{path}: truncated, tensor {t.name} ends past the end of the file")
        name = ROPE_FREQS if t.name == ROPE_FREQS else family.canonical_name(t.name)
        if name is None:
            continue
        kept = _blocks(t, path) if keep_blocks else None
        w: torch.Tensor | GGUFTensor = kept if kept is not None else _dequantize(t, path)
        tensors[name] = family.from_gguf(name, w, config)
    return tensors


def load_gguf(path: Path, weights: bool = True, cache_dir: Path | None = None,
              keep_blocks: bool = False) -> Checkpoint:
    """Load `path` (without `weights`: its config and tokenizer only); raise CheckpointError (or
    UnsupportedModelError) with the file named. With `cache_dir`, what an earlier load of the same
    file (same path, size and modification time) left there is read instead of the file
    (engine/gguf_cache.py): start-up in seconds, the same checkpoint. `keep_blocks`: matrices of
    the block types kernels/cpu/quant.py keeps stay as they ship (GGUFTensor; read straight from
    the file, nothing cached)."""
    cache = GGUFCache(cache_dir, path) if cache_dir is not None else None
    meta, reader = _metadata(path, cache)
    family = family_of_file(meta, path)
    config = family.config_from_gguf(meta, path)
    tensors: Tensors = {}
    if weights and keep_blocks:
        tensors = _tensors(reader if reader is not None else _open(path), family, config, path, keep_blocks)
    elif weights:
        cached = cache.tensors() if cache is not None else None
        if cached is None:
            # without keep_blocks every tensor is dequantized: all are torch.Tensor
            cached = cast(dict[str, torch.Tensor], _tensors(reader if reader is not None else _open(path), family, config, path))
            if cache is not None:
                cache.store_tensors(cached)
        tensors = dict(cached)
    rope_freq_factors = tensors.pop(ROPE_FREQS, None)
    if isinstance(rope_freq_factors, GGUFTensor):  # never: only matrices are kept in block types
        raise CheckpointError(f"{path}: {ROPE_FREQS} is not a vector")
    if weights:
        check_tensors(family.expected_shapes(config), tensors, str(path))
    tokenizer = tokenizer_from_gguf_fields(meta.field, str(path))
    if tokenizer.chat_template is None:
        tokenizer.chat_template = family.chat_template
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer, source=str(path),
                      rope_freq_factors=rope_freq_factors)
