"""The model interface: what the loaders and the runner need of a model family, and nothing more.

A family is one file in engine/models/ that defines `FAMILY`, an object with this interface
(engine/models/registry.py finds it; nothing else names it):

- which architectures it runs: GGUF `general.architecture` values (also `ModelConfig.architecture`)
  and Hugging Face `config.json` `model_type` values;
- its config mapping: a GGUF file's metadata, or a config.json, to a `ModelConfig` (a family with
  hyper-parameters of its own subclasses ModelConfig in its file);
- its weight names: each GGUF tensor name to the canonical (Hugging Face) name the family's model
  reads, any layout fix a GGUF tensor needs on the way (llama.cpp's permuted Q/K rows), and the
  shape of every tensor a checkpoint of a config must hold;
- its chat format, where the family has one its files may lack (`chat_template`);
- its layer wiring: `build` makes the model, whose `forward` runs one flat batch of tokens from
  many sequences over the paged KV pool (engine/attention.py's AttentionBatch).

What a model may use of its attention backend is in the backend's own interface
(engine/attention_backend.py), capabilities included: a model never asks which backend it has.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from kvfence.engine.attention import AttentionBatch
from kvfence.engine.attention_backend import AttentionBackend
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.gguf_metadata import GGUFMetadata
from kvfence.engine.gguf_tensor import GGUFTensor
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.model_config import ModelConfig


class Model(Protocol):
    """A loaded model on one device: what the runner (engine/runner.py), the workers and the
    readiness check use."""

    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    attention: AttentionBackend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                pool: KVPool, logits_rows: torch.Tensor,
                between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64; logits_rows: [N] rows to score -> logits [N, vocab] float32.

        Writes every token's K/V into the pages `batch` names (layer i into `pool.keys(i)` and
        `pool.values(i)`), then attends through them. `between_layers` is called before each
        layer; an exception it raises stops the forward there, having written K/V only for the
        layers before it, into the batch's own slots."""
        ...


class ModelFamily(Protocol):
    """One family of architectures sharing a layer wiring (see the module docstring)."""

    name: str
    architectures: tuple[str, ...]  # GGUF general.architecture values, and ModelConfig.architecture
    hf_model_types: tuple[str, ...]  # config.json model_type values
    chat_template: str | None  # the family's own turn format, for a file that carries no template

    def config_from_gguf(self, meta: GGUFMetadata, path: Path) -> ModelConfig:
        """The config a GGUF file's metadata describes; CheckpointError or UnsupportedModelError
        naming `path` when a key is missing or a value is out of what the family runs."""
        ...

    def config_from_hf(self, raw: dict[str, Any], source: str) -> ModelConfig:
        """The config a config.json describes (errors as config_from_gguf's, naming `source`)."""
        ...

    def canonical_name(self, gguf_name: str) -> str | None:
        """A GGUF tensor's canonical name; None for a tensor the family's model does not read."""
        ...

    def from_gguf(self, name: str, tensor: torch.Tensor | GGUFTensor,
                  config: ModelConfig) -> torch.Tensor | GGUFTensor:
        """The tensor under canonical `name` as the model reads it (the GGUF layout undone)."""
        ...

    def expected_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint of `config` must hold, by canonical name, with its shape."""
        ...

    def build(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device | str = "cpu", *,
              attention_backend: str = "auto", cpu_kernels: bool = True) -> Model:
        """The model of `checkpoint` on `device` in `dtype`. `attention_backend`: auto | torch |
        cpu | triton (engine/attention_backend.py). `cpu_kernels`: False runs torch's paths even
        where kernels/cpu runs (what benchmarks compare against)."""
        ...


class GGUFNames:
    """A family's canonical names of GGUF tensors: whole-model ones by name, and per-layer ones
    (`blk.N.<name>`) as `model.layers.N.<canonical>`."""

    _LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")

    def __init__(self, model: dict[str, str], layer: dict[str, str]) -> None:
        self.model, self.layer = model, layer

    def canonical(self, gguf_name: str) -> str | None:
        if gguf_name in self.model:
            return self.model[gguf_name]
        m = self._LAYER.match(gguf_name)
        if m and m.group(2) in self.layer:
            return f"model.layers.{m.group(1)}.{self.layer[m.group(2)]}"
        return None
