#!/usr/bin/env python
"""Disaggregated serving in three shapes, measured one after the other in one run, per transport:

- `inprocess`: `kvfence serve` with both workers in its own process (the default deployment);
- `processes`: a prefill and a decode `kvfence worker` process and a front end
  (`kvfence serve --discovery static://...`), all on loopback;
- `namespaces`: the same, each worker in a network namespace of its own (as root), the KV crossing
  a veth pair between them and the control connections a veth pair each.

Each shape serves the same streamed completions (scripts/bench_serve.py) at every concurrency
level; the table has TTFT, inter-token latency and output tokens/s. Each worker process gets
`--worker-threads` intra-op threads (default half the cores: the two "hosts" share this machine),
the in-process server all of them for one step at a time. Also measured: the control channel's
own cost per step, as the round trip of an empty step (no sequences) over an authenticated
loopback control connection against the same step through the in-process channel.

  sudo .venv/bin/python scripts/bench_remote.py --transports tcp,nixl,mooncake --concurrency 1,16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx
import torch

from kvfence.app.config.environment import kvfence_home
from kvfence.app.remote.client import RemoteWorker
from kvfence.app.remote.server import KvEndpoint, WorkerServer
from kvfence.app.serve.pairing import role_record
from kvfence.engine.checkpoint import load_checkpoint
from kvfence.engine.compute import ComputeThread
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.registry import build_model
from kvfence.engine.known_models import resolve_model
from kvfence.engine.protocol import RunStep
from kvfence.engine.runner import ModelRunner
from kvfence.engine.worker import LocalWorkerChannel, Worker
from kvfence.transports.core.front_key import FrontKey
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.registry import create_transport
from kvfence.transports.wire.channel import listen

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402

POOLS = ("--max-context", "2048", "--prefill-num-pages", "256", "--decode-num-pages", "512")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kvfence(*args: str, log: Path, prefix: tuple[str, ...] = (), threads: int | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.Popen([*prefix, sys.executable, "-m", "kvfence.app.cli", *args], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=env)


def wait_for(condition, what: str, timeout_s: float = 300) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


class Namespaces:
    """Two hosts: network namespaces joined by a veth pair (KV), each joined to this one (control)."""

    def __init__(self) -> None:
        self.ip = shutil.which("ip") or "ip"
        tag = os.urandom(3).hex()
        self.ns = {"prefill": f"kvfb-p-{tag}", "decode": f"kvfb-d-{tag}"}
        self.control = {"prefill": ("10.221.0.1", "10.221.0.2"), "decode": ("10.222.0.1", "10.222.0.2")}
        self.kv = {"prefill": "10.223.0.1", "decode": "10.223.0.2"}
        for role, ns in self.ns.items():
            here, there = f"kvbh{role[0]}{tag}", f"kvbn{role[0]}{tag}"
            mine, theirs = self.control[role]
            self._run("netns", "add", ns)
            self._run("-n", ns, "link", "set", "lo", "up")
            self._run("link", "add", here, "type", "veth", "peer", "name", there)
            self._run("link", "set", there, "netns", ns)
            self._run("addr", "add", f"{mine}/24", "dev", here)
            self._run("link", "set", here, "up")
            self._run("-n", ns, "addr", "add", f"{theirs}/24", "dev", there)
            self._run("-n", ns, "link", "set", there, "up")
        p, d = f"kvbkp{tag}", f"kvbkd{tag}"
        self._run("link", "add", p, "type", "veth", "peer", "name", d)
        for role, link in (("prefill", p), ("decode", d)):
            self._run("link", "set", link, "netns", self.ns[role])
            self._run("-n", self.ns[role], "addr", "add", f"{self.kv[role]}/24", "dev", link)
            self._run("-n", self.ns[role], "link", "set", link, "up")

    def _run(self, *args: str) -> None:
        subprocess.run([self.ip, *args], check=True, capture_output=True)

    def remove(self) -> None:
        for ns in self.ns.values():
            subprocess.run([self.ip, "netns", "del", ns], capture_output=True)


def write_front_key(directory: Path) -> tuple[Path, Path]:
    """A fresh front end key pair in `directory`: (private, public), as `kvfence front-key` writes."""
    private, public = directory / "front.key", directory / "front.pub"
    FrontKey.generate().write(private, public)
    return private, public


class Deployment:
    def __init__(self, shape: str, transport: str, model: str, directory: Path, worker_threads: int) -> None:
        self.procs: list[subprocess.Popen] = []
        self.hosts = Namespaces() if shape == "namespaces" else None
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        secret = directory / "secret"
        secret.write_text(os.urandom(32).hex())
        secret.chmod(0o600)
        front_key, front_public = write_front_key(directory)
        # loopback, netns: only the deployment reaches these hosts
        consent = (f"--{transport}-unauthenticated-ports-ok",) if transport in ("nixl", "mooncake") else ()
        common = ("--model", model, "--transport", transport, *consent, "--transport-secret-file", str(secret))
        if shape == "inprocess":
            self.procs.append(kvfence("serve", *common, *POOLS, "--port", str(port), "--canary-interval", "3600",
                                      log=directory / "serve.log"))
        else:
            controls = []
            for role in ("prefill", "decode"):
                host = self.hosts.control[role][1] if self.hosts else "127.0.0.1"
                control = f"{host}:{free_port()}"
                where = ("--transport-host", self.hosts.kv[role]) if self.hosts else ()
                self.procs.append(kvfence("worker", "--role", role, "--control", control, *common, *POOLS, *where,
                                          "--front-public-key-file", str(front_public),
                                          log=directory / f"{role}.log", threads=worker_threads,
                                          prefix=(self.hosts.ip, "netns", "exec", self.hosts.ns[role])
                                          if self.hosts else ()))
                controls.append(control)
            self.procs.append(kvfence("serve", "--model", model, "--discovery", "static://" + ",".join(controls),
                                      "--transport-secret-file", str(secret), "--front-key-file", str(front_key),
                                      "--port", str(port),
                                      "--canary-interval", "3600", log=directory / "front.log"))
        wait_for(lambda: ready(self.url), f"{shape} over {transport} ready (logs in {directory})")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.hosts is not None:
            self.hosts.remove()


async def control_channel_cost(model: str, steps: int) -> tuple[float, float]:
    """Mean seconds per empty step (no sequences: what is left is the channel): to a worker
    behind a control connection on loopback, and to the same worker in this process."""
    checkpoint = load_checkpoint(Path(model))
    llama = build_model(checkpoint, torch.float32)
    pool = KVPool(llama.config, 64, 16, torch.float32)
    worker = Worker("decode", ModelRunner(llama, pool))
    secret, front_key = DeploymentSecret.generate(), FrontKey.generate()
    compute = ComputeThread("bench")
    endpoint = KvEndpoint(lambda: create_transport("tcp", secret=secret, front_key=front_key.public,
                                                   host="127.0.0.1"),
                          pool.data, lambda: role_record(pool, "bench", 1024))
    server = WorkerServer(worker, compute, endpoint, secret, checkpoint.tokenizer, front_key=front_key.public,
                          model="bench", max_context_tokens=1024)
    listener = listen("127.0.0.1", 0)
    address = "127.0.0.1:%d" % listener.getsockname()[1]

    async def timed(channel) -> float:  # type: ignore[no-untyped-def]
        for i in range(20):
            await channel.call(RunStep(step_id=i + 1, seqs=[], incarnation=worker.incarnation))
        start = time.perf_counter()
        for i in range(steps):
            await channel.call(RunStep(step_id=100 + i, seqs=[], incarnation=worker.incarnation))
        return (time.perf_counter() - start) / steps

    async with anyio.create_task_group() as tg:
        await tg.start(server.serve, listener)
        remote = await RemoteWorker.connect(tg, address, secret, front_key=front_key)
        remote_s = await timed(remote)
        remote.close()
        local_s = await timed(LocalWorkerChannel(worker, compute))
        tg.cancel_scope.cancel()
    listener.close()
    compute.close()
    return remote_s, local_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the fetched default model)")
    ap.add_argument("--transports", default="tcp,nixl,mooncake")
    ap.add_argument("--shapes", default="inprocess,processes,namespaces")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--control-steps", type=int, default=2000, help="empty steps for the control channel's cost")
    ap.add_argument("--worker-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="intra-op threads of each worker process (default: half the cores, as if each worker had "
                         "a host of its own; the in-process server runs one step at a time on all of them)")
    args = ap.parse_args()
    if args.model is None:
        args.model = str(resolve_model(None, kvfence_home(), progress=False))
    remote_s, local_s = anyio.run(control_channel_cost, args.model, args.control_steps)
    print(f"control channel, empty step round trip: {remote_s * 1e6:.0f} us over a loopback control connection, "
          f"{local_s * 1e6:.0f} us through the in-process channel (+{(remote_s - local_s) * 1e6:.0f} us per step)",
          flush=True)
    shapes = args.shapes.split(",")
    if "namespaces" in shapes and os.geteuid() != 0:
        print("namespaces: skipped (needs root)")
        shapes.remove("namespaces")
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"prompt≈{args.prompt_tokens} output={args.output_tokens} requests/level={args.requests}")
    print(f"{'transport':>10}{'shape':>12}{'level':>7}{'ok':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}"
          f"{'out tok/s':>11}")
    for transport in args.transports.split(","):
        for shape in shapes:
            directory = Path(tempfile.mkdtemp(prefix=f"bench-{shape}-{transport}-"))
            d = Deployment(shape, transport, args.model, directory, args.worker_threads)
            try:
                for c in levels:
                    bench = argparse.Namespace(url=d.url, model="SmolLM2-135M-Instruct", requests=args.requests,
                                               prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens)
                    random.seed(0)
                    r = asyncio.run(bench_serve.run_level(bench, c, None))
                    print(f"{transport:>10}{shape:>12}{'c=' + str(c):>7}{r['ok']:>5}{r['ttft_p50']:>10.3f}"
                          f"{r['ttft_p99']:>10.3f}{r['itl_p50'] * 1000:>9.1f}m{r['output_tok_s']:>11.1f}", flush=True)
            finally:
                d.stop()


if __name__ == "__main__":
    main()
