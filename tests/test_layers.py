"""The packages form layers, and no module imports from a layer above its own: a change that
does fails here (checked on the source, every import, at module level or inside a function).

kernels      the CPU and Triton kernels (kernels.cpu and kernels.triton know nothing of each other)
transports   moving KV pages between pools, sealed channels
engine       the model, its workers and their protocol
scheduler    every decision about requests and pages (its pure core: tests/scheduler/core/test_core_is_sans_io.py)
app          the server, the commands, deployment

Inside app, its parts form layers the same way, lowest first:

config       each setting declared once; the TOML file, the environment, the commands' options
api          the OpenAI-compatible HTTP API over the scheduler
serve        a deployment assembled in one process (`kvfence serve`)
remote       workers in processes of their own: their control protocol, its two ends, the front end
             that drives them (`kvfence serve --discovery`), `kvfence worker`, discovery and membership
tools        client tools that look at a deployment from outside (`kvfence probe`, `kvfence status`)
cli          the `kvfence` command

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
APP_PARTS = ["config", "api", "serve", "remote", "tools", "cli"]  # lowest first: app/<part>/, or app/cli.py


def _package(path: Path, root: Path) -> str:
    """The dotted package `path` is in (kvfence.app.api for app/api/routes.py); '' outside `root`."""
    if not path.is_relative_to(root):
        return ""
    return ".".join(["kvfence", *path.relative_to(root).parent.parts])


def _imports(path: Path, names: bool = False, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module below kvfence.) of every kvfence import in `path`. With `names`, `from M import x`
    counts as M.x (x may be a module: `from kvfence.app import api`). A relative import counts as
    the absolute one it stands for."""
    package = _package(path, root)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            modules = [f"{module}.{a.name}" for a in node.names] if names else [module]
        else:
            continue
        found += [(node.lineno, n.removeprefix("kvfence.")) for n in modules if n.startswith("kvfence.")]
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


def test_every_part_of_app_is_in_a_layer() -> None:
    parts = {p.parent.name for p in (ROOT / "app").glob("*/__init__.py")}
    parts |= {p.stem for p in (ROOT / "app").glob("*.py") if p.stem != "__init__"}
    assert parts == set(APP_PARTS), f"parts of app {parts ^ set(APP_PARTS)}: each needs its place in APP_PARTS"


def _above_in_app(part: str, imports: list[tuple[int, str]]) -> list[str]:
    """The imports (with names) of a module in app's `part` that reach a part above it."""
    return [f"{line}: kvfence.{module}" for line, module in imports
            if module.startswith("app.") and APP_PARTS.index(module.split(".")[1]) > APP_PARTS.index(part)]


@pytest.mark.parametrize("path", [p for p in sorted((ROOT / "app").rglob("*.py")) if p != ROOT / "app/__init__.py"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_of_app_imports_from_a_part_above_its_own(path: Path) -> None:
    source = path.relative_to(ROOT)
    part = source.parts[1].removesuffix(".py")
    above = _above_in_app(part, _imports(path, names=True))
    assert not above, (f"{source} ({part}) imports from a part of app above its own (the parts, lowest first: "
                       f"{', '.join(APP_PARTS)}):\n" + "\n".join(above))


def test_the_check_sees_an_import_from_a_part_of_app_above(tmp_path: Path) -> None:
    probe = tmp_path / "app" / "api" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from kvfence.app.config.config import ServeConfig\nfrom kvfence.app import serve\n"
                     "def f():\n    from ..remote import front\nimport kvfence.app.cli\nfrom . import routes\n")
    imports = _imports(probe, names=True, root=tmp_path)
    assert imports == [(1, "app.config.config.ServeConfig"), (2, "app.serve"), (4, "app.remote.front"),
                       (5, "app.cli"), (6, "app.api.routes")]
    assert _above_in_app("api", imports) == ["2: kvfence.app.serve", "4: kvfence.app.remote.front",
                                             "5: kvfence.app.cli"]


def test_every_package_folder_is_installed() -> None:
    """pyproject.toml's [tool.setuptools] packages names every folder with an __init__.py, and only
    those: an editable install finds an unlisted one anyway, a fresh install leaves it out."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    top = {folder: package for package, folder in setuptools["package-dir"].items()}
    folders = {".".join([top[p.relative_to(ROOT).parts[0]], *p.relative_to(ROOT).parent.parts[1:]])
               for layer in LAYERS for p in (ROOT / layer).rglob("__init__.py")}
    listed = set(setuptools["packages"])
    assert folders == listed, f"unlisted: {sorted(folders - listed)}; listed, no folder: {sorted(listed - folders)}"
