"""Choosing the attention backend, and translating an AttentionBatch for the kernels (no kernel runs here)."""

from __future__ import annotations

import pytest
import torch

from kvfence.engine import attention_backend
from kvfence.engine.attention import build_attention_batch
from kvfence.engine.attention_backend import (
    CpuBackend, TorchBackend, kernel_batch, resolve_backend_name, select_attention_backend,
)
from kvfence.kernels.cpu import library as cpu_kernels


@pytest.fixture
def with_triton(monkeypatch: pytest.MonkeyPatch):
    """Pretend triton imports; the argument says whether it runs as the interpreter."""
    def use(interpreted: bool) -> None:
        monkeypatch.setattr(attention_backend, "_triton_status", lambda: (True, interpreted))
    return use


@pytest.fixture
def cpu_kernels_build(monkeypatch: pytest.MonkeyPatch):
    """Pretend the CPU kernels build here, or not."""
    def use(builds: bool) -> None:
        monkeypatch.setattr(cpu_kernels, "available", lambda: builds)
        monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: "" if builds else "the CPU lacks AVX2 or FMA")
    return use


def test_unknown_name_is_refused() -> None:
    with pytest.raises(ValueError, match="auto, torch, cpu, triton"):
        resolve_backend_name("cuda", "cpu")


def test_torch_runs_anywhere(with_triton) -> None:
    with_triton(False)
    assert resolve_backend_name("torch", "cpu") == resolve_backend_name("torch", "cuda:0") == "torch"
    assert isinstance(select_attention_backend("torch", "cpu"), TorchBackend)


def test_auto_picks_triton_only_on_cuda(with_triton, cpu_kernels_build) -> None:
    with_triton(True)  # even under the interpreter, auto keeps the CPU off triton
    cpu_kernels_build(False)
    assert resolve_backend_name("auto", "cpu") == "torch"
    with_triton(False)
    assert resolve_backend_name("auto", torch.device("cuda:0")) == "triton"


def test_auto_picks_the_cpu_kernels_where_they_build(cpu_kernels_build) -> None:
    cpu_kernels_build(True)
    assert resolve_backend_name("auto", "cpu") == resolve_backend_name("cpu", "cpu") == "cpu"
    assert isinstance(select_attention_backend("auto", "cpu"), CpuBackend)
    with pytest.raises(ValueError, match="runs on the CPU, not on cuda:0"):
        resolve_backend_name("cpu", "cuda:0")
    cpu_kernels_build(False)
    assert resolve_backend_name("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match=r"unavailable here \(the CPU lacks AVX2 or FMA\); use --attention-backend torch"):
        resolve_backend_name("cpu", "cpu")


def test_auto_falls_back_to_torch_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_backend, "_triton_status", lambda: (False, False))
    assert resolve_backend_name("auto", "cuda:0") == "torch"
    with pytest.raises(ValueError, match=r"3.4 or later\): pip install 'kvfence\[triton\]'"):
        resolve_backend_name("triton", "cuda:0")


def test_triton_on_the_cpu_needs_the_interpreter(with_triton) -> None:
    with_triton(False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend_name("triton", "cpu")
    with_triton(True)
    assert resolve_backend_name("triton", "cpu") == "triton"
    assert resolve_backend_name("triton", "cuda:0") == "triton"


def test_interpreter_status_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert attention_backend._triton_status() == (True, False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attention_backend._triton_status() == (True, True)


def test_kernel_batch_translates_a_mixed_batch() -> None:
    page_size = 4
    decode = [([7, 2], 5), ([4], 1)]  # (table, kv_len incl. the new token)
    prefill = [([9, 0, 3], 6, 3), ([5], 0, 2)]  # (table, cached, chunk)
    batch = build_attention_batch(page_size, decode, prefill, torch.device("cpu"))
    kb = kernel_batch(batch)
    assert kb.decode_page_table.dtype == torch.int32
    assert kb.decode_page_table.tolist() == [[7, 2], [4, 0]]
    assert kb.decode_kv_lens.tolist() == [5, 1]
    assert kb.prefill_cu_seqlens.tolist() == [0, 3, 5]
    assert kb.prefill_cached_lens.tolist() == [6, 0]
    assert kb.prefill_page_table.tolist() == [[9, 0, 3], [5, 0, 0]]
    assert (kb.prefill_max_tokens, kb.prefill_num_tokens) == (3, 5)


def test_kernel_batch_of_a_prefill_only_batch() -> None:
    batch = build_attention_batch(4, [], [([1, 2], 3, 2)], torch.device("cpu"))
    kb = kernel_batch(batch)
    assert kb.decode_kv_lens.tolist() == [] and kb.prefill_cu_seqlens.tolist() == [0, 2]
