#!/usr/bin/env python
"""What kvfence's isolation guards cost: the same server with every guard on and every guard off,
side by side, taking turns.

Both servers are the default one (disaggregated: a prefill and a decode worker in one process, the
KV moved over tcp) with `--canary-interval 3600` (an idle server does nothing while the other is
measured) and `--no-prefix-cache`, plus whatever flags follow `--`. Both are started through Python
(`app/serve/server.serve`, in a process of their own), one with `Guards()`, the other with `Guards.none()`:
no owner-tag check, no page digests, no push capabilities, no sealing (the same records in clear
after the handshake), no scrub of freed pages. No flag, setting or variable can do that
(app/serve/guards.py): only code that assembles a server.

Both load while the other loads, then warm up; then, --rounds times, each serves --requests
streamed chat completions at --concurrency streams (scripts/bench_serve.py's `run_level`), the one
that goes first alternating every round, every prompt unique (a random tag first, so neither server
can reuse any KV). Printed per round: tok/s, TTFT p50, ITL p50 and the server process's CPU time
per output token (every thread: the guards' work wherever it runs) of both, the tok/s ratio on/off
and the CPU ratio off/on; then the median of each. Where the server keeps every core busy (16
streams on two cores: the compute thread's OpenMP team spins between steps) the two ratios are the
same number; below that, the CPU ratio is the guards' cost where the rate cannot show it.

  .venv/bin/python scripts/bench_guards.py                            # 5 rounds of 64 requests at 16 streams
  .venv/bin/python scripts/bench_guards.py --rounds 2 --requests 16   # a smoke run
  .venv/bin/python scripts/bench_guards.py -- --dtype bfloat16        # flags after -- go to both servers
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
import bench_serve  # noqa: E402
from local_server import free_port, stop, wait_ready  # noqa: E402

SERVER_FLAGS = ("--canary-interval", "3600", "--no-prefix-cache")
SIDES = ("on", "off")


def serve_in_this_process(flags: list[str], guarded: bool) -> int:
    """`kvfence serve *flags`, here, with every guard on (`guarded`) or every guard off."""
    import logging

    import anyio

    from kvfence.app.config.config import ServeConfig, load_config
    from kvfence.app.config.environment import kvfence_home
    from kvfence.app.config.settings import add_flags
    from kvfence.app.serve.guards import Guards
    from kvfence.app.serve.server import serve
    from kvfence.engine.checkpoint import load_checkpoint
    from kvfence.engine.compute import confine_to_one_intra_op_thread
    from kvfence.engine.loading import checkpoint_cache
    from kvfence.engine.known_models import resolve_model, served_name

    intra_op_threads = confine_to_one_intra_op_thread()  # before any torch op, as `kvfence serve` does
    parser = argparse.ArgumentParser(prog="kvfence serve")
    add_flags(parser, ServeConfig)
    config = load_config(vars(parser.parse_args(flags)), os.environ, None)
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    home = kvfence_home()
    checkpoint = load_checkpoint(resolve_model(config.model, home), cache_dir=checkpoint_cache(home))
    name = config.served_model_name or served_name(config.model)
    return anyio.run(serve, config, checkpoint, name, intra_op_threads, Guards() if guarded else Guards.none())


def launch(side: str, flags: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """A server process of `side` ("on": every guard on; "off": every guard off) on a free port:
    (process, URL), not yet ready."""
    port = free_port()
    code = (f"import sys; sys.path.insert(0, {str(SCRIPTS)!r}); import bench_guards; "
            f"sys.exit(bench_guards.serve_in_this_process({[*flags, '--port', str(port)]!r}, {side == 'on'}))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc, f"http://127.0.0.1:{port}"


class _UniquePrompts:
    """An httpx client whose every streamed request starts its prompt with a fresh random tag."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def stream(self, method: str, url: str, *, json: dict, **kwargs: Any) -> Any:
        tag = secrets.token_hex(6)
        if "messages" in json:
            first, *rest = json["messages"]
            json = {**json, "messages": [{**first, "content": f"{tag} {first['content']}"}, *rest]}
        else:
            json = {**json, "prompt": f"{tag} {json['prompt']}"}
        return self._client.stream(method, url, json=json, **kwargs)


