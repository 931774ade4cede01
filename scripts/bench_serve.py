#!/usr/bin/env python
"""Load generator for any OpenAI-compatible server: TTFT, inter-token latency, output tokens/s.

Also reports, for kvfence servers, the mean KV hand-off per level (prefill done -> KV landed in
the decode pool, from /metrics' kvfence_kv_handoff_seconds).

Sends streaming /v1/completions requests (--chat: /v1/chat/completions, one user message) with
`ignore_eos` so every request produces exactly --output-tokens tokens, and
`stream_options: {"include_usage": true}` so the last chunk reports the prompt tokens the server
served from its prefix cache (`usage.prompt_tokens_details.cached_tokens`; llama.cpp's server also
sends `timings.cache_n`). --extra adds JSON fields to every body (e.g. '{"cache_prompt": false}'
for llama.cpp's server). Either a fixed number of requests in flight (--concurrency, a list runs
each level in turn) or an open-loop Poisson arrival rate (--request-rate, requests/s).

Prompts are unique: each starts with a fresh random hex tag (48 bits, from `secrets`), then
≈--prompt-tokens random words, so no two requests in a process share a prompt prefix beyond the
chat template's, and a prefix cache cannot turn repeated prompts into a speed-up.
--fixed-prompts (`fixed_prompts` on the namespace) restores the old behaviour: no tag, and the
same seeded word sequence at every level.

  .venv/bin/python scripts/bench_serve.py --url http://127.0.0.1:8000 --concurrency 1,4,16 \
      --prompt-tokens 128 --output-tokens 64 --requests 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
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


def token_counts(chunk: dict) -> tuple[int | None, int | None, int | None]:
    """(prompt tokens, of them served from a prefix cache, completion tokens) as one streamed chunk
    reports them: OpenAI's `usage` (with `prompt_tokens_details.cached_tokens`), else llama.cpp's
    `timings` (`prompt_n` evaluated + `cache_n` reused); None where the chunk says nothing."""
    usage, timings = chunk.get("usage") or {}, chunk.get("timings") or {}
    prompt = usage.get("prompt_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None and "cache_n" in timings:
        cached = timings["cache_n"]
        prompt = prompt if prompt is not None else timings.get("prompt_n", 0) + cached
    return prompt, cached, usage.get("completion_tokens")


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, rng: random.Random) -> dict:
    # The tag comes first so that no two prompts share a prefix: a prefix cache has nothing to hit.
    tag = None if getattr(args, "fixed_prompts", False) else secrets.token_hex(6)
    prompt = " ".join(([tag] if tag else []) + [rng.choice(WORDS) for _ in range(args.prompt_tokens)])
    chat = getattr(args, "chat", False)
    body = {"model": args.model, "max_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            **json.loads(getattr(args, "extra", None) or "{}"),
            **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})}
    reported: dict = {}
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
            for key, value in zip(("prompt_tokens", "cached_tokens", "completion_tokens"), token_counts(chunk)):
                if value is not None:
                    reported[key] = value
    end = time.perf_counter()
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"tag": tag, "ttft": stamps[0] - start if stamps else float("nan"), "itl": itl, "latency": end - start,
            "chunks": len(stamps), "prompt_tokens": reported.get("prompt_tokens"),
            "cached_tokens": reported.get("cached_tokens"), "completion_tokens": reported.get("completion_tokens")}


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


def reported_sum(results: list[dict], key: str) -> int | None:
    """The sum of a per-request count over `results`; None unless every request reported it."""
    values = [r.get(key) for r in results]
    return sum(values) if values and None not in values else None  # type: ignore[arg-type]


async def run_level(args: argparse.Namespace, concurrency: int | None, rate: float | None) -> dict:
    """One level of load. The result's `cached_tokens` / `prompt_tokens` / `completion_tokens` are
    the level's sums as the server reported them (None if any request did not say); `requests`
    holds each request's tag, TTFT, latency and counts."""
    rng = random.Random(0) if getattr(args, "fixed_prompts", False) else random.Random(secrets.randbits(64))
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
            "mean_latency_s": statistics.fmean(r["latency"] for r in ok) if ok else float("nan"),
            "prompt_tokens": reported_sum(ok, "prompt_tokens"), "cached_tokens": reported_sum(ok, "cached_tokens"),
            "completion_tokens": reported_sum(ok, "completion_tokens"),
            "requests": [{k: v for k, v in r.items() if k != "itl"} for r in results]}


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
    ap.add_argument("--fixed-prompts", action="store_true",
                    help="no random tag: the same seeded prompts at every level (a prefix cache will hit them)")
    args = ap.parse_args()
    levels = [(None, args.request_rate)] if args.request_rate else \
        [(int(c), None) for c in args.concurrency.split(",")]
    print(f"{args.url}  prompt≈{args.prompt_tokens}  output={args.output_tokens}  requests/level={args.requests}")
    print(f"{'level':>10}{'ok':>5}{'err':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}"
          f"{'out tok/s':>11}{'handoff ms':>12}{'cached/prompt tok':>19}")
    for concurrency, rate in levels:
        r = asyncio.run(run_level(args, concurrency, rate))
        label = f"c={concurrency}" if concurrency else f"{rate}/s"
        print(f"{label:>10}{r['ok']:>5}{r['errors']:>5}{r['ttft_p50']:>10.3f}{r['ttft_p99']:>10.3f}"
              f"{r['itl_p50'] * 1000:>9.1f}m{r['itl_p99'] * 1000:>9.1f}m{r['output_tok_s']:>11.1f}"
              f"{r['handoff_mean_s'] * 1000:>12.1f}{str(r['cached_tokens']) + '/' + str(r['prompt_tokens']):>19}",
              flush=True)


if __name__ == "__main__":
    main()
