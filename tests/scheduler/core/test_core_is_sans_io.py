"""The scheduler core (every module of scheduler/core/) does no I/O: no await, no event-loop
library, no clock (time comes in events), and it imports nothing of the scheduler outside it but
the passive metrics. Checked on the source, so a new module there is checked as soon as it exists."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SCHEDULER = Path(__file__).resolve().parents[3] / "scheduler"
CORE = sorted((SCHEDULER / "core").glob("*.py"))
FORBIDDEN_IMPORTS = {"anyio", "asyncio", "time", "trio", "socket", "threading", "subprocess", "selectors"}
OUTSIDE_ALLOWED = {"kvfence.scheduler.metrics"}  # counters and gauges in memory; rendered by the drivers


def _roots(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name.split(".")[0] for alias in node.names}
    if isinstance(node, ast.ImportFrom):
        return {(node.module or "").split(".")[0]}
    return set()


def test_the_core_is_every_module_of_its_folder() -> None:
    assert len(CORE) > 10 and (SCHEDULER / "core" / "scheduler.py") in CORE


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_core_module_has_no_await_no_loop_and_no_clock(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text())):
        assert not isinstance(node, (ast.Await, ast.AsyncFunctionDef, ast.AsyncFor, ast.AsyncWith)), \
            f"{path.name}:{node.lineno}: the core never awaits"
        forbidden = _roots(node) & FORBIDDEN_IMPORTS
        assert not forbidden, f"{path.name}:{getattr(node, 'lineno', 0)}: imports {forbidden}"


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_the_core_imports_nothing_of_the_scheduler_outside_it(path: Path) -> None:
    """The drivers (driver.py, offline.py) and I/O helpers (handle.py, transfer.py) stay outside."""
    for node in ast.walk(ast.parse(path.read_text())):
        modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                   else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for module in modules:
            if module.startswith("kvfence.scheduler") and module not in OUTSIDE_ALLOWED:
                assert module.startswith("kvfence.scheduler.core"), f"{path.name} imports {module}"


def test_the_engine_imports_nothing_of_the_scheduler() -> None:
    """One direction only: the worker protocol lives in engine/protocol.py, which the scheduler imports."""
    for path in (SCHEDULER.parent / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("kvfence.scheduler"), f"engine/{path.name} imports {node.module}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("kvfence.scheduler") for a in node.names), f"engine/{path.name}"
