"""docs/failures.md lists a test for every behaviour of tests/data/FAILURES.md, and every test it
names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def numbered_behaviours() -> set[int]:
    text = (ROOT / "tests/data/FAILURES.md").read_text()
    return {int(m) for m in re.findall(r"^(\d+)\. ", text, flags=re.MULTILINE)}


NOT_BUILT = re.compile(r"not built yet \(issue (\d+)\)")


def index_rows() -> dict[int, list[str]]:
    rows: dict[int, list[str]] = {}
    for line in (ROOT / "docs/failures.md").read_text().splitlines():
        m = re.match(r"^\| (\d+) \|", line)
        if m:
            rows[int(m.group(1))] = re.findall(r"`(tests/[^`]+::[^`]+)`", line)
    return rows


def not_built_rows() -> dict[int, int]:
    """Behaviours whose row says which later issue builds them instead of naming tests."""
    rows = {}
    for line in (ROOT / "docs/failures.md").read_text().splitlines():
        if (m := re.match(r"^\| (\d+) \|", line)) and (issue := NOT_BUILT.search(line)):
            rows[int(m.group(1))] = int(issue.group(1))
    return rows


def defined_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    names |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return names


def test_every_behaviour_has_a_listed_test() -> None:
    """Every behaviour has a row; every row names tests, except one that says which later issue
    builds it (and then names none: a row cannot claim both)."""
    behaviours, rows, later = numbered_behaviours(), index_rows(), not_built_rows()
    assert len(behaviours) == 36
    assert set(rows) == behaviours
    assert all(bool(rows[n]) != (n in later) for n in behaviours), \
        [n for n in behaviours if bool(rows[n]) == (n in later)]
    assert not later, later  # every behaviour is built


def test_every_listed_test_exists() -> None:
    missing = []
    for node in {node for nodes in index_rows().values() for node in nodes}:
        file, _, name = node.partition("::")
        path = ROOT / file
        if not path.is_file() or name not in defined_names(path):
            missing.append(node)
    assert not missing, missing
