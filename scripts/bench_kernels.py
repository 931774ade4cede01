"""The CPU kernels (kernels/cpu/kernels.c) against the paths they replace, interleaved step by step.

Three models over one pool: the CPU kernels as the engine runs them (a decode step's layers one
C call each, kernels/cpu/layer.py), the same kernels one call per op (packed GEMM, CPU attention
backend, fused norms and SiLU·up), and torch's paths (oneDNN linears, torch attention, torch
norms: `LlamaModel(cpu_kernels=False)`). Each batch size decodes greedy steps taking turns on the
three, so a machine that drifts (a shared host does) moves every column alike; the ratios are
the numbers to read.

    .venv/bin/python scripts/bench_kernels.py                 # batches 1,4,16,32
    .venv/bin/python scripts/bench_kernels.py --batches 16 --steps 40
    .venv/bin/python scripts/bench_kernels.py --ops           # each kernel alone, on the model's shapes

With --ops: each linear of the default model at M = 1, 4, 16, 128 rows, packed GEMM against
oneDNN, on 1 and 2 threads (weights in cache: the kernels' compute, not the memory); and decode
attention of 16 sequences of 143 keys against the torch path's gather + bmm.
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
from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.token_counts import LeaseTokenCounts
from kvfence.kernels.cpu import library as cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sampling import PAGE_SIZE, Batch  # noqa: E402


SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def per_call(fn, repeats: int = 50) -> float:  # type: ignore[no-untyped-def]
    """Seconds per call, the median of `repeats` timed calls after two untimed ones."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ops() -> None:
    from kvfence.engine.attention import build_attention_batch, paged_attention
    from kvfence.kernels.cpu import attention as cpu_attention, gemm as cpu_gemm

    print(f"{'threads':>8}{'M':>5}" + "".join(f"{name:>18}" for name in SHAPES) + "   (GFLOP/s packed / oneDNN)")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for m in (1, 4, 16, 128):
            cells = []
            for n, k in SHAPES.values():
                w, x = torch.randn(n, k), torch.randn(m, k)
                packed, onednn = cpu_gemm.PackedWeight(w), torch.ops.mkldnn._reorder_linear_weight(w, None)
                flops = 2 * m * n * k
                mine = flops / per_call(lambda: packed(x)) / 1e9
                theirs = flops / per_call(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [],
                                                                                      "")) / 1e9
                cells.append(f"{mine:7.1f} / {theirs:5.1f}")
            print(f"{threads:>8}{m:>5}" + "".join(f"{c:>18}" for c in cells))
    torch.set_num_threads(2)
    pages, page_size, kv_heads, group, head_dim, batch, keys_per_seq = 400, 16, 3, 3, 64, 16, 143
    layer = torch.randn(pages, 2, kv_heads, page_size, head_dim)
    keys, values = layer[:, 0], layer[:, 1]
    need = -(-keys_per_seq // page_size)
    order = (torch.randperm(pages - 1) + 1).tolist()
    step = build_attention_batch(page_size, [(order[i * need:(i + 1) * need], keys_per_seq) for i in range(batch)],
                                 [], torch.device("cpu"))
    q = torch.randn(batch, kv_heads * group, head_dim)
    tables = cpu_attention.DecodeTables.checked(step.decode_page_table, step.decode_kv_lens, pages, page_size)
    mine = per_call(lambda: cpu_attention.decode_attention(q, keys, values, tables, head_dim ** -0.5))
    theirs = per_call(lambda: paged_attention(q, keys, values, step))
    print(f"\ndecode attention, {batch} sequences x {keys_per_seq} keys, {kv_heads} KV heads x {group} queries, "
          f"2 threads: CPU kernel {mine * 1e6:.0f} us, torch path {theirs * 1e6:.0f} us ({theirs / mine:.1f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--ops", action="store_true", help="each kernel alone instead of whole steps")
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit(f"the CPU kernels are unavailable here: {cpu_kernels.unavailable_reason()}")
    if args.ops:
        return ops()
    sizes = [int(b) for b in args.batches.split(",")]
    checkpoint = load_model_spec(None, kvfence_home(), progress=False)
    fast = LlamaModel(checkpoint, torch.float32)
    per_op = LlamaModel(checkpoint, torch.float32)
    per_op.fused_layers = None
    slow = LlamaModel(checkpoint, torch.float32, cpu_kernels=False)
    pages_per_seq = -(-(args.prompt_tokens + args.steps * 3 + 8) // PAGE_SIZE)
    pool = KVPool(fast.config, sum(sizes) * pages_per_seq, PAGE_SIZE, torch.float32)
    runners = {"fused": ModelRunner(fast, pool), "per op": ModelRunner(per_op, pool),
               "torch": ModelRunner(slow, pool)}
    counts = LeaseTokenCounts(fast.config.vocab_size, pool.device)
    grammars = LeaseGrammars(checkpoint.tokenizer, fast.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        batches, first_page = {}, 0
        for k, size in enumerate(sizes):
            prompts = [torch.randint(100, fast.config.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
                       for _ in range(size)]
            batches[size] = Batch(runners["fused"], SamplingParams(temperature=0), 1 + k * 1000, first_page, size,
                                  pages_per_seq, prompts, counts, grammars)
            first_page += size * pages_per_seq
        times: dict[tuple[str, int], list[float]] = {(name, size): [] for name in runners for size in sizes}
        for _ in range(args.steps):
            for size, batch in batches.items():
                for name, runner in runners.items():
                    batch.runner = runner
                    t0 = time.perf_counter()
                    batch.step()
                    times[(name, size)].append(time.perf_counter() - t0)
    print(f"decode step, fp32, {torch.get_num_threads()} threads, context ≈{args.prompt_tokens + args.steps * 3 // 2} tokens, "
          f"{args.steps} steps each, every guard on, interleaved ({fast.attention.name} vs {slow.attention.name} "
          "attention)")
    print(f"{'batch':>6}{'layer calls ms':>16}{'op calls ms':>13}{'torch+oneDNN ms':>17}"
          f"{'vs op calls':>13}{'vs torch':>10}")
    for size in sizes:
        f, k, o = (statistics.median(times[(name, size)][2:]) * 1e3 for name in runners)
        print(f"{size:>6}{f:>16.2f}{k:>13.2f}{o:>17.2f}{k / f:>12.2f}x{o / f:>9.2f}x")


if __name__ == "__main__":
    main()
