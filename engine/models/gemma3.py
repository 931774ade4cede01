"""The Gemma 3 family (text): Gemma 3 270M and its larger siblings, over a paged KV cache.

The layer, as llama.cpp and the reference implementation run it: RMSNorm before attention, Q and K
each RMS-normed per head (QK-norm), RoPE (rotate-half) with base 1e6 on global layers and 1e4 on
sliding ones, grouped-query attention scaled by 1/sqrt(head_dim), an RMSNorm after attention
before the residual; then RMSNorm, GeGLU (gelu-tanh of the gate times up), down, and an RMSNorm
after it before the residual. Five layers in six (all but layers 5, 11, 17, ...) attend only to
the last `sliding_window` positions (engine/attention.py's `window`); the others read the whole
context, so every page of a sequence stays in its lease until it ends. Embeddings are scaled by
sqrt(hidden) and the head is tied to them.

GGUF files store every norm weight with Gemma's +1 already added (llama.cpp's converter), so the
norms multiply by the stored weight; a Hugging Face directory stores it without, so Gemma 3 loads
from GGUF files only here.
"""

from __future__ import annotations

import dataclasses
import math
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
from kvfence.engine.models.family import GGUFNames
from kvfence.engine.model_config import ModelConfig, UnsupportedModelError
from kvfence.engine.rope import Rope

SLIDING_PATTERN = 6  # every sixth layer is global (llama.cpp's gemma3: set_swa_pattern(6))
LOCAL_ROPE_THETA = 10_000.0  # the sliding layers' RoPE base (llama.cpp: rope_freq_base_train_swa)

# Gemma's turn format (its instruction-tuned models' own template, as the base model's file carries
# none): a system message joins the first user turn; the assistant's role is "model".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first_prefix = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first_prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('conversation roles must alternate user, assistant, user, ... after an optional system') }}"
    "{% endif %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ (first_prefix if loop.first else '') + (message['content'] | trim) + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

_NAMES = GGUFNames({"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"},
                   {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
})


@dataclasses.dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    sliding_window: int = 512  # tokens a sliding layer attends to, its own included

    def is_sliding(self, layer: int) -> bool:
        return (layer + 1) % SLIDING_PATTERN != 0


@dataclasses.dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor
    o: Linear
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    post_ffn_norm: torch.Tensor
    window: int  # 0: a global layer


