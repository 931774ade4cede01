"""How much work a tenant's first token waits for beside another tenant's flood, counted.

The real scheduler core and the explorer's simulated workers (tests/scheduler/core/core_explorer.py)
on one simulated compute thread: both workers' steps run one after the other, in the order they
were sent, as on one device (engine/compute.py). A step costs about its rows: one per decode
sequence, one per prefill token. Measured is the rows of the steps that ran between the quiet
tenant's submit and its first token, beside a flood of three times the running slots, against
the same request alone. Nothing is timed.

The bound: the quiet request waits for the steps already in flight when it came, then for its
own prefill step, which carries at most one request of any other group; never for a decode step
of the flood (its pages' grant goes ahead of it: `grant_goes_ahead`, scheduler/core/policy.py) nor for
the flood's burst of prompts (`prefill_order`). So the flood's size does not change it.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest
from core_explorer import Budget, World

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.protocol import RunStep
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.actions import Action, CutStep, SendStep
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.lifecycle import State
from kvfence.scheduler.core.request import Request
from kvfence.scheduler.core.tenants import Tenant

CHUNK, RUNNING = 8, 8
FLOOD, QUIET = Tenant(name="flood"), Tenant(name="quiet")
LONG = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


class OneComputeThread:
    """Drives a World whose workers share one device: the steps sent run one at a time, urgent
    ones (RunStep.urgent) first, each lane in the order sent, and the device takes its next step
    as soon as one ends, before the scheduler hears of it (engine/compute.py); a transfer lands as
    soon as it starts. `rows` counts the work of every step that ran."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.fifo: deque[tuple[str, RunStep]] = deque()
        self.current: tuple[str, RunStep] | None = None  # the step the device runs
        self.rows = 0
        self.steps: list[tuple[str, RunStep]] = []
        self.sent: list[tuple[str, RunStep, list[RunStep]]] = []  # each step sent, with the steps queued then
        self.cut_asked: set[tuple[str, int]] = set()  # (worker, step id) of each CutStep
        self.cuts = 0
        take = world.core.take_actions

        def take_in_order() -> list[Action]:
            actions = take()
            for a in actions:
                if isinstance(a, SendStep):
                    self.sent.append((a.worker, a.message, [m for _, m in self.queued]))
                    self.fifo.append((a.worker, a.message))
                elif isinstance(a, CutStep):
                    self.cut_asked.add((a.worker, a.step_id))
            self._pick()
            return actions

        world.core.take_actions = take_in_order  # type: ignore[method-assign]  # notes the order steps are sent in

    @property
    def queued(self) -> list[tuple[str, RunStep]]:
        """The step running, then those waiting."""
        return ([self.current] if self.current else []) + list(self.fifo)

    def _pick(self) -> None:
        if self.current is None and self.fifo:
            i = next((k for k, (_, m) in enumerate(self.fifo) if m.urgent), 0)
            self.current = self.fifo[i]
            del self.fifo[i]

    def settle(self) -> None:
        """Carry out the core's actions (as the explorer does) and land every transfer they start."""
        w = self.world
        w.carry_out()
        while w.transfers:
            for key in list(w.transfers):
                w.land(key)
            w.carry_out()

    def run_one(self) -> None:
        """The step the device runs ends: whole, or, if it was asked to stop (CutStep) and was sent
        cuttable, at once (its rows not counted: it stops at the next of its layers)."""
        assert self.current is not None
        (name, msg), self.current = self.current, None
        cut = msg.cuttable and (name, msg.step_id) in self.cut_asked
        self.cuts += cut
        self.rows += 0 if cut else sum(len(s.token_ids) for s in msg.seqs)
        self.steps.append((name, msg))
        self._pick()  # the device goes on before the reply is read
        self.world.reply(name, cut=cut)
        self.settle()

    def first_token(self, request_id: str) -> bool:
        return any(e.delta.token_ids for e in self.world.deltas.get(request_id, ()))


def world(tiny: Checkpoint, chunk: int, contended: int | None = None, decodes: int = 1, **config: object) -> World:
    """Disaggregated workers on one device, pages to spare; `config`: more SchedulerConfig fields."""
    fields: dict = dict(page_size_tokens=4, max_context_tokens=64, max_running=RUNNING, max_queue=64,
                        chunk_tokens=chunk, contended_chunk_tokens=contended, disaggregated=True,
                        queue_timeout_s=3600, heartbeat_s=3600)
    return World(tiny.tokenizer, SchedulerConfig(**(fields | config)), 512, [], SHORT,
                 Budget(requests=0, aborts=0, restarts=0, ticks=0, transfer_faults=0), decodes=decodes, device="cpu")


