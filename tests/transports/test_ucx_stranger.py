"""UCX's own listener under NIXL, established (issue 28, item 4, first half): a worker's NIXL plane
(UCX kept to tcp, as between hosts without RDMA) and a stranger process with its own NIXL agent
that never took part in kvfence's pairing but holds the worker's agent metadata. The stranger's
WRITE lands in the pool and its READ returns the pool's bytes: UCX authenticates no peer, and the
agent metadata (worker address, pool address, remote keys) is the only key. That is why it travels
only inside the sealed pairing (tests/transports/test_sealed_relay.py) and why the plane keeps
UCX's listener to the endpoint's interface. Whether a stranger can forge that metadata without
it is the second half, not built yet."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("nixl")

VICTIM = r"""
import sys, time, torch
from kvfence.transports.onesided.nixl.plane import NixlPlane
pool = torch.zeros(4, 1024)
pool[1] = 3.0
plane = NixlPlane(hostname="127.0.0.1")
open(sys.argv[1], "wb").write(plane.open(pool))
deadline = time.time() + 60
while time.time() < deadline and not (pool[0] == 7.0).all():
    plane.notifications()  # the worker's own progress, as its transport polls while it expects writes
    time.sleep(0.005)
end = time.time() + 2  # keep progressing a little: the stranger's READ may still be in flight
while time.time() < end:
    plane.notifications()
    time.sleep(0.005)
print("page0", float(pool[0].sum()), flush=True)
"""

STRANGER = r"""
import os, sys, time, torch, msgspec, numpy as np
from nixl._api import nixl_agent, nixl_agent_config
from kvfence.transports.onesided.nixl.plane import NixlDescriptor, skip_ucx_ib_without_rdma_devices
skip_ucx_ib_without_rdma_devices()
victim = msgspec.msgpack.decode(open(sys.argv[1], "rb").read(), type=NixlDescriptor)
agent = nixl_agent(f"stranger-{os.getpid()}", nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                                                 backends=["UCX"]))
buf = torch.full((2, 1024), 7.0)
agent.register_memory(buf)
peer = agent.add_remote_agent(victim.metadata)
for op, local, remote in (("WRITE", 0, 0), ("READ", 1, 1)):
    src = agent.get_xfer_descs(np.array([[buf[local].data_ptr(), 4096, 0]], dtype=np.uint64), "DRAM")
    dst = agent.get_xfer_descs(np.array([[victim.base_address + 4096 * remote, 4096, 0]], dtype=np.uint64), "DRAM")
    xfer = agent.initialize_xfer(op, src, dst, peer, b"")
    state, deadline = agent.transfer(xfer), time.time() + 30
    while state == "PROC" and time.time() < deadline:
        state = agent.check_xfer_state(xfer)
        time.sleep(0.005)
    print(op, state, float(buf[local].sum()), flush=True)
"""


def test_a_stranger_holding_the_agent_metadata_writes_and_reads_the_pool(tmp_path: Path) -> None:
    env = {**os.environ, "UCX_TLS": "tcp", "NIXL_LOG_LEVEL": "WARN"}  # no shared memory, no cma: UCX's tcp listener
    descriptor = tmp_path / "victim.descriptor"
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, str(descriptor)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (descriptor.exists() and descriptor.stat().st_size) and victim.poll() is None:
            assert time.monotonic() < deadline, "the worker's plane did not open"
            time.sleep(0.05)
        stranger = subprocess.run([sys.executable, "-c", STRANGER, str(descriptor)], env=env, capture_output=True,
                                  text=True, timeout=120)
        assert stranger.returncode == 0, stranger.stderr[-2000:]
        out, err = victim.communicate(timeout=90)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    assert victim.returncode == 0, err[-2000:]
    lines = [line.split() for line in stranger.stdout.splitlines() if line.startswith(("WRITE", "READ"))]
    assert lines == [["WRITE", "DONE", str(7.0 * 1024)], ["READ", "DONE", str(3.0 * 1024)]], stranger.stdout
    assert out.split() == ["page0", str(7.0 * 1024)]  # the stranger's page landed in the pool
