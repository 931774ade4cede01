#!/usr/bin/env python
"""Cost of scrubbing freed KV pages per mode (--kv-scrub), on the default model's page geometry.

Usage: .venv/bin/python scripts/bench_scrub.py [--pages-per-release 12] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvfence.app.config.environment import kvfence_home
from kvfence.engine.checkpoint import read_config
from kvfence.engine.kv_pool import SCRUB_MODES, UNSCRUBBED, KVPool
from kvfence.engine.loading import DTYPES
from kvfence.engine.known_models import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages-per-release", type=int, default=12)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    path = resolve_model(None, kvfence_home(), progress=False)
    config = read_config(path)  # metadata only
    pool = KVPool(config, 1024, 16, DTYPES[args.dtype])
    pool.data.fill_(1.0)  # touch every page once, so first-touch faults are not measured
    n = args.pages_per_release
    mib = n * pool.page_nbytes / 2**20
    print(f"{args.dtype}, {n} pages ({n * 16} tokens, {mib:.1f} MiB) per release, {torch.get_num_threads()} threads")
    for mode in (*SCRUB_MODES, UNSCRUBBED):
        releases = 0
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            for first in range(0, pool.num_pages - n, n):
                pages = list(range(first, first + n))
                pool.assign(pages, 5)
                pool.clear(pages, mode)
                releases += 1
        per = (time.perf_counter() - t0) / releases
        print(f"{mode:>7}: {per * 1e3:6.2f} ms per release, {mib / 1024 / per:6.1f} GiB/s")


if __name__ == "__main__":
    main()
