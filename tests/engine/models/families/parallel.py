"""A family that is not in kvfence, written the way a new one is: this one file, nothing else.

`parallel` is the parallel-residual block of GPT-J and PaLM: one norm per layer, and attention
and the MLP both read it, their outputs summed into the residual at once,
    x = x + o(attention(norm(x))) + down(silu(gate(norm(x))) * up(norm(x))),
with RoPE (rotate-half) on grouped-query attention. Its GGUF files use llama's tensor and key
names (no `ffn_norm`: the block has one norm) and store Q/K permuted as llama.cpp's converter
does for llama. tests/engine/models/test_a_new_family.py puts this folder on engine/models'
search path and serves it through the unchanged loaders, runner and scheduler.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvfence.engine.attention import AttentionBatch
from kvfence.engine.attention_backend import select_attention_backend
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.gguf_metadata import GGUFMetadata, float32_value
from kvfence.engine.gguf_tensor import GGUFTensor
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.linear import Linear
from kvfence.engine.model_config import ModelConfig
from kvfence.engine.models.llama import unpermuted
from kvfence.engine.rope import Rope

_NAMES = {"attn_norm.weight": "norm.weight", "attn_q.weight": "q.weight", "attn_k.weight": "k.weight",
          "attn_v.weight": "v.weight", "attn_output.weight": "o.weight", "ffn_gate.weight": "gate.weight",
          "ffn_up.weight": "up.weight", "ffn_down.weight": "down.weight"}
_GLOBAL = {"token_embd.weight": "embed.weight", "output_norm.weight": "final_norm.weight", "output.weight": "head.weight"}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


class ParallelModel:
    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device | str,
                 attention_backend: str) -> None:
        self.config = c = checkpoint.config
        self.dtype, self.device = dtype, torch.device(device)
        self.attention = select_attention_backend(attention_backend, self.device)

        def w(name: str) -> torch.Tensor:
            value = checkpoint.tensors[name]
            value = value.dequantize() if isinstance(value, GGUFTensor) else value
            return value.to(device=self.device, dtype=dtype).contiguous()

        self.embed = w("embed.weight")
        self.head = Linear(self.embed if c.tie_word_embeddings else w("head.weight"))
        self.final_norm = w("final_norm.weight")
        self.layers = [{"norm": w(f"layers.{i}.norm.weight"),
                        "qkv": Linear(torch.cat([w(f"layers.{i}.{n}.weight") for n in ("q", "k", "v")])),
                        "o": Linear(w(f"layers.{i}.o.weight")),
                        "gate_up": Linear(torch.cat([w(f"layers.{i}.{n}.weight") for n in ("gate", "up")])),
                        "down": Linear(w(f"layers.{i}.down.weight"))} for i in range(c.num_layers)]
        self.rope = Rope(c, dtype, self.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                pool: KVPool, logits_rows: torch.Tensor,
                between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        c, t = self.config, input_ids.shape[0]
        x = self.embed[input_ids]
        cos, sin = self.rope.tables(positions)
        for i, layer in enumerate(self.layers):
            if between_layers is not None:
                between_layers()
            h = F.rms_norm(x, (c.hidden_size,), layer["norm"], c.rms_norm_eps)
            qkv = layer["qkv"](h)
            qk = self.rope.apply(qkv[:, : c.q_size + c.kv_size].view(t, c.num_heads + c.num_kv_heads, c.head_dim),
                                 cos, sin)
            v = qkv[:, c.q_size + c.kv_size:].view(t, c.num_kv_heads, c.head_dim)
            self.attention.store_kv(pool.keys(i), pool.values(i), qk[:, c.num_heads:], v, batch)
            attn = self.attention.paged_attention(qk[:, : c.num_heads], pool.keys(i), pool.values(i), batch)
            gate, up = layer["gate_up"](h).chunk(2, dim=-1)
            x = x + layer["o"](attn.reshape(t, c.q_size)) + layer["down"](F.silu(gate) * up)
        x = F.rms_norm(x[logits_rows], (c.hidden_size,), self.final_norm, c.rms_norm_eps)
        return self.head(x).float()


class ParallelFamily:
    name = "parallel"
    architectures = ("parallel",)
    hf_model_types = ("parallel",)
    chat_template = None

    def config_from_gguf(self, meta: GGUFMetadata, path: Path) -> ModelConfig:
        def get(key: str, default: Any = None) -> Any:
            return meta.required(f"parallel.{key}", path, default)

        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        return ModelConfig(architecture="parallel", num_layers=int(get("block_count")), hidden_size=hidden,
                           intermediate_size=int(get("feed_forward_length")), num_heads=heads,
                           num_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=hidden // heads,
                           vocab_size=int(get("vocab_size")), max_context_tokens=int(get("context_length")),
                           rope_theta=float32_value(get("rope.freq_base")),
                           rms_norm_eps=float32_value(get("attention.layer_norm_rms_epsilon")),
                           tie_word_embeddings="output.weight" not in meta.tensor_names)

    def config_from_hf(self, raw: dict[str, Any], source: str) -> ModelConfig:
        raise NotImplementedError("the parallel family ships as GGUF only")

    def canonical_name(self, gguf_name: str) -> str | None:
        m = _LAYER.match(gguf_name)
        if m and m.group(2) in _NAMES:
            return f"layers.{m.group(1)}.{_NAMES[m.group(2)]}"
        return _GLOBAL.get(gguf_name)

    def from_gguf(self, name: str, tensor: torch.Tensor | GGUFTensor,
                  config: ModelConfig) -> torch.Tensor | GGUFTensor:
        heads = config.num_heads if name.endswith(".q.weight") else config.num_kv_heads if name.endswith(".k.weight") else 0
        return unpermuted(tensor, heads) if heads else tensor

    def expected_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        c = config
        shapes: dict[str, tuple[int, ...]] = {"embed.weight": (c.vocab_size, c.hidden_size),
                                              "final_norm.weight": (c.hidden_size,)}
        if not c.tie_word_embeddings:
            shapes["head.weight"] = (c.vocab_size, c.hidden_size)
        for i in range(c.num_layers):
            shapes.update({f"layers.{i}.norm.weight": (c.hidden_size,),
                           f"layers.{i}.q.weight": (c.q_size, c.hidden_size),
                           f"layers.{i}.k.weight": (c.kv_size, c.hidden_size),
                           f"layers.{i}.v.weight": (c.kv_size, c.hidden_size),
                           f"layers.{i}.o.weight": (c.hidden_size, c.q_size),
                           f"layers.{i}.gate.weight": (c.intermediate_size, c.hidden_size),
                           f"layers.{i}.up.weight": (c.intermediate_size, c.hidden_size),
                           f"layers.{i}.down.weight": (c.hidden_size, c.intermediate_size)})
        return shapes

    def build(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device | str = "cpu", *,
              attention_backend: str = "auto", cpu_kernels: bool = True) -> ParallelModel:
        return ParallelModel(checkpoint, dtype, device, attention_backend)


FAMILY = ParallelFamily()
