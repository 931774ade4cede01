#!/usr/bin/env python
"""The yardstick, side by side: kvfence and llama.cpp's own C++ `llama-server` on two files, all three
up at once, taking turns at every concurrency level; the median of --runs interleaved sweeps.

  .venv/bin/python scripts/bench_peer.py                       # fp32, c = 1, 4, 16, 3 runs, caches off
  .venv/bin/python scripts/bench_peer.py --cache               # prefix caches on, on all three
  .venv/bin/python scripts/bench_peer.py --dtype bfloat16      # kvfence and the converted peer in bf16
  .venv/bin/python scripts/bench_peer.py -- --disaggregation off   # flags after -- go to kvfence serve

The servers:
- kvfence: `kvfence serve` with its defaults (disaggregated over tcp, every guard on), this
  script's pool sizes (--max-context 2048, 256 prefill and 512 decode pages), no readiness canary
  during the run, `--no-prefix-cache` (with --cache: `--prefix-cache`), then whatever follows `--`.
- llama.cpp F32 (BF16 with --dtype bfloat16): llama.cpp as vendored in the `llama-cpp-python` sdist
  on PyPI (pinned below), built once with cmake + ninja (`llama-server`, `llama-quantize`) under
  $KVFENCE_HOME/peer/, outside the repo, serving the model's GGUF converted by `llama-quantize`:
  the same weights, in the same dtype, that kvfence dequantizes.
- llama.cpp Q4_1: the same `llama-server` on the model's own file, unconverted (what a llama.cpp
  user runs).
Both `llama-server`s: 16 slots, continuous batching, a 2048-token context per slot, --threads
threads (default: every core, as kvfence's compute uses). Caches off (the default): every request
carries `cache_prompt: false` and the server runs with `--no-cache-prompt`, `--cache-ram 0` (no
host-memory prompt cache) and `--cache-reuse 0` (no KV-shift reuse). With --cache: `cache_prompt:
true`, `--cache-prompt` and the server's other defaults (an 8 GiB host-memory prompt cache).

The prefix cache is the script's to set: `--prefix-cache` / `--no-prefix-cache` after `--` is refused.

Requests (scripts/bench_serve.py): streamed chat completions, one user message of a fresh random
12-hex-digit tag (≈11 tokens) followed by ≈--prompt-tokens random words, so no prompt repeats across
warm-up, levels, runs or servers (checked at the end: every tag is distinct) and the only prefix two
requests share is the chat template's (≈25 tokens: with --cache, kvfence serves its full pages of it
from the cache, llama-server all of it); exactly --output-tokens tokens each (`ignore_eos`,
temperature 0; a server reporting another completion count gets a warning); --requests per level
with that many in flight; a fresh connection per request. All three servers are warmed up first
(2x the top level's streams at the top level).

Each run sweeps the levels; at each level every server takes its turn, the order rotated by one
per level and per run, so a shared host's drift falls on all alike. Per server and level: output
tok/s (requests x --output-tokens / wall time of the level), TTFT p50/p99 (request sent -> first
content chunk), ITL p50/p99 (between content chunks, over every request), and the prompt tokens
the server says it served from a cache (`stream_options: {"include_usage": true}`, read from
`usage.prompt_tokens_details.cached_tokens`, else llama.cpp's `timings.cache_n`), summed over the
level: 0 shows a cache was really off. The table gives the median over the runs of each metric,
the tok/s range over the runs, and kvfence's tok/s ratio to each server; --json gets every run's
numbers (and each request's tag, TTFT and token counts), --plot tok/s, TTFT p99 and ITL p50
against concurrency, one line per server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvfence.app.config.environment import kvfence_home
from kvfence.engine.known_models import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402
from bench_remote import free_port, wait_for  # noqa: E402

PEER_SDIST = "llama-cpp-python==0.3.36"
POOLS = ("--max-context", "2048", "--prefill-num-pages", "256", "--decode-num-pages", "512")
SLOTS = 16
# What the table, the JSON's medians and the plot take per server and level.
METRICS = ("output_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "cached_tokens", "prompt_tokens",
           "completion_tokens", "errors")


def run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    """Run a build step; on failure, the tail of its log says why."""
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
    if done.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({done.returncode}); see {log}:\n" + log.read_text()[-3000:])


def peer_build(home: Path) -> Path:
    """The directory of the built llama.cpp binaries (built once, then reused)."""
    root = home / "peer" / PEER_SDIST.replace("==", "-")
    bin_dir = root / "build" / "bin"
    if (bin_dir / "llama-server").exists() and (bin_dir / "llama-quantize").exists():
        return bin_dir
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    print(f"building llama.cpp from the {PEER_SDIST} sdist (once; log: {log})", flush=True)
    run([sys.executable, "-m", "pip", "download", PEER_SDIST, "--no-binary", ":all:", "--no-deps", "-d",
         str(root / "sdist")], log)
    sdist = next((root / "sdist").glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(root / "src", filter="data")
    source = next((root / "src").glob("*/vendor/llama.cpp"))
    run(["cmake", "-S", str(source), "-B", str(root / "build"), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
         "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON",
         "-DBUILD_SHARED_LIBS=OFF"], log)
    run(["ninja", "-C", str(root / "build"), "llama-server", "llama-quantize"], log)
    return bin_dir


def peer_model(bin_dir: Path, model: Path, dtype: str) -> Path:
    """The model's GGUF in F32 or BF16 (converted once, beside the binaries)."""
    kind = {"float32": "F32", "bfloat16": "BF16"}[dtype]
    out = bin_dir.parent.parent / f"{model.stem}.{kind}.gguf"
    if not out.exists():
        tmp = out.with_suffix(".partial")
        run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(model), str(tmp), kind],
            bin_dir.parent.parent / "quantize.log")
        tmp.rename(out)
    return out


