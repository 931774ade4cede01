"""The GPU check, run on a lent CUDA machine by scripts/gpu_check.sh; prints ONE summary at the end.

Sections, each guarded (a failure is reported and the next one runs) and time-boxed:
1. kernel tests: tests/kernels and tests/engine/test_attention_backend.py, compiled on CUDA;
2. decode benchmark: kernels.paged_decode at batch 16/64/256 x context 512/2048/8192 on a pool
   with the default model's layout (30 layers, 3 KV heads, head_dim 64, 9 query heads, 16-token
   pages, bf16), pages scattered over the pool; achieved GB/s of KV read against the H200's
   ~4.8 TB/s, the fused owner check's cost (CHECK_OWNER on vs off), the torch path's time, and
   the largest difference between the two;
3. server smoke test: `kvfence serve` in bf16 on cuda:0 (prefill and decode), one chat request,
   a non-empty reply; then the same server under load (scripts/bench_serve.py: streamed
   completions of ≈128 prompt words and 64 tokens at 1, 16 and 64 concurrent streams, every guard
   on): output tok/s, TTFT and ITL per level. The default model when it is in KVFENCE_HOME (or
   --model), else a stand-in: random weights in the default model's architecture, written with
   tests/tiny_models.py.

--dry-run runs the same code on the CPU under the Triton interpreter at tiny sizes (the server in
float32 with a 2-layer random model): it proves the script, not the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
H200_BYTES_PER_S = 4.8e12


@dataclasses.dataclass
class Outcome:
    name: str
    ok: bool
    lines: list[str]
    seconds: float


def run_section(name: str, fn, *args) -> Outcome:
    start = time.monotonic()
    try:
        ok, lines = fn(*args)
    except Exception as e:  # a section's failure must not stop the others
        ok, lines = False, [f"{type(e).__name__}: {e}", *traceback.format_exc().splitlines()[-6:]]
    outcome = Outcome(name, ok, lines, time.monotonic() - start)
    print(f"--- {name}: {'ok' if ok else 'FAILED'} ({outcome.seconds:.0f} s)", flush=True)
    for line in lines:
        print("    " + line, flush=True)
    return outcome


def kernel_tests(args: argparse.Namespace) -> tuple[bool, list[str]]:
    # -W default: warnings from this machine's library versions are reported, not turned into failures.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "default", "tests/kernels",
           "tests/engine/test_attention_backend.py"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.tests_timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return False, [f"timed out after {args.tests_timeout_s} s", *out.splitlines()[-5:]]
    lines = proc.stdout.strip().splitlines()
    last = lines[-1] if lines else proc.stderr.strip()[-500:]
    failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return proc.returncode == 0, [last, *failures[:10]]


def decode_bench(args: argparse.Namespace) -> tuple[bool, list[str]]:
    import torch

    from kvfence.engine.attention import build_attention_batch, paged_attention
    from kvfence.kernels.triton.paged_decode import paged_decode_attention

    device = torch.device("cpu" if args.dry_run else "cuda:0")
    layers, kv_heads, heads, head_dim, page_size = (2, 3, 9, 64, 16) if args.dry_run else (30, 3, 9, 64, 16)
    dtype = torch.bfloat16
    batches, contexts = ([2], [64]) if args.dry_run else ([16, 64, 256], [512, 2048, 8192])
    num_pages = max(batches) * max(contexts) // page_size
    pool = torch.empty(num_pages, layers, 2, kv_heads, page_size, head_dim, dtype=dtype, device=device)
    pool.normal_()
    keys, values = pool[:, layers // 2, 0], pool[:, layers // 2, 1]  # one layer's strided views
    tags = torch.zeros(num_pages, 2, dtype=torch.int64, device=device)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(num_pages, generator=gen)  # a fragmented pool: tables scattered all over it

    def timed(fn, graph: bool = False) -> float:
        """Seconds per call, median: on CUDA the kernels alone (replayed from a CUDA graph) or the
        eager call with its Python launcher; on the CPU one eager call."""
        if device.type == "cuda":
            import triton.testing

            if graph:
                return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") / 1e3
            return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    lines = ["kernel us: CUDA-graph replay; eager us: the launcher's call as the engine makes it",
             "batch x ctx   KV MiB  kernel us   GB/s  %peak  no-check us  owner-check  eager us  torch us  max|diff|"]
    overheads: list[float] = []
    ok = True
    deadline = time.monotonic() + args.bench_budget_s
    for batch in batches:
        for ctx in contexts:
            if time.monotonic() > deadline:
                lines.append(f"{batch} x {ctx}: skipped, over the {args.bench_budget_s} s budget")
                ok = False
                continue
            pages_per_seq = ctx // page_size
            table64 = order[: batch * pages_per_seq].view(batch, pages_per_seq).to(device)
            leases = torch.stack([torch.arange(1, batch + 1), torch.full((batch,), 7)], 1).to(device)
            tags[table64] = leases[:, None, :]
            table = table64.to(torch.int32)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            q = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
            out, flags = paged_decode_attention(q, keys, values, table, lens, tags, leases)
            if int(flags.sum()) != 0:
                ok = False
                lines.append(f"{batch} x {ctx}: {int(flags.sum())} sequences flagged on their own pages")
            t_on = timed(lambda: paged_decode_attention(q, keys, values, table, lens, tags, leases), graph=True)
            t_off = timed(lambda: paged_decode_attention(q, keys, values, table, lens), graph=True)
            t_eager = timed(lambda: paged_decode_attention(q, keys, values, table, lens, tags, leases))
            kv_bytes = batch * ctx * kv_heads * head_dim * 2 * pool.element_size()
            overhead = t_on / t_off - 1
            overheads.append(overhead)
            torch_us, diff = float("nan"), float("nan")
            if batch * ctx <= args.torch_max_tokens:
                attn = build_attention_batch(page_size, [(row, ctx) for row in table64.tolist()], [], device)
                ref = paged_attention(q, keys, values, attn)
                diff = (ref.float() - out.float()).abs().max().item()
                ok = ok and diff < 5e-2
                torch_us = timed(lambda: paged_attention(q, keys, values, attn)) * 1e6
            gbps = kv_bytes / t_on / 1e9
            lines.append(f"{batch:>5} x {ctx:<5} {kv_bytes / 2**20:7.1f} {t_on * 1e6:10.1f} {gbps:6.0f} "
                         f"{100 * gbps * 1e9 / H200_BYTES_PER_S:5.1f}% {t_off * 1e6:12.1f} {100 * overhead:+10.2f}% "
                         f"{t_eager * 1e6:9.1f} {torch_us:9.1f} {diff:10.2e}")
            tags[table64] = 0
    if overheads:
        median = sorted(overheads)[len(overheads) // 2]
        lines.append(f"owner check (CHECK_OWNER on vs off): median {100 * median:+.2f}%, "
                     f"max {100 * max(overheads):+.2f}% per decode attention call")
    pool = keys = values = tags = None  # the pool's memory back to the device before the next check
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ok, lines


def _stand_in_model(path: Path, dry_run: bool) -> Path:
    """Random weights in the default model's architecture (a 2-layer tiny one for --dry-run)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import TinySpec, build_tiny_model, write_gguf

    spec = TinySpec() if dry_run else TinySpec(
        num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
        context_length=8192, rope_theta=100000.0, tie_embeddings=True)
    return write_gguf(build_tiny_model(spec, seed=1), path)


