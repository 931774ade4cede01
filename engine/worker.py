"""A worker: one device, one model replica, one KV pool, driven by scheduler messages.

Compute runs on the device's compute thread (engine/compute.py), never on the event loop, one
step at a time. The scheduler talks to a worker only through a `WorkerChannel` (engine/protocol.py;
`LocalWorkerChannel` here), which round-trips every message through the protocol's wire codec, so
the worker could live in another process without changing the scheduler.
"""

from __future__ import annotations

import logging

import torch

from kvfence.engine.compute import ComputeThread
from kvfence.engine.kv_pool import KVPool, check_scrub
from kvfence.engine.kv_sanitizer import SlotViolation
from kvfence.engine.logprobs import TokenLogprobs
from kvfence.engine.owner_check import OwnerViolation
from kvfence.engine.page_tables import LeasePageTables
from kvfence.engine.runner import ModelRunner, SeqWork
from kvfence.engine.grammar import LeaseGrammars
from kvfence.engine.token_counts import LeaseTokenCounts
from kvfence.engine.tokenizer import Tokenizer
from kvfence.engine.ids import id_hex, mint_id
from kvfence.engine.protocol import (
    OwnerMismatch, RunStep, SeqFailure, SeqStep, StepDone, StepFailed, WorkerReply, WorkerRequest, decode_reply,
    decode_request, encode,
)

log = logging.getLogger(__name__)

DEFERRED_WAIT_S = 0.05  # the longest a step of only deferred seqs waits for their grammar


