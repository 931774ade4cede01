"""The registry: which family runs an architecture, found from the files of engine/models/ alone,
and no module outside engine/models/ naming a family."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfence.engine import models
from kvfence.engine.model_config import UnsupportedModelError
from kvfence.engine.models import registry

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("app", "engine", "scheduler", "transports", "kernels")
NOT_FAMILIES = {"family", "registry"}


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    registry.families.cache_clear()
    yield
    registry.families.cache_clear()


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2"])
def test_the_llama_family_runs_its_architectures(architecture: str) -> None:
    assert registry.family_of(architecture).name == "llama"
    assert registry.family_of_hf(architecture, "config.json").name == "llama"


def test_an_unknown_architecture_names_what_runs() -> None:
    with pytest.raises(UnsupportedModelError, match=r"^m.gguf: unknown architecture 'rwkv6'; kvfence runs gemma3, llama, mistral, qwen2"):
        registry.family_of("rwkv6", "m.gguf")
    with pytest.raises(UnsupportedModelError, match=r"model_type='bert' \(architectures=\['BertModel'\]\)"):
        registry.family_of_hf("bert", "dir", ["BertModel"])


def test_two_families_claiming_one_architecture_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                            fresh_registry: None) -> None:
    (tmp_path / "copycat.py").write_text(
        "class Copycat:\n    name = 'copycat'\n    architectures = ('qwen2',)\n    hf_model_types = ()\n"
        "FAMILY = Copycat()\n")
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(tmp_path)])
    try:
        with pytest.raises(RuntimeError, match="families 'copycat' and 'llama' both claim architectures 'qwen2'"):
            registry.families()
    finally:
        sys.modules.pop(f"{models.__name__}.copycat", None)


def _family_modules() -> set[str]:
    return {f"kvfence.engine.models.{p.stem}" for p in (ROOT / "engine" / "models").glob("*.py")
            if p.stem not in NOT_FAMILIES and p.stem != "__init__"}


def test_no_module_outside_engine_models_names_a_family() -> None:
    """The loaders, the runner, the workers, the scheduler and the app reach a family only through
    the registry, so a new family touches none of them."""
    families = _family_modules()
    assert "kvfence.engine.models.llama" in families
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.parent == ROOT / "engine" / "models":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""]
                         if isinstance(node, ast.ImportFrom) else [])
                named = [n for n in names if any(n == f or n.startswith(f + ".") for f in families)]
                assert not named, f"{path.relative_to(ROOT)}:{node.lineno} imports {named[0]}"
