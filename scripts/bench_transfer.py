#!/usr/bin/env python
"""KV transfer bandwidth and latency, per transport and transfer size, on one machine (loopback).

Sizes (pages of the default model in fp32: 16 tokens x 46,080 B = 737,280 B):
  page     1 page (the same one every time, so it stays in the caches)
  request  128 pages (2,048 tokens, ~94 MB), destination pages shuffled, as a real pool hands them out
  256MiB   364 pages (as many whole pages as fit in 256 MiB), contiguous on both sides
  2048     2,048 pages (32,768 tokens, ~1.5 GB), contiguous on both sides (the pools grow to hold it)

Methods:
  memcpy     torch `copy_` page by page between the two pools (the floor for moving the bytes once)
  socket     raw loopback TCP: `sendall` of each source page's memoryview; a receiver thread
             `recv_into`s each destination page and acknowledges with one byte (latency ends there)
  <name>     a registered transport through the Transport API, both endpoints in this process and
             one anyio task group: per transfer receiver.expect(manifest, dst) + sender.push(...) +
             receiver.completion(...). Manifests are built as TransferLink.move builds them
             (`digests=[]`: the sender computes xxh3_64 per page, the receiver recomputes and compares).

Both pools are allocated and touched once before timing; every method uses the same two. Each
(method, size) moves once, checks the destination bytes, then repeats for `--repeat-seconds` (at
least 5 times). GB/s = bytes / mean time; p50/p90 per transfer; "vs socket" = GB/s over the socket
baseline's at that size. `--digest-cost` times xxh3_64 alone over the same pages (one pass, the
sender's; the receiver makes a second) and shows two passes as a share of each transport's p50.

Usage: .venv/bin/python scripts/bench_transfer.py [--sizes page,request,256MiB]
           [--transports tcp,nixl,mooncake,inprocess] [--repeat-seconds 3] [--digest-cost] [--json PATH]
           [--torch-threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import socket
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import anyio
import msgspec
import torch

from kvfence.app.config.config import PoolsConfig
from kvfence.engine.ids import id_hex, mint_id
from kvfence.transports.base import PairingRecord, Peer, TransferManifest, Transport, TransportUnavailable
from kvfence.transports.core.digest import page_digest
from kvfence.transports.core.front_key import FrontKey
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.inprocess import InProcessHub
from kvfence.transports.registry import create_transport

PAGE_TOKENS = PoolsConfig().page_size_tokens  # the default page size
PAGE_NBYTES = 46_080 * PAGE_TOKENS  # one fp32 page of the default model
MIB256_PAGES = (256 << 20) // PAGE_NBYTES  # 364
SIZES = {"page": 1, "request": 2048 // PAGE_TOKENS, "256MiB": MIB256_PAGES, "2048": 2048}
DEFAULT_SIZES = ("page", "request", "256MiB")
TRANSFER_TIMEOUT_S = 60.0
SECRET = DeploymentSecret.generate()  # both ends live in this process
FRONT = FrontKey.generate()
MIN_REPS, MAX_REPS = 5, 20_000


class Case(NamedTuple):
    size: str
    src: list[int]
    dst: list[int]

    @property
    def nbytes(self) -> int:
        return len(self.src) * PAGE_NBYTES


class Row(NamedTuple):
    method: str
    size: str
    nbytes: int
    status: str  # "ok", "not installed", "error"
    reason: str = ""
    gbps: float = 0.0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    reps: int = 0


def make_cases(sizes: list[str], pool_pages: int) -> list[Case]:
    rng = random.Random(0)
    cases = []
    for size in sizes:
        n = SIZES[size]
        dst = {"page": [pool_pages - 1], "request": rng.sample(range(pool_pages), n)}.get(size, list(range(n)))
        cases.append(Case(size, list(range(n)), dst))
    return cases


def measured(method: str, case: Case, times_s: list[float]) -> Row:
    times = sorted(times_s)
    p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
    return Row(method, case.size, case.nbytes, "ok", gbps=case.nbytes / statistics.fmean(times) / 1e9,
               p50_ms=statistics.median(times) * 1e3, p90_ms=p90 * 1e3, reps=len(times))


def repeat(fn: Callable[[], object], seconds: float) -> list[float]:
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < MIN_REPS or (time.perf_counter() < deadline and len(times) < MAX_REPS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


async def arepeat(fn: Callable[[], Awaitable[object]], seconds: float) -> list[float]:
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < MIN_REPS or (time.perf_counter() < deadline and len(times) < MAX_REPS):
        start = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - start)
    return times


def landed(src: torch.Tensor, dst: torch.Tensor, case: Case) -> bool:
    return torch.equal(src[case.src], dst[case.dst])


def bench_sync(method: str, move: Callable[[Case], None], src: torch.Tensor, dst: torch.Tensor, case: Case,
               seconds: float) -> Row:
    """A baseline: zero the destination pages, move once, check the bytes, then time repeats."""
    dst[case.dst] = 0
    try:
        move(case)
        if not landed(src, dst, case):
            return Row(method, case.size, case.nbytes, "error", "destination pages differ from the source")
        return measured(method, case, repeat(lambda: move(case), seconds))
    except OSError as e:
        return Row(method, case.size, case.nbytes, "error", f"{type(e).__name__}: {e}")


def memcpy_mover(src: torch.Tensor, dst: torch.Tensor) -> Callable[[Case], None]:
    def move(case: Case) -> None:
        for s, d in zip(case.src, case.dst):
            dst[d].copy_(src[s])
    return move


class SocketBaseline:
    """Loopback TCP: this thread sends, a receiver thread lands page ranges it is handed per transfer."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.src_mv = memoryview(src.view(torch.uint8).reshape(-1).numpy())
        self.dst_mv = memoryview(dst.view(torch.uint8).reshape(-1).numpy())
        listener = socket.create_server(("127.0.0.1", 0))
        self.tx = socket.create_connection(listener.getsockname())
        self.rx, _ = listener.accept()
        listener.close()
        for sock in (self.tx, self.rx):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.jobs: queue.Queue[list[int] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        while (pages := self.jobs.get()) is not None:
            for d in pages:
                view, got = self.dst_mv[d * PAGE_NBYTES:(d + 1) * PAGE_NBYTES], 0
                while got < PAGE_NBYTES:
                    n = self.rx.recv_into(view[got:])
                    if not n:
                        return
                    got += n
            self.rx.sendall(b"\x01")

    def move(self, case: Case) -> None:
        self.jobs.put(case.dst)
        for s in case.src:
            self.tx.sendall(self.src_mv[s * PAGE_NBYTES:(s + 1) * PAGE_NBYTES])
        if self.tx.recv(1) != b"\x01":
            raise ConnectionError("the receiver closed without acknowledging")

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=5)
        self.tx.close()
        self.rx.close()


