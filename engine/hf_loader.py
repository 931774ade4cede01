"""Load a Hugging Face model directory: config.json (read by the family its model_type names,
engine/models/registry.py), safetensors shards, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvfence.engine.checkpoint import Checkpoint, CheckpointError, Tensors, check_tensors
from kvfence.engine.json_file import read_json_object
from kvfence.engine.model_config import ModelConfig
from kvfence.engine.models.registry import family_of_hf
from kvfence.engine.tokenizer import tokenizer_from_hf_dir

def read_config_json(directory: Path) -> dict[str, Any]:
    """`directory`'s config.json; CheckpointError naming what is wrong."""
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{directory}: not a model directory (no config.json)")
    return read_json_object(cfg_path, CheckpointError)


def config_of(directory: Path) -> ModelConfig:
    """The config `directory`'s config.json describes, read by the family its model_type names."""
    raw = read_config_json(directory)
    source = str(directory)
    return family_of_hf(raw.get("model_type"), source, raw.get("architectures")).config_from_hf(raw, source)


def _shard_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files (PyTorch .bin weights are not loaded)")
    return files


def load_hf_dir(directory: Path, weights: bool = True) -> Checkpoint:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    raw = read_config_json(directory)
    family = family_of_hf(raw.get("model_type"), str(directory), raw.get("architectures"))
    config = family.config_from_hf(raw, str(directory))
    tensors: Tensors = {}
    for shard in _shard_files(directory) if weights else ():
        try:
            tensors.update(load_file(str(shard)))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{shard}: cannot read safetensors ({e})") from e
    if weights:
        check_tensors(family.expected_shapes(config), tensors, str(directory))
    tokenizer = tokenizer_from_hf_dir(directory)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = family.chat_template
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer, source=str(directory))
