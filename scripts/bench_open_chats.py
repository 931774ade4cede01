#!/usr/bin/env python
"""Sixteen official-client chats without max_tokens against a server on its default settings:
does every one finish, and none end mid-stream?

Starts `kvfence serve` with no flags but its port and `--canary-interval 3600` (`--server-arg`
adds more), sends `--chats` streamed chats at once with the openai client's defaults (no
max_tokens, temperature 1), each with a prompt of its own, and prints for each how it ended, how
many tokens it streamed and how long it took, then the server's preemption count.

    .venv/bin/python scripts/bench_open_chats.py [--chats 16]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_server import MODEL, start, stop  # noqa: E402

TOPICS = ["a lighthouse", "a bakery", "the moon", "a river", "an old map", "a violin", "a winter garden", "a robot",
          "a train station", "a kite", "the ocean", "a library", "a volcano", "a fox", "a clock tower", "a desert"]


async def chat(c: openai.AsyncOpenAI, k: int) -> tuple[str, int, float]:
    t0 = time.monotonic()
    stream = await c.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                             messages=[{"role": "user", "content": f"Tell me a story about "
                                                        f"{TOPICS[k % len(TOPICS)]} ({k})."}])
    ending, tokens = "no finish_reason", 0
    try:
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                ending = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except openai.APIError as e:
        ending = f"error mid-stream: {e}"
    return ending, tokens, time.monotonic() - t0


async def run(url: str, n: int) -> list[tuple[str, int, float]]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600) as c:
        return await asyncio.gather(*(chat(c, k) for k in range(n)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--server-arg", action="append", default=[])
    args = parser.parse_args()
    proc, url = start(["--canary-interval", "3600", *args.server_arg], Path(tempfile.mkdtemp()) / "server.log")
    try:
        results = asyncio.run(run(url, args.chats))
        metrics = httpx.get(url + "/metrics", timeout=10).text
    finally:
        stop(proc)
    for k, (ending, tokens, seconds) in enumerate(results):
        print(f"chat {k:2d}: {ending}, {tokens} tokens, {seconds:.1f} s")
    preempted = re.search(r"^kvfence_preemptions_total (\S+)$", metrics, re.M)
    finished = sum(1 for ending, _, _ in results if ending in ("stop", "length"))
    print(f"{finished} of {len(results)} finished; preemptions: {preempted.group(1) if preempted else '?'}")
    return 0 if finished == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
