#!/usr/bin/env python
"""MooncakePlane write bandwidth and latency between two engines in this process (tcp, loopback):
one 256 MiB write, single-range 4 KiB and 720 KiB writes (one page of the default model is
737,280 bytes), and 64 scattered 4 KiB pages in one post. Latency is post -> DONE as seen by a
busy-polling caller.

Usage: .venv/bin/python scripts/bench_mooncake_plane.py [--protocol tcp|rdma] [--device mlx5_0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvfence.transports.onesided.data_plane import WriteState
from kvfence.transports.onesided.mooncake.plane import MooncakePlane

POOL_NBYTES = 256 << 20


def timed_write(tx: MooncakePlane, peer: str, ranges: list[tuple[int, int, int]]) -> float:
    start = time.perf_counter()
    handle = tx.post_write(peer, ranges, b"")
    while (state := tx.state(handle)) is WriteState.PENDING:
        pass
    elapsed = time.perf_counter() - start
    tx.release(handle)
    if state is not WriteState.DONE:
        raise RuntimeError(f"write ended {state}")
    return elapsed


def report(label: str, nbytes: int, times_s: list[float]) -> None:
    p50 = statistics.median(times_s)
    p99 = sorted(times_s)[min(len(times_s) - 1, int(len(times_s) * 0.99))]
    print(f"{label:<28}{nbytes / p50 / 1e9:>8.2f} GB/s  p50 {p50 * 1e6:>9.0f} us  "
          f"p99 {p99 * 1e6:>9.0f} us  (n={len(times_s)})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--protocol", default="tcp")
    parser.add_argument("--device", default="")
    args = parser.parse_args()
    src = torch.randint(0, 256, (POOL_NBYTES,), dtype=torch.uint8)
    dst = torch.zeros(POOL_NBYTES, dtype=torch.uint8)
    tx = MooncakePlane(args.protocol, args.device)
    rx = MooncakePlane(args.protocol, args.device)
    tx.open(src)
    peer = tx.connect(rx.open(dst))
    try:
        timed_write(tx, peer, [(0, 0, 4096)])  # handshake and connection setup
        report("1 x 256 MiB", POOL_NBYTES, [timed_write(tx, peer, [(0, 0, POOL_NBYTES)]) for _ in range(3)])
        if not torch.equal(src, dst):
            raise RuntimeError("256 MiB write did not land intact")
        rng = random.Random(0)
        for nbytes in (4096, 720 * 1024):
            slots = POOL_NBYTES // nbytes
            times = [timed_write(tx, peer, [(rng.randrange(slots) * nbytes, rng.randrange(slots) * nbytes,
                                            nbytes)]) for _ in range(200)]
            report(f"1 x {nbytes // 1024} KiB", nbytes, times)
        pages = POOL_NBYTES // 4096
        times = [timed_write(tx, peer, [(s * 4096, d * 4096, 4096) for s, d in
                                        zip(rng.sample(range(pages), 64), rng.sample(range(pages), 64))])
                 for _ in range(50)]
        report("64 x 4 KiB scattered", 64 * 4096, times)
    finally:
        tx.close()
        rx.close()


if __name__ == "__main__":
    main()
