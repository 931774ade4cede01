#!/usr/bin/env python
"""How far a decode step is from what this machine allows: its read bandwidth and GEMM peak, the
decode step of the default model at several batch sizes against its floor, and where one batch's
step time goes (batch 16 unless --profile-batch says otherwise).

The floor of a step is max(bytes read / read bandwidth, FLOPs / GEMM peak): every step reads
every weight once and every sequence's keys and values once per layer, and does 2 FLOPs per
weight per sequence (attention's share is small at these contexts and counted too). Bandwidth: a
summing read of a tensor far larger than the caches, with as many threads as a worker's compute
uses; peak: a large square GEMM (its operands in cache). Both are sampled again every five steps
while the steps run (a shared host's bandwidth moves by 1.5x within minutes), and the floor takes
the best of the samples: what this machine allowed at its best during the run, so `x floor` never
flatters the step.

    .venv/bin/python scripts/bench_floor.py [--batches 1,4,16,32] [--steps 30] [--prompt-tokens 128]
                                            [--profile-batch 16] [--weights native|float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from kvfence.app.config.environment import kvfence_home
from kvfence.engine.grammar import LeaseGrammars
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.llama import LlamaModel
from kvfence.engine.loading import load_model_spec
from kvfence.engine.model_config import ModelConfig
from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.token_counts import LeaseTokenCounts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sampling import PAGE_SIZE, Batch  # noqa: E402


def best_of(fn, repeats: int = 5) -> float:  # type: ignore[no-untyped-def]
    """The fastest of `repeats` timed calls, in seconds (after one untimed call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second of a summing read of `nbytes` of fp32."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / best_of(lambda: x.sum())


def gemm_peak(dtype: torch.dtype, n: int = 2048) -> float:
    """FLOP/s of an n x n x n GEMM in `dtype`."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n ** 3 / best_of(lambda: torch.mm(a, b))


def step_cost(c: ModelConfig, weight_bytes: int, batch: int, context: int) -> tuple[int, float]:
    """(bytes read, FLOPs) of one fp32 decode step of `batch` sequences at `context` tokens: every
    weight once (`weight_bytes`: as the model holds them), and every sequence's keys and values in
    every layer."""
    per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size \
        + 3 * c.hidden_size * c.intermediate_size
    weights = c.num_layers * per_layer + c.vocab_size * c.hidden_size
    attention = 4 * context * c.num_heads * c.head_dim * c.num_layers
    return weight_bytes + batch * context * c.kv_bytes_per_token(4), batch * (2 * weights + attention)


def held_weight_bytes(model: LlamaModel) -> int:
    """Bytes a decode step reads of the weights: every linear's (and the LM head's) as held."""
    linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return sum(lin.packed.nbytes if lin.packed is not None else lin.weight.numel() * 4
               for lin in (*linears, model.lm_head))


def _labelled(module, name: str, label: str) -> None:  # type: ignore[no-untyped-def]
    """Wrap `module.name` so that each call shows in the profile as `label` (ctypes calls do not)."""
    inner = getattr(module, name)

    def call(*args, **kwargs):  # type: ignore[no-untyped-def]
        with torch.profiler.record_function(label):
            return inner(*args, **kwargs)
    setattr(module, name, call)


def profile(runner: ModelRunner, batch: Batch, rows: int = 16) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from kvfence.kernels.cpu import attention as cpu_attention, elementwise as cpu_elementwise, gemm as cpu_gemm, layer as cpu_layer

    wrapped = [(cpu_layer.FusedLayers, "run", "kvfence::fused_layers (C, every layer)"),
               (cpu_gemm.PackedWeight, "__call__", "kvfence::gemm (C)"),
               (cpu_attention, "decode_attention", "kvfence::decode_attention (C)"),
               (cpu_attention, "store_kv", "kvfence::store_kv (C)"),
               (cpu_elementwise, "rms_norm", "kvfence::rms_norm (C)"),
               (cpu_elementwise, "silu_mul", "kvfence::silu_mul (C)")]
    original = [getattr(module, name) for module, name, _ in wrapped]
    for module, name, label in wrapped:
        _labelled(module, name, label)
    try:
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                batch.step()
    finally:
        for (module, name, _), inner in zip(wrapped, original):
            setattr(module, name, inner)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"\nwhere a batch-{len(batch.leases)} step goes (5 steps, self CPU time, ops over 1%):")
    print(f"{'op':<44}{'ms/step':>9}{'share':>8}{'calls/step':>12}")
    for e in events[:rows]:
        if e.self_cpu_time_total < total / 100:
            break
        print(f"{e.key[:43]:<44}{e.self_cpu_time_total / 5e3:>9.2f}{e.self_cpu_time_total / total:>8.1%}"
              f"{e.count / 5:>12.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--profile-batch", type=int, default=16, help="the batch whose step is profiled")
    ap.add_argument("--weights", choices=("native", "float32"), default="native",
                    help="the quantized matrices kept as the file ships them (default), or dequantized")
    args = ap.parse_args()
    sizes = [int(b) for b in args.batches.split(",")]
    bws, peaks = [read_bandwidth()], [gemm_peak(torch.float32)]
    peak16 = gemm_peak(torch.bfloat16)

    checkpoint = load_model_spec(None, kvfence_home(), progress=False, keep_blocks=args.weights == "native")
    model = LlamaModel(checkpoint, torch.float32)
    weight_bytes = held_weight_bytes(model)
    pages_per_seq = -(-(args.prompt_tokens + args.steps + 8) // PAGE_SIZE)
    pool = KVPool(model.config, sum(sizes) * pages_per_seq, PAGE_SIZE, torch.float32)
    runner = ModelRunner(model, pool)
    counts = LeaseTokenCounts(model.config.vocab_size, pool.device)
    grammars = LeaseGrammars(checkpoint.tokenizer, model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0)
    with torch.inference_mode():
        batches, first_page = {}, 0
        for k, size in enumerate(sizes):
            prompts = [torch.randint(100, model.config.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
                       for _ in range(size)]
            batches[size] = Batch(runner, greedy, 1 + k * 1000, first_page, size, pages_per_seq, prompts, counts,
                                  grammars)
            first_page += size * pages_per_seq
        for i in range(args.steps):  # batch sizes take turns step by step: drift falls on all alike
            for b in batches.values():
                b.step()
            if i % 5 == 4:
                bws.append(read_bandwidth())
                peaks.append(gemm_peak(torch.float32))
        bw, peak32 = max(bws), max(peaks)
        print(f"{torch.get_num_threads()} threads, {len(bws)} samples during the run: read "
              f"{min(bws) / 1e9:.1f}-{bw / 1e9:.1f} GB/s, GEMM fp32 {min(peaks) / 1e9:.0f}-{peak32 / 1e9:.0f} "
              f"GFLOP/s (the floor takes the best); bf16 {peak16 / 1e9:.1f} GFLOP/s")
        print(f"\ndecode step, fp32, --weights {args.weights} ({weight_bytes / 2**20:.1f} MiB read per step), context "
              f"≈{args.prompt_tokens + args.steps // 2} tokens, {args.steps} steps each, every guard on (owner check), "
              "interleaved")
        print(f"{'batch':>6}{'ms/step':>10}{'floor ms':>10}{'bound by':>10}{'x floor':>9}{'tok/s':>9}")
        for size, b in batches.items():
            ms = statistics.median(b.step_s[2:]) * 1e3
            nbytes, flops = step_cost(model.config, weight_bytes, size, args.prompt_tokens + args.steps // 2)
            read_ms, compute_ms = nbytes / bw * 1e3, flops / peak32 * 1e3
            floor = max(read_ms, compute_ms)
            print(f"{size:>6}{ms:>10.2f}{floor:>10.2f}{'memory' if read_ms >= compute_ms else 'compute':>10}"
                  f"{ms / floor:>9.2f}{size / ms * 1e3:>9.1f}")
        profile(runner, batches.get(args.profile_batch, next(iter(batches.values()))))


if __name__ == "__main__":
    main()
