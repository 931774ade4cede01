#!/usr/bin/env python
"""How long a grammar bomb takes to be refused, while another stream runs: the time to each 400,
and the longest gap between the stream's chunks meanwhile.

Starts `kvfence serve` (defaults; `--server-arg` adds flags), starts one long streamed chat, and
sends each bomb of scripts/soak.py `--repeat` times (a new variant each time, so no cache answers:
the pattern's count, or an alternative added), one after another, while it streams.

    .venv/bin/python scripts/bench_bombs.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_server import MODEL, start, stop  # noqa: E402
from soak_hostile import BOMBS  # noqa: E402

NAMES = ["a{20000} in response_format", "a{20000} in 20 tools (tool_choice none)", "40 slow alternatives"]


def variant(bomb: dict, k: int) -> dict:
    bomb = copy.deepcopy(bomb)
    text = json.dumps(bomb).replace("a{20000}", f"a{{{20000 + k}}}").replace("){200}", f"){{{200 + k}}}", 1)
    return json.loads(text)


async def measure(url: str, repeat: int) -> tuple[dict[str, list[float]], float]:
    gaps: list[float] = []
    times: dict[str, list[float]] = {name: [] for name in NAMES}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        done = asyncio.Event()

        async def stream() -> None:
            body = {"model": MODEL, "stream": True, "max_tokens": 4000, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "Count to a thousand."}]}
            last = None
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    now = time.monotonic()
                    if line.startswith("data: ") and last is not None and not done.is_set():
                        gaps.append(now - last)
                    last = now
                    if done.is_set():
                        return

        task = asyncio.create_task(stream())
        await asyncio.sleep(3)
        for k in range(repeat):
            for name, bomb in zip(NAMES, BOMBS):
                body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                        **variant(bomb, k)}
                t0 = time.monotonic()
                r = await http.post("/v1/chat/completions", json=body)
                times[name].append(time.monotonic() - t0)
                assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_too_complex", r.text
        done.set()
        await task
    return times, max(gaps, default=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--server-arg", action="append", default=[])
    args = parser.parse_args()
    proc, url = start(["--canary-interval", "3600", *args.server_arg], Path(tempfile.mkdtemp()) / "server.log")
    try:
        time.sleep(5)  # the probes start in the background
        times, gap = asyncio.run(measure(url, args.repeat))
    finally:
        stop(proc)
    for name, values in times.items():
        each = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name}: 400 after median {statistics.median(values):.3f} s, max {max(values):.3f} s ({each})")
    print(f"longest gap between the other stream's chunks meanwhile: {gap:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
