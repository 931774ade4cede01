"""engine/compute.py: one thread per device runs the torch work, in order, and nothing else gets a team."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
import threading

import anyio
import pytest

from kvfence.engine.compute import ComputeThread


@pytest.fixture
def compute():
    thread = ComputeThread("test-compute-unit", intra_op_threads=1)
    yield thread
    thread.close()


def test_runs_everything_on_one_thread_with_its_own_team_size(compute: ComputeThread) -> None:
    import torch

    seen = [compute.call(lambda: (threading.get_ident(), torch.get_num_threads())) for _ in range(3)]
    assert len(set(seen)) == 1 and seen[0][0] != threading.get_ident()
    assert seen[0][1] == compute.intra_op_threads == 1


@pytest.mark.anyio
async def test_calls_run_one_at_a_time_in_submission_order(compute: ComputeThread) -> None:
    order: list[int] = []
    running = threading.Lock()

    def job(i: int) -> int:
        assert running.acquire(blocking=False), "two calls ran at once"
        try:
            threading.Event().wait(0.01)
            order.append(i)
            return i * i
        finally:
            running.release()

    results: dict[int, int] = {}

    async def submit(i: int) -> None:
        results[i] = await compute.run(job, i)

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(submit, i)
            await anyio.sleep(0)  # submitted in this order
    assert order == list(range(8))
    assert results == {i: i * i for i in range(8)}


@pytest.mark.anyio
async def test_a_cancelled_caller_still_waits_for_the_call(compute: ComputeThread) -> None:
    started, finished = threading.Event(), threading.Event()

    def step() -> str:
        started.set()
        threading.Event().wait(0.2)
        finished.set()
        return "done"

    with anyio.move_on_after(0.05) as scope:
        result = await compute.run(step)
    # The deadline passed mid-call, but the call owns its pages until it returns.
    assert started.is_set() and finished.is_set() and result == "done"
    assert scope.cancelled_caught or scope.cancel_called


@pytest.mark.anyio
async def test_errors_reach_the_caller_and_the_thread_goes_on(compute: ComputeThread) -> None:
    def fail() -> None:
        raise ValueError("bad step")

    with pytest.raises(ValueError, match="bad step"):
        await compute.run(fail)
    assert await compute.run(lambda: 7) == 7


def test_rejects_a_team_of_zero() -> None:
    with pytest.raises(ValueError, match="intra-op threads must be >= 1"):
        ComputeThread("bad", intra_op_threads=0)


def test_only_the_compute_thread_keeps_a_team() -> None:
    """The server's set-up (cli._serve, app/serve/server.serve), in a fresh process: the event loop's
    thread and threads started later run torch single-threaded; the compute thread keeps its team."""
    code = textwrap.dedent("""
        import threading, torch
        from kvfence.engine.compute import ComputeThread, confine_to_one_intra_op_thread
        before = confine_to_one_intra_op_thread()
        compute = ComputeThread("c", intra_op_threads=2)
        confine_to_one_intra_op_thread()
        later = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start(); t.join()
        print(before >= 1, torch.get_num_threads(), compute.call(torch.get_num_threads), later[0])
        compute.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "1", "2", "1"]


@pytest.mark.anyio
async def test_an_urgent_call_runs_before_the_calls_waiting_ahead_of_it(compute: ComputeThread) -> None:
    """A call running is never interrupted; after it, the urgent calls in the order submitted, then
    the others in theirs."""
    release = threading.Event()
    order: list[str] = []

    def job(name: str) -> None:
        if name == "running":
            release.wait(5)
        order.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(compute.run, job, "running")
        await anyio.sleep(0.05)  # it has started
        for name, urgent in (("a", False), ("b", False), ("u1", True), ("c", False), ("u2", True)):
            tg.start_soon(functools.partial(compute.run, job, name, urgent=urgent))
            await anyio.sleep(0.01)  # submitted in this order
        release.set()
    assert order == ["running", "u1", "u2", "a", "b", "c"]


def test_close_finishes_what_was_submitted() -> None:
    thread = ComputeThread("test-compute-close", intra_op_threads=1)
    done: list[int] = []
    futures = [thread._submit(done.append, (i,), i % 2 == 0) for i in range(4)]
    thread.close()
    assert all(f.done() for f in futures) and sorted(done) == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="closed"):
        thread.call(lambda: 1)
