"""Generation without a server: the scheduler core with a synchronous driver (`kvfence generate`,
the readiness canary's local answer, and the engine's tests).

The same core as the server (scheduler/core/scheduler.py) with one worker bound to both roles: the same
admission, page grants, growth and preemption, continuous batching of decode steps with prefill
chunks up to a token budget, and the same output rules (scheduler/core/output.py). The driver calls the
worker directly, in this thread, and applies the last releases before returning, so the pool is
untagged and scrubbed when `generate` returns.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.tokenizer import Tokenizer
from kvfence.engine.worker import Worker
from kvfence.scheduler.core.actions import CutStep, Emit, SendStep
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.scheduler import SchedulerCore
from kvfence.scheduler.core.errors import AdmissionRejected
from kvfence.scheduler.core.page_ledger import PageLedger
from kvfence.scheduler.core.worker_binding import WorkerBinding


@dataclasses.dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    # Logits of every sampled token, [generated, vocab] float32, when asked for.
    logits: torch.Tensor | None = None


class OfflineEngine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, *, chunk_tokens: int = 512,
                 max_running: int = 64) -> None:
        if chunk_tokens <= 0 or max_running <= 0:
            raise ValueError("chunk_tokens and max_running must be > 0")
        self.runner = runner
        self.worker = Worker("colocated", runner, tokenizer=tokenizer)
        self.config = SchedulerConfig(
            page_size_tokens=runner.pool.page_size_tokens, max_running=max_running, max_queue=1 << 30,
            chunk_tokens=chunk_tokens, disaggregated=False,
            max_context_tokens=min(runner.model.config.max_context_tokens, runner.pool.capacity_tokens))
        self.binding = WorkerBinding(self.worker.role, runner.pool.num_pages)
        self.core = SchedulerCore(self.config, tokenizer, self.binding, self.binding)

    @property
    def max_context_tokens(self) -> int:
        return self.config.max_context_tokens

    @property
    def ledger(self) -> PageLedger:
        return self.binding.ledger

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 return_logits: bool = False) -> list[GenerationOutput]:
        """Generate for every prompt; outputs in input order. Raises ValueError for a request that
        can never fit (empty prompt, prompt + max_tokens over the context) before anything runs,
        and RuntimeError if a request fails (a KV integrity violation: a bug, pages being this
        engine's own)."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        now = time.monotonic()  # no deadline applies offline: the clock never advances
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                self.core.admissible(prompt, p, now)
            except AdmissionRejected as e:
                raise ValueError(f"request {i}: {e.message}") from None
        ids = [self.core.submit(prompt, p, now).request_id for prompt, p in zip(prompts, params)]
        index = {request_id: i for i, request_id in enumerate(ids)}
        texts, tokens = [""] * len(ids), [[] for _ in ids]  # type: list[str], list[list[int]]
        reasons: list[str | None] = [None] * len(ids)
        logits: list[list[torch.Tensor]] = [[] for _ in ids]
        while True:
            actions = self.core.take_actions()
            if not actions:
                break
            for action in actions:
                if isinstance(action, SendStep):
                    self._run(action, return_logits, index, logits, now)
                elif isinstance(action, Emit):
                    i = index[action.request_id]
                    if action.delta.error is not None:
                        raise RuntimeError(f"request {i} failed: {action.delta.error.message}")
                    texts[i] += action.delta.text
                    tokens[i] += action.delta.token_ids
                    reasons[i] = action.delta.finish_reason or reasons[i]
                elif isinstance(action, CutStep):
                    pass  # each step ran whole before the core heard of it: there is nothing to cut
                else:  # transfers and their quarantines exist only between two pools
                    raise RuntimeError(f"the offline engine cannot carry out {type(action).__name__}")
        # the core sent the last releases to the idle worker as soon as they were made: the pool is clean
        return [GenerationOutput(prompt_token_ids=list(prompt), generated_token_ids=tokens[i], text=texts[i],
                                 finish_reason=reasons[i] or "length",
                                 logits=torch.stack(logits[i]) if logits[i] else None)
                for i, prompt in enumerate(prompts)]

    def flush_cache(self) -> int:
        """Drop the prefix cache (SchedulerCore.flush_cache) and hand the freed pages back to the
        worker at once; returns how many were freed."""
        now = time.monotonic()
        freed = sum(self.core.flush_cache(now).values())
        while actions := self.core.take_actions():
            for action in actions:
                if isinstance(action, SendStep):
                    self._run(action, False, {}, [], now)
        return freed

    def _run(self, action: SendStep, return_logits: bool, index: dict[str, int],
             logits: list[list[torch.Tensor]], now: float) -> None:
        step = self.binding.in_flight
        reply, rows = self.worker.execute_with_logits(action.message, return_logits)
        if rows is not None and step is not None:
            sampled = [req for req, token in zip(step.requests, getattr(reply, "tokens", [])) if token is not None]
            for row, req in zip(rows, sampled):
                logits[index[req.request_id]].append(row)
        self.core.step_replied(action.worker, reply, now)
