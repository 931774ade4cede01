"""What start-up built is frozen out of garbage collection while serving, and collectable again
after (app/serve/gc_heap.py)."""

from __future__ import annotations

import gc
import weakref

from kvfence.app.serve.gc_heap import startup_heap_frozen


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_what_was_alive_at_start_up_is_never_walked_while_serving_and_is_freed_after() -> None:
    node = Node()
    alive = weakref.ref(node)
    with startup_heap_frozen() as frozen:
        assert frozen > 0 and gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert alive() is not None  # frozen: full collections do not walk it
        made_later = Node()
        later = weakref.ref(made_later)
        del made_later
        gc.collect()
        assert later() is None  # what serving makes is collected as usual
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None
