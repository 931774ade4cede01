"""A loaded checkpoint: model config, weights under canonical names, and a tokenizer.

Weights use the Hugging Face Llama names (``model.layers.{i}.self_attn.q_proj.weight``...) and the
rotate-half RoPE convention whatever file they came from, so one model implementation serves both
GGUF files and HF directories.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from kvfence.engine.gguf_tensor import GGUFTensor
from kvfence.engine.model_config import ModelConfig
from kvfence.engine.tokenizer import Tokenizer


class CheckpointError(ValueError):
    """A model file or directory cannot be loaded; the message names the file and the problem."""


# canonical name -> float tensor ([out, in] for matrices), or a matrix kept in its GGUF block type
Tensors = dict[str, torch.Tensor | GGUFTensor]


@dataclasses.dataclass
class Checkpoint:
    config: ModelConfig
    tensors: Tensors  # block types kept only with load_checkpoint's `keep_blocks`
    tokenizer: Tokenizer
    source: str  # the path it was loaded from
    # Per-frequency RoPE divisors stored in the file (Llama 3.1 GGUF `rope_freqs`), if any.
    rope_freq_factors: torch.Tensor | None = None


def layer_tensor_names(config: ModelConfig, layer: int) -> list[str]:
    """Canonical tensor names one decoder layer must provide."""
    p = f"model.layers.{layer}."
    names = [
        p + "input_layernorm.weight",
        p + "post_attention_layernorm.weight",
        p + "self_attn.q_proj.weight",
        p + "self_attn.k_proj.weight",
        p + "self_attn.v_proj.weight",
        p + "self_attn.o_proj.weight",
        p + "mlp.gate_proj.weight",
        p + "mlp.up_proj.weight",
        p + "mlp.down_proj.weight",
    ]
    if config.qkv_bias:
        names += [p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"]
    return names


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `config` must hold, with its shape."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (c.q_size, c.hidden_size),
            p + "self_attn.k_proj.weight": (c.kv_size, c.hidden_size),
            p + "self_attn.v_proj.weight": (c.kv_size, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, c.q_size),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        })
        if c.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (c.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (c.kv_size,)
    return shapes


def check_tensors(config: ModelConfig, tensors: Tensors, source: str) -> None:
    """Raise CheckpointError naming the first missing or misshapen tensor."""
    for name, shape in expected_shapes(config).items():
        t = tensors.get(name)
        if t is None:
            raise CheckpointError(f"{source}: tensor {name} is missing")
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(t.shape)}, expected {shape}")


def load_checkpoint(path: str | Path, weights: bool = True, cache_dir: Path | None = None,
                    keep_blocks: bool = False) -> Checkpoint:
    """Load a GGUF file or a Hugging Face model directory. Without `weights`: its config and
    tokenizer only (`tensors` is empty: what a front end whose workers run elsewhere needs).
    `cache_dir`: where a GGUF file's start-up cache lives (engine/gguf_cache.py; a directory of
    safetensors loads fast already and is read as it is). `keep_blocks` (`--weights native`): a
    GGUF file's quantized matrices stay in their block types (engine/gguf_tensor.py)."""
    from kvfence.engine import gguf_loader, hf_loader

    p = Path(path)
    if p.is_dir():
        return hf_loader.load_hf_dir(p, weights)
    if p.is_file():
        return gguf_loader.load_gguf(p, weights, cache_dir, keep_blocks)
    raise CheckpointError(f"{p}: no such file or directory")
