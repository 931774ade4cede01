"""Where torch work runs: one compute thread per device, and no intra-op threads anywhere else.

torch's CPU kernels run their loops on OpenMP thread teams, and the OpenMP runtime (libgomp)
keeps a separate team for every application thread that starts a parallel region. Once the
process holds more OpenMP threads than it has CPUs, libgomp stops spinning between parallel
regions and puts its threads to sleep after each one, so every op of a step pays a wake-up. A
decode step is ~2,000 ops, many of them small: measured on the 2-core development machine, the
same batch-16 decode ran 150-165 tok/s on a second thread against 210-265 tok/s on the thread
that loaded the model (docs/benchmarks.md, "One compute thread").

So a server keeps exactly one team per device:
- every torch op of a worker (model load, pool allocation, steps, restarts, the readiness
  canary's local answer) runs on the device's `ComputeThread`, which alone uses the intra-op
  threads. Workers placed on the same device share it, which also runs their steps one at a time:
  on a CPU they share the same cores, and two steps at once would only slow each other down;
- `confine_to_one_intra_op_thread` holds the calling thread (the event loop's) to one intra-op
  thread, so the little torch work it does itself (transports touching page memory) never starts
  a team of its own.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import torch

T = TypeVar("T")


def confine_to_one_intra_op_thread() -> int:
    """Hold the calling thread to one intra-op thread; returns the count it had before.

    Call it from the event loop's thread before that thread runs any torch op, and again after
    starting compute threads: torch also hands its last `set_num_threads` value to every thread
    that runs its first op later, and this puts that value back to one."""
    before = torch.get_num_threads()  # also fixes this thread's own setting from now on
    torch.set_num_threads(1)
    return before


class ComputeThread:
    """One long-lived thread that runs the torch work of every worker on one device, one call at a
    time: urgent calls first, then the others, each lane in the order submitted.

    The urgent lane is for a step carrying a prompt whose first token someone waits for while other
    workers' steps queue on the same device (RunStep.urgent, set by the scheduler): it runs next,
    not after the step queued ahead of it. Each worker has at most one message in flight, so a
    call never passes an earlier call of the same worker.

    `intra_op_threads`: the OpenMP team size of this thread (None: torch's default, i.e.
    OMP_NUM_THREADS or the number of cores)."""

    def __init__(self, name: str, intra_op_threads: int | None = None) -> None:
        if intra_op_threads is not None and intra_op_threads < 1:
            raise ValueError(f"intra-op threads must be >= 1, got {intra_op_threads}")
        self.name = name
        self._lanes: tuple[collections.deque[_Call], collections.deque[_Call]] = (collections.deque(),
                                                                                  collections.deque())
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, args=(intra_op_threads,), name=name, daemon=True)
        self._thread.start()
        self.intra_op_threads: int = self.call(torch.get_num_threads)

    def _serve(self, intra_op_threads: int | None) -> None:
        if intra_op_threads is not None:
            torch.set_num_threads(intra_op_threads)
        torch.get_num_threads()  # fixes this thread's team size before anything else can change it
        while True:
            with self._ready:
                while not (self._lanes[0] or self._lanes[1] or self._closed):
                    self._ready.wait()
                if not (self._lanes[0] or self._lanes[1]):
                    return  # closed and drained
                fn, args, future = (self._lanes[0] or self._lanes[1]).popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # the caller gets it; the thread goes on
                    future.set_exception(e)

    def _submit(self, fn: Callable[..., T], args: tuple[object, ...], urgent: bool) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._ready:
            if self._closed:
                raise RuntimeError(f"the compute thread {self.name} is closed")
            self._lanes[0 if urgent else 1].append((fn, args, future))
            self._ready.notify()
        return future

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the compute thread and wait (blocking: for start-up, never on the loop)."""
        return self._submit(fn, args, False).result()

    async def run(self, fn: Callable[..., T], *args: object, urgent: bool = False) -> T:
        """Run `fn(*args)` on the compute thread without blocking the event loop (`urgent`: ahead
        of every call not urgent that waits for its turn).

        Not cancellable once submitted: a step owns its pages until it returns, so the caller
        waits for the result even when its scope is cancelled."""
        future = self._submit(fn, args, urgent)
        with anyio.CancelScope(shield=True):
            result = await asyncio.wrap_future(future)
        return result

    def close(self) -> None:
        """Finish what was submitted and end the thread."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join()


_Call = tuple[Callable[..., Any], tuple[object, ...], "concurrent.futures.Future[Any]"]
