"""A loaded checkpoint: model config, weights under canonical names, and a tokenizer.

Weights use the Hugging Face names of their family (``model.layers.{i}.self_attn.q_proj.weight``...)
and its layout whatever file they came from (engine/models/: each family maps a GGUF file's names
and layout to its own), so one model implementation serves both GGUF files and HF directories.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from kvfence.engine.gguf_tensor import GGUFTensor
from kvfence.engine.model_config import ModelConfig
from kvfence.engine.tokenizer import Tokenizer


class CheckpointError(ValueError):
    """A model file or directory cannot be loaded; the message names the file and the problem."""


# canonical name -> float tensor ([out, in] for matrices), or a matrix kept in its GGUF block type
Tensors = dict[str, torch.Tensor | GGUFTensor]


@dataclasses.dataclass
class Checkpoint:
    config: ModelConfig
    tensors: Tensors  # block types kept only with load_checkpoint's `keep_blocks`
    tokenizer: Tokenizer
    source: str  # the path it was loaded from
    # Per-frequency RoPE divisors stored in the file (Llama 3.1 GGUF `rope_freqs`), if any.
    rope_freq_factors: torch.Tensor | None = None


def check_tensors(shapes: dict[str, tuple[int, ...]], tensors: Tensors, source: str) -> None:
    """Raise CheckpointError naming the first of `shapes` (a family's `expected_shapes`) missing
    from `tensors` or of another shape."""
    for name, shape in shapes.items():
        t = tensors.get(name)
        if t is None:
            raise CheckpointError(f"{source}: tensor {name} is missing")
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(t.shape)}, expected {shape}")


def load_checkpoint(path: str | Path, weights: bool = True, cache_dir: Path | None = None,
                    keep_blocks: bool = False) -> Checkpoint:
    """Load a GGUF file or a Hugging Face model directory. Without `weights`: its config and
    tokenizer only (`tensors` is empty: what a front end whose workers run elsewhere needs).
    `cache_dir`: where a GGUF file's start-up cache lives (engine/gguf_cache.py; a directory of
    safetensors loads fast already and is read as it is). `keep_blocks` (`--weights native`): a
    GGUF file's quantized matrices stay in their block types (engine/gguf_tensor.py)."""
    from kvfence.engine import gguf_loader, hf_loader

    p = Path(path)
    if p.is_dir():
        return hf_loader.load_hf_dir(p, weights)
    if p.is_file():
        return gguf_loader.load_gguf(p, weights, cache_dir, keep_blocks)
    raise CheckpointError(f"{p}: no such file or directory")


def read_config(path: str | Path, cache_dir: Path | None = None) -> ModelConfig:
    """The config of a GGUF file (its metadata, through the start-up cache in `cache_dir`) or of
    a Hugging Face directory (its config.json): no weight is read."""
    from kvfence.engine import gguf_loader, hf_loader

    p = Path(path)
    if p.is_dir():
        return hf_loader.config_of(p)
    if p.is_file():
        return gguf_loader.config_of(gguf_loader.read_metadata(p, cache_dir), p)
    raise CheckpointError(f"{p}: no such file or directory")
