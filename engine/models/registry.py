"""Which family runs an architecture: every module of engine/models/ that defines `FAMILY`.

A new family is one new file here (its config mapping, weight names and layer wiring behind
engine/models/family.py's interface) and its tests; the loaders, the runner, the workers and
the scheduler name no family. Two families claiming one architecture is an error at start-up.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

import torch

from kvfence.engine import models
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.model_config import UnsupportedModelError
from kvfence.engine.models.family import Model, ModelFamily

_NOT_FAMILIES = ("family", "registry")  # the interface and this module


@functools.cache
def families() -> tuple[ModelFamily, ...]:
    """Every family, by module name (found once per process)."""
    found: list[ModelFamily] = []
    for module in sorted(m.name for m in pkgutil.iter_modules(models.__path__)):
        if module in _NOT_FAMILIES:
            continue
        family = getattr(importlib.import_module(f"{models.__name__}.{module}"), "FAMILY", None)
        if family is not None:
            found.append(family)
    for kind in ("architectures", "hf_model_types"):
        claimed: dict[str, str] = {}
        for family in found:
            for name in getattr(family, kind):
                if name in claimed:
                    raise RuntimeError(f"families {claimed[name]!r} and {family.name!r} both claim {kind} {name!r}")
                claimed[name] = family.name
    return tuple(found)


def _runs(kind: str) -> str:
    return ", ".join(sorted(name for family in families() for name in getattr(family, kind)))


def family_of(architecture: str, source: str = "") -> ModelFamily:
    """The family that runs `architecture` (a GGUF general.architecture, or ModelConfig's);
    UnsupportedModelError naming `source` and what kvfence runs otherwise."""
    for family in families():
        if architecture in family.architectures:
            return family
    where = f"{source}: " if source else ""
    raise UnsupportedModelError(f"{where}unknown architecture {architecture!r}; kvfence runs {_runs('architectures')}")


def family_of_hf(model_type: object, source: str, architectures: object = None) -> ModelFamily:
    """The family that runs a config.json's `model_type` (errors as family_of's)."""
    for family in families():
        if model_type in family.hf_model_types:
            return family
    raise UnsupportedModelError(f"{source}: unknown architecture model_type={model_type!r} "
                                f"(architectures={architectures}); kvfence runs {_runs('hf_model_types')}")


def build_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device | str = "cpu", *,
                attention_backend: str = "auto", cpu_kernels: bool = True) -> Model:
    """The model of `checkpoint`, built by its family (engine/models/family.py's `build`)."""
    return family_of(checkpoint.config.architecture, checkpoint.source).build(
        checkpoint, dtype, device, attention_backend=attention_backend, cpu_kernels=cpu_kernels)
