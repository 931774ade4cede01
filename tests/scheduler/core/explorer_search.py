"""The breadth-first search of the core explorer (tests/scheduler/core/core_explorer.py): every
interleaving of the events a `World` enables, deduplicated by its fingerprint, the invariants
checked after every event; `Violation` carries the shortest trace that breaks one."""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections import deque
from collections.abc import Callable

from core_explorer import Broken, World, shared_memo


class Violation(AssertionError):
    def __init__(self, what: str, trace: list[str]) -> None:
        super().__init__(f"{what}\nshortest trace ({len(trace)} events):\n  " + "\n  ".join(trace))
        self.what = what
        self.trace = trace

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return Violation, (self.what, self.trace)  # found in another process, raised in the test's


@dataclasses.dataclass
class Report:
    states: int
    transitions: int
    quiescent: int
    max_depth: int
    shared: int = 0  # states in which some request reads pages it shares from the prefix cache
    cuts: int = 0  # transitions that cut a step short

    def __str__(self) -> str:
        return (f"{self.states} states, {self.transitions} transitions, {self.quiescent} quiescent, "
                f"deepest path {self.max_depth} events" + (f", {self.shared} sharing" if self.shared else "")
                + (f", {self.cuts} cuts" if self.cuts else ""))


def explore(make: Callable[[], World], max_states: int = 200_000) -> Report:
    """Every interleaving of the events `make()`'s world enables, breadth first; raises Violation
    with the shortest trace to a broken invariant."""
    logging.disable(logging.CRITICAL)
    try:
        return _bfs(make, max_states)
    finally:
        logging.disable(logging.NOTSET)


def _bfs(make: Callable[[], World], max_states: int) -> Report:
    root = make()
    seen = {root.fingerprint()}
    frontier: deque[tuple[World, list[str]]] = deque([(root, [])])
    transitions = quiescent = depth = shared = cuts = 0
    while frontier:
        world, trace = frontier.popleft()
        depth = max(depth, len(trace))
        shared += world.sharing()
        enabled = [name for name, _ in world.events()]
        if not enabled:
            quiescent += 1
            _checked(world.check_quiescent, trace + ["(no event left)"])
        for name in enabled:
            child = copy.deepcopy(world, memo=shared_memo(world))
            step = dict(child.events())[name]
            path = trace + [name]

            def run(child: World = child, step: Callable[[], None] = step) -> None:
                step()
                child.carry_out()
                child.check()

            _checked(run, path)
            transitions += 1
            cuts += name.endswith(" is cut")
            key = child.fingerprint()
            if key not in seen:
                seen.add(key)
                if len(seen) > max_states:
                    raise RuntimeError(f"more than {max_states} states: tighten the budget")
                frontier.append((child, path))
    return Report(len(seen), transitions, quiescent, depth, shared, cuts)


def _checked(fn: Callable[[], None], trace: list[str]) -> None:
    try:
        fn()
    except (Broken, AssertionError, RuntimeError, ValueError, KeyError) as e:
        if isinstance(e, Violation):
            raise
        raise Violation(f"{type(e).__name__}: {e}", trace) from e
