"""Load a Hugging Face model directory: config.json, safetensors shards, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvfence.engine.checkpoint import Checkpoint, CheckpointError, Tensors, check_tensors
from kvfence.engine.model_config import ModelConfig, UnsupportedModelError
from kvfence.engine.tokenizer import tokenizer_from_hf_dir

_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


def config_from_hf(raw: dict[str, Any], source: str) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise UnsupportedModelError(
            f"{source}: unknown architecture model_type={model_type!r} "
            f"(architectures={raw.get('architectures')}); kvfence runs {', '.join(_MODEL_TYPES)}")
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        context = int(raw.get("max_position_embeddings", 2048))
        # Without sliding-window attention, Mistral is exact only within its window: cap the context.
        window = raw.get("sliding_window") if model_type == "mistral" else None
        if window:
            context = min(context, int(window))
        scaling = raw.get("rope_scaling") or {}
        llama3 = None
        if scaling.get("rope_type", scaling.get("type")) == "llama3":
            llama3 = (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                      float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
        elif scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise UnsupportedModelError(f"{source}: rope_scaling {scaling} is not supported")
        return ModelConfig(
            architecture=_MODEL_TYPES[model_type],
            num_layers=int(raw["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            vocab_size=int(raw["vocab_size"]),
            max_context_tokens=context,
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            rope_llama3_scaling=llama3,
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: config.json lacks {e.args[0]}") from e
    except UnsupportedModelError as e:
        if str(e).startswith(source):
            raise
        raise UnsupportedModelError(f"{source}: {e}") from e


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

    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{directory}: not a model directory (no config.json)")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from e
    config = config_from_hf(raw, str(directory))
    tensors: Tensors = {}
    for shard in _shard_files(directory) if weights else ():
        try:
            tensors.update(load_file(str(shard)))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{shard}: cannot read safetensors ({e})") from e
    if weights:
        check_tensors(config, tensors, str(directory))
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer_from_hf_dir(directory),
                      source=str(directory))
