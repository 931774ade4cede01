#!/usr/bin/env python
"""The yardstick, side by side: llama.cpp's own `llama-server` and kvfence on the same requests,
both up in one run, taking turns at every concurrency level; a table with ratios and a plot.

  .venv/bin/python scripts/bench_peer.py                       # fp32, c = 1, 4, 16
  .venv/bin/python scripts/bench_peer.py --dtype bfloat16      # both in bf16
  .venv/bin/python scripts/bench_peer.py -- --disaggregation off   # flags after -- go to kvfence serve

The peer: llama.cpp as vendored in the `llama-cpp-python` sdist on PyPI (pinned below), built
once with cmake + ninja (its `llama-server` and `llama-quantize`) under
$KVFENCE_HOME/peer/, outside the repo; the default model's GGUF converted by `llama-quantize` to
F32 (or BF16), the same weights kvfence dequantizes. It serves with 16 slots, continuous
batching, every request `cache_prompt: false` (no prompt cache: kvfence's prefix cache does not
help these random prompts either) and as many threads as kvfence's compute uses. kvfence serves
with its defaults (disaggregated over tcp, every guard on) plus whatever follows `--`.

Requests: streamed chat completions (scripts/bench_serve.py) of ≈--prompt-tokens words and
exactly --output-tokens tokens (`ignore_eos`), --requests per level, the same prompts for both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

from kvfence.app.environment import kvfence_home
from kvfence.engine.model_registry import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402
from bench_remote import free_port, ready, wait_for  # noqa: E402

PEER_SDIST = "llama-cpp-python==0.3.36"
POOLS = ("--max-context", "2048", "--prefill-num-pages", "256", "--decode-num-pages", "512")
SLOTS = 16


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


def serving(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def bench_args(url: str, args: argparse.Namespace, extra: dict) -> argparse.Namespace:
    return argparse.Namespace(url=url, model=args.model_name, requests=args.requests, prompt_tokens=args.prompt_tokens,
                              output_tokens=args.output_tokens, chat=True, extra=json.dumps(extra), no_keepalive=True)


def measure_level(name: str, bench: argparse.Namespace, c: int) -> dict:
    r = asyncio.run(bench_serve.run_level(bench, c, None))
    print(f"{name:>9} c={c:<3} {r['ok']:>3} ok {r['errors']} err  TTFT p50 {r['ttft_p50']:.3f} "
          f"p99 {r['ttft_p99']:.3f} s  ITL p50 {r['itl_p50'] * 1000:.1f} ms  {r['output_tok_s']:.1f} tok/s", flush=True)
    return r


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def plot(peer: dict[int, dict], ours: dict[int, dict], path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(peer)
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for name, data in (("llama.cpp", peer), ("kvfence", ours)):
        tput.plot(levels, [data[c]["output_tok_s"] for c in levels], marker="o", label=name)
        ttft.plot(levels, [data[c]["ttft_p99"] for c in levels], marker="o", label=name)
    tput.set(xlabel="concurrent streams", ylabel="output tok/s", xscale="log", xticks=levels, xticklabels=levels)
    ttft.set(xlabel="concurrent streams", ylabel="TTFT p99 (s)", xscale="log", xticks=levels, xticklabels=levels)
    for ax in (tput, ttft):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    argv = sys.argv[1:]
    ours_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=32, help="requests per level")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--model", default=None, help="GGUF path (default: the fetched default model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp's threads")
    ap.add_argument("--plot", default="bench_peer.png", help="where the plot goes")
    args = ap.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",")]
    home = kvfence_home()
    model = resolve_model(args.model, home)
    args.model_name = model.stem.split(".")[0]
    bin_dir = peer_build(home)
    peer_gguf = peer_model(bin_dir, model, args.dtype)
    logs = Path(tempfile.mkdtemp(prefix="bench_peer-"))
    print(f"model {model.name} ({args.dtype}); logs in {logs}; kvfence flags: {' '.join(ours_flags) or '(defaults)'}")

    peer_port, our_port = free_port(), free_port()
    peer = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(peer_gguf), "--host", "127.0.0.1",
                             "--port", str(peer_port), "--parallel", str(SLOTS), "--ctx-size", str(SLOTS * 2048),
                             "--threads", str(args.threads), "--cont-batching", "--alias", args.model_name],
                            stdout=open(logs / "peer.log", "w"), stderr=subprocess.STDOUT)
    ours_proc = None
    try:
        wait_for(lambda: serving(f"http://127.0.0.1:{peer_port}"), f"llama-server (log {logs / 'peer.log'})")
        # An idle kvfence does nothing while the peer is measured: no periodic readiness canary.
        ours_proc = subprocess.Popen([sys.executable, "-m", "kvfence.app.cli", "serve", "--model", str(model),
                                      "--port", str(our_port), "--dtype", args.dtype, "--canary-interval", "3600",
                                      *POOLS, *ours_flags],
                                     stdout=open(logs / "kvfence.log", "w"), stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        wait_for(lambda: ready(f"http://127.0.0.1:{our_port}"), f"kvfence (log {logs / 'kvfence.log'})")
        benches = {"llama.cpp": bench_args(f"http://127.0.0.1:{peer_port}", args, {"cache_prompt": False}),
                   "kvfence": bench_args(f"http://127.0.0.1:{our_port}", args, {})}
        for bench in benches.values():  # warm-up: both servers start cold
            asyncio.run(bench_serve.run_level(bench, 2, None))
        # Level by level, the two take turns: a shared host's drift falls on both alike.
        results: dict[str, dict[int, dict]] = {name: {} for name in benches}
        for c in args.levels:
            for name, bench in benches.items():
                results[name][c] = measure_level(name, bench, c)
        theirs, ours = results["llama.cpp"], results["kvfence"]
    finally:
        stop(peer)
        if ours_proc is not None:
            stop(ours_proc)

    print(f"\n{args.dtype}, chat streams of ≈{args.prompt_tokens} prompt words and {args.output_tokens} tokens, "
          f"{args.requests} requests per level")
    print("| streams | llama.cpp tok/s | kvfence tok/s | ratio | llama.cpp TTFT p99 | kvfence TTFT p99 |")
    print("|---|---|---|---|---|---|")
    for c in args.levels:
        a, b = theirs[c], ours[c]
        print(f"| {c} | {a['output_tok_s']:.1f} | {b['output_tok_s']:.1f} | {b['output_tok_s'] / a['output_tok_s']:.2f}x "
              f"| {a['ttft_p99']:.3f} s | {b['ttft_p99']:.3f} s |")
    plot(theirs, ours, Path(args.plot), f"kvfence vs llama.cpp ({args.dtype}, {time.strftime('%Y-%m-%d')})")
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