@dataclass(frozen=True)
class Server:
    """One server under test: how it is started, where it answers, what every request adds."""

    name: str
    cmd: list[str]
    url: str
    log: Path
    health: str  # the path that answers 200 once it serves
    extra: dict  # fields added to every request body


def up(server: Server, proc: subprocess.Popen) -> bool:
    if proc.poll() is not None:
        raise SystemExit(f"{server.name} exited ({proc.returncode}); {server.log}:\n" + server.log.read_text()[-3000:])
    try:
        return httpx.get(server.url + server.health, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def servers(args: argparse.Namespace, bin_dir: Path, model: Path, peer_gguf: Path, ours_flags: list[str],
            logs: Path) -> list[Server]:
    """kvfence, llama-server on the converted copy, llama-server on the model's own file."""
    def llama(gguf: Path, label: str) -> Server:
        port = free_port()
        cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(SLOTS), "--ctx-size", str(SLOTS * 2048), "--threads", str(args.threads),
               "--cont-batching", "--alias", args.model_name]
        # Off: no prompt caching by default, no host-memory prompt cache, no KV-shift reuse, and every
        # request says `cache_prompt: false` as well.
        cmd += ["--cache-prompt"] if args.cache else ["--no-cache-prompt", "--cache-ram", "0", "--cache-reuse", "0"]
        return Server(f"llama.cpp {label}", cmd, f"http://127.0.0.1:{port}", logs / f"llama-{label}.log", "/health",
                      {"cache_prompt": args.cache})

    port = free_port()
    # An idle kvfence does nothing while a peer is measured: no periodic readiness canary.
    ours = Server("kvfence", [sys.executable, "-m", "kvfence.app.cli", "serve", "--model", str(model), "--port",
                              str(port), "--dtype", args.dtype, "--canary-interval", "3600", *POOLS,
                              "--prefix-cache" if args.cache else "--no-prefix-cache", *ours_flags],
                  f"http://127.0.0.1:{port}", logs / "kvfence.log", "/ready", {})
    kind = {"float32": "F32", "bfloat16": "BF16"}[args.dtype]
    own = model.stem.rsplit(".", 1)[-1] if "." in model.stem else "own"
    return [ours, llama(peer_gguf, kind), llama(model, own)]


def bench_args(server: Server, args: argparse.Namespace, requests: int) -> argparse.Namespace:
    return argparse.Namespace(url=server.url, model=args.model_name, requests=requests,
                              prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, chat=True,
                              extra=json.dumps(server.extra), no_keepalive=True, fixed_prompts=False)


