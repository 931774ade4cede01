"""kernels/cpu/elementwise.py: RMSNorm and SiLU·up in one C call each equal the torch expressions
(float32 rounding), including rows with large and tiny values, and refuse what they do not take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfence.kernels.cpu import elementwise as cpu_elementwise, library as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available() and cpu_kernels.unavailable_as_expected(),
                                reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


@pytest.mark.parametrize("rows,d", [(1, 576), (16, 576), (7, 8), (130, 1536)])
def test_rms_norm_equals_torch(rows: int, d: int) -> None:
    g = torch.Generator().manual_seed(rows + d)
    x = torch.randn(rows, d, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
    w = torch.randn(d, generator=g)
    torch.testing.assert_close(cpu_elementwise.rms_norm(x, w, 1e-5), F.rms_norm(x, (d,), w, 1e-5),
                               rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows,n", [(1, 1536), (16, 1536), (3, 8), (128, 64)])
def test_silu_mul_equals_torch(rows: int, n: int) -> None:
    g = torch.Generator().manual_seed(rows * n)
    gate_up = torch.randn(rows, 2 * n, generator=g) * 8  # well into both tails of the SiLU
    gate_up[0, :4] = torch.tensor([-120.0, -88.0, 60.0, 0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_elementwise.silu_mul(gate_up), F.silu(gate) * up, rtol=4e-6, atol=1e-6)


def test_what_they_do_not_take_is_refused() -> None:
    with pytest.raises(ValueError, match="rms_norm wants"):
        cpu_elementwise.rms_norm(torch.zeros(2, 12), torch.ones(12), 1e-5)
    with pytest.raises(ValueError, match="rms_norm wants"):
        cpu_elementwise.rms_norm(torch.zeros(2, 16), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="silu_mul wants"):
        cpu_elementwise.silu_mul(torch.zeros(2, 24))
    with pytest.raises(ValueError, match="silu_mul wants"):
        cpu_elementwise.silu_mul(torch.zeros(2, 32, dtype=torch.float64))


def test_a_model_without_the_kernels_runs_torch_paths_with_the_same_greedy_tokens(tiny) -> None:  # noqa: ANN001
    """`LlamaModel(cpu_kernels=False)` (what benchmarks compare against) takes none of them, and
    both models pick the same greedy tokens on the tiny model's prompt."""
    from kvfence.engine.attention import build_attention_batch
    from kvfence.engine.kv_pool import KVPool
    from kvfence.engine.models.llama import LlamaModel

    fast, slow = LlamaModel(tiny, torch.float32), LlamaModel(tiny, torch.float32, cpu_kernels=False)
    assert fast.fused_elementwise and fast.attention.name == "cpu" and fast.lm_head.packed is not None
    assert not slow.fused_elementwise and slow.attention.name == "torch" and slow.lm_head.packed is None
    ids = torch.tensor(tiny.tokenizer.encode("the quick brown fox jumps over"), dtype=torch.int64)
    logits = []
    for model in (fast, slow):
        pool = KVPool(tiny.config, 4, 16, torch.float32)
        batch = build_attention_batch(16, [], [([1, 2], 0, len(ids))], torch.device("cpu"))
        logits.append(model.forward(ids, torch.arange(len(ids)), batch, pool, torch.arange(len(ids))))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