def quiet_wait(tiny: Checkpoint, flood: int, chunk: int = CHUNK, after_steps: int = 40
               ) -> tuple[int, int, list[tuple[str, RunStep]]]:
    """(rows the quiet request's first token waited for, rows in flight when it came, the steps
    it waited for after those in flight), beside `flood` flood requests (0: alone) that ran
    `after_steps` steps first."""
    w = world(tiny, chunk)
    drive = OneComputeThread(w)
    floods = [w.core.submit([5 + i % 50, 6, 7, 8, 9, 10], LONG, 0.0, tenant=FLOOD) for i in range(flood)]
    drive.settle()
    for _ in range(after_steps):  # the flood runs, its queue waiting
        if drive.current:
            drive.run_one()
    in_flight = sum(len(s.token_ids) for _, m in drive.queued for s in m.seqs)
    queued = len(drive.queued)
    quiet = w.core.submit([60, 61, 62, 63, 64, 65], SHORT, 0.0, tenant=QUIET)
    drive.settle()
    before, first = drive.rows, len(drive.steps)
    while not drive.first_token(quiet.request_id):
        drive.run_one()
    if after_steps >= 40:
        assert all(r.state.terminal or r.num_generated for r in floods[:RUNNING])  # the flood was decoding
    return drive.rows - before, in_flight, drive.steps[first + queued:]


@pytest.mark.parametrize("flood", [3 * RUNNING, 6 * RUNNING])
def test_a_first_token_waits_for_the_work_in_flight_and_its_own_prefill_only(tiny: Checkpoint, flood: int) -> None:
    alone, _, _ = quiet_wait(tiny, 0)
    beside, in_flight, steps = quiet_wait(tiny, flood)
    assert alone == 6  # its own prompt, nothing else
    assert beside <= in_flight + CHUNK, (beside, in_flight, [(n, len(m.seqs)) for n, m in steps])
    for name, msg in steps:  # after the steps it found in flight, the decode worker ran no decode step before it
        if name == "decode":
            assert not msg.seqs, "the quiet request waited behind a decode step of the flood"


def test_its_prefill_step_carries_one_request_of_the_other_group_at_most(tiny: Checkpoint) -> None:
    """Prefill chunks of 32 tokens and a flood of 6-token prompts all prefilling when the quiet
    request comes: its step carries the flood's first prompt and its own, not the flood's burst."""
    _, _, steps = quiet_wait(tiny, 3 * RUNNING, chunk=32, after_steps=1)
    own = [m for n, m in steps if n == "prefill" and any(s.token_ids[:1] == [60] for s in m.seqs)]
    assert own and len(own[-1].seqs) <= 2, [len(s.token_ids) for s in own[-1].seqs]


def _flood_prefill_tokens(msg: RunStep, quiet_prompt: list[int]) -> int:
    return sum(len(s.token_ids) for s in msg.seqs if not set(s.token_ids) <= set(quiet_prompt))


def test_while_two_groups_are_active_a_group_already_decoding_prefills_short_steps(tiny: Checkpoint) -> None:
    """Chunks of 32 tokens, 8 while contended; flood prompts of 20 tokens. The flood alone fills
    its steps up to the chunk. Once the quiet tenant has sent a request (within RecentGroups'
    window), the flood, which has requests decoding, prefills at most 8 tokens a step, so the next
    quiet request finds at most that much of it in flight, and the quiet prompt (waiting for its
    first token) goes whole in its step. Past the window, the flood gets the whole chunk again."""
    w = world(tiny, 32, 8)
    drive = OneComputeThread(w)
    for i in range(6 * RUNNING):
        w.core.submit([5 + i % 50] + [6 + i % 7] * 19, LONG, w.now, tenant=FLOOD)
    drive.settle()

    def flood_steps(count: int, quiet_prompt: list[int]) -> list[int]:
        start = len(drive.steps)
        for _ in range(count):
            drive.run_one()
        return [_flood_prefill_tokens(m, quiet_prompt) for n, m in drive.steps[start:] if n == "prefill"]

    quiet_prompt = list(range(60, 80))
    assert max(flood_steps(30, quiet_prompt)) > 8  # alone: the whole chunk
    w.now = 1.0
    quiet = w.core.submit(quiet_prompt, SHORT, w.now, tenant=QUIET)
    drive.settle()
    start = len(drive.steps)
    while not drive.first_token(quiet.request_id):
        drive.run_one()
    own = [m for n, m in drive.steps[start:] if n == "prefill" and any(set(s.token_ids) <= set(quiet_prompt)
                                                                        for s in m.seqs)]
    assert [len(s.token_ids) for s in own[0].seqs if set(s.token_ids) <= set(quiet_prompt)] == [20]
    contended = flood_steps(30, quiet_prompt)
    assert contended and max(contended) <= 8, contended
    w.now = 1.0 + w.config.contention_window_s + 1
    assert max(flood_steps(30, quiet_prompt)) > 8  # the quiet tenant went quiet: the whole chunk again


