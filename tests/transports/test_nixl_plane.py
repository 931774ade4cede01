"""`NixlPlane` for real: two planes (two NIXL agents) in this process, writing over UCX loopback.
Byte placement, the notification and when it arrives, state transitions, failures, and a close
(of a plane, and of a paired NixlTransport) that leaves no agent, thread or file descriptor behind."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("nixl")

from transport_harness import make_manifest, paired  # noqa: E402

from kvfence.transports.onesided.data_plane import WriteState  # noqa: E402
from kvfence.transports.onesided.nixl.plane import NixlPlane  # noqa: E402

KIB = 1024


def process_counts() -> tuple[int, int]:
    """(threads, open file descriptors) of this process."""
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


@pytest.fixture
def planes() -> Iterator[tuple[NixlPlane, NixlPlane, torch.Tensor, torch.Tensor, str]]:
    """A writer plane connected to a reader plane over 64 KiB pools: (tx, rx, src, dst, key)."""
    src = torch.randint(0, 256, (64 * KIB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    dst = torch.zeros(64 * KIB, dtype=torch.uint8)
    tx, rx = NixlPlane(), NixlPlane()
    tx.open(src)
    key = tx.connect(rx.open(dst))
    try:
        yield tx, rx, src, dst, key
    finally:
        tx.close()
        rx.close()


def drive(tx: NixlPlane, rx: NixlPlane, handle: object, timeout_s: float = 10.0) -> tuple[WriteState, list]:
    """Poll the write (and let the reader make progress) until it is terminal; the states seen
    and the reader's notifications up to then."""
    states, notes, deadline = [], [], time.monotonic() + timeout_s
    while True:
        states.append(tx.state(handle))
        notes += rx.notifications()
        if states[-1] is not WriteState.PENDING or time.monotonic() > deadline:
            return states[-1], notes
        time.sleep(0.0005)


def test_ranges_land_exactly_and_the_notification_follows(planes) -> None:  # type: ignore[no-untyped-def]
    tx, rx, src, dst, key = planes
    ranges = [(0, 8 * KIB, 4 * KIB), (20 * KIB, 0, 2 * KIB), (40 * KIB, 60 * KIB, 4 * KIB)]
    handle = tx.post_write(key, ranges, b"transfer-1")
    state, notes = drive(tx, rx, handle)
    assert state is WriteState.DONE
    expected = torch.zeros_like(dst)
    for s, d, n in ranges:
        expected[d:d + n] = src[s:s + n]
    assert torch.equal(dst, expected)  # every range in place, nothing else touched
    for _ in range(2000):  # the notification leaves once the write is DONE; it may trail a little
        if notes:
            break
        notes += rx.notifications()
        time.sleep(0.0005)
    assert notes == [(tx.agent_name, b"transfer-1")]
    assert tx.state(handle) is WriteState.DONE  # terminal states stick
    tx.release(handle)
    tx.release(handle)  # again: no-op
    with pytest.raises(KeyError):
        tx.state(handle)


def test_a_write_without_notification_delivers_none(planes) -> None:  # type: ignore[no-untyped-def]
    tx, rx, src, dst, key = planes
    handle = tx.post_write(key, [(0, 0, 64 * KIB)], b"")
    assert drive(tx, rx, handle)[0] is WriteState.DONE
    time.sleep(0.05)
    assert rx.notifications() == []
    assert torch.equal(dst, src)
    tx.release(handle)


def test_a_write_stays_pending_until_the_reader_makes_progress(planes) -> None:  # type: ignore[no-untyped-def]
    tx, rx, src, dst, key = planes
    handle = tx.post_write(key, [(0, 0, 64 * KIB)], b"n")
    seen = {tx.state(handle) for _ in range(50)}  # the reader never polls: the flush cannot finish
    assert seen == {WriteState.PENDING}
    with pytest.raises(RuntimeError, match="pending"):
        tx.release(handle)
    assert drive(tx, rx, handle)[0] is WriteState.DONE
    tx.release(handle)


def test_bad_writes_raise_before_anything_starts(planes) -> None:  # type: ignore[no-untyped-def]
    tx, rx, src, dst, key = planes
    with pytest.raises(ValueError, match="outside"):
        tx.post_write(key, [(0, 60 * KIB, 8 * KIB)], b"")
    with pytest.raises(ValueError, match="outside"):
        tx.post_write(key, [(0, 0, 0)], b"")
    with pytest.raises(KeyError):
        tx.post_write("nobody", [(0, 0, KIB)], b"")
    with pytest.raises(ValueError):
        tx.connect(b"not a descriptor")
    assert not dst.any()


