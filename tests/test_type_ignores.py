"""Every `type: ignore` in the packages names its codes and says why (a comment after it), so a
reader knows what the checker cannot see there; scripts/typecheck (mypy, strict, with
warn_unused_ignores) refuses one that is no longer needed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["app", "engine", "kernels", "scheduler", "transports"]
IGNORE = re.compile(r"#\s*type:\s*ignore(?P<codes>\[[a-z, -]+\])?(?P<rest>.*)$")


def test_every_type_ignore_names_its_codes_and_says_why() -> None:
    bare = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                match = IGNORE.search(line)
                if match and (not match["codes"] or not re.match(r"\s*#\s*\S", match["rest"])):
                    bare.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not bare, "a type: ignore without its codes or its reason:\n" + "\n".join(bare)


def test_the_check_finds_a_bare_ignore() -> None:
    assert IGNORE.search("x = f()  # type: ignore") and not IGNORE.search("x = f()  # type: ignore")["codes"]
    reason = IGNORE.search("x = f()  # type: ignore[attr-defined]  # nixl ships no types")["rest"]
    assert re.match(r"\s*#\s*\S", reason)
