"""A new family is one new file: tests/engine/models/families/parallel.py (a parallel-residual
block, not Llama-shaped), put on engine/models' search path, is found by the registry, loaded by
the unchanged GGUF loader and served by the unchanged runner, worker and scheduler (the offline
engine, through the paged pool, prefill in chunks, batched decode). Its greedy tokens and logits
equal a dense reference written here from the weights' values, without pages.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvfence.engine import models
from kvfence.engine.checkpoint import load_checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.model_config import UnsupportedModelError
from kvfence.engine.models import registry
from kvfence.engine.models.registry import build_model
from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.offline import OfflineEngine
from tiny_models import TinyModel, TinySpec, build_tiny_model, write_gguf

FAMILIES = Path(__file__).parent / "families"
PROMPTS = [[5, 17, 30, 2, 44, 9, 12, 60, 3, 21, 8], [40, 41, 42], [7] * 19]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def with_parallel_family(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(FAMILIES)])
    registry.families.cache_clear()
    yield
    registry.families.cache_clear()
    sys.modules.pop(f"{models.__name__}.parallel", None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyModel, Path]:
    model = build_tiny_model(TinySpec(num_layers=3), seed=11)
    return model, write_gguf(model, tmp_path_factory.mktemp("parallel") / "tiny-parallel.gguf", arch_name="parallel")


def dense_logits(model: TinyModel, ids: list[int]) -> torch.Tensor:
    """The parallel block over the whole sequence at once, from the weights' values: [len(ids), vocab]."""
    s = model.spec
    w = {name: torch.from_numpy(np.asarray(v, dtype=np.float32)).double() for name, v in model.hf_tensors.items()}

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + s.rms_norm_eps) * weight

    def rope(x: torch.Tensor) -> torch.Tensor:  # [T, heads, d], rotate-half
        d = s.head_dim
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.outer(torch.arange(x.shape[0], dtype=torch.float64), inv)
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    t, group = len(ids), s.num_heads // s.num_kv_heads
    x = w["model.embed_tokens.weight"][ids]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).view(t, s.num_heads, s.head_dim))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).view(t, s.num_kv_heads, s.head_dim))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, s.num_kv_heads, s.head_dim)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / s.head_dim ** 0.5
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)
        mlp = (torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T))
        x = x + attn.reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T + mlp @ w[p + "mlp.down_proj.weight"].T
    return (norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T).float()


def test_without_its_file_the_architecture_is_refused(tiny: tuple[TinyModel, Path]) -> None:
    with pytest.raises(UnsupportedModelError, match="unknown architecture 'parallel'; kvfence runs .*llama"):
        load_checkpoint(tiny[1])


def test_its_file_is_all_it_takes(with_parallel_family: None, tiny: tuple[TinyModel, Path]) -> None:
    model, path = tiny
    checkpoint = load_checkpoint(path)
    assert checkpoint.config.architecture == "parallel"
    assert not any(name.startswith("model.") for name in checkpoint.tensors)  # its own names, not Llama's
    built = build_model(checkpoint, torch.float32)
    engine = OfflineEngine(ModelRunner(built, KVPool(built.config, 32, 4, torch.float32)),
                           checkpoint.tokenizer, chunk_tokens=8)
    outputs = engine.generate(PROMPTS, [GREEDY] * len(PROMPTS), return_logits=True)
    for prompt, out in zip(PROMPTS, outputs):
        expected = dense_logits(model, prompt + out.generated_token_ids)[len(prompt) - 1: -1]
        assert out.generated_token_ids == expected.argmax(-1).tolist()
        assert out.logits is not None
        torch.testing.assert_close(out.logits, expected, atol=2e-3, rtol=0)
    assert engine.ledger.num_in_use == 0