@pytest.mark.parametrize("after_steps", [40, 41, 42, 43, 57, 64, 71])
def test_while_contended_a_first_token_waits_for_the_step_running_and_its_own_prefill(
        tiny: Checkpoint, after_steps: int) -> None:
    """The quiet tenant sent a request before (so the server is contended) while a flood of 24
    runs: no step waits on the device behind the one it runs (`waits_for_device`), and the quiet
    tenant's next request's first token waits for that step, then its own prefill, which goes
    ahead of any step queued since (RunStep.urgent) and carries nothing of the flood (which may
    prefill 2 tokens a step while contended). Several moments of the flood's run, so the step running is a decode step in some
    and a prefill step in others."""
    w = world(tiny, CHUNK, contended=2)
    drive = OneComputeThread(w)
    for i in range(3 * RUNNING):
        w.core.submit([5 + i % 50, 6, 7, 8, 9, 10], LONG, 0.0, tenant=FLOOD)
    first = w.core.submit([70, 71, 72, 73, 74, 75], SHORT, 0.0, tenant=QUIET)
    drive.settle()
    for _ in range(after_steps):
        drive.run_one()
    assert first.state.terminal and w.core.num_running() == RUNNING
    stepping = [m for _, m in drive.queued if m.seqs]
    assert len(stepping) <= 1, "two steps queued on the device"
    running = sum(len(s.token_ids) for m in stepping for s in m.seqs)
    quiet = w.core.submit([60, 61, 62, 63, 64, 65], SHORT, 0.0, tenant=QUIET)
    drive.settle()
    before = drive.rows
    while not drive.first_token(quiet.request_id):
        drive.run_one()
    assert drive.rows - before <= running + 6, (drive.rows - before, running)


@pytest.mark.parametrize("contended", [False, True], ids=["first-in-a-while", "contended"])
def test_a_first_token_never_waits_for_the_rest_of_a_step_of_another_groups_prompts(tiny: Checkpoint,
                                                                                      contended: bool) -> None:
    """Chunks of 32 tokens (16 while contended), flood prompts of 20 tokens, the flood sending all
    along: whenever the step the device runs is a step of the flood's prompts (sent cuttable: the
    flood is decoding), a quiet request that comes has it cut (CutStep) and waits for the rows of
    its own prompt, plus, when the server was not contended, the steps queued behind the one cut
    (uncontended, steps queue on the device) — never for the flood's 20 to 32 rows of the step cut.
    The chunks cut go again, and every request ends with all its tokens and pages. Contended, the
    flood holds every running slot and queues more; the first request in a while finds a slot free
    (with none free, both workers' steps in flight hold every request that could give one up)."""
    w = world(tiny, 32, 16, max_running=RUNNING if contended else 64)
    drive = OneComputeThread(w)

    def flood_request(i: int) -> Request:
        return w.core.submit([5 + i % 50] + [6 + i % 7] * 19, LONG, w.now, tenant=FLOOD)

    reqs = [flood_request(i) for i in range(4 * RUNNING)]
    if contended:  # the quiet tenant sent a request lately
        reqs.append(w.core.submit([90, 91], SHORT, w.now, tenant=QUIET))
    drive.settle()
    waits, allowed, cut_rows = [], [], []
    for probe in range(8):
        while any(r.tenant == "quiet" and not r.state.terminal for r in reqs):
            drive.run_one()  # the quiet tenant sends one request at a time
        last_sent = drive.sent[-1][1].step_id
        if not contended:
            w.now += w.config.contention_window_s + 1  # the quiet tenant's first request in a while
        reqs.append(flood_request(probe))  # the flood keeps sending
        drive.settle()
        for _ in range(60):  # a step of the flood's prompts sent since, running
            if drive.current and drive.current[0] == "prefill" and drive.current[1].cuttable and \
                    drive.current[1].step_id > last_sent:
                break
            drive.run_one()
        else:
            raise AssertionError("no step of the flood's prompts was sent cuttable")
        cut_rows.append(sum(len(s.token_ids) for s in drive.current[1].seqs))
        queued = sum(len(s.token_ids) for _, m in drive.fifo for s in m.seqs)
        quiet = w.core.submit([60 + probe, 61, 62, 63, 64, 65], SHORT, w.now, tenant=QUIET)
        reqs.append(quiet)
        drive.settle()
        before = drive.rows
        while not drive.first_token(quiet.request_id):
            drive.run_one()
        waits.append(drive.rows - before)
        allowed.append(6 + queued)

    assert all(wait <= bound for wait, bound in zip(waits, allowed)), (waits, allowed, cut_rows)
    if contended:
        assert waits == [6] * len(waits), (waits, cut_rows)  # nothing queues on the device while contended
    assert drive.cuts == len(waits) and max(cut_rows) >= (16 if contended else 20), cut_rows
    while drive.current is not None:
        drive.run_one()
    assert all(r.state is State.FINISHED and r.num_generated == r.params.max_tokens for r in reqs)
    assert w.core.pages_in_use() == {name: 0 for name in w.core.pages_in_use()}


