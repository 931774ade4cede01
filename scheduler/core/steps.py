"""Each worker's next step: what it runs (decode steps, prefill chunks within the token budget),
the tag changes it carries, and when one in flight is asked to stop between layers; part of the
scheduler core (no I/O, no clock: the time is passed in). The batching decisions themselves are
scheduler/core/policy.py's pure functions; this part builds and sends the messages.
"""

from __future__ import annotations

from kvfence.engine.protocol import RunStep, SeqStep
from kvfence.scheduler.core.actions import Action, CutStep, SendStep
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.fleet import Fleet
from kvfence.scheduler.core.lifecycle import Event
from kvfence.scheduler.core.policy import (contended_chunks, decode_steps, first_token_on, grant_goes_ahead,
                                           prefilling_on, waits_for_device)
from kvfence.scheduler.core.preemption import Preemption
from kvfence.scheduler.core.registry import Registry
from kvfence.scheduler.core.request import Request
from kvfence.scheduler.core.worker_binding import Step, WorkerBinding


class Steps:
    def __init__(self, config: SchedulerConfig, registry: Registry, fleet: Fleet, preemption: Preemption,
                 actions: list[Action]) -> None:
        """`actions`: the core's list of actions for its driver, which the messages join."""
        self.config = config
        self.registry = registry
        self.fleet = fleet
        self.preemption = preemption
        self._actions = actions
        self._step_id = 0

    def plan(self, w: WorkerBinding, now: float, contended: bool) -> None:
        """The next step of idle worker `w`: decode steps of the requests decoding on it (each
        first gets the page its next token lands in), then prefill chunks within the token
        budget (`contended_chunks`); sent when it runs something or carries tag changes. Tag changes
        alone first when `grant_goes_ahead`; nothing while it `waits_for_device` (scheduler/core/policy.py)."""
        running = self.registry.index
        if w.decodes and grant_goes_ahead(w, running):
            self.send(w, [], [], [], now)
            return
        if not first_token_on(w, running) and waits_for_device(w, self.fleet.workers, contended):
            return
        decodes = self.preemption.grow(w, now) if w.decodes else []  # may preempt (prefilling and decoding ones)
        seqs = decode_steps(decodes, w.table)
        chunks, urgent = contended_chunks(prefilling_on(w, running) if w.prefills else [], running,
                                          self.config.chunk_tokens - len(seqs), w.table, contended,
                                          self.config.held_back_tokens)
        if seqs or chunks or w.table.has_pending:
            self.send(w, decodes, chunks, seqs + [s for _, s in chunks], now, urgent=urgent,
                       cuttable=bool(chunks) and not seqs and not urgent and not any(r.chunk_cut for r, _ in chunks))

    def send(self, w: WorkerBinding, decodes: list[Request], chunks: list[tuple[Request, SeqStep]],
              seqs: list[SeqStep], now: float, *, urgent: bool = False, cuttable: bool = False) -> None:
        """`urgent`: it may pass the steps queued on its device (RunStep.urgent); tag changes alone
        always may (they take no time). `cuttable`: it carries only chunks of groups already
        decoding (RunStep.cuttable), which `cut_for_first_tokens` may stop."""
        pending = w.table.take_pending()
        self._step_id += 1
        w.in_flight = Step(number=pending.number, decodes=decodes, chunks=chunks, seqs=seqs, step_id=self._step_id,
                           cuttable=cuttable)
        w.last_sent_s = now
        if seqs:
            w.last_step = self._step_id
        for req in w.in_flight.requests:
            req.fire(Event.STEP_SENT)
        message = RunStep(step_id=self._step_id, seqs=seqs, grants=pending.grants, released=pending.released,
                          landed=pending.landed, sealed=pending.sealed, ended=pending.ended, incarnation=w.incarnation,
                          urgent=urgent or not seqs, cuttable=cuttable)
        self._actions.append(SendStep(w.name, message))

    def cut_for_first_tokens(self) -> None:
        """Ask each worker whose step in flight carries only other groups' prompt chunks to stop
        it between layers (CutStep) while a prompt of a group with nothing decoding waits for its
        first token on it: that prompt's own step then goes next, not after the rest of a chunk
        (up to a whole 128 tokens uncontended). The chunks cut go again as they were, and whole:
        a chunk is cut once at most (`Request.chunk_cut`), so however many first tokens other
        groups send, each chunk costs its request at most one step's work more. A group alone is
        never cut for its own requests (`waits_for_first_token`)."""
        for w in self.fleet.workers:
            step = w.in_flight
            if step is not None and step.cuttable and not step.cut_asked and first_token_on(w, self.registry.index):
                step.cut_asked = True
                self._actions.append(CutStep(w.name, step.step_id))