class Worker:
    def __init__(self, role: str, runner: ModelRunner, scrub: str = "poison",
                 tokenizer: Tokenizer | None = None) -> None:
        """`scrub`: what released pages are filled with (see KVPool.clear). With a KV sanitizer on
        the runner, the worker also tells it of releases and of transfers that landed.
        `tokenizer`: the model's, which a grammar needs (engine/grammar.py); without it a step of a
        grammar-bound request fails."""
        check_scrub(scrub)
        self.role = role
        self.runner = runner
        self.scrub = scrub
        self.device = runner.pool.device
        self.sanitizer = runner.sanitizer
        self.page_tables = LeasePageTables()
        self.token_counts = LeaseTokenCounts(runner.model.config.vocab_size, self.device)
        self.grammars = LeaseGrammars(tokenizer, runner.model.config.vocab_size)
        self.incarnation = id_hex(mint_id())
        self._cut_asked = 0  # the step asked to stop between layers (set from another thread)

    def ask_cut(self, step_id: int) -> None:
        """Stop step `step_id` at its next layer boundary if it is running and cuttable
        (RunStep.cuttable); safe from any thread. Asking for a step that already ended does nothing."""
        self._cut_asked = step_id

    def restart(self) -> None:
        """Come back as a new incarnation with a blank pool, as a restarted worker process would:
        every page untagged and poisoned, no page table, the sanitizer's ledger empty. Steps built for the old
        incarnation are refused from now on (`execute`), so nothing is read across incarnations."""
        every = list(range(self.pool.num_pages))
        self.pool.clear(every, "poison")
        self.page_tables.clear()
        self.token_counts.clear()
        self.grammars.clear()
        self._cut_asked = 0  # step ids start again with the next scheduler
        if self.sanitizer is not None:
            self.sanitizer.forget(every)
        old, self.incarnation = self.incarnation, id_hex(mint_id())
        log.warning("%s worker restarted: incarnation %s -> %s", self.role, old, self.incarnation)

    @property
    def pool(self) -> KVPool:
        return self.runner.pool

    def execute(self, request: WorkerRequest) -> WorkerReply:
        """Run one message to completion (called in the worker's thread)."""
        return self.execute_with_logits(request)[0]

    def execute_with_logits(self, request: WorkerRequest,
                            return_logits: bool = False) -> tuple[WorkerReply, torch.Tensor | None]:
        """`execute`, and with `return_logits` the logits of every token sampled, one row per
        sampled seq in order, leaving out seqs that failed before the forward (in-process callers
        only: logits never travel)."""
        match request:
            case RunStep() if request.incarnation and request.incarnation != self.incarnation:
                return StepFailed(step_id=request.step_id,
                                  message=f"the {self.role} worker restarted (step for incarnation "
                                          f"{request.incarnation}, worker is {self.incarnation})",
                                  incarnation=self.incarnation, stale_incarnation=True), None
            case RunStep():
                try:
                    return self._run_step(request, return_logits)
                except Exception as e:  # a failed step fails its requests, not the worker
                    log.exception("%s worker: step %d failed", self.role, request.step_id)
                    return StepFailed(step_id=request.step_id, message=f"{type(e).__name__}: {e}",
                                      incarnation=self.incarnation), None
        raise TypeError(f"unknown worker message {type(request).__name__}")

    def _apply_tags(self, cmd: RunStep) -> None:
        if cmd.released:
            self.pool.clear(cmd.released, self.scrub)
        self.page_tables.forget(cmd.ended)
        self.token_counts.forget(cmd.ended)
        self.grammars.forget(cmd.ended)
        for grant in cmd.grants:
            self.pool.assign(grant.pages, grant.lease)
            self.page_tables.name(grant.lease, grant.tenant)
        if self.sanitizer is not None:
            if cmd.released:
                self.sanitizer.forget(cmd.released)
            for landing in cmd.landed:
                self.sanitizer.record_write(landing.lease, landing.pages, landing.first_token,
                                            landing.num_tokens - landing.first_token)
        for seal in cmd.sealed:  # after the landings: a seal is checked against who wrote the page
            refused = self.pool.seal(seal.pages, seal.lease, seal.seal)
            if refused:
                log.error("%s worker: pages %s to be sealed are not tagged with %s; they keep their tags, so "
                          "every read of them fails closed", self.role, refused, self.page_tables.who(seal.lease))
            if self.sanitizer is not None:
                self.sanitizer.seal(seal.lease, seal.seal, seal.pages)

    def _run_step(self, cmd: RunStep, return_logits: bool) -> tuple[WorkerReply, torch.Tensor | None]:
        """Apply the message's tag and page-table changes, then run its forward. Contract with the
        scheduler: a reply from the incarnation the message was built for means those changes were
        applied, also when the forward failed; a worker that cannot apply them comes back as a new
        incarnation (every page poisoned and untagged), so the scheduler fails what was bound to it."""
        try:
            self._apply_tags(cmd)
        except Exception as e:
            log.exception("%s worker: applying the page tags of step %d failed: restarting", self.role, cmd.step_id)
            self.restart()
            return StepFailed(step_id=cmd.step_id, message=f"{type(e).__name__}: {e}",
                              incarnation=self.incarnation), None
        if not cmd.seqs:
            return StepDone(step_id=cmd.step_id, tokens=[], incarnation=self.incarnation), None
        works: list[SeqWork] = []
        indices: list[int] = []  # the seq index of each work
        failed: list[SeqFailure] = []
        deferred: list[int] = []
        for index, seq in enumerate(cmd.seqs):
            if self._defer(seq):
                deferred.append(index)
                continue
            try:
                works.append(self._work(seq))
                indices.append(index)
            except Exception as e:  # this seq fails alone; the step goes on for the others
                log.exception("%s worker: step %d: seq %d (lease %s) failed", self.role, cmd.step_id, index,
                              id_hex(seq.lease))
                failed.append(SeqFailure(index, f"{type(e).__name__}: {e}"))
        if deferred and not works:
            self.grammars.wait(DEFERRED_WAIT_S)  # nothing else to run: no empty steps as fast as they come
        n = len(cmd.seqs)
        tokens: list[int | None] = [None] * n
        violations: list[OwnerMismatch] = []
        logprobs: list[TokenLogprobs | None] = []
        prompt_logprobs: list[list[TokenLogprobs]] = []
        logits, cut = None, False
        if works:
            step_id = cmd.step_id
            with torch.inference_mode():
                result = self.runner.step(works, return_logits,
                                          (lambda: self._cut_asked == step_id) if cmd.cuttable else None)
            cut = result.cut
            if cut:
                log.debug("%s worker: step %d cut short between layers", self.role, step_id)
                deferred = sorted(deferred + [index for j, index in enumerate(indices)
                                              if j not in {v.work_index for v in result.violations}])
            logits = result.logits
            for j, index in enumerate(indices):
                tokens[index] = result.tokens[j]
            violations = [self._mismatch(v, indices) for v in result.violations]
            failed += [SeqFailure(indices[j], why, request_fault=True) for j, why in result.dead_ends.items()]
            if result.logprobs:
                logprobs = [None] * n
                for j, index in enumerate(indices):
                    logprobs[index] = result.logprobs[j]
            if result.prompt_logprobs:
                prompt_logprobs = [[] for _ in range(n)]
                for j, index in enumerate(indices):
                    prompt_logprobs[index] = result.prompt_logprobs[j]
        return StepDone(step_id=cmd.step_id, tokens=tokens, violations=violations, incarnation=self.incarnation,
                        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                        failed=sorted(failed, key=lambda f: f.seq_index), deferred=deferred, cut=cut), logits

    def _defer(self, s: SeqStep) -> bool:
        """Leave `s` out of this step: its grammar is still being compiled here in the background
        (engine/grammar.py); its page table is extended all the same (the scheduler counts the
        pages sent), nothing else of it is applied."""
        if s.history is None or s.sampling is None or not s.sampling.grammar_key:
            return False
        if self.grammars.ready(s.sampling.grammar_key, s.grammar):
            return False
        self.page_tables.extend(s.lease, s.new_pages)
        return True

    def _work(self, s: SeqStep) -> SeqWork:
        params = s.sampling
        counts = grammar = None
        if params is not None and params.penalized:
            counts = self.token_counts.observe(s.lease, s.context_tokens, s.token_ids, s.history, s.prompt_tokens)
        if params is not None and params.grammar_key:
            grammar = self.grammars.observe(s.lease, s.grammar, s.context_tokens, s.token_ids, s.history,
                                            s.prompt_tokens, key=params.grammar_key)
        return SeqWork(seq=s, page_table=self.page_tables.extend(s.lease, s.new_pages), counts=counts,
                       grammar=grammar)

    def _mismatch(self, v: OwnerViolation | SlotViolation, indices: list[int]) -> OwnerMismatch:
        """The violation of work `v.work_index` as its seq's (`indices`: the seq index of each work)."""
        if isinstance(v, OwnerViolation):
            return OwnerMismatch(seq_index=indices[v.work_index], page=v.page, owner=v.owner)
        log.error("KV SANITIZER: %s worker: %s would read token %d (page %d slot %d), last written "
                  "by %s", self.role, self.page_tables.who(v.lease), v.position, v.page, v.slot,
                  self.page_tables.who(v.writer) if v.writer else "nobody since the page was released")
        return OwnerMismatch(seq_index=indices[v.work_index], page=v.page, owner=v.writer, check="sanitizer",
                             detail=f"token {v.position} (slot {v.slot})")


