#!/usr/bin/env python
"""What logprobs, penalties and a JSON-schema grammar cost on a batch-16 decode step of the real model.

Each configuration decodes its own 16 sequences (prompts of --prompt-tokens tokens, greedy), and the
configurations take turns step by step, so machine noise and drift fall on all of them alike. A
step is timed as a worker runs it: the per-lease bookkeeping (penalty counts, grammar matchers)
plus the forward and the sampling. Prints ms per step (median) and the cost over plain greedy.

    .venv/bin/python scripts/bench_sampling.py [--batch 16] [--steps 40] [--prompt-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvfence.app.config.config import PoolsConfig
from kvfence.app.config.environment import kvfence_home
from kvfence.engine.grammar import LeaseGrammars, grammar_spec
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.registry import build_model
from kvfence.engine.loading import load_model_spec
from kvfence.engine.runner import ModelRunner, SeqWork
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.token_counts import LeaseTokenCounts

PAGE_SIZE = PoolsConfig().page_size_tokens
# a first string of at least 400 characters, so no output completes the grammar within the steps
SCHEMA = {"type": "object", "required": ["name", "age", "tags"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "minLength": 400}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
CONFIGS = {
    "plain greedy": SamplingParams(temperature=0),
    "logprobs, top 20": SamplingParams(temperature=0, logprobs=20),
    "penalties (3 kinds)": SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.5,
                                          repetition_penalty=1.2),
    "json-schema grammar": SamplingParams(temperature=0, grammar=grammar_spec("json_schema", SCHEMA, strict=True)),
    "all of them": SamplingParams(temperature=0, logprobs=20, presence_penalty=0.5, frequency_penalty=0.5,
                                  repetition_penalty=1.2, grammar=grammar_spec("json_schema", SCHEMA, strict=True)),
}


class Batch:
    """16 sequences decoding under one SamplingParams, with the worker's per-lease state."""

    def __init__(self, runner: ModelRunner, params: SamplingParams, first_lease: int, first_page: int, batch: int,
                 pages_per_seq: int, prompts: list[list[int]], counts: LeaseTokenCounts, grammars: LeaseGrammars) -> None:
        self.runner, self.params, self.counts, self.grammars = runner, params, counts, grammars
        self.leases = [first_lease + i for i in range(batch)]
        self.tables = [list(range(first_page + i * pages_per_seq, first_page + (i + 1) * pages_per_seq))
                       for i in range(batch)]
        self.prompt_tokens = len(prompts[0])
        for lease, table in zip(self.leases, self.tables):
            runner.pool.assign(table, lease)
        out = runner.step([self._work(lease, table, p, 0, history=[]) for lease, table, p in
                           zip(self.leases, self.tables, prompts)])
        self.last: list[int] = out.tokens  # type: ignore[assignment]
        self.context = self.prompt_tokens
        self.step_s: list[float] = []

    def _work(self, lease: int, table: list[int], tokens: list[int], position: int, history: list[int] | None) -> SeqWork:
        p = self.params
        counts = self.counts.observe(lease, position, tokens, history, self.prompt_tokens) if p.penalized else None
        grammar = (self.grammars.observe(lease, p.grammar, position, tokens, history, self.prompt_tokens)
                   if p.grammar is not None else None)
        return SeqWork.local(token_ids=tokens, context_tokens=position, page_table=table, lease=lease, sampling=p,
                       output_index=max(0, position + len(tokens) - self.prompt_tokens), counts=counts, grammar=grammar)

    def step(self) -> None:
        t0 = time.perf_counter()
        works = [self._work(lease, table, [t], self.context, None)
                 for lease, table, t in zip(self.leases, self.tables, self.last)]
        out = self.runner.step(works)
        self.step_s.append(time.perf_counter() - t0)
        if out.violations:
            raise RuntimeError(f"a check refused the benchmark's own reads: {out.violations[:1]}")
        self.last = out.tokens  # type: ignore[assignment]
        self.context += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    args = ap.parse_args()
    checkpoint = load_model_spec(None, kvfence_home(), progress=False)
    model = build_model(checkpoint, torch.float32)
    pages_per_seq = -(-(args.prompt_tokens + args.steps + 2) // PAGE_SIZE)
    pool = KVPool(model.config, len(CONFIGS) * args.batch * pages_per_seq, PAGE_SIZE, torch.float32)
    runner = ModelRunner(model, pool)
    counts = LeaseTokenCounts(model.config.vocab_size, pool.device)
    grammars = LeaseGrammars(checkpoint.tokenizer, model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, model.config.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
               for _ in range(args.batch)]
    with torch.inference_mode():
        batches = {name: Batch(runner, params, 1 + k * 1000, k * args.batch * pages_per_seq, args.batch, pages_per_seq,
                               prompts, counts, grammars) for k, (name, params) in enumerate(CONFIGS.items())}
        for _ in range(args.steps):
            for b in batches.values():
                b.step()
    print(f"batch {args.batch}, prompts of {args.prompt_tokens} tokens, {args.steps} decode steps each, fp32, "
          f"{torch.get_num_threads()} threads, configurations interleaved step by step")
    base = statistics.median(batches["plain greedy"].step_s[2:])
    print(f"{'sampling':<22}{'ms/step p50':>12}{'cost':>10}")
    for name, b in batches.items():
        ms = statistics.median(b.step_s[2:])
        print(f"{name:<22}{ms * 1e3:>12.2f}{(ms / base - 1) * 100:>+9.1f}%")


if __name__ == "__main__":
    main()