def test_a_chunk_is_cut_once_at_most_however_many_first_tokens_come(tiny: Checkpoint) -> None:
    """A quiet tenant sending one-token requests one after another, each while a step of the
    flood's prompts runs, would cut every such step (its group never has anything decoding): the
    chunks a cut step carried go again whole (not cuttable), so each costs its request one try
    more at most, and the flood still finishes."""
    w = world(tiny, 32, 16)
    drive = OneComputeThread(w)
    reqs = [w.core.submit([5 + i % 50] + [6 + i % 7] * 19, LONG, w.now, tenant=FLOOD) for i in range(3 * RUNNING)]
    one = dataclasses.replace(SHORT, max_tokens=1)
    drive.settle()
    while drive.current is not None:
        name, msg = drive.current
        if name == "prefill" and msg.seqs and not msg.urgent and len(reqs) < 200:
            reqs.append(w.core.submit([60 + len(reqs) % 30, 61, 62], one, w.now, tenant=QUIET))
            drive.settle()
        drive.run_one()
    cut = {(n, m.step_id) for n, m in drive.steps if m.cuttable and (n, m.step_id) in drive.cut_asked}
    assert len(cut) == drive.cuts > 10
    for i, (name, msg) in enumerate(drive.steps):
        if (name, msg.step_id) not in cut:
            continue
        leases = {s.lease for s in msg.seqs}
        again = next(m for n, m in drive.steps[i + 1:] if n == "prefill" and leases & {s.lease for s in m.seqs})
        assert not again.cuttable, f"the chunks of cut step {msg.step_id} were sent cuttable again"
    assert all(r.state is State.FINISHED and r.num_generated == r.params.max_tokens for r in reqs)
    assert w.core.pages_in_use() == {name: 0 for name in w.core.pages_in_use()}


def test_a_prefill_worker_waiting_for_its_turn_is_never_starved(tiny: Checkpoint) -> None:
    """One prefill and two decode workers on one device, contended the whole run (a quiet
    request every few steps beside a flood of 48): every request ends with its tokens, and a
    prefill step of the flood alone is never sent while another step is queued on the device."""
    w = world(tiny, CHUNK, decodes=2)
    drive = OneComputeThread(w)
    reqs = [w.core.submit([5 + i % 50, 6, 7, 8, 9, 10], dataclasses.replace(LONG, max_tokens=10 + i % 17), 0.0,
                          tenant=FLOOD) for i in range(6 * RUNNING)]
    drive.settle()
    steps = 0
    while drive.current is not None:
        if steps % 25 == 0 and steps < 1500:
            reqs.append(w.core.submit([60 + steps % 30, 61, 62], SHORT, 0.0, tenant=QUIET))
            drive.settle()
        drive.run_one()
        steps += 1
        assert steps < 5000, "the run never ends"
    assert all(r.state is State.FINISHED and r.num_generated == r.params.max_tokens for r in reqs)
    assert sum(r.tenant == "quiet" for r in reqs) >= 10
    held = [(m, ahead) for name, m, ahead in drive.sent if name == "prefill" and m.seqs and not m.urgent]
    assert held, "the flood never prefilled"
    for m, ahead in held:
        assert not any(a.seqs for a in ahead), f"step {m.step_id} of the flood's prompts queued behind another step"
    assert w.core.pages_in_use() == {name: 0 for name in w.core.pages_in_use()}


def test_a_contention_window_of_zero_keeps_one_groups_throughput_first(tiny: Checkpoint) -> None:
    """`--contention-window 0`: the flood keeps its whole chunk and its queue beside the quiet tenant."""
    w = world(tiny, 32, 8, contention_window_s=0)
    drive = OneComputeThread(w)
    for i in range(6 * RUNNING):
        w.core.submit([5 + i % 50] + [6 + i % 7] * 19, LONG, 0.0, tenant=FLOOD)
    quiet = [w.core.submit(list(range(60, 80)), SHORT, 0.0, tenant=QUIET)]
    drive.settle()
    for step in range(120):
        if step % 20 == 10:
            quiet.append(w.core.submit(list(range(60 + step % 7, 80)), SHORT, 0.0, tenant=QUIET))
            drive.settle()
        drive.run_one()
    flood_prefill = [_flood_prefill_tokens(m, list(range(60, 80))) for n, m in drive.steps if n == "prefill"]
    assert max(flood_prefill) > 8
    assert any(sum(1 for m in ahead if m.seqs) for _, _, ahead in drive.sent), "no step ever queued behind another"