class Gemma3Model:
    """The Gemma 3 layer wiring over a checkpoint of the family (engine/models/family.py's Model)."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device | str,
                 attention_backend: str, cpu_kernels: bool) -> None:
        config = checkpoint.config
        if not isinstance(config, Gemma3Config):
            raise UnsupportedModelError(f"{checkpoint.source}: not a Gemma 3 config")
        self.config: Gemma3Config = config
        self.dtype, self.device = dtype, torch.device(device)
        self.attention = select_attention_backend(attention_backend, self.device)
        t = checkpoint.tensors

        def w(name: str) -> torch.Tensor:
            value = t[name]
            value = value.dequantize() if isinstance(value, GGUFTensor) else value
            return value.to(device=self.device, dtype=dtype).contiguous()

        def linear(*names: str) -> Linear:
            return Linear(torch.cat([w(n) for n in names]) if len(names) > 1 else w(names[0]), None,
                          cpu_gemm_ok=cpu_kernels)

        c = config
        self.embed = w("model.embed_tokens.weight")
        self.embed_scale = torch.tensor(math.sqrt(c.hidden_size), dtype=torch.float32).to(dtype).item()
        self.lm_head = Linear(self.embed, None, cpu_gemm_ok=cpu_kernels)
        self.final_norm = w("model.norm.weight")
        self.layers = []
        for i in range(c.num_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            self.layers.append(_Layer(
                attn_norm=w(p + "input_layernorm.weight"),
                qkv=linear(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                q_norm=w(a + "q_norm.weight"), k_norm=w(a + "k_norm.weight"), o=linear(a + "o_proj.weight"),
                post_attn_norm=w(p + "post_attention_layernorm.weight"),
                ffn_norm=w(p + "pre_feedforward_layernorm.weight"),
                gate_up=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=linear(p + "mlp.down_proj.weight"),
                post_ffn_norm=w(p + "post_feedforward_layernorm.weight"),
                window=c.sliding_window if c.is_sliding(i) else 0))
        self.rope_global = Rope(c, dtype, self.device)
        self.rope_local = Rope(dataclasses.replace(c, rope_theta=LOCAL_ROPE_THETA), dtype, self.device)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                pool: KVPool, logits_rows: torch.Tensor,
                between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        c = self.config
        n = input_ids.shape[0]
        x = self.embed[input_ids] * self.embed_scale  # [T, hidden]
        tables = {0: self.rope_global.tables(positions), c.sliding_window: self.rope_local.tables(positions)}
        for i, layer in enumerate(self.layers):
            if between_layers is not None:
                between_layers()
            qkv = layer.qkv(self._norm(x, layer.attn_norm))
            q = self._norm(qkv[:, : c.q_size].view(n, c.num_heads, c.head_dim), layer.q_norm)
            k = self._norm(qkv[:, c.q_size: c.q_size + c.kv_size].view(n, c.num_kv_heads, c.head_dim), layer.k_norm)
            v = qkv[:, c.q_size + c.kv_size:].view(n, c.num_kv_heads, c.head_dim)
            cos, sin = tables[layer.window]
            q, k = Rope.apply(q, cos, sin), Rope.apply(k, cos, sin)
            keys, values = pool.keys(i), pool.values(i)
            self.attention.store_kv(keys, values, k, v, batch)
            attn = self.attention.paged_attention(q, keys, values, batch, layer.window)
            x = x + self._norm(layer.o(attn.reshape(n, c.q_size)), layer.post_attn_norm)
            gate, up = layer.gate_up(self._norm(x, layer.ffn_norm)).chunk(2, dim=-1)
            x = x + self._norm(layer.down(F.gelu(gate, approximate="tanh") * up), layer.post_ffn_norm)
        x = self._norm(x[logits_rows], self.final_norm)
        return self.lm_head(x).float()


class Gemma3Family:
    """Gemma 3's config mapping, weight names and model (engine/models/family.py)."""

    name = "gemma3"
    architectures = ("gemma3",)
    hf_model_types: tuple[str, ...] = ()  # GGUF only (the module docstring)
    chat_template = CHAT_TEMPLATE

    def config_from_gguf(self, meta: GGUFMetadata, path: Path) -> ModelConfig:
        def get(key: str, default: Any = None) -> Any:
            return meta.required(f"gemma3.{key}", path, default)

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        try:
            return Gemma3Config(
                architecture="gemma3",
                num_layers=int(get("block_count")),
                hidden_size=hidden,
                intermediate_size=int(get("feed_forward_length")),
                num_heads=heads,
                num_kv_heads=int(get("attention.head_count_kv", heads)),
                head_dim=int(get("attention.key_length", hidden // heads)),
                vocab_size=len(meta.field("tokenizer.ggml.tokens") or []) or int(get("vocab_size")),
                max_context_tokens=int(get("context_length")),
                rope_theta=float32_value(get("rope.freq_base", 1_000_000.0)),
                rms_norm_eps=float32_value(get("attention.layer_norm_rms_epsilon", 1e-6)),
                tie_word_embeddings=True,
                sliding_window=int(get("attention.sliding_window")),
            )
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{path}: {e}") from e

    def config_from_hf(self, raw: dict[str, Any], source: str) -> ModelConfig:
        raise UnsupportedModelError(f"{source}: Gemma 3 loads from GGUF files only")

    def canonical_name(self, gguf_name: str) -> str | None:
        return _NAMES.canonical(gguf_name)

    def from_gguf(self, name: str, tensor: torch.Tensor | GGUFTensor,
                  config: ModelConfig) -> torch.Tensor | GGUFTensor:
        return tensor  # stored for rotate-half RoPE (llama.cpp runs Gemma with NeoX RoPE)

    def expected_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        c = config
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                                              "model.norm.weight": (c.hidden_size,)}
        for i in range(c.num_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            shapes.update({
                p + "input_layernorm.weight": (c.hidden_size,),
                a + "q_proj.weight": (c.q_size, c.hidden_size),
                a + "k_proj.weight": (c.kv_size, c.hidden_size),
                a + "v_proj.weight": (c.kv_size, c.hidden_size),
                a + "o_proj.weight": (c.hidden_size, c.q_size),
                a + "q_norm.weight": (c.head_dim,),
                a + "k_norm.weight": (c.head_dim,),
                p + "post_attention_layernorm.weight": (c.hidden_size,),
                p + "pre_feedforward_layernorm.weight": (c.hidden_size,),
                p + "post_feedforward_layernorm.weight": (c.hidden_size,),
                p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
            })
        return shapes

    def build(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device | str = "cpu", *,
              attention_backend: str = "auto", cpu_kernels: bool = True) -> Gemma3Model:
        return Gemma3Model(checkpoint, dtype, device, attention_backend, cpu_kernels)


FAMILY = Gemma3Family()
