#!/usr/bin/env python
"""Page digest throughput: the algorithms a transport pair could agree on, over one 64 MiB buffer
and over KV pages of the default model (737,280 bytes in fp32), in GB/s.

Usage: .venv/bin/python scripts/bench_digest.py
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import numpy as np
import xxhash

from kvfence.app.config.config import PoolsConfig

PAGE_NBYTES = 46_080 * PoolsConfig().page_size_tokens  # one fp32 page of the default model, default page size


def algorithms() -> dict[str, Callable[[memoryview], object]]:
    algs: dict[str, Callable[[memoryview], object]] = {
        "xxh3_64": xxhash.xxh3_64_intdigest,
        "xxh3_128": xxhash.xxh3_128_intdigest,
        "sha256": lambda b: hashlib.sha256(b).digest(),
        "blake2b": lambda b: hashlib.blake2b(b).digest(),
    }
    return algs


def rate(fn: Callable[[memoryview], object], views: list[memoryview], min_s: float = 0.5) -> float:
    total = sum(v.nbytes for v in views)
    for v in views[:2]:
        fn(v)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_s:
        for v in views:
            fn(v)
        reps += 1
    return reps * total / (time.perf_counter() - start) / 1e9


def main() -> None:
    data = memoryview(np.random.default_rng(0).integers(0, 256, 64 * 2**20, dtype=np.uint8).tobytes())
    whole = [data]
    pages = [data[i: i + PAGE_NBYTES] for i in range(0, data.nbytes - PAGE_NBYTES, PAGE_NBYTES)]
    print(f"{'algorithm':<10}{'64 MiB GB/s':>13}{'per page GB/s':>15}")
    for name, fn in algorithms().items():
        print(f"{name:<10}{rate(fn, whole):>13.1f}{rate(fn, pages):>15.1f}", flush=True)


if __name__ == "__main__":
    main()
