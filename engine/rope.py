"""Rotary position embeddings, rotate-half convention (the Hugging Face layout)."""

from __future__ import annotations

import math

import torch

from kvfence.engine.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """[head_dim/2] float32 angular frequencies, with Llama 3.1 scaling when configured."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if freq_factors is not None:
        return inv_freq / freq_factors.float().reshape(-1)
    if config.rope_llama3_scaling is not None:
        factor, low_ff, high_ff, original_ctx = config.rope_llama3_scaling
        low_wavelen = original_ctx / low_ff
        high_wavelen = original_ctx / high_ff
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_ctx / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class Rope:
    """Precomputed cos/sin tables; `apply` rotates Q and K heads in one call."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 freq_factors: torch.Tensor | None = None) -> None:
        inv_freq = inverse_frequencies(config, freq_factors)
        positions = torch.arange(config.max_context_tokens, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_ctx, head_dim/2]
        cos, sin = freqs.cos(), freqs.sin()
        # Full-width tables, so a rotation is two products and a sum over whole heads (see apply).
        self.cos = torch.cat((cos, cos), -1).to(device=device, dtype=dtype)  # [max_ctx, head_dim]
        self.sin = torch.cat((-sin, sin), -1).to(device=device, dtype=dtype)  # [max_ctx, head_dim]

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> (cos, sin), each [T, 1, head_dim]; computed once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] -> rotated x, same shape and dtype.

        With x = (x1, x2) in halves: (x1 cos - x2 sin, x2 cos + x1 sin), computed as
        x * (cos, cos) + (x2, x1) * (-sin, sin), which rounds exactly the same (negation is exact)
        in four ops instead of seven."""
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
