"""A hypothesis state machine over the real scheduler: real workers (the tiny model), a real
one-sided transport over a real NIXL plane whose WRITEs the test holds, lands late or fails, and
clients that submit, go away and wait — all interleaved, with short transfer timeouts so holds
turn into timeouts, unacknowledged cancels and quarantines.

Checked after every step, against the scheduler's own state: each pool's ledger accounts for every
page; a write that may still land only aims at pages its lease still holds or that are quarantined
for it (never a free page, never another lease's); every request's stream is monotone (nothing
after its terminal delta, one terminal at most). At the end, with every held write landed and the
clients quiet: every request ended, both pools are back at their baseline, nothing is quarantined.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import anyio
import anyio.abc
import anyio.from_thread
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from nixl_planes import PlaneTransport, WrappedNixlPlane
from serving_harness import start_serving_over

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.handle import RequestHandle
from kvfence.scheduler.core.output import OutputDelta
from kvfence.scheduler.core.page_ledger import PageLedger
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.onesided.data_plane import WriteState

pytestmark = pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")
PAGE_TOKENS = 4
NUM_PAGES = 48
CONFIG = SchedulerConfig(page_size_tokens=PAGE_TOKENS, max_context_tokens=64, chunk_tokens=32, disaggregated=True,
                         transfer_timeout_s=0.25, heartbeat_s=0.2)


@dataclasses.dataclass
class Held:
    """A write the plane was asked to post; the test decides when it really goes, or fails."""

    args: tuple
    dst_pages: list[int]
    lease: int  # the decode lease whose pages it aims at (owner of its pages when posted)
    decision: str = ""  # "" (held) | "land" | "fail"
    inner: object | None = None
    terminal: bool = False  # its state was last seen DONE or FAILED


class ControlledPlane(WrappedNixlPlane):
    def __init__(self) -> None:
        super().__init__()
        self.page_nbytes = 0  # set once the pools exist
        self.decode_ledger: PageLedger | None = None
        self.held: list[Held] = []

    def post_write(self, peer: str, ranges: list[tuple[int, int, int]], notification: bytes) -> object:
        dst = [p for _, d, n in ranges for p in range(d // self.page_nbytes, (d + n) // self.page_nbytes)]
        assert self.decode_ledger is not None
        lease = owner(self.decode_ledger, dst[0])
        assert lease and all(owner(self.decode_ledger, p) == lease for p in dst), "a write aimed at pages not its lease's"
        self.held.append(held := Held((peer, ranges, notification), dst, lease))
        return held

    def state(self, handle: object) -> WriteState:
        assert isinstance(handle, Held)
        if handle.decision == "fail":
            return WriteState.FAILED
        if handle.decision == "":
            return WriteState.PENDING
        if handle.inner is None:
            handle.inner = self.inner.post_write(*handle.args)
        state = self.inner.state(handle.inner)
        handle.terminal = state is not WriteState.PENDING
        return state

    def release(self, handle: object) -> None:
        assert isinstance(handle, Held)
        if handle.inner is not None:
            self.inner.release(handle.inner)

    def in_flight(self) -> list[Held]:
        """Writes whose bytes may still land: held, or landing and not yet seen DONE."""
        return [h for h in self.held if h.decision == "" or (h.decision == "land" and not h.terminal)]


def owner(ledger: PageLedger, page: int) -> int:
    """The lease holding `page` (0: free); a quarantined page counts as its lease's."""
    for lease, pages in [*ledger._owned.items(), *ledger._quarantined.items()]:  # noqa: SLF001 (test oracle)
        if page in pages:
            return lease
    return 0


