"""UCX's own listener under NIXL, established: a worker's NIXL plane (UCX kept to tcp, as between
hosts without RDMA) and a stranger process with its own NIXL agent that never took part in
kvfence's pairing. Holding the worker's agent metadata, the stranger's WRITE lands in the pool and
its READ returns the pool's bytes: UCX authenticates no peer. Nor is the metadata a key: with the
worker's 64-bit id replaced by random bytes and the agent's name by another, the WRITE and the READ
land all the same, so what they need is the listener's address (a port scan finds it) and an
address inside the pool (UCX's own traffic carries it in clear, for any observer of the network).
Sealing the pairing cannot close that, and UCX's settings do not either: with tcp's zero-copy PUT
turned off (`UCX_TCP_PUT_ENABLE=n`, both sides) UCX emulates PUT and GET in software and they land
as before. The outcome, enforced:
`--transport nixl` runs only with the operator's consent, as mooncake does
(`tests/app/config/test_config.py::test_transport_endpoint_options`, `tests/app/test_cli.py`)."""

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
metadata = bytearray(victim.metadata)
if sys.argv[2] == "forged":  # not the victim's: the worker id (UCX's address, first 8 bytes), the agent's name
    at = metadata.index(b"|c0") + 3 + 8  # the UCX backend's connection blob, after its 8-byte length
    metadata[at:at + 8] = os.urandom(8)
    metadata = bytearray(bytes(metadata).replace(victim.agent.encode(), b"x" * len(victim.agent)))
peer = agent.add_remote_agent(bytes(metadata))
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


@pytest.mark.parametrize("metadata, ucx", [("held", {}), ("forged", {}), ("forged", {"UCX_TCP_PUT_ENABLE": "n"})])
def test_a_stranger_writes_and_reads_the_pool_through_ucxs_own_listener(tmp_path: Path, metadata: str,
                                                                          ucx: dict[str, str]) -> None:
    # no shared memory, no cma: UCX's tcp listener
    env = {**os.environ, "UCX_TLS": "tcp", "NIXL_LOG_LEVEL": "WARN", **ucx}
    descriptor = tmp_path / "victim.descriptor"
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, str(descriptor)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (descriptor.exists() and descriptor.stat().st_size) and victim.poll() is None:
            assert time.monotonic() < deadline, "the worker's plane did not open"
            time.sleep(0.05)
        stranger = subprocess.run([sys.executable, "-c", STRANGER, str(descriptor), metadata], env=env,
                                  capture_output=True, text=True, timeout=120)
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
