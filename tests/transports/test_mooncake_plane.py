"""MooncakePlane against the real engine (tcp, loopback): two planes in one process, each with
its own engine and pool; every write is checked byte for byte, including the bytes it must not
touch. And what a stranger's engine (no secret, no descriptor: only the port, which a scan finds)
can reach of a pool: nothing but the ranges a push in flight has exposed."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch
from transport_harness import MooncakeStranger

pytest.importorskip("mooncake.engine")

from kvfence.transports.onesided.data_plane import WriteState  # noqa: E402
from kvfence.transports.onesided.mooncake.plane import MooncakeDescriptor, MooncakePlane, merge_ranges  # noqa: E402

PAGE = 4096
SMALL_NBYTES = 256 * PAGE  # the part of the pools the small-write tests use
POOL_NBYTES = (64 << 20) + SMALL_NBYTES


def wait_terminal(plane: MooncakePlane, handle: object, timeout_s: float = 20.0) -> WriteState:
    deadline = time.monotonic() + timeout_s
    while (state := plane.state(handle)) is WriteState.PENDING and time.monotonic() < deadline:
        time.sleep(0.001)
    return state


def num_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Pair:
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.src = torch.randint(0, 256, (POOL_NBYTES,), dtype=torch.uint8, generator=gen)
        self.dst = torch.zeros(POOL_NBYTES, dtype=torch.uint8)
        self.tx, self.rx = MooncakePlane(), MooncakePlane()
        self.tx.open(self.src)
        self.rx_descriptor = self.rx.open(self.dst)
        self.rx.expose([(0, POOL_NBYTES)])  # as a receiver does for a push's dst pages, here all of them
        self.peer = self.tx.connect(self.rx_descriptor)

    def write(self, ranges: list[tuple[int, int, int]]) -> WriteState:
        handle = self.tx.post_write(self.peer, ranges, b"")
        state = wait_terminal(self.tx, handle)
        assert self.tx.state(handle) is state  # terminal states are sticky and safe to ask again
        self.tx.release(handle)
        return state

    def expected(self, ranges: list[tuple[int, int, int]]) -> torch.Tensor:
        out = torch.zeros(SMALL_NBYTES, dtype=torch.uint8)
        for src, dst, n in ranges:
            out[dst:dst + n] = self.src[src:src + n]
        return out


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.tx.close()
    p.rx.close()


def test_merge_ranges_coalesces_only_runs_contiguous_on_both_sides() -> None:
    assert merge_ranges([(4096, 8192, 4096), (0, 4096, 4096)]) == [(0, 4096, 8192)]
    assert merge_ranges([(0, 0, 10), (10, 20, 10)]) == [(0, 0, 10), (10, 20, 10)]
    assert merge_ranges([(20, 0, 5), (0, 5, 5), (5, 10, 5)]) == [(0, 5, 10), (20, 0, 5)]
    assert merge_ranges([]) == []


def test_descriptor_names_the_session_and_the_pool(pair: Pair) -> None:
    desc = msgspec.msgpack.decode(pair.rx_descriptor, type=MooncakeDescriptor)
    assert desc.session_id == pair.rx.session_id and desc.session_id.startswith("127.0.0.1:")
    assert (desc.protocol, desc.base_address, desc.nbytes) == ("tcp", pair.dst.data_ptr(), POOL_NBYTES)
    assert pair.tx.connect(pair.rx_descriptor) == pair.peer  # idempotent


def _scattered(num: int, seed: int) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    src_pages = rng.sample(range(SMALL_NBYTES // PAGE), num)
    dst_pages = rng.sample(range(SMALL_NBYTES // PAGE), num)
    return [(s * PAGE, d * PAGE, PAGE) for s, d in zip(src_pages, dst_pages)]


CASES = {
    "one": [(3 * PAGE, 5 * PAGE, PAGE)],
    "one_odd_sizes": [(17, 1000, 12345)],
    "two_adjacent": [(0, 10 * PAGE, PAGE), (PAGE, 11 * PAGE, PAGE)],
    "two_adjacent_reversed": [(PAGE, 11 * PAGE, PAGE), (0, 10 * PAGE, PAGE)],
    "two_scattered": [(100 * PAGE, 3 * PAGE, 2 * PAGE), (7 * PAGE, 200 * PAGE, PAGE)],
    "many_adjacent_run": [(i * PAGE, (40 + i) * PAGE, PAGE) for i in range(64)][::-1],
    "many_scattered": _scattered(100, seed=7),
    "many_mixed": [(i * PAGE, (200 + i) * PAGE, PAGE) for i in range(8)][::-1]
    + [(50 * PAGE + 7, 100 * PAGE + 1, 3 * PAGE), (9 * PAGE, 150 * PAGE, 11520)],
    "one_720kib": [(20 * PAGE, 0, 720 * 1024)],
}


@pytest.mark.parametrize("name", list(CASES))
def test_write_lands_exactly_the_ranges(pair: Pair, name: str) -> None:
    ranges = CASES[name]
    pair.dst[:SMALL_NBYTES].zero_()
    assert pair.write(ranges) is WriteState.DONE
    assert torch.equal(pair.dst[:SMALL_NBYTES], pair.expected(ranges))  # and nothing else moved


def test_bad_ranges_and_peers_are_refused_before_anything_starts(pair: Pair) -> None:
    for ranges in ([(0, 0, 0)], [(-1, 0, 8)], [(0, POOL_NBYTES - 4, 8)], [(POOL_NBYTES, 0, 1)],
                   [(0, 0, 8), (100, 4, 8)]):
        with pytest.raises(ValueError):
            pair.tx.post_write(pair.peer, ranges, b"")
    with pytest.raises(KeyError):
        pair.tx.post_write("127.0.0.1:1", [(0, 0, 8)], b"")
    rdma = MooncakeDescriptor(session_id="127.0.0.1:1", protocol="rdma", base_address=4096, nbytes=4096)
    with pytest.raises(ValueError, match="rdma"):
        pair.tx.connect(msgspec.msgpack.encode(rdma))
    with pytest.raises(KeyError):
        pair.tx.state(object())


def test_64mib_write_and_close_waits_for_it(pair: Pair) -> None:
    """≥ 64 MiB in one write; a sender cannot close or release while it is in flight."""
    tx = MooncakePlane()
    tx.open(pair.src)
    nbytes = 64 << 20
    handle = tx.post_write(tx.connect(pair.rx_descriptor), [(0, SMALL_NBYTES, nbytes)], b"")
    with pytest.raises(RuntimeError, match="in flight"):  # 64 MiB cannot land within microseconds
        tx.close()
    with pytest.raises(RuntimeError, match="pending"):
        tx.release(handle)
    assert wait_terminal(tx, handle) is WriteState.DONE
    assert torch.equal(pair.dst[SMALL_NBYTES:SMALL_NBYTES + nbytes], pair.src[:nbytes])
    tx.release(handle)
    tx.release(handle)  # released twice: no-op
    with pytest.raises(KeyError):
        tx.state(handle)
    tx.close()
    tx.close()  # idempotent
    with pytest.raises(RuntimeError):
        tx.post_write(pair.peer, [(0, 0, 8)], b"")
    with pytest.raises(RuntimeError):
        tx.open(pair.src)


def _closed_peer(pair: Pair, write_first: bool, tx: MooncakePlane | None = None) -> tuple[MooncakePlane, str]:
    """A peer plane that is closed by the time the caller writes to it."""
    tx = tx or pair.tx
    pool = torch.zeros(8 << 20, dtype=torch.uint8)
    victim = MooncakePlane()
    key = tx.connect(victim.open(pool))
    victim.expose([(0, pool.nbytes)])
    if write_first:  # the engine then has the session cached and a connection open
        handle = tx.post_write(key, [(0, 0, PAGE)], b"")
        assert wait_terminal(tx, handle) is WriteState.DONE
        tx.release(handle)
    victim.close()
    return victim, key


def test_write_to_a_closed_peer_fails_at_post_or_ends_failed(pair: Pair) -> None:
    _, key = _closed_peer(pair, write_first=False)
    with pytest.raises(ConnectionError):  # first contact: the handshake is refused, nothing starts
        pair.tx.post_write(key, [(0, 0, PAGE)], b"")
    _, key = _closed_peer(pair, write_first=True)
    for nbytes in (PAGE, 8 << 20):
        handle = pair.tx.post_write(key, [(0, 0, nbytes)], b"")
        assert wait_terminal(pair.tx, handle) is WriteState.FAILED
        pair.tx.release(handle)


def test_a_failure_too_late_to_rule_out_an_engine_timeout_stays_pending(pair: Pair) -> None:
    """With trusted_failure_s=0 every failure could be a timeout against a live peer, whose
    buffered bytes may still land: the write stays PENDING for good, yet close() may proceed."""
    tx = MooncakePlane(trusted_failure_s=0)
    tx.open(pair.src)
    _, key = _closed_peer(pair, write_first=True, tx=tx)
    handle = tx.post_write(key, [(0, 0, PAGE)], b"")
    time.sleep(2)  # the engine gives up on a refused peer within about a second
    assert tx.state(handle) is WriteState.PENDING
    with pytest.raises(RuntimeError):
        tx.release(handle)
    tx.close()  # the engine has let go of the write: closing does not wait for it
    assert tx.state(handle) is WriteState.PENDING


def test_open_close_cycles_leak_no_threads_or_descriptors(pair: Pair) -> None:
    def cycle() -> None:
        tx = MooncakePlane()
        tx.open(pair.src)
        handle = tx.post_write(tx.connect(pair.rx_descriptor), [(0, 0, PAGE)], b"")
        assert wait_terminal(tx, handle) is WriteState.DONE
        tx.release(handle)
        tx.close()

    cycle()  # the first engine in a process sets up process-wide state (logging, allocator)
    threads, fds = num_threads(), num_fds()
    for _ in range(10):
        cycle()
    assert (num_threads(), num_fds()) == (threads, fds)


def test_one_batch_failing_while_another_still_writes_keeps_the_write_pending(pair: Pair) -> None:
    """FAILURES 7 with the real engine: one write of two ranges is two engine batches in flight at
    once. The small one is reported failed (its status is the one thing injected) while the other,
    64 MiB, is still really being written: the write stays PENDING, so nothing can be released,
    until that batch is terminal too; then it is FAILED, and the big range's bytes did land."""
    from kvfence.transports.onesided.mooncake import plane as mooncake_plane

    tx = MooncakePlane()
    tx.open(pair.src)
    big = (64 << 20) - 2 * PAGE
    ranges = [(0, SMALL_NBYTES, PAGE), (2 * PAGE, SMALL_NBYTES + 2 * PAGE, big)]  # not contiguous: two batches
    pair.dst[SMALL_NBYTES:].zero_()
    handle = tx.post_write(tx.connect(pair.rx_descriptor), ranges, b"")
    assert len(handle.live) == 2  # type: ignore[attr-defined]
    small_batch = handle.live[0]  # type: ignore[attr-defined]
    engine = tx._engine  # type: ignore[attr-defined]

    class ReportsTheSmallBatchFailed:  # the real engine, but for that one status
        def __getattr__(self, name: str) -> object:
            return getattr(engine, name)

        def transfer_check_status(self, batch: int) -> int:
            return mooncake_plane._FAILED if batch == small_batch else engine.transfer_check_status(batch)

    tx._engine = ReportsTheSmallBatchFailed()  # type: ignore[attr-defined]
    pending_after_failure = 0
    while (state := tx.state(handle)) is WriteState.PENDING:
        if handle.failed and handle.live:  # type: ignore[attr-defined]
            pending_after_failure += 1
        time.sleep(0.0005)
    assert pending_after_failure > 0  # seen failed while the other batch still wrote: still PENDING
    assert state is WriteState.FAILED
    assert torch.equal(pair.dst[SMALL_NBYTES + 2 * PAGE:SMALL_NBYTES + 2 * PAGE + big], pair.src[2 * PAGE:2 * PAGE + big])
    tx.release(handle)
    tx._engine = engine  # type: ignore[attr-defined]
    tx.close()


