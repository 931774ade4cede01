"""A model's hyper-parameters, independent of the file format: what the KV pool, the sizing and
the runner read of every family. A family builds it from a file (engine/models/); a family with
hyper-parameters of its own subclasses it in its file."""

from __future__ import annotations

import dataclasses

class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this engine cannot run."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a GGUF general.architecture its family runs (engine/models/registry.py)
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context_tokens: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    # Llama 3.1-style frequency scaling: (factor, low_freq_factor, high_freq_factor, original_ctx).
    rope_llama3_scaling: tuple[float, float, float, int] | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                     "num_kv_heads", "head_dim", "vocab_size", "max_context_tokens"):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"model config field {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes one token occupies in the KV cache: K and V for every layer."""
        return 2 * self.num_layers * self.kv_size * element_size