class LocalWorkerChannel:
    """A `WorkerChannel` (engine/protocol.py) to a worker in this process: every message goes
    through the protocol's wire codec, as it would to another process, and runs on the device's
    compute thread.

    `compute`: the thread of the worker's device; it runs one message at a time, in the order
    `call` was entered (an urgent step ahead of the others waiting), so a worker (and every worker
    sharing the device) runs one step at a time. `device`: that thread's name, which the scheduler
    uses to let the workers sharing it take turns."""

    def __init__(self, worker: Worker, compute: ComputeThread) -> None:
        self.worker = worker
        self.compute = compute
        self.role = self.name = worker.role
        self.device = compute.name

    def _serve(self, payload: bytes) -> bytes:
        return encode(self.worker.execute(decode_request(payload)))

    async def restart(self) -> None:
        """Restart the worker (a new incarnation, see Worker.restart), between steps."""
        await self.compute.run(self.worker.restart)

    async def call(self, request: WorkerRequest) -> WorkerReply:
        urgent = isinstance(request, RunStep) and request.urgent
        reply = await self.compute.run(self._serve, encode(request), urgent=urgent)  # not cancellable mid-step
        return decode_reply(reply)

    async def cut(self, step_id: int) -> None:
        self.worker.ask_cut(step_id)
