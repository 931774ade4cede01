"""The packages form layers, and no module imports from a layer above its own: a change that
does fails here (checked on the source, every import, at module level or inside a function).

kernels      the CPU and Triton kernels (kernels.cpu and kernels.triton know nothing of each other)
transports   moving KV pages between pools, sealed channels
engine       the model, its workers and their protocol
scheduler    every decision about requests and pages (its pure core: tests/scheduler/core/test_core_is_sans_io.py)
app          the server, the commands, deployment

And every folder with an __init__.py is a package pyproject.toml installs.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["kernels", "transports", "engine", "scheduler", "app"]  # lowest first
SIBLINGS = [("kernels.cpu", "kernels.triton")]  # subpackages that never import each other


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module below kvfence.) of every kvfence import in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        found += [(node.lineno, n.removeprefix("kvfence.")) for n in names if n.startswith("kvfence.")]
    return sorted(found)


def _sources() -> list[Path]:
    return [p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))]


def test_every_package_is_in_a_layer() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages == set(LAYERS), f"packages {packages - set(LAYERS)} have no layer: add them to LAYERS"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_from_a_layer_above_its_own(path: Path) -> None:
    source = path.relative_to(ROOT)
    own = LAYERS.index(source.parts[0])
    for line, module in _imports(path):
        target = module.split(".")[0]
        assert target in LAYERS, f"{source}:{line} imports kvfence.{module}, which is in no layer"
        if LAYERS.index(target) > own:
            raise AssertionError(f"{source}:{line} imports kvfence.{module}: {target} is above {source.parts[0]} "
                                 f"(the layers, lowest first: {', '.join(LAYERS)})")


def test_sibling_packages_import_nothing_of_each_other() -> None:
    for pair in SIBLINGS:
        for a, b in (pair, pair[::-1]):
            for path in sorted((ROOT / a.replace(".", "/")).rglob("*.py")):
                for line, module in _imports(path):
                    assert not (module + ".").startswith(b + "."), f"{path.relative_to(ROOT)}:{line} imports {module}"


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from kvfence.app.cli import main\nimport kvfence.engine.ids\n")
    assert _imports(probe) == [(2, "app.cli"), (3, "engine.ids")]


def test_every_package_folder_is_installed() -> None:
    """pyproject.toml's [tool.setuptools] packages names every folder with an __init__.py, and only
    those: an editable install finds an unlisted one anyway, a fresh install leaves it out."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    top = {folder: package for package, folder in setuptools["package-dir"].items()}
    folders = {".".join([top[p.relative_to(ROOT).parts[0]], *p.relative_to(ROOT).parent.parts[1:]])
               for layer in LAYERS for p in (ROOT / layer).rglob("__init__.py")}
    listed = set(setuptools["packages"])
    assert folders == listed, f"unlisted: {sorted(folders - listed)}; listed, no folder: {sorted(listed - folders)}"
