#!/usr/bin/env python
"""How many chat requests without `max_tokens` run at once with the default KV pools.

A request without max_tokens may generate up to the whole context. Reserving that up front lets
only pool / context of them run (4 with the default decode pool of 4 contexts); growing decode
pages with the sequence lets max_running of them run. Two measures:

  bookkeeping (default): the scheduler alone, no model step, on pools sized exactly as
  `kvfence serve` sizes them by default for the model (app/serve/sizing.py): submit --requests chat
  prompts without max_tokens and count how many hold pages (running) and how many wait.

      .venv/bin/python scripts/bench_capacity.py --requests 64

  --url: a running server: --requests concurrent streaming chat requests without max_tokens;
  each reads --read-tokens chunks and then disconnects (so greedy answers that never stop do not
  run to the context). Reports the most that streamed at once (first chunk seen, not yet done).

      .venv/bin/python scripts/bench_capacity.py --url http://127.0.0.1:8000 --requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import types

QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "Explain gravity simply.",
             "Name three prime numbers.", "What is a KV cache?", "Tell me a short story about a fox.",
             "How do bees make honey?", "Why is the sky blue?"]


def bookkeeping(args: argparse.Namespace) -> None:
    from kvfence.app.config.config import ServeConfig
    from kvfence.app.config.environment import kvfence_home
    from kvfence.app.serve.sizing import plan_pools, resolve_context
    from kvfence.engine.checkpoint import load_checkpoint
    from kvfence.engine.known_models import resolve_model
    from kvfence.engine.sampling import SamplingParams
    from kvfence.scheduler.driver import Scheduler

    checkpoint = load_checkpoint(resolve_model(None, kvfence_home(), progress=False))
    serve = ServeConfig()
    plans = {p.role: p for p in plan_pools(serve, checkpoint.config, element_size=4)}
    context, _ = resolve_context(serve, checkpoint.config, list(plans.values()))
    config = serve.scheduler.bind(page_size_tokens=serve.pools.page_size_tokens, max_context_tokens=context,
                                  disaggregated=True, prefill_device_type="cpu")
    # Admission and reservation are synchronous: no worker is called until the driver runs.
    prefill, decode = types.SimpleNamespace(role="prefill"), types.SimpleNamespace(role="decode")
    scheduler = Scheduler(config, checkpoint.tokenizer, prefill, decode,  # type: ignore[arg-type]
                          prefill_pages=plans["prefill"].num_pages, decode_pages=plans["decode"].num_pages,
                          link=types.SimpleNamespace())  # type: ignore[arg-type]
    tok = checkpoint.tokenizer
    prompts = [tok.encode(f"<|im_start|>user\n{QUESTIONS[i % len(QUESTIONS)]}<|im_end|>\n<|im_start|>assistant\n")
               for i in range(args.requests)]
    for p in prompts:
        scheduler.submit(p, SamplingParams())  # no max_tokens: up to the context
    running = scheduler.core.num_running()
    print(f"context {context} tokens; pools: prefill {plans['prefill'].num_pages} pages, decode "
          f"{plans['decode'].num_pages} pages of {serve.page_size_tokens} tokens; max_running {serve.max_running}")
    print(f"{args.requests} chat requests without max_tokens (prompts {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens): {running} running at once, {len(scheduler.core.queue)} waiting; "
          f"decode pages reserved: {scheduler.ledger('decode').num_used}")


async def served(args: argparse.Namespace) -> None:
    import httpx

    streaming, most, ends = 0, 0, []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal streaming, most
        body = {"model": args.model, "stream": True,
                "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}
        chunks, started = 0, False
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                ends.append(f"HTTP {r.status_code}: {(await r.aread())[:120]!r}")
                return
            try:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        ends.append(f"error {chunk['error'].get('code')}")
                        return
                    if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                        if not started:
                            started, streaming = True, streaming + 1
                            most = max(most, streaming)
                        chunks += 1
                        if chunks >= args.read_tokens:
                            ends.append("read enough, disconnected")
                            return
                    if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                        ends.append(f"finished: {chunk['choices'][0]['finish_reason']}")
                        return
            finally:
                if started:
                    streaming -= 1

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=args.url, timeout=httpx.Timeout(120.0)) as client:
        await asyncio.gather(*(one(client, i) for i in range(args.requests)))
    print(f"{args.requests} concurrent streaming chats without max_tokens: at most {most} streamed at once; "
          f"{time.perf_counter() - start:.1f} s in all")
    for end in sorted(set(ends)):
        print(f"  {ends.count(end):3d} x {end}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--url", help="measure a running server instead of the scheduler's bookkeeping")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--read-tokens", type=int, default=48, help="chunks each client reads before it leaves")
    args = parser.parse_args()
    if args.url:
        asyncio.run(served(args))
    else:
        bookkeeping(args)


if __name__ == "__main__":
    main()