def server_smoke(args: argparse.Namespace) -> tuple[bool, list[str]]:
    import socket

    import httpx

    home = Path(os.environ.get("KVFENCE_HOME", Path.home() / ".cache" / "kvfence"))
    default = home / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    lines = []
    if args.model:
        model = Path(args.model)
    elif default.is_file() and not args.dry_run:
        model = default
    else:
        model = _stand_in_model(Path("/tmp/kvfence-gpu-check-model.gguf"), args.dry_run)
        why = "dry run: a 2-layer one" if args.dry_run else f"the default architecture; no {default} here"
        lines.append(f"model: a stand-in with random weights ({why})")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = [sys.executable, "-m", "kvfence.app.cli", "serve", "--model", str(model), "--port", str(port),
             "--canary-interval", "3600"]
    if args.dry_run:
        serve += ["--dtype", "float32", "--prefill-device", "cpu", "--decode-device", "cpu", "--max-context", "256"]
    else:
        import torch

        # Two GPUs: prefill on one and decode on the other, the first real deployment of the design.
        decode_device = "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"
        lines.append(f"placement: prefill cuda:0, decode {decode_device} "
                     f"({torch.cuda.device_count()} GPUs visible)")
        serve += ["--dtype", "bfloat16", "--prefill-device", "cuda:0", "--decode-device", decode_device,
                  "--max-context", "4096"]
    helptext = subprocess.run([sys.executable, "-m", "kvfence.app.cli", "serve", "--help"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60).stdout
    if "--attention-backend" in helptext:
        serve += ["--attention-backend", "torch" if args.dry_run else "triton"]
    else:
        lines.append("`serve` has no --attention-backend yet: the server ran its default attention path")
    log_path = Path("/tmp/kvfence-gpu-check-server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(serve, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {log_path.read_text()[-1500:]}")
            try:
                if httpx.get(base + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {args.ready_timeout_s} s: {log_path.read_text()[-1500:]}")
            time.sleep(0.5)
        lines.append(f"ready after {args.ready_timeout_s - (deadline - time.monotonic()):.0f} s")
        name = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        start = time.monotonic()
        reply = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": name, "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        body = reply.json()
        text = body["choices"][0]["message"]["content"] if reply.status_code == 200 else ""
        lines.append(f"HTTP {reply.status_code} in {time.monotonic() - start:.2f} s, "
                     f"{body.get('usage', {}).get('completion_tokens')} tokens: {text[:80]!r}")
        attention = re.findall(r".*attention.*", log_path.read_text())
        lines += [f"log: {line.strip()[:120]}" for line in attention[:3]]
        loaded, load_lines = serving_load(base, name, args)
        return reply.status_code == 200 and bool(text.strip()) and loaded, lines + load_lines
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serving_load(base: str, model: str, args: argparse.Namespace) -> tuple[bool, list[str]]:
    """The server at `base` under streamed load at each level (scripts/bench_serve.py), one line
    each; False if any request failed."""
    import asyncio

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_serve

    levels, requests, prompt, tokens = ([1, 2], 4, 16, 8) if args.dry_run else ([1, 16, 64], 0, 128, 64)
    ok, lines = True, []
    for c in levels:
        bench = argparse.Namespace(url=base, model=model, requests=requests or max(16, 2 * c), prompt_tokens=prompt,
                                   output_tokens=tokens, chat=False, extra="")
        r = asyncio.run(bench_serve.run_level(bench, c, None))
        ok = ok and r["errors"] == 0
        lines.append(f"load c={c}: {r['ok']} ok, {r['errors']} errors, {r['output_tok_s']:.0f} tok/s, TTFT p50 "
                     f"{r['ttft_p50'] * 1e3:.0f} / p99 {r['ttft_p99'] * 1e3:.0f} ms, ITL p50 {r['itl_p50'] * 1e3:.1f} ms")
    return ok, lines


def environment() -> list[str]:
    import torch

    lines = [f"python {sys.version.split()[0]}, torch {torch.__version__}"]
    try:
        import triton

        lines[0] += f", triton {triton.__version__}"
    except ImportError:
        lines[0] += ", no triton"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        lines.append(f"{p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny sizes")
    parser.add_argument("--model", default=None, help="GGUF for the smoke test (default: the default model if cached)")
    parser.add_argument("--skip", action="append", default=[], choices=["tests", "bench", "smoke"])
    parser.add_argument("--tests-timeout-s", type=int, default=150)
    parser.add_argument("--bench-budget-s", type=int, default=75)
    parser.add_argument("--ready-timeout-s", type=int, default=90)
    parser.add_argument("--torch-max-tokens", type=int, default=256 * 8192, help="largest batch x ctx timed on torch")
    args = parser.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    started = time.monotonic()
    env = run_section("environment", lambda: (True, environment()))
    outcomes = [env]
    sections = [("tests", "kernel tests", kernel_tests), ("bench", "decode benchmark", decode_bench),
                ("smoke", "server smoke test", server_smoke)]
    for key, name, fn in sections:
        if key not in args.skip:
            outcomes.append(run_section(name, fn, args))
    print("\n==================== kvfence GPU check: summary ====================")
    for o in outcomes:
        print(f"[{'PASS' if o.ok else 'FAIL'}] {o.name} ({o.seconds:.0f} s)")
        for line in o.lines:
            print("       " + line)
    print(f"total {time.monotonic() - started:.0f} s{' (dry run: CPU, interpreter)' if args.dry_run else ''}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "gpu_check.json").write_text(json.dumps([dataclasses.asdict(o) for o in outcomes], indent=1))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