def measure_level(server: Server, args: argparse.Namespace, c: int) -> dict:
    r = asyncio.run(bench_serve.run_level(bench_args(server, args, args.requests), c, None))
    tags = [q["tag"] for q in r["requests"]]
    if r["completion_tokens"] is not None and r["completion_tokens"] != r["ok"] * args.output_tokens:
        print(f"WARNING: {server.name} c={c} reports {r['completion_tokens']} completion tokens, "
              f"not {r['ok']} x {args.output_tokens}; its tok/s counts {args.output_tokens} per request", flush=True)
    print(f"{server.name:>15} c={c:<3} {r['ok']:>3} ok {r['errors']} err  TTFT p50 {r['ttft_p50']:.3f} "
          f"p99 {r['ttft_p99']:.3f} s  ITL p50 {r['itl_p50'] * 1000:.1f} p99 {r['itl_p99'] * 1000:.1f} ms  "
          f"{r['output_tok_s']:.1f} tok/s  cached {r['cached_tokens']}/{r['prompt_tokens']} prompt tokens  "
          f"tags {tags[0]}, {tags[1] if len(tags) > 1 else ''}…", flush=True)
    return r


def median(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def medians(runs: list[dict], names: list[str], levels: list[int]) -> dict[str, dict[int, dict]]:
    """Per server and level, the median over the runs of each metric (None if no run reported it)."""
    return {name: {c: {m: median([run["levels"][str(c)][name][m] for run in runs]) for m in METRICS}
                   for c in levels} for name in names}


def table(runs: list[dict], med: dict[str, dict[int, dict]], names: list[str], levels: list[int]) -> str:
    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 1000:.1f}"

    rows = ["| streams | server | out tok/s | range over runs | kvfence ÷ | TTFT p50 ms | TTFT p99 ms "
            "| ITL p50 ms | ITL p99 ms | cached / prompt tokens |", "|---" * 10 + "|"]
    for c in levels:
        ours = med["kvfence"][c]["output_tok_s"]
        for name in names:
            m = med[name][c]
            tput = [run["levels"][str(c)][name]["output_tok_s"] for run in runs]
            ratio = "" if name == "kvfence" else f"{ours / m['output_tok_s']:.2f}x"
            cached = "n/a" if m["cached_tokens"] is None else f"{m['cached_tokens']:.0f}"
            prompt = "n/a" if m["prompt_tokens"] is None else f"{m['prompt_tokens']:.0f}"
            rows.append(f"| {c} | {name} | {m['output_tok_s']:.1f} | {min(tput):.1f}–{max(tput):.1f} | {ratio} "
                        f"| {ms(m['ttft_p50'])} | {ms(m['ttft_p99'])} | {ms(m['itl_p50'])} | {ms(m['itl_p99'])} "
                        f"| {cached} / {prompt} |")
    return "\n".join(rows)


