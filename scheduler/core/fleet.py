"""The workers the core serves on and the pairs they form, as they come (`add_pair`), drain
(`drain`) and go (`lose`). Part of the scheduler core: no I/O, no clock."""

from __future__ import annotations

import logging

from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.worker_binding import Pair, WorkerBinding

log = logging.getLogger(__name__)


class Fleet:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.workers: list[WorkerBinding] = []
        self.pairs: list[Pair] = []
        self._changed = False

    def add_pair(self, prefill: WorkerBinding, decode: WorkerBinding, max_context_tokens: int | None = None) -> Pair:
        """Serve on `prefill` -> `decode` from now on (their endpoints paired; each is added as a
        worker if new). `max_context_tokens`: the longest request both hold (at most the config's)."""
        if self.config.disaggregated != (prefill is not decode):
            raise ValueError("disaggregated mode needs a prefill and a decode worker; colocated binds one to both")
        if not prefill.prefills or not decode.decodes:
            raise ValueError(f"{prefill.name} -> {decode.name}: a pair is a prefill and a decode worker")
        if any(p.prefill is prefill and p.decode is decode for p in self.pairs):
            raise ValueError(f"{prefill.name} -> {decode.name} is paired already")
        for w in (prefill, decode):
            if w not in self.workers:
                if any(o.name == w.name for o in self.workers):
                    raise ValueError(f"a worker named {w.name!r} serves already")
                self.workers.append(w)
        limit = self.config.max_context_tokens
        pair = Pair(prefill, decode, limit if max_context_tokens is None else min(limit, max_context_tokens))
        self.pairs.append(pair)
        return pair

    def find(self, name: str) -> WorkerBinding | None:
        """The live worker named `name`, or None."""
        return next((w for w in self.workers if w.name == name), None)

    def worker(self, name: str) -> WorkerBinding:
        """The live worker named `name` (KeyError when no live worker has it)."""
        w = self.find(name)
        if w is None:
            raise KeyError(name)
        return w

    def lose(self, name: str) -> WorkerBinding | None:
        """The worker named `name` is gone, and every pair it was in; the worker, or None when unknown."""
        w = self.find(name)
        if w is not None:
            self.workers.remove(w)
            self.pairs = [p for p in self.pairs if w not in (p.prefill, p.decode)]
            self._changed = True
        return w

    def drain(self, w: WorkerBinding) -> None:
        """`w` said it shuts down: nothing new starts on it."""
        if not w.draining:
            w.draining, self._changed = True, True
            log.info("the %s worker %s is draining: nothing new starts on it; %d pairs still take requests",
                     w.role, w.name, len(self.serving_pairs))

    def take_changed(self) -> bool:
        """Whether pairs came, went or began draining since the last call (the queue is then
        checked again for requests no pair can ever serve)."""
        changed, self._changed = self._changed, False
        return changed

    @property
    def serving_pairs(self) -> list[Pair]:
        """The pairs new attempts may start on: live, and neither worker draining."""
        return [p for p in self.pairs if not p.prefill.draining and not p.decode.draining]

    @property
    def max_context_tokens(self) -> int:
        """The longest request some live pair holds (the config's when none is live)."""
        return max((p.max_context_tokens for p in self.pairs), default=self.config.max_context_tokens)