class TransferFailed(RuntimeError):
    pass


async def move(tx: Transport, rx: Transport, peer: Peer, case: Case) -> None:
    """One transfer as TransferLink.move makes it (capability included); raises TransferFailed
    with the verdict's reason."""
    manifest = TransferManifest(transfer_id=id_hex(mint_id()), lease=id_hex(mint_id()), nonce=id_hex(mint_id()),
                                num_tokens=len(case.src) * PAGE_TOKENS, num_pages=len(case.src))
    manifest = msgspec.structs.replace(
        manifest, capability=FRONT.capability(manifest, case.dst, peer.info.record.incarnation))
    rx.expect(manifest, case.dst)
    try:
        with anyio.fail_after(TRANSFER_TIMEOUT_S):
            pushed = await tx.push(peer, manifest, case.src, case.dst)
            verdict = await rx.completion(manifest.transfer_id) if pushed.ok else pushed
        reason = "" if pushed.ok and verdict.ok else verdict.reason or pushed.reason or "failed, no reason given"
    except TimeoutError:
        reason = f"timed out after {TRANSFER_TIMEOUT_S:g} s"
    except Exception as e:  # a transport error is a failed transfer, as in TransferLink.move
        reason = f"transport error: {type(e).__name__}: {e}"
    if reason:
        await tx.cancel(manifest.transfer_id)
        await rx.cancel(manifest.transfer_id)
        raise TransferFailed(reason)


async def bench_transport(name: str, src: torch.Tensor, dst: torch.Tensor, cases: list[Case],
                          seconds: float) -> list[Row]:
    hub = InProcessHub()  # only the inprocess transport uses it
    record = PairingRecord(model="SmolLM2-135M-Instruct@bench", dtype="float32", page_size_tokens=PAGE_TOKENS,
                           page_nbytes=PAGE_NBYTES, page_layout="pages,layers,kv,kv_heads,page_size,head_dim",
                           digest="xxh3_64", max_context_tokens=8192, incarnation=id_hex(mint_id()))
    options = {"hub": hub} if name == "inprocess" else {}
    try:
        tx, rx = (create_transport(name, secret=SECRET, front_key=FRONT.public, **options),
                  create_transport(name, secret=SECRET, front_key=FRONT.public, **options))
    except TransportUnavailable as e:
        return [Row(name, c.size, c.nbytes, "not installed", str(e)) for c in cases]
    rows: list[Row] = []
    try:
        async with anyio.create_task_group() as tg:
            try:
                with anyio.fail_after(TRANSFER_TIMEOUT_S):
                    rx_info = await rx.start(tg, dst, record)
                    await tx.start(tg, src, record)
                    peer = await tx.pair(rx_info)
                for case in cases:
                    dst[case.dst] = 0
                    try:
                        await move(tx, rx, peer, case)
                        if not landed(src, dst, case):
                            raise TransferFailed("reported ok but the destination pages differ from the source")
                        rows.append(measured(name, case, await arepeat(lambda: move(tx, rx, peer, case), seconds)))
                    except (TransferFailed, ValueError) as e:
                        rows.append(Row(name, case.size, case.nbytes, "error", str(e)))
            finally:
                await tx.aclose()
                await rx.aclose()
    except Exception as e:  # setup or teardown failed: the sizes not yet measured are errors
        done = {r.size for r in rows}
        rows += [Row(name, c.size, c.nbytes, "error", f"{type(e).__name__}: {e}") for c in cases if c.size not in done]
    return rows