def test_writes_to_a_closed_peer_fail_once_the_disconnect_is_noticed() -> None:
    src, dst = torch.ones(64 * KIB, dtype=torch.uint8), torch.zeros(64 * KIB, dtype=torch.uint8)
    tx, rx = NixlPlane(), NixlPlane()
    try:
        tx.open(src)
        key = tx.connect(rx.open(dst))
        first = tx.post_write(key, [(0, 0, KIB)], b"")  # connects the agents
        assert drive(tx, rx, first)[0] is WriteState.DONE
        tx.release(first)
        rx.close()
        # Until UCX notices the peer is gone, a write can still complete (the pool is still
        # mapped here: cma writes it regardless of the deregistration); then posts raise, or
        # writes end FAILED. The transport never depends on this: it writes only after "go".
        outcome, deadline = "", time.monotonic() + 5
        while not outcome and time.monotonic() < deadline:
            try:
                handle = tx.post_write(key, [(0, 0, 64 * KIB)], b"")
            except Exception:
                outcome = "post raised"
                break
            state = drive(tx, rx, handle)[0]
            tx.release(handle)
            if state is WriteState.FAILED:
                outcome = "failed"
            time.sleep(0.02)
        assert outcome in ("post raised", "failed")
    finally:
        tx.close()
        rx.close()


def test_close_leaves_no_agent_thread_or_descriptor_behind() -> None:
    gc.collect()
    before = process_counts()
    src, dst = torch.ones(64 * KIB, dtype=torch.uint8), torch.zeros(64 * KIB, dtype=torch.uint8)
    tx, rx = NixlPlane(), NixlPlane()
    tx.open(src)
    key = tx.connect(rx.open(dst))
    assert process_counts() != before  # agents hold threads and sockets while open
    done = tx.post_write(key, [(0, 0, 64 * KIB)], b"x")
    assert drive(tx, rx, done)[0] is WriteState.DONE
    tx.post_write(key, [(0, 0, KIB)], b"")  # never polled or released: close must release it
    tx.close()
    rx.close()
    tx.close()  # idempotent
    assert process_counts() == before
    assert rx.notifications() == []
    with pytest.raises(RuntimeError, match="not open"):
        tx.post_write(key, [(0, 0, KIB)], b"")
    with pytest.raises(RuntimeError, match="once"):
        tx.open(src)


def test_agent_names_are_unique() -> None:
    planes = [NixlPlane(), NixlPlane()]
    try:
        for plane in planes:
            plane.open(torch.zeros(KIB, dtype=torch.uint8))
        assert planes[0].agent_name != planes[1].agent_name
        assert planes[0].agent_name.startswith(f"kvfence-{os.getpid()}-")
    finally:
        for plane in planes:
            plane.close()


def native_threads() -> int:
    """Threads of this process that Python did not start (NIXL's and UCX's)."""
    return len(os.listdir("/proc/self/task")) - threading.active_count()


@pytest.mark.anyio
async def test_a_closed_nixl_transport_pair_leaves_no_native_thread_or_descriptor() -> None:
    gc.collect()
    threads, fds = native_threads(), process_counts()[1]
    async with paired("nixl") as p:
        manifest = make_manifest(2)
        manifest = p.arm(manifest, [3, 4])
        assert (await p.tx.push(p.peer, manifest, [0, 1], [3, 4])).ok
        assert native_threads() > threads  # the agents' (UCX's async thread)
    assert (native_threads(), process_counts()[1]) == (threads, fds)


def test_a_process_that_used_nixl_exits_cleanly() -> None:
    """Where libibverbs is installed but no RDMA device exists, UCX's InfiniBand module would crash
    the process at exit (onesided/nixl/plane.py); the plane keeps it from loading."""
    code = ("import torch\nfrom kvfence.transports.onesided.nixl.plane import NixlPlane\n"
            "plane = NixlPlane()\nplane.open(torch.zeros(1024))\nplane.close()\n")
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


LISTENERS = """
import os, torch
from kvfence.transports.onesided.nixl.plane import NixlPlane
def listening():  # this process's IPv4 TCP listeners, as (address, port)
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the listing's own descriptor
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    out = []
    for line in open("/proc/self/net/tcp").read().splitlines()[1:]:
        cols = line.split()
        if cols[3] == "0A" and cols[9] in mine:
            ip, port = cols[1].split(":")
            out.append((".".join(str(int(ip[i:i + 2], 16)) for i in (6, 4, 2, 0)), int(port, 16)))
    return out
plane = NixlPlane(hostname="127.0.0.1")
plane.open(torch.zeros(1024))
print(sorted(set(a for a, _ in listening())))
plane.close()
"""


def test_ucx_listens_only_on_the_interface_of_the_endpoints_host() -> None:
    """UCX's tcp transport opens listeners of its own beside the authenticated pairing; the plane
    keeps them to the interface of its host, as every other socket of the endpoint is: with the
    host on loopback nothing listens on another interface. (It would, with UCX left alone, on a
    machine that has another interface; a machine without one has nothing to check.)"""
    from kvfence.transports.onesided.nixl.plane import interface_addresses, interface_of

    if not set(interface_addresses()) - {"lo"}:
        pytest.skip("no network interface but loopback: nothing to keep UCX from")
    assert interface_of("127.0.0.1") == "lo"
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    done = subprocess.run([sys.executable, "-c", LISTENERS], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "['127.0.0.1']", done.stdout

