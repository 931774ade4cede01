"""A run of the core explorer (tests/scheduler/core/core_explorer.py) described by picklable values, so
that it can go to a process of its own: the exhaustive runs take a core each, and CI has two."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from core_explorer import Budget, World
from explorer_search import Report, explore

from kvfence.engine.sampling import SamplingParams
from kvfence.engine.tokenizer import Tokenizer
from kvfence.scheduler.core.config import SchedulerConfig


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a world is made of, picklable: an exploration can run in a process of its own
    (`explore_setup`). The tokenizer comes from the GGUF at `checkpoint`."""

    checkpoint: str
    disaggregated: bool
    budget: Budget
    pages: int = 4
    chunk: int = 4
    cache: bool = False
    prompts: tuple[tuple[int, ...], ...] = ((5, 6, 7), (8, 9, 10))
    decodes: int = 1
    samples: int = 1  # > 1: the first submit is that many samples of one request
    params: SamplingParams = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def factory(self, tokenizer: Tokenizer) -> Callable[[], World]:
        config = SchedulerConfig(page_size_tokens=2, max_context_tokens=8, max_running=2, max_queue=self.samples,
                                 chunk_tokens=self.chunk, disaggregated=self.disaggregated, queue_timeout_s=10,
                                 heartbeat_s=1, max_preemptions=1, prefix_cache=self.cache)
        prompts = [list(p) for p in self.prompts]
        return lambda: World(tokenizer, config, self.pages, prompts, self.params, self.budget, self.decodes,
                             self.samples)


def explore_setup(setup: Setup) -> Report:
    """`explore` of the world `setup` describes, its tokenizer loaded here (for another process)."""
    from kvfence.engine.checkpoint import load_checkpoint

    return explore(setup.factory(load_checkpoint(setup.checkpoint, weights=False).tokenizer))