def bench_digest(src: torch.Tensor, case: Case, seconds: float) -> tuple[float, float]:
    """(ms per transfer, GB/s) of xxh3_64 over the case's source pages, one page at a time."""
    mv = memoryview(src.view(torch.uint8).reshape(-1).numpy())
    pages = [mv[s * PAGE_NBYTES:(s + 1) * PAGE_NBYTES] for s in case.src]
    times = repeat(lambda: [page_digest(p, "xxh3_64") for p in pages], seconds)
    return statistics.median(times) * 1e3, case.nbytes / statistics.fmean(times) / 1e9


def print_table(rows: list[Row]) -> None:
    socket_gbps = {r.size: r.gbps for r in rows if r.method == "socket" and r.status == "ok"}
    print(f"\n{'method':<10}{'size':<9}{'MB':>7}{'GB/s':>8}{'p50 ms':>10}{'p90 ms':>10}{'vs socket':>11}{'n':>7}")
    for r in rows:
        head = f"{r.method:<10}{r.size:<9}{r.nbytes / 1e6:>7.1f}"
        if r.status != "ok":
            print(f"{head}  {r.status}: {r.reason}")
            continue
        ratio = f"{r.gbps / socket_gbps[r.size]:.2f}" if r.size in socket_gbps else "-"
        print(f"{head}{r.gbps:>8.2f}{r.p50_ms:>10.3f}{r.p90_ms:>10.3f}{ratio:>11}{r.reps:>7}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help=f"of {', '.join(SIZES)}")
    ap.add_argument("--transports", default="tcp,nixl,mooncake,inprocess")
    ap.add_argument("--repeat-seconds", type=float, default=3.0)
    ap.add_argument("--digest-cost", action="store_true", help="also time xxh3_64 alone over the same pages")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="intra-op threads; with 2 on 2 shared cores a copy_ waits ~8 ms whenever another process runs")
    args = ap.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    if unknown := [s for s in sizes if s not in SIZES]:
        ap.error(f"unknown size(s) {unknown}; choose from {', '.join(SIZES)}")
    if not (args.repeat_seconds > 0 and args.torch_threads >= 1):
        ap.error("--repeat-seconds must be positive and --torch-threads at least 1")
    transports = [t for t in args.transports.split(",") if t]
    torch.set_num_threads(args.torch_threads)
    pool_pages = max(MIB256_PAGES, *(SIZES[s] for s in sizes))
    load_before = os.getloadavg()
    print(f"{pool_pages} pages of {PAGE_NBYTES:,} B per pool, {torch.get_num_threads()} torch threads, "
          f"{os.cpu_count()} cpus, load average {load_before[0]:.2f}", flush=True)

    src = torch.randn(pool_pages, PAGE_NBYTES // 4, generator=torch.Generator().manual_seed(0))  # touched
    dst = torch.full_like(src, 1.0)  # written once, so no first-touch fault is timed
    cases = make_cases(sizes, pool_pages)
    rows = [bench_sync("memcpy", memcpy_mover(src, dst), src, dst, c, args.repeat_seconds) for c in cases]
    sock = SocketBaseline(src, dst)
    try:
        rows += [bench_sync("socket", sock.move, src, dst, c, args.repeat_seconds) for c in cases]
    finally:
        sock.close()
    for name in transports:
        print(f"  {name} ...", flush=True)
        rows += anyio.run(bench_transport, name, src, dst, cases, args.repeat_seconds)
    print_table(rows)

    digest = {}
    if args.digest_cost:
        print(f"\nxxh3_64 alone, one pass over the pages of a transfer (sender); the receiver repeats it."
              f"\n{'size':<9}{'ms':>9}{'GB/s':>8}   2 passes as share of p50")
        for c in cases:
            ms, gbps = bench_digest(src, c, args.repeat_seconds)
            share = {r.method: 2 * ms / r.p50_ms for r in rows
                     if r.size == c.size and r.status == "ok" and r.method not in ("memcpy", "socket")}
            digest[c.size] = {"ms": ms, "gbps": gbps, "share_of_p50_two_passes": share}
            print(f"{c.size:<9}{ms:>9.3f}{gbps:>8.2f}   " + "  ".join(f"{m} {s:.0%}" for m, s in share.items()))
    load_after = os.getloadavg()
    print(f"\nload average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"page_nbytes": PAGE_NBYTES, "pool_pages": pool_pages, "cpus": os.cpu_count(),
                       "torch_threads": torch.get_num_threads(), "load_average_before": load_before,
                       "load_average_after": load_after, "repeat_seconds": args.repeat_seconds,
                       "rows": [r._asdict() for r in rows], "digest": digest}, f, indent=2)


if __name__ == "__main__":
    main()
