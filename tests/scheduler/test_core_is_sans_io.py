"""The scheduler core does no I/O: no await, no event-loop library, no clock (time comes in events);
and the engine never imports the scheduler. Checked on the source, so a change that breaks either fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SCHEDULER = Path(__file__).resolve().parents[2] / "scheduler"
CORE_MODULES = ["core.py", "reservation.py", "preemption.py", "worker_events.py", "admission.py", "policy.py", "lease_table.py", "page_ledger.py",
                "worker_binding.py", "request.py", "output.py", "actions.py", "errors.py", "config.py", "tenants.py",
                "prefix_cache.py", "router.py"]
FORBIDDEN_IMPORTS = {"anyio", "asyncio", "time", "trio", "socket", "threading"}


@pytest.mark.parametrize("name", CORE_MODULES)
def test_core_module_has_no_await_no_loop_and_no_clock(name: str) -> None:
    tree = ast.parse((SCHEDULER / name).read_text())
    for node in ast.walk(tree):
        assert not isinstance(node, (ast.Await, ast.AsyncFunctionDef, ast.AsyncFor, ast.AsyncWith)), \
            f"{name}:{node.lineno}: the core never awaits"
        if isinstance(node, ast.Import):
            roots = {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots = {(node.module or "").split(".")[0]}
        else:
            continue
        assert not roots & FORBIDDEN_IMPORTS, f"{name}:{node.lineno}: imports {roots & FORBIDDEN_IMPORTS}"


def test_the_core_imports_only_core_modules_of_the_scheduler() -> None:
    """The drivers (driver.py, offline.py) and I/O helpers (handle.py, transfer.py) stay outside."""
    core = {name.removesuffix(".py") for name in CORE_MODULES} | {"metrics"}
    for name in CORE_MODULES:
        for node in ast.walk(ast.parse((SCHEDULER / name).read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvfence.scheduler."):
                assert node.module.rsplit(".", 1)[1] in core, f"{name} imports {node.module}"


def test_the_engine_imports_nothing_of_the_scheduler() -> None:
    """One direction only: the worker protocol lives in engine/protocol.py, which the scheduler imports."""
    for path in (SCHEDULER.parent / "engine").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("kvfence.scheduler"), f"engine/{path.name} imports {node.module}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("kvfence.scheduler") for a in node.names), f"engine/{path.name}"
