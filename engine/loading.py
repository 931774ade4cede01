"""From a `--model` value to a ready model: resolve, load, place on a device in a dtype."""

from __future__ import annotations

from pathlib import Path

import torch

from kvfence.engine.checkpoint import Checkpoint, load_checkpoint
from kvfence.engine.known_models import resolve_model

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def pick_device(name: str) -> torch.device:
    """'auto' is the first GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available here; use --device cpu")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is float32 on the CPU (this model family is precision-sensitive) and bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def checkpoint_cache(home: Path) -> Path:
    """Where the start-up cache of the models under `home` lives (engine/gguf_cache.py)."""
    return home / "cache"


def load_model_spec(spec: str | None, home: Path, progress: bool = True, keep_blocks: bool = False) -> Checkpoint:
    """`keep_blocks`: `--weights native` (engine/checkpoint.load_checkpoint)."""
    return load_checkpoint(resolve_model(spec, home, progress), cache_dir=checkpoint_cache(home),
                           keep_blocks=keep_blocks)
