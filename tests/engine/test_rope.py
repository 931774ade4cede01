"""engine/rope.py: the rotation equals the rotate-half formula of the Hugging Face layout, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvfence.engine.model_config import ModelConfig
from kvfence.engine.rope import Rope, inverse_frequencies

CONFIG = ModelConfig(architecture="llama", num_layers=1, hidden_size=128, intermediate_size=256, num_heads=4,
                     num_kv_heads=2, head_dim=64, vocab_size=100, max_context_tokens=4096)


def rotate_half(x: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(x1 cos - x2 sin, x2 cos + x1 sin) with cos/sin rounded to `dtype` first, as the model stores them."""
    freqs = torch.outer(positions.float(), inverse_frequencies(CONFIG))
    cos, sin = freqs.cos().to(dtype)[:, None], freqs.sin().to(dtype)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 17, 300])
def test_rotation_is_exactly_rotate_half(dtype: torch.dtype, num_tokens: int) -> None:
    g = torch.Generator().manual_seed(num_tokens)
    rope = Rope(CONFIG, dtype, torch.device("cpu"))
    positions = torch.randint(0, CONFIG.max_context_tokens, (num_tokens,), generator=g)
    x = (torch.randn(num_tokens, 6, CONFIG.head_dim, generator=g) * 4).to(dtype)
    assert torch.equal(Rope.apply(x, *rope.tables(positions)), rotate_half(x, positions, dtype))
