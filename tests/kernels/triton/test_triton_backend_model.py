"""The Triton backend inside a real model step: same logits as the torch path (tiny random Llama, fp32)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvfence.engine.models import llama  # noqa: E402
from kvfence.engine.attention_backend import TritonBackend  # noqa: E402
from kvfence.engine.kv_pool import KVPool  # noqa: E402
from kvfence.engine.runner import ModelRunner, SeqWork  # noqa: E402
from kvfence.engine.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Two sequences: prefill chunks, then a decode next to a second prefill chunk -> logits per step."""
    a = list(range(3, 13))  # 10 prompt tokens
    b = list(range(20, 31))  # 11, in two chunks
    runner.pool.assign([5, 2], 11)
    runner.pool.assign([0, 7, 3], 22)
    s1 = runner.step([SeqWork.local(token_ids=a, context_tokens=0, page_table=[5, 2], lease=11, sampling=GREEDY),
                      SeqWork.local(token_ids=b[:6], context_tokens=0, page_table=[0, 7, 3], lease=22, sampling=GREEDY)],
                     return_logits=True)
    s2 = runner.step([SeqWork.local(token_ids=[40], context_tokens=10, page_table=[5, 2], lease=11, sampling=GREEDY),
                      SeqWork.local(token_ids=b[6:], context_tokens=6, page_table=[0, 7, 3], lease=22, sampling=GREEDY)],
                     return_logits=True)
    s3 = runner.step([SeqWork.local(token_ids=[41], context_tokens=11, page_table=[5, 2], lease=11, sampling=GREEDY),
                      SeqWork.local(token_ids=[42], context_tokens=11, page_table=[0, 7, 3], lease=22, sampling=GREEDY)],
                     return_logits=True)
    return [s.logits for s in (s1, s2, s3)]  # type: ignore[misc]


def test_model_steps_match_the_torch_path(tiny, device) -> None:
    torch_model = llama.LlamaModel(tiny, torch.float32, device, attention_backend="torch")
    want = _steps(ModelRunner(torch_model, KVPool(torch_model.config, 8, 8, torch.float32, device)))
    model = llama.LlamaModel(tiny, torch.float32, device, attention_backend="triton")
    backend = model.attention
    assert isinstance(backend, TritonBackend)
    got = _steps(ModelRunner(model, KVPool(model.config, 8, 8, torch.float32, device)))
    assert backend._last is not None, "the steps ran through the Triton backend"
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