def plot(med: dict[str, dict[int, dict]], levels: list[int], path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("output_tok_s", "output tok/s", 1), ("ttft_p99", "TTFT p99 (ms)", 1000),
              ("itl_p50", "ITL p50 (ms)", 1000))
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4))
    for ax, (metric, label, scale) in zip(axes, panels):
        for name, data in med.items():
            ax.plot(levels, [data[c][metric] * scale for c in levels], marker="o", label=name)
        ax.set(xlabel="concurrent streams", ylabel=label, xscale="log", xticks=levels, xticklabels=levels)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def provenance(bin_dir: Path) -> dict:
    """What was measured: the kvfence commit (and whether the tree was dirty), the llama.cpp build."""
    root = Path(__file__).resolve().parent.parent

    def out(cmd: list[str], cwd: Path | None = None) -> str:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
        return (done.stdout + done.stderr).strip()

    return {"kvfence_commit": out(["git", "rev-parse", "HEAD"], root),
            "kvfence_dirty": bool(out(["git", "status", "--porcelain", "--untracked-files=no"], root)),
            "llama_server": out([str(bin_dir / "llama-server"), "--version"]).splitlines()[-2:],
            "peer_sdist": PEER_SDIST, "host_cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def main() -> None:
    argv = sys.argv[1:]
    ours_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=32, help="requests per level")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="interleaved sweeps; the table takes the median")
    ap.add_argument("--cache", action="store_true", help="prefix caches on, on all three (default: off on all)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--model", default=None, help="GGUF path (default: the fetched default model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp's threads")
    ap.add_argument("--plot", default="bench_peer.png", help="where the plot goes")
    ap.add_argument("--json", default="bench_peer.json", help="where every run's numbers go")
    args = ap.parse_args(argv)
    if {"--prefix-cache", "--no-prefix-cache"} & set(ours_flags):
        ap.error("the prefix cache follows --cache on all three servers; do not pass it after --")
    levels = [int(c) for c in args.concurrency.split(",")]
    home = kvfence_home()
    model = resolve_model(args.model, home)
    args.model_name = model.stem.split(".")[0]
    bin_dir = peer_build(home)
    peer_gguf = peer_model(bin_dir, model, args.dtype)
    logs = Path(tempfile.mkdtemp(prefix="bench_peer-"))
    under_test = servers(args, bin_dir, model, peer_gguf, ours_flags, logs)
    names = [s.name for s in under_test]
    print(f"model {model.name} ({args.dtype}); prefix caches {'ON' if args.cache else 'off'} on all; logs in {logs}; "
          f"kvfence flags after --: {' '.join(ours_flags) or '(none)'}", flush=True)
    report = {"config": {k: v for k, v in vars(args).items()}, "kvfence_flags": ours_flags,
              "servers": {s.name: {"cmd": s.cmd, "extra_body": s.extra} for s in under_test},
              "provenance": provenance(bin_dir), "warmup": {}, "runs": []}
    tags: list[str] = []
    procs: list[subprocess.Popen] = []
    try:
        for s in under_test:  # all three up at once, for the whole sitting
            procs.append(subprocess.Popen(s.cmd, stdout=open(s.log, "w"), stderr=subprocess.STDOUT,
                                          env=dict(os.environ, PYTHONUNBUFFERED="1")))
        for s, proc in zip(under_test, procs):
            wait_for(lambda: up(s, proc), f"{s.name} (log {s.log})")
        top = max(levels)
        for s in under_test:  # every server starts cold
            r = asyncio.run(bench_serve.run_level(bench_args(s, args, 2 * top), top, None))
            report["warmup"][s.name] = r
            tags += [q["tag"] for q in r["requests"]]
        for run in range(args.runs):
            print(f"run {run + 1}/{args.runs}", flush=True)
            record: dict = {"run": run, "order": {}, "levels": {}}
            for i, c in enumerate(levels):
                k = (run + i) % len(under_test)  # each server leads each level once in len(under_test) runs
                order = under_test[k:] + under_test[:k]
                record["order"][str(c)] = [s.name for s in order]
                record["levels"][str(c)] = {}
                for s in order:
                    r = measure_level(s, args, c)
                    record["levels"][str(c)][s.name] = r
                    tags += [q["tag"] for q in r["requests"]]
            report["runs"].append(record)
            Path(args.json).write_text(json.dumps(report, indent=1))  # what an interrupted sitting measured
    finally:
        for proc in procs:
            stop(proc)

    if len(set(tags)) != len(tags):
        raise SystemExit(f"{len(tags) - len(set(tags))} prompt tags repeated: the comparison is not valid")
    med = medians(report["runs"], names, levels)
    report["median"] = {name: {str(c): v for c, v in per.items()} for name, per in med.items()}
    report["distinct_prompts"] = len(tags)
    Path(args.json).write_text(json.dumps(report, indent=1))
    for name in names:
        for c in levels:
            cached = med[name][c]["cached_tokens"]
            if not args.cache and cached:
                print(f"WARNING: {name} served {cached:.0f} prompt tokens from a cache at c={c} with caches off")
    print(f"\n{args.dtype}, prefix caches {'on' if args.cache else 'off'}, chat streams of a random tag + "
          f"≈{args.prompt_tokens} words and {args.output_tokens} tokens, {args.requests} requests per level, "
          f"median of {args.runs} interleaved run(s); {len(tags)} prompts, all distinct")
    print(table(report["runs"], med, names, levels))
    plot(med, levels, Path(args.plot), f"kvfence vs llama-server ({args.dtype}, caches "
         f"{'on' if args.cache else 'off'}, median of {args.runs}, {time.strftime('%Y-%m-%d')})")
    print(f"plot: {args.plot}  numbers: {args.json}")


if __name__ == "__main__":
    main()
