#!/usr/bin/env python
"""Load generator for any OpenAI-compatible server: TTFT, inter-token latency, output tokens/s.

Also reports, for kvfence servers, the mean KV hand-off per level (prefill done -> KV landed in
the decode pool, from /metrics' kvfence_kv_handoff_seconds).

Sends streaming /v1/completions requests (--chat: /v1/chat/completions, one user message) with
`ignore_eos` so every request produces exactly --output-tokens tokens; --extra adds JSON fields
to every body (e.g. '{"cache_prompt": false}' for llama.cpp's server). Either a fixed number of requests in flight (--concurrency, a list runs
each level in turn) or an open-loop Poisson arrival rate (--request-rate, requests/s).

  .venv/bin/python scripts/bench_serve.py --url http://127.0.0.1:8000 --concurrency 1,4,16 \
      --prompt-tokens 128 --output-tokens 64 --requests 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

WORDS = ("time river stone light house garden music paper window story morning forest silver "
         "bridge letter summer market friend number circle").split()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, rng: random.Random) -> dict:
    prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_tokens))
    chat = getattr(args, "chat", False)
    body = {"model": args.model, "max_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, **json.loads(getattr(args, "extra", None) or "{}"),
            **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})}
    start = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"error": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choice = (chunk.get("choices") or [{}])[0]
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                stamps.append(time.perf_counter())
    end = time.perf_counter()
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft": stamps[0] - start if stamps else float("nan"), "itl": itl, "latency": end - start,
            "chunks": len(stamps)}


async def handoff_totals(client: httpx.AsyncClient) -> tuple[float, float]:
    """(sum of seconds, count) of kvfence_kv_handoff_seconds (prefill done -> KV landed in the
    decode pool) from /metrics; (0, 0) for servers without it (colocated, or not kvfence)."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return 0.0, 0.0
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("kvfence_kv_handoff_seconds_sum", "kvfence_kv_handoff_seconds_count"):
            found[name.rsplit("_", 1)[1]] = float(value)
    return found.get("sum", 0.0), found.get("count", 0.0)


async def run_level(args: argparse.Namespace, concurrency: int | None, rate: float | None) -> dict:
    rng = random.Random(0)
    # a fresh connection per request with `no_keepalive` (llama.cpp's server may close an idle one
    # just as a client reuses it)
    limits = httpx.Limits(max_connections=(concurrency or 256) + 4,
                          max_keepalive_connections=0 if getattr(args, "no_keepalive", False) else None)
    async with httpx.AsyncClient(base_url=args.url, timeout=600, limits=limits) as client:
        handoff_before = await handoff_totals(client)
        results: list[dict] = []
        start = time.perf_counter()
        if concurrency is not None:
            queue = list(range(args.requests))

            async def worker() -> None:
                while queue:
                    queue.pop()
                    results.append(await one_request(client, args, rng))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            tasks = []
            for _ in range(args.requests):
                tasks.append(asyncio.create_task(one_request(client, args, rng)))
                await asyncio.sleep(rng.expovariate(rate))  # type: ignore[arg-type]
            results = list(await asyncio.gather(*tasks))
        wall = time.perf_counter() - start
        handoff_after = await handoff_totals(client)
    transfers = handoff_after[1] - handoff_before[1]
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    return {"ok": len(ok), "errors": len(results) - len(ok), "wall_s": wall,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
            "output_tok_s": len(ok) * args.output_tokens / wall,
            "handoff_mean_s": (handoff_after[0] - handoff_before[0]) / transfers if transfers else float("nan"),
            "mean_latency_s": statistics.fmean(r["latency"] for r in ok) if ok else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    ap.add_argument("--request-rate", type=float, default=None, help="open loop, requests/s (overrides --concurrency)")
    ap.add_argument("--requests", type=int, default=32, help="requests per level")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="approximate prompt length (one word ≈ one token)")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--chat", action="store_true", help="chat completions instead of completions")
    ap.add_argument("--extra", default="", help="JSON object of fields added to every request body")
    args = ap.parse_args()
    levels = [(None, args.request_rate)] if args.request_rate else \
        [(int(c), None) for c in args.concurrency.split(",")]
    print(f"{args.url}  prompt≈{args.prompt_tokens}  output={args.output_tokens}  requests/level={args.requests}")
    print(f"{'level':>10}{'ok':>5}{'err':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}"
          f"{'out tok/s':>11}{'handoff ms':>12}")
    for concurrency, rate in levels:
        r = asyncio.run(run_level(args, concurrency, rate))
        label = f"c={concurrency}" if concurrency else f"{rate}/s"
        print(f"{label:>10}{r['ok']:>5}{r['errors']:>5}{r['ttft_p50']:>10.3f}{r['ttft_p99']:>10.3f}"
              f"{r['itl_p50'] * 1000:>9.1f}m{r['itl_p99'] * 1000:>9.1f}m{r['output_tok_s']:>11.1f}"
              f"{r['handoff_mean_s'] * 1000:>12.1f}", flush=True)


if __name__ == "__main__":
    main()
