#!/usr/bin/env python
"""Two tenants, one flooding: the quiet one's time to first token, alone and beside the flood.

Starts `kvfence serve` (the default model; `--server-arg` adds flags) with an API keys file of two
tenants, "flood" and "quiet". First the quiet tenant sends `--probes` short streamed chats one
after another, alone; then the flood tenant keeps `--flood` streamed chats of `--flood-tokens`
tokens in flight (more than the server's running slots, so its requests queue; from a process of
its own; `--flood-words` makes their prompts long) while the quiet tenant sends the same probes
again, one a second. Every prompt is unique (no prefix-cache hit on either side). Prints the quiet
tenant's p50 / p99 time to first token in both phases and their ratio, and how many of the flood's
prompt steps were cut for a quiet first token (`kvfence_steps_cut`).

    .venv/bin/python scripts/bench_fairness.py [--probes 20] [--flood 24] [--server-arg=--max-running=8]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import multiprocessing.synchronize
import re
import secrets
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_server import MODEL, percentile, start, stop, write_keys  # noqa: E402

_unique = itertools.count()


async def ttft(http: httpx.AsyncClient, key: str, max_tokens: int, words: int = 0) -> float | None:
    """One streamed chat with a unique prompt (`words` more words of filler before its question);
    its time to the first chunk with content."""
    filler = " ".join(secrets.choice(("red", "blue", "tree", "stone", "river", "cloud")) for _ in range(words))
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user",
                          "content": f"Request {next(_unique)} {secrets.token_hex(4)}: {filler} name a colour."}]}
    t0 = time.monotonic()
    async with http.stream("POST", "/v1/chat/completions", json=body,
                           headers={"authorization": f"Bearer {key}"}) as r:
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                if any(c.get("delta", {}).get("content") for c in json.loads(line[6:]).get("choices", [])):
                    first = time.monotonic() - t0
        return first


async def flood(url: str, key: str, args: argparse.Namespace, stop: multiprocessing.synchronize.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async def flooder() -> None:
            while not stop.is_set():
                await ttft(http, key, args.flood_tokens, args.flood_words)

        await asyncio.gather(*(flooder() for _ in range(args.flood)))


def flood_process(url: str, key: str, args: argparse.Namespace, stop: multiprocessing.synchronize.Event) -> None:
    """The flooding tenant's client: a process of its own, as another tenant's client would be, so
    reading its streams never delays the quiet client's reads."""
    asyncio.run(flood(url, key, args, stop))


async def measure(url: str, keys: dict[str, str], args: argparse.Namespace) -> tuple[list[float], list[float]]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        # Warm up: the first steps of each batch shape after start are several times slower, and
        # three short requests left some of them to the alone phase's probes.
        await asyncio.gather(*(ttft(http, keys["quiet"], 32) for _ in range(8)))
        for _ in range(8):
            await ttft(http, keys["quiet"], 8)
        alone = [t for t in [await ttft(http, keys["quiet"], 8) for _ in range(args.probes)] if t is not None]
        spawn = multiprocessing.get_context("spawn")
        stop = spawn.Event()
        flooding = spawn.Process(target=flood_process, args=(url, keys["flood"], args, stop))
        flooding.start()
        await asyncio.sleep(args.warmup)
        beside = []
        for _ in range(args.probes):
            t = await ttft(http, keys["quiet"], 8)
            if t is not None:
                beside.append(t)
            await asyncio.sleep(1.0)
        stop.set()
        flooding.join(600)
    return alone, beside


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--flood", type=int, default=24, help="flood requests kept in flight")
    parser.add_argument("--flood-tokens", type=int, default=64)
    parser.add_argument("--flood-words", type=int, default=0, help="filler words in each flood prompt (long prompts)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of flood before the quiet probes")
    parser.add_argument("--server-arg", action="append", default=[])
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp())
    keys = write_keys(workdir / "keys.toml", ["flood", "quiet"], admin=True)
    proc, url = start(["--api-keys", str(workdir / "keys.toml"), "--canary-interval", "3600", *args.server_arg],
                      workdir / "server.log")
    try:
        alone, beside = asyncio.run(measure(url, keys, args))
        metrics = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {keys['admin']}"}, timeout=10).text
    finally:
        stop(proc)
    cuts = sum(float(v) for v in re.findall(r"^kvfence_steps_cut_total\{[^}]*\} (\S+)$", metrics, re.M))
    a50, a99, b50, b99 = (percentile(alone, 0.5), percentile(alone, 0.99), percentile(beside, 0.5),
                          percentile(beside, 0.99))
    print(f"quiet tenant, time to first token (s): alone p50 {a50:.3f} p99 {a99:.3f} ({len(alone)}); "
          f"beside {args.flood} flood streams p50 {b50:.3f} p99 {b99:.3f} ({len(beside)}); p99 ratio {b99 / a99:.2f}")
    print("slowest beside the flood (s):", " ".join(f"{t:.3f}" for t in sorted(beside)[-8:]))
    print(f"steps of the flood's prompts cut for a quiet first token: {cuts:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
