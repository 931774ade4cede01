#!/usr/bin/env python
"""Time to first token per turn of a growing chat, with the prefix cache and without it.

One conversation (a long system prompt, then a user question per turn, each answer appended)
grows over --turns turns (each conversation opens with a line of its own, so its first turn is
cold). Every turn is sent twice, interleaved: warm (the conversation so far is
in the cache) and cold (a fresh `cache_salt`, which shares nothing: the same work as a server
without a cache). Both answers must be equal (greedy); the table gives, per turn, the prompt and
cached tokens and the median TTFT of each over --rounds conversations.

  .venv/bin/python scripts/bench_multiturn.py --url http://127.0.0.1:8000 --turns 8 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid

import httpx

SYSTEM = ("You are a careful assistant for a travel company. Answer briefly, name concrete places, "
          "and never invent prices. ") * 6
QUESTIONS = ["Where should I go in spring?", "And for a week in autumn?", "Which city has the best museums?",
             "What about food markets?", "Is it good for children?", "How do I get there by train?",
             "What should I pack?", "Give me one last tip.", "And one more?", "Thanks, anything else?"]


def turn(http: httpx.Client, model: str, messages: list[dict], max_tokens: int, salt: str | None,
         key: str | None) -> tuple[float, str, int, int]:
    """(TTFT s, answer, prompt tokens, cached tokens) of one streamed chat request."""
    body: dict = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                  "stream": True, "stream_options": {"include_usage": True}}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"authorization": f"Bearer {key}"} if key else {}
    start, first, parts, usage = time.perf_counter(), None, [], {}
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            raise SystemExit(f"HTTP {r.status_code}: {r.text}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    parts.append(choice["delta"]["content"])
    details = usage.get("prompt_tokens_details") or {}
    return (first or time.perf_counter()) - start, "".join(parts), usage.get("prompt_tokens", 0), \
        details.get("cached_tokens", 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--api-key", default=None)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args()
    rows: list[dict] = [{"turn": t + 1, "warm": [], "cold": []} for t in range(args.turns)]
    mismatches = 0
    with httpx.Client(base_url=args.url, timeout=600) as http:
        for _ in range(args.rounds):
            # a fresh opening line per conversation: its first turn is cold in every round
            messages = [{"role": "system", "content": f"Conversation {uuid.uuid4().hex[:8]}. {SYSTEM}"}]
            for t in range(args.turns):
                messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
                warm = turn(http, args.model, messages, args.max_tokens, None, args.api_key)
                cold = turn(http, args.model, messages, args.max_tokens, uuid.uuid4().hex, args.api_key)
                mismatches += warm[1] != cold[1]
                row = rows[t]
                row["warm"].append(warm[0])
                row["cold"].append(cold[0])
                row["prompt_tokens"], row["cached_tokens"] = warm[2], warm[3]
                messages.append({"role": "assistant", "content": warm[1]})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print("| turn | prompt tokens | cached tokens | TTFT cold ms | TTFT cached ms | cold / cached |")
        print("|---|---|---|---|---|---|")
        for row in rows:
            warm, cold = statistics.median(row["warm"]) * 1e3, statistics.median(row["cold"]) * 1e3
            print(f"| {row['turn']} | {row['prompt_tokens']} | {row['cached_tokens']} | {cold:.1f} | {warm:.1f} "
                  f"| {cold / warm:.2f}x |")
    print(f"answers differing between cached and cold runs: {mismatches}", file=sys.stderr)
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
