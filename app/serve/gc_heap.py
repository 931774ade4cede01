"""What start-up built is never walked by the garbage collector again.

A server keeps for its whole life what it built at start-up: the model's modules and tensors'
Python objects, the tokenizer's vocabulary, the chat template, the grammar compiler's tables,
hundreds of thousands of objects. Python's full collections walk every tracked object, so each
one (every few seconds under load) held the GIL, and with it the event loop and the Python part of
every compute thread's step, for 110-170 ms on the development machine: the slowest time to first
token of a tenant beside another's flood was one of those pauses (docs/benchmarks.md, "No request
stalls, starves or fails another"). `gc.freeze()` moves every object alive at the call to a
generation the collector never scans; later collections walk only what was made since.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


@contextmanager
def startup_heap_frozen() -> Iterator[int]:
    """While serving: what start-up left behind is collected, then the rest frozen out of every
    later collection; on leaving, unfrozen again, so a process that builds servers one after
    another (the tests) still collects each one's cycles once it is gone. Yields the count frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%d objects made at start-up are left out of garbage collection while serving", frozen)
    try:
        yield frozen
    finally:
        gc.unfreeze()
