"""Readiness through the real path (invariant 8).

At start the canary prompt's greedy answer is computed on the prefill worker's model alone, in a
small pool of its own (no transport involved). Then, and again every `interval_s`, the same prompt
goes through the real serving path (scheduler -> prefill worker -> transport -> decode worker).
The server is ready only while the last canary produced exactly the known answer; a wrong answer,
an error or a timeout makes `/ready` 503 until a canary passes again.

Busy is not broken: the canary enters through the scheduler's priority path (ahead of the queue,
outside the running-slot limit, taking its pages from the newest running request when the decode
pool is full), so a saturated but healthy server stays ready. It still runs the real path.
"""

from __future__ import annotations

import logging

import anyio
import torch
from prometheus_client import Counter, Gauge

from kvfence.engine.kv_pool import KVPool
from kvfence.engine.llama import LlamaModel
from kvfence.scheduler.offline import OfflineEngine
from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.tokenizer import Tokenizer
from kvfence.scheduler.driver import Scheduler
from kvfence.scheduler.errors import AdmissionRejected

log = logging.getLogger(__name__)

CANARY_TEXT = "The quick brown fox jumps over the lazy dog. The capital of France is"
CANARY_TOKENS = 8


class ReadinessCanary:
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, model: LlamaModel, *,
                 interval_s: float, timeout_s: float) -> None:
        self.scheduler = scheduler
        self.model = model
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

    def _local_answer(self) -> list[int]:
        """The canary's greedy ids on this model without any transport (runs on the prefill worker's
        compute thread)."""
        page_size = self.scheduler.config.page_size_tokens  # the served pools' page size
        pages = -(-(len(self.prompt) + CANARY_TOKENS) // page_size)
        pool = KVPool(self.model.config, pages, page_size, self.model.dtype, self.model.device)
        engine = OfflineEngine(ModelRunner(self.model, pool), self.scheduler.tokenizer)
        with torch.inference_mode():
            return engine.generate([self.prompt], [self.params])[0].generated_token_ids

    async def check_once(self) -> bool:
        """One canary through the serving path; updates `passed`."""
        if self.expected is None:
            self.expected = await self.scheduler.prefill_channel.compute.run(self._local_answer)
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