def unique_prompts() -> None:
    """Every request bench_serve sends from now on starts with a random tag: its seeded prompts
    repeat across runs, and no server may serve one request from another's KV."""
    send = bench_serve.one_request

    async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, rng: Any) -> dict:
        return await send(_UniquePrompts(client), args, rng)  # type: ignore[arg-type]

    bench_serve.one_request = one_request


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid`, every thread of it, so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(bench: argparse.Namespace, concurrency: int, pid: int | None = None) -> dict:
    """bench_serve's level; with `pid`, also the server's CPU seconds per output token over it."""
    before = cpu_seconds(pid) if pid is not None else 0.0
    result = asyncio.run(bench_serve.run_level(bench, concurrency, None))
    if pid is not None:
        tokens = result["output_tok_s"] * result["wall_s"]
        result["cpu_ms_per_token"] = (cpu_seconds(pid) - before) * 1000 / max(tokens, 1)
    return result


def describe(r: dict) -> str:
    errors = f", {r['errors']} errors" if r["errors"] else ""
    return (f"{r['output_tok_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50']:6.3f} s  ITL p50 {r['itl_p50'] * 1000:6.1f} ms"
            f"  CPU {r['cpu_ms_per_token']:5.2f} ms/token{errors}")


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=16, help="streams in flight")
    ap.add_argument("--requests", type=int, default=64, help="requests per server per round")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="approximate prompt length (words)")
    ap.add_argument("--output-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    flags = [*SERVER_FLAGS, *extra]
    logs = Path(tempfile.mkdtemp(prefix="bench_guards-"))
    print(f"kvfence serve {' '.join(flags)}, every guard on and every guard off; logs in {logs}", flush=True)
    servers = {side: launch(side, flags, logs / f"guards-{side}.log") for side in SIDES}
    try:
        for side, (proc, url) in servers.items():
            wait_ready(proc, url, logs / f"guards-{side}.log")
        model = httpx.get(servers["on"][1] + "/v1/models").json()["data"][0]["id"]
        unique_prompts()
        benches = {side: argparse.Namespace(url=url, model=model, requests=args.requests, chat=True, extra="",
                                            prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens)
                   for side, (_, url) in servers.items()}
        for bench in benches.values():  # warm-up: both start cold
            measure(argparse.Namespace(**{**vars(bench), "requests": args.concurrency}), args.concurrency)
        print(f"{args.rounds} rounds of {args.requests} chat streams per server at {args.concurrency} in flight, "
              f"≈{args.prompt_tokens} prompt words, {args.output_tokens} tokens each")
        ratios: list[float] = []
        cpu_ratios: list[float] = []
        speeds: dict[str, list[float]] = {side: [] for side in SIDES}
        for i in range(args.rounds):
            order = SIDES if i % 2 == 0 else SIDES[::-1]  # who goes first alternates
            results = {side: measure(benches[side], args.concurrency, servers[side][0].pid) for side in order}
            for side in SIDES:
                speeds[side].append(results[side]["output_tok_s"])
            ratios.append(results["on"]["output_tok_s"] / results["off"]["output_tok_s"])
            cpu_ratios.append(results["off"]["cpu_ms_per_token"] / results["on"]["cpu_ms_per_token"])
            print(f"round {i + 1}  guards on: {describe(results['on'])}  |  guards off: {describe(results['off'])}"
                  f"  |  on/off {ratios[-1]:.3f}, by CPU {cpu_ratios[-1]:.3f}", flush=True)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    print(f"median over {len(ratios)} rounds: guards on {statistics.median(speeds['on']):.1f} tok/s, guards off "
          f"{statistics.median(speeds['off']):.1f} tok/s; on/off {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)}); by CPU time per token (off/on) "
          f"{statistics.median(cpu_ratios):.3f} (rounds: {', '.join(f'{r:.3f}' for r in cpu_ratios)})")


if __name__ == "__main__":
    main()
