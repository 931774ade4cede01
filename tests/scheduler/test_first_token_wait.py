"""How much work a tenant's first token waits for beside another tenant's flood, counted.

The real scheduler core and the explorer's simulated workers (tests/scheduler/core_explorer.py)
on one simulated compute thread: both workers' steps run one after the other, in the order they
were sent, as on one device (engine/compute.py). A step costs about its rows: one per decode
sequence, one per prefill token. Measured is the rows of the steps that ran between the quiet
tenant's submit and its first token, beside a flood of three times the running slots, against
the same request alone. Nothing is timed.

The bound: the quiet request waits for the steps already in flight when it came, then for its
own prefill step, which carries at most one request of any other group; never for a decode step
of the flood (its pages' grant goes ahead of it: `grant_goes_ahead`, scheduler/policy.py) nor for
the flood's burst of prompts (`prefill_order`). So the flood's size does not change it.
"""

from __future__ import annotations

from collections import deque

import pytest
from core_explorer import Budget, World

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.protocol import RunStep
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.actions import Action, SendStep
from kvfence.scheduler.config import SchedulerConfig
from kvfence.scheduler.tenants import Tenant

CHUNK, RUNNING = 8, 8
FLOOD, QUIET = Tenant("flood"), Tenant("quiet")
LONG = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


class OneComputeThread:
    """Drives a World: the steps sent run one at a time in the order sent; a transfer lands as
    soon as it starts. `rows` counts the work of every step that ran."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.fifo: deque[tuple[str, RunStep]] = deque()
        self.rows = 0
        self.steps: list[tuple[str, RunStep]] = []
        take = world.core.take_actions

        def take_in_order() -> list[Action]:
            actions = take()
            self.fifo.extend((a.worker, a.message) for a in actions if isinstance(a, SendStep))
            return actions

        world.core.take_actions = take_in_order  # type: ignore[method-assign]  # notes the order steps are sent in

    def settle(self) -> None:
        """Carry out the core's actions (as the explorer does) and land every transfer they start."""
        w = self.world
        w.carry_out()
        while w.transfers:
            for key in list(w.transfers):
                w.land(key)
            w.carry_out()

    def run_one(self) -> None:
        name, msg = self.fifo.popleft()
        self.rows += sum(len(s.token_ids) for s in msg.seqs)
        self.steps.append((name, msg))
        self.world.reply(name)
        self.settle()

    def first_token(self, request_id: str) -> bool:
        return any(e.delta.token_ids for e in self.world.deltas.get(request_id, ()))


def world(tiny: Checkpoint, chunk: int) -> World:
    config = SchedulerConfig(page_size_tokens=4, max_context_tokens=64, max_running=RUNNING, max_queue=64,
                             chunk_tokens=chunk, disaggregated=True, queue_timeout_s=3600, heartbeat_s=3600)
    return World(tiny.tokenizer, config, 512, [], SHORT, Budget(requests=0, aborts=0, restarts=0, ticks=0,
                                                                 transfer_faults=0))


def quiet_wait(tiny: Checkpoint, flood: int, chunk: int = CHUNK, after_steps: int = 40
               ) -> tuple[int, int, list[tuple[str, RunStep]]]:
    """(rows the quiet request's first token waited for, rows in flight when it came, the steps
    it waited for), beside `flood` flood requests (0: alone) that ran `after_steps` steps first."""
    w = world(tiny, chunk)
    drive = OneComputeThread(w)
    floods = [w.core.submit([5 + i % 50, 6, 7, 8, 9, 10], LONG, 0.0, tenant=FLOOD) for i in range(flood)]
    drive.settle()
    for _ in range(after_steps):  # the flood runs, its queue waiting
        if drive.fifo:
            drive.run_one()
    in_flight = sum(len(s.token_ids) for _, m in drive.fifo for s in m.seqs)
    quiet = w.core.submit([60, 61, 62, 63, 64, 65], SHORT, 0.0, tenant=QUIET)
    drive.settle()
    before, first = drive.rows, len(drive.steps)
    while not drive.first_token(quiet.request_id):
        drive.run_one()
    if after_steps >= 40:
        assert all(r.state.terminal or r.num_generated for r in floods[:RUNNING])  # the flood was decoding
    return drive.rows - before, in_flight, drive.steps[first:]


@pytest.mark.parametrize("flood", [3 * RUNNING, 6 * RUNNING])
def test_a_first_token_waits_for_the_work_in_flight_and_its_own_prefill_only(tiny: Checkpoint, flood: int) -> None:
    alone, _, _ = quiet_wait(tiny, 0)
    beside, in_flight, steps = quiet_wait(tiny, flood)
    assert alone == 6  # its own prompt, nothing else
    assert beside <= in_flight + CHUNK, (beside, in_flight, [(n, len(m.seqs)) for n, m in steps])
    for name, msg in steps[1:]:  # after the step it found running, the decode worker ran no decode step before it
        if name == "decode":
            assert not msg.seqs, "the quiet request waited behind a decode step of the flood"


def test_its_prefill_step_carries_one_request_of_the_other_group_at_most(tiny: Checkpoint) -> None:
    """Prefill chunks of 32 tokens and a flood of 6-token prompts all prefilling when the quiet
    request comes: its step carries the flood's first prompt and its own, not the flood's burst."""
    _, _, steps = quiet_wait(tiny, 3 * RUNNING, chunk=32, after_steps=1)
    own = [m for n, m in steps if n == "prefill" and any(s.token_ids[:1] == [60] for s in m.seqs)]
    assert own and len(own[-1].seqs) <= 2, [len(s.token_ids) for s in own[-1].seqs]
