"""Readiness through the real path (invariant 8).

At start the canary prompt's greedy answer is computed on the prefill worker's model alone, in a
small pool of its own (no transport involved; `local_reference` in this process, the worker's own
`Reference` call when it runs in another). Then, and again every `interval_s`, the same prompt
goes through the real serving path (scheduler -> prefill worker -> transport -> decode worker).
The server is ready only while the last canary produced exactly the known answer; a wrong answer,
an error or a timeout makes `/ready` 503 until a canary passes again.

Busy is not broken: the canary enters through the scheduler's priority path (ahead of the queue,
outside the running-slot limit, taking its pages from the newest running request when the decode
pool is full), so a saturated but healthy server stays ready. It still runs the real path.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
import torch
from prometheus_client import Counter, Gauge

from kvfence.engine.compute import ComputeThread
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.family import Model
from kvfence.scheduler.offline import OfflineEngine
from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.tokenizer import Tokenizer
from kvfence.scheduler.driver import Scheduler
from kvfence.scheduler.core.errors import AdmissionRejected

log = logging.getLogger(__name__)

CANARY_TEXT = "The quick brown fox jumps over the lazy dog. The capital of France is"
CANARY_TOKENS = 8


Reference = Callable[[list[int], int], Awaitable[list[int]]]  # (prompt, max_tokens) -> greedy ids


def greedy_answer(model: Model, tokenizer: Tokenizer, prompt: list[int], max_tokens: int,
                  page_size_tokens: int) -> list[int]:
    """The greedy continuation of `prompt` on `model` alone, in a scratch pool of its own (call on
    the model's compute thread)."""
    pages = -(-(len(prompt) + max_tokens) // page_size_tokens)
    pool = KVPool(model.config, pages, page_size_tokens, model.dtype, model.device)
    engine = OfflineEngine(ModelRunner(model, pool), tokenizer)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with torch.inference_mode():
        return engine.generate([prompt], [params])[0].generated_token_ids


def local_reference(compute: ComputeThread, model: Model, tokenizer: Tokenizer,
                    page_size_tokens: int) -> Reference:
    """The reference of a prefill worker in this process: `greedy_answer` on its compute thread."""
    async def reference(prompt: list[int], max_tokens: int) -> list[int]:
        return await compute.run(greedy_answer, model, tokenizer, prompt, max_tokens, page_size_tokens)
    return reference


class ReadinessCanary:
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, reference: Reference, *,
                 interval_s: float, timeout_s: float) -> None:
        """`reference`: the canary's known answer, computed on the prefill worker's model alone."""
        self.scheduler = scheduler
        self.reference = reference
        self.prompt = tokenizer.encode(CANARY_TEXT)
        self.params = SamplingParams(temperature=0, max_tokens=CANARY_TOKENS, ignore_eos=True)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.expected: list[int] | None = None
        self.passed = False
        self.last_failure = ""
        registry = scheduler.metrics.registry
        self._ready = Gauge("kvfence_ready", "1 while the last readiness canary passed", registry=registry)
        self._runs = Counter("kvfence_readiness_canaries", "Readiness canaries by result", ["result"],
                             registry=registry)

    async def check_once(self) -> bool:
        """One canary through the serving path; updates `passed`."""
        if self.expected is None:
            self.expected = await self.reference(self.prompt, CANARY_TOKENS)
        ids: list[int] = []
        error = ""
        try:
            handle = self.scheduler.submit_priority(self.prompt, self.params)
        except AdmissionRejected as e:
            if self.scheduler.draining:  # /ready is 503 while draining anyway: no new verdict
                log.info("readiness canary not admitted (%s); keeping the last verdict", e.code)
                return self.passed
            # Load never refuses the priority path: a refusal (pages quarantined) is a broken path.
            return self._verdict([], f"{e.code}: {e.message}")
        with anyio.move_on_after(self.timeout_s) as scope:
            async for delta in handle.deltas():
                ids += delta.token_ids
                if delta.error is not None:
                    error = f"{delta.error.code}: {delta.error.message}"
        if scope.cancelled_caught:
            handle.abort()
            error = f"no answer within {self.timeout_s:g} s"
        return self._verdict(ids, error)

    def _verdict(self, ids: list[int], error: str) -> bool:
        ok = not error and ids == self.expected
        if not ok:
            self.last_failure = error or f"answer {ids} != known {self.expected}"
            log.error("readiness canary failed: %s", self.last_failure)
        elif not self.passed:
            log.info("readiness canary passed: the serving path returned the known answer")
        self.passed = ok
        self._ready.set(1 if ok else 0)
        self._runs.labels("ok" if ok else "failed").inc()
        return ok

    async def run(self) -> None:
        """Check now, then every interval_s, until cancelled."""
        while True:
            await self.check_once()
            await anyio.sleep(self.interval_s if self.passed else min(self.interval_s, 1.0))