class SchedulerLifecycle(RuleBasedStateMachine):
    def __init__(self, tiny: Checkpoint) -> None:
        super().__init__()
        self.portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self.portal_cm.__enter__()
        self.streams: list[list[OutputDelta]] = []
        self.handles: list[RequestHandle] = []
        self.served, _ = self.portal.start_task(self._serve, tiny)

    async def _serve(self, tiny: Checkpoint, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Runs the scheduler, its workers and transports in one task group until `_done`."""
        secret = DeploymentSecret.generate()
        self._done = anyio.Event()
        async with anyio.create_task_group() as tg:
            self.tg = tg
            self.plane = ControlledPlane()
            self.serving = await start_serving_over(
                tg, tiny, CONFIG, NUM_PAGES, PlaneTransport(self.plane, secret, cancel_ack_timeout_s=0.05),
                PlaneTransport(WrappedNixlPlane(), secret, cancel_ack_timeout_s=0.05))
            self.plane.decode_ledger = self.serving.scheduler.ledger("decode")
            self.plane.page_nbytes = self.serving.workers[1].pool.page_nbytes
            task_status.started()
            await self._done.wait()
            await self.serving.aclose()
            tg.cancel_scope.cancel()

    # -- rules ----------------------------------------------------------------------------------
    @rule(prompt_len=st.integers(1, 20), max_tokens=st.integers(1, 12))
    def submit(self, prompt_len: int, max_tokens: int) -> None:
        def go() -> None:
            handle = self.serving.scheduler.submit(list(range(3, 3 + prompt_len)),
                                                   SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                  ignore_eos=True))
            stream: list[OutputDelta] = []
            self.handles.append(handle)
            self.streams.append(stream)

            async def read() -> None:
                async for delta in handle.deltas():
                    stream.append(delta)

            self.tg.start_soon(read)

        self.portal.call(go)

    @rule(i=st.integers(0, 20))
    def client_goes(self, i: int) -> None:
        if i < len(self.handles):
            self.portal.call(self.handles[i].abort)

    @rule(i=st.integers(0, 20), how=st.sampled_from(["land", "fail"]))
    def decide_write(self, i: int, how: str) -> None:
        def go() -> None:
            undecided = [h for h in self.plane.held if h.decision == ""]
            if undecided:
                undecided[i % len(undecided)].decision = how

        self.portal.call(go)

    @rule(seconds=st.sampled_from([0.0, 0.02, 0.1, 0.3]))
    def time_passes(self, seconds: float) -> None:
        self.portal.call(anyio.sleep, seconds)

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def ledgers_account_for_every_page(self) -> None:
        s = self.serving.scheduler
        self.portal.call(lambda: (s.ledger("prefill").check_integrity(), s.ledger("decode").check_integrity()))

    @invariant()
    def a_write_that_may_land_aims_only_at_its_leases_pages(self) -> None:
        def check() -> None:
            ledger = self.serving.scheduler.ledger("decode")
            for h in self.plane.in_flight():
                for page in h.dst_pages:
                    assert owner(ledger, page) == h.lease, \
                        f"page {page} of a write still in flight for lease {h.lease:x} is now {owner(ledger, page):x}"

        self.portal.call(check)

    @invariant()
    def streams_are_monotone(self) -> None:
        def check() -> None:
            for stream in self.streams:
                ends = [i for i, d in enumerate(stream) if d.finish_reason or d.error]
                assert len(ends) <= 1 and (not ends or ends[0] == len(stream) - 1), stream

        self.portal.call(check)

    def teardown(self) -> None:
        try:
            self.portal.call(self._drain)
        finally:
            self.portal.call(self._done.set)
            self.served.result(timeout=30)
            self.portal_cm.__exit__(None, None, None)

    async def _drain(self) -> None:
        s = self.serving.scheduler
        with anyio.fail_after(20):
            while s.in_flight() or self.plane.in_flight() or s.ledger("decode").num_quarantined \
                    or s.ledger("prefill").num_quarantined or not all(self._ended(st) for st in self.streams):
                for h in self.plane.held:
                    h.decision = h.decision or "land"
                await anyio.sleep(0.02)
        assert all(n == 0 for n in s.pages_in_use().values()), s.pages_in_use()

    @staticmethod
    def _ended(stream: list[OutputDelta]) -> bool:
        return bool(stream) and bool(stream[-1].finish_reason or stream[-1].error)

def test_the_real_scheduler_keeps_its_invariants_under_any_interleaving(tiny: Checkpoint) -> None:
    run_state_machine_as_test(lambda: SchedulerLifecycle(tiny), settings=settings(
        max_examples=12, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