def test_a_stranger_reaches_nothing_of_a_pool_but_the_ranges_a_push_exposes() -> None:
    """Mooncake's own handshake port answers anyone, and its data port serves whatever memory is
    registered: so over tcp a plane registers nothing at `open`, and a receiver exposes only a
    push's dst pages, from its "go" to its end. Outside them a stranger neither writes nor reads;
    inside them (the window a push is in flight) the same calls work, which is what the rest of
    this test rules out elsewhere."""
    secret = torch.full((64 * PAGE,), 0x5A, dtype=torch.uint8)  # a pool holding some tenant's KV
    sender_pool = torch.full((64 * PAGE,), 0x6B, dtype=torch.uint8)
    rx, tx, stranger = MooncakePlane(), MooncakePlane(), MooncakeStranger()
    try:
        rx.open(secret)
        tx.open(sender_pool)
        base = secret.data_ptr()
        for plane, pool in ((rx, secret), (tx, sender_pool)):
            assert stranger.write(plane.session_id, pool.data_ptr() + 8 * PAGE) < 0
            assert stranger.read(plane.session_id, pool.data_ptr() + 8 * PAGE) < 0
        assert bool((secret == 0x5A).all()) and bool((sender_pool == 0x6B).all())
        assert bool((stranger.buffer == 0xAB).all())  # nothing was read into it

        exposure = rx.expose([(8 * PAGE, PAGE), (9 * PAGE, PAGE), (20 * PAGE, PAGE)])
        stranger = MooncakeStranger()  # the engine stops trying a session after a few refusals
        assert stranger.write(rx.session_id, base + 2 * PAGE) < 0  # outside the exposed pages
        assert stranger.write(rx.session_id, base + 9 * PAGE + PAGE // 2) < 0  # straddling their end
        assert stranger.write(rx.session_id, base + 8 * PAGE) == 0  # inside: the window of a push
        assert bool((secret[8 * PAGE:9 * PAGE] == 0xAB).all())
        assert int((secret != 0x5A).sum()) == PAGE
        rx.conceal(exposure)
        rx.conceal(exposure)  # idempotent
        for page in (8, 9, 20):
            assert stranger.write(rx.session_id, base + page * PAGE) < 0
            assert stranger.read(rx.session_id, base + page * PAGE) < 0
        assert int((secret != 0x5A).sum()) == PAGE
    finally:
        rx.close()
        tx.close()


def test_an_exposure_the_engine_refuses_exposes_nothing() -> None:
    pool = torch.zeros(16 * PAGE, dtype=torch.uint8)
    rx = MooncakePlane()
    try:
        rx.open(pool)
        held = rx.expose([(4 * PAGE, PAGE)])
        with pytest.raises(RuntimeError, match="could not register"):  # its second range overlaps the first
            rx.expose([(0, PAGE), (4 * PAGE, PAGE)])
        with pytest.raises(ValueError):
            rx.expose([(15 * PAGE, 2 * PAGE)])  # past the pool
        stranger = MooncakeStranger()
        assert stranger.write(rx.session_id, pool.data_ptr()) < 0  # the first range was undone
        rx.conceal(held)
    finally:
        rx.close()
