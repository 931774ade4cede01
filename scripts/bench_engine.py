#!/usr/bin/env python
"""Engine throughput on this machine: prefill and decode tokens/s at several batch sizes and dtypes.

Runs the real model through ModelRunner over the paged KV pool (the default page size), greedy sampling.
Usage: .venv/bin/python scripts/bench_engine.py [--model M] [--dtypes float32,bfloat16]
       [--batches 1,8,32] [--prompt-tokens 128] [--decode-steps 32] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvfence.app.config.config import PoolsConfig
from kvfence.app.config.environment import kvfence_home
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.kv_sanitizer import KvSanitizer
from kvfence.engine.models.registry import build_model
from kvfence.engine.loading import DTYPES, load_model_spec
from kvfence.engine.runner import ModelRunner, SeqWork
from kvfence.engine.sampling import SamplingParams

PAGE_SIZE = PoolsConfig().page_size_tokens
GREEDY = SamplingParams(temperature=0.0)
LEASE = 1 << 100  # any nonzero 128-bit lease


def bench(runners: list[ModelRunner], batch: int, prompt_tokens: int, decode_steps: int,
          vocab: int) -> tuple[float, list[float]]:
    """Returns (prefill tok/s of one prompt, decode tok/s summed over the batch, one per runner).

    With several runners (same model and pool, different settings), decode steps alternate between
    them step by step, so machine noise and drift fall on all of them alike. A runner's KV
    sanitizer is told of the writes of the other runners' steps too (they share the pool)."""
    sanitizers = [r.sanitizer for r in runners if r.sanitizer is not None]
    runner = runners[0]
    pages_per_seq = -(-(prompt_tokens + decode_steps + 1) // PAGE_SIZE)
    tables = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(batch)]
    for i, table in enumerate(tables):
        runner.pool.assign(table, LEASE + i)  # the owner-tag check runs, as in serving
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, vocab, (prompt_tokens,), generator=gen).tolist() for _ in range(batch)]
    last: list[int] = []
    prefill_s = 0.0
    for i, (table, prompt) in enumerate(zip(tables, prompts)):
        t0 = time.perf_counter()
        out = runner.step([SeqWork.local(token_ids=prompt, context_tokens=0, page_table=table, lease=LEASE + i,
                                   sampling=GREEDY)])
        if i == 0:
            prefill_s = time.perf_counter() - t0
        last.append(out.tokens[0])  # type: ignore[arg-type]
        for s in sanitizers:
            if s is not runner.sanitizer:
                s.record_write(LEASE + i, table, 0, prompt_tokens)
    ctx = prompt_tokens
    spent = [0.0] * len(runners)
    steps = [0] * len(runners)
    for step in range(decode_steps + 1):
        k = step % len(runners)
        t0 = time.perf_counter()
        out = runners[k].step([SeqWork.local(token_ids=[t], context_tokens=ctx, page_table=tb, lease=LEASE + i,
                                       sampling=GREEDY)
                               for i, (t, tb) in enumerate(zip(last, tables))])
        if step > 0:  # the first step warms up
            spent[k] += time.perf_counter() - t0
            steps[k] += 1
        if out.violations:
            raise RuntimeError(f"a check refused the benchmark's own reads: {out.violations[:1]}")
        for s in sanitizers:
            if s is not runners[k].sanitizer:
                for i, tb in enumerate(tables):
                    s.record_write(LEASE + i, tb, ctx, 1)
        last = out.tokens  # type: ignore[assignment]
        ctx += 1
    return prompt_tokens / prefill_s, [batch * n / t for n, t in zip(steps, spent)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--guards", default="on", choices=["on", "off", "both"],
                    help="owner-tag check on every step (on), off, or both in alternation for a ratio")
    ap.add_argument("--sanitizer-cost", action="store_true",
                    help="also alternate a runner with the owner check and the KV sanitizer (--kv-sanitizer)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = load_model_spec(args.model, kvfence_home(), progress=False)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"model {checkpoint.source}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"prompt {args.prompt_tokens} tokens, {args.decode_steps} decode steps")
    print(f"{'dtype':<10}{'batch':>6}{'prefill tok/s':>15}{'decode tok/s':>14}")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        model = build_model(checkpoint, dtype)
        pages = max(batches) * (-(-(args.prompt_tokens + args.decode_steps + 1) // PAGE_SIZE))
        pool = KVPool(model.config, pages, PAGE_SIZE, dtype)
        checks = {"on": [True], "off": [False], "both": [True, False]}[args.guards]
        runners = [ModelRunner(model, pool, owner_check=c) for c in checks]
        if args.sanitizer_cost:
            runners.append(ModelRunner(model, pool, sanitizer=KvSanitizer(pool.num_pages, PAGE_SIZE)))
        for b in batches:
            prefill, decodes = bench(runners, b, args.prompt_tokens, args.decode_steps, model.config.vocab_size)
            print(f"{name:<10}{b:>6}{prefill:>15.0f}{decodes[0]:>14.1f}", flush=True)
            if args.guards == "both":
                print(f"{'':<10}{'':>6}{'(no check)':>15}{decodes[1]:>14.1f}   "
                      f"ratio with/without owner check: {decodes[0] / decodes[1]:.3f}", flush=True)
            if args.sanitizer_cost:
                print(f"{'':<10}{'':>6}{'(+sanitizer)':>15}{decodes[-1]:>14.1f}   "
                      f"ratio with/without sanitizer: {decodes[-1] / decodes[0]:.3f}", flush=True)


if __name__ == "__main__":
    main()
