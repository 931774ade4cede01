"""`--weights native`: the default model's Q4_1 layers and Q8_0 embedding stay as the file ships
them, and the model computes exactly what it computes over the float32 weights the file
dequantizes to: every logit of prefill chunks, single decode steps and batched decode steps, with
either block family; and its greedy outputs equal the references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfence.engine.checkpoint import Checkpoint, load_checkpoint
from kvfence.engine.gguf_loader import read_metadata
from kvfence.engine.gguf_tensor import GGUFTensor
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.llama import LlamaModel
from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.weight_size import weight_bytes
from kvfence.kernels.cpu import gemm as cpu_gemm, library as cpu_kernels
from kvfence.scheduler.offline import OfflineEngine

pytestmark = pytest.mark.skipif(not cpu_kernels.available() and cpu_kernels.unavailable_as_expected(),
                                reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")
GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def native(default_model_path: Path) -> Checkpoint:
    return load_checkpoint(default_model_path, keep_blocks=True)


def _engine(checkpoint: Checkpoint) -> OfflineEngine:
    model = LlamaModel(checkpoint, torch.float32)
    pool = KVPool(model.config, num_pages=1024, page_size_tokens=16, dtype=torch.float32)
    return OfflineEngine(ModelRunner(model, pool), checkpoint.tokenizer, chunk_tokens=64)


def test_the_file_s_block_types_are_kept_and_dequantize_to_the_float32_load(native: Checkpoint, smollm2: Checkpoint,
                                                                             default_model_path: Path) -> None:
    kept = {name: t for name, t in native.tensors.items() if isinstance(t, GGUFTensor)}
    assert {t.kind for t in kept.values()} == {"Q4_1", "Q8_0"}
    assert kept["model.embed_tokens.weight"].kind == "Q8_0"
    assert len(kept) == 1 + 7 * native.config.num_layers  # every matrix; the norms stay float32
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.7.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        assert torch.equal(kept[name].dequantize(), smollm2.tensors[name]), name  # Q/K un-permuted alike
    model = LlamaModel(native, torch.float32)
    assert model.embed_rows is not None and model.lm_head.packed is model.embed_rows
    assert model.fused_layers is not None and model.layers[0].gate_up.packed.kinds == ["Q4_1"]
    held = {kind: sum(lin.packed.nbytes for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up,
                                                                             layer.down) if lin.packed.kinds == [kind])
            for kind in ("Q4_1", "Q8_0")}
    held["Q8_0"] += model.lm_head.packed.nbytes
    assert held["Q4_1"] + held["Q8_0"] < 0.2 * 4 * sum(t.numel() for t in smollm2.tensors.values())
    predicted = weight_bytes(read_metadata(default_model_path), True, "float32", 4)  # what `kvfence check` says
    assert {kind: predicted.by_kind[kind] for kind in held} == held


def _same_logits(native: Checkpoint, smollm2: Checkpoint, cases: list[dict], params: SamplingParams) -> None:
    prompts = [c["prompt_token_ids"] for c in cases]
    outs = [_engine(checkpoint).generate(prompts, [params] * len(cases), return_logits=True)
            for checkpoint in (native, smollm2)]
    for case, ours, theirs in zip(cases, *outs):
        assert ours.generated_token_ids == theirs.generated_token_ids, case["id"]
        assert ours.generated_token_ids == case["greedy_ids"][:params.max_tokens], case["id"]
        assert ours.logits is not None and theirs.logits is not None
        assert torch.equal(ours.logits.view(torch.int32), theirs.logits.view(torch.int32)), case["id"]


def test_every_logit_equals_the_float32_model_s(native: Checkpoint, smollm2: Checkpoint, reference: dict) -> None:
    """Every reference case at once: prefill chunks of 64 (the two-panel blocks over decoded
    panels) and decode steps of all of them (the one-pass blocks in the fused layers)."""
    _same_logits(native, smollm2, reference["cases"], GREEDY_32)


def test_with_the_avx2_blocks_too(native: Checkpoint, smollm2: Checkpoint, reference: dict) -> None:
    before = cpu_gemm.wide_blocks()
    cpu_gemm.wide_blocks(False)
    try:
        _same_logits(native, smollm2, reference["cases"][:3], SamplingParams(temperature=0.0, max_tokens=8,
                                                                             ignore_eos=True))
    finally:
        cpu_gemm.wide_blocks(before)
