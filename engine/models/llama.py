"""The Llama family: Llama 2/3, Mistral, Qwen2 (and SmolLM2, a Llama) over a paged KV cache.

The layer: pre-norm (RMSNorm), RoPE (rotate-half) on grouped-query attention with optional Q/K/V
biases (Qwen2), a SwiGLU MLP, residuals around both. Plain tensors, no autograd, token-major
activations: a step is one flat batch of T tokens from many sequences (engine/attention.py's
AttentionBatch). Q/K/V and gate/up projections are fused into one GEMM each, so a layer is four
matrix multiplies whatever the batch.

Weights are read under the Hugging Face names whatever the file. GGUF (llama.cpp's format)
stores the Q and K projections of `llama`-architecture models permuted for interleaved-pair RoPE;
`from_gguf` un-permutes them per head, so the model uses the rotate-half RoPE Hugging Face
checkpoints use (mixing the two conventions is silently wrong). `qwen2` and `mistral` files are
stored unpermuted (llama.cpp runs them with NeoX RoPE) and are left as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvfence.engine.attention import AttentionBatch
from kvfence.engine.attention_backend import select_attention_backend
from kvfence.engine.checkpoint import Checkpoint, CheckpointError
from kvfence.engine.gguf_metadata import GGUFMetadata, float32_value
from kvfence.engine.gguf_tensor import GGUFTensor
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.linear import Linear
from kvfence.engine.models.family import GGUFNames
from kvfence.engine.model_config import ModelConfig, UnsupportedModelError
from kvfence.engine.rope import Rope
from kvfence.kernels.cpu import elementwise as cpu_elementwise, gemm as cpu_gemm, layer as cpu_layer
from kvfence.kernels.cpu import library as cpu_kernels_library

_NAMES = GGUFNames({
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}, {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
})
_PERMUTED_QK_ARCHS = ("llama",)  # whose Q/K weights the GGUF converter permuted for interleaved RoPE


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave: rows (head, pair, 2) -> (head, 2, pair)."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    return (w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])
             .transpose(1, 2).reshape(w.shape).contiguous())


def unpermuted(tensor: torch.Tensor | GGUFTensor, num_heads: int) -> torch.Tensor | GGUFTensor:
    """`unpermute_qk` of a float tensor, or of the rows of a tensor kept in its block type."""
    if isinstance(tensor, GGUFTensor):
        return tensor.with_rows(lambda rows: unpermute_qk(rows, num_heads))
    return unpermute_qk(tensor, num_heads)


def permute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The GGUF converter's permutation (inverse of `unpermute_qk`); used to write GGUF files."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    return (w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:])
             .transpose(1, 2).reshape(w.shape).contiguous())


@dataclasses.dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> q_size + 2 * kv_size (with the Q/K/V biases when the model has them)
    o: Linear  # q_size -> hidden
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden


class LlamaModel:
    """The Llama layer wiring over a checkpoint of the family (engine/models/family.py's Model)."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device | str = "cpu",
                 attention_backend: str = "auto", cpu_kernels: bool = True) -> None:
        """`attention_backend`: auto | torch | cpu | triton (engine/attention_backend.py).
        `cpu_kernels`: False runs torch's paths (oneDNN linears, torch attention under auto, torch
        norms) even where kernels/cpu/library.py runs: what benchmarks compare against.
        Matrices the checkpoint kept in their GGUF block types (GGUFTensor) are multiplied as
        they are by the CPU GEMM where it runs float32 (the embedding and LM head included);
        anywhere else they are dequantized here, to what the float32 loader gives."""
        self.config: ModelConfig = checkpoint.config
        self.dtype = dtype
        self.device = torch.device(device)
        if not cpu_kernels and attention_backend == "auto" and self.device.type == "cpu":
            attention_backend = "torch"
        self.attention = select_attention_backend(attention_backend, self.device)
        t = checkpoint.tensors
        blocks_ok = (cpu_kernels and self.device.type == "cpu" and dtype == torch.float32
                     and cpu_kernels_library.available())

        def w(name: str) -> torch.Tensor:
            value = t[name]
            value = value.dequantize() if isinstance(value, GGUFTensor) else value
            return value.to(device=self.device, dtype=dtype).contiguous()

        def kept(*names: str) -> bool:
            return blocks_ok and any(cpu_gemm.kept_as_shipped(t[name]) for name in names)

        def linear(*names: str, bias: torch.Tensor | None = None) -> Linear:
            if kept(*names):
                return Linear.of_parts([t[name] for name in names], bias)
            weight = torch.cat([w(name) for name in names]) if len(names) > 1 else w(names[0])
            return Linear(weight, bias, cpu_gemm_ok=cpu_kernels)

        embed = "model.embed_tokens.weight"  # [vocab, hidden]
        self.embed_rows: cpu_gemm.PackedWeight | None = None  # the embedding kept as it ships, else None
        if kept(embed):
            head = linear(embed)
            self.embed_rows, self.embed = head.packed, torch.empty(0)
            self.lm_head = head if self.config.tie_word_embeddings else linear("lm_head.weight")
        else:
            self.embed = w(embed)
            self.lm_head = (Linear(self.embed, None, cpu_gemm_ok=cpu_kernels) if self.config.tie_word_embeddings
                            else linear("lm_head.weight"))
        self.final_norm = w("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if self.config.qkv_bias:
                bias = torch.cat([w(a + "q_proj.bias"), w(a + "k_proj.bias"), w(a + "v_proj.bias")])
            self.layers.append(LayerWeights(
                attn_norm=w(p + "input_layernorm.weight"),
                qkv=linear(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight", bias=bias),
                o=linear(a + "o_proj.weight"),
                mlp_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=linear(p + "mlp.down_proj.weight"),
            ))
        self.rope = Rope(self.config, dtype, self.device, checkpoint.rope_freq_factors)
        # The norms and SiLU·up as one C call each where the CPU kernels run (kernels/cpu/elementwise.py).
        c = self.config
        self.fused_elementwise = cpu_kernels and all(
            cpu_elementwise.usable(torch.empty(0, n, dtype=dtype, device=self.device))
            for n in (c.hidden_size, c.intermediate_size))
        self.fused_layers = self._fused_layers() if self.fused_elementwise else None

    def _fused_layers(self) -> cpu_layer.FusedLayers | None:
        """Every layer of a step in one C call each (kernels/cpu/layer.py), where the attention
        backend checks whole-layer tables (its `layer_tables` capability) and every linear is
        packed for the CPU GEMM; None elsewhere."""
        c = self.config
        packed = [lin.packed for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        ready = [p for p in packed if p is not None]
        if (self.attention.layer_tables is None or len(ready) < len(packed)
                or not cpu_layer.FusedLayers.usable(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                                     c.intermediate_size)):
            return None
        params = []
        for i, layer in enumerate(self.layers):
            qkv, o, gate_up, down = ready[4 * i: 4 * i + 4]
            params.append(cpu_layer.LayerParams(attn_norm=layer.attn_norm, qkv=qkv, o=o, mlp_norm=layer.mlp_norm,
                                                gate_up=gate_up, down=down))
        return cpu_layer.FusedLayers(params, hidden=c.hidden_size, heads=c.num_heads, kv_heads=c.num_kv_heads,
                                      head_dim=c.head_dim, intermediate=c.intermediate_size, eps=c.rms_norm_eps)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused_elementwise:
            return cpu_elementwise.rms_norm(x, weight, self.config.rms_norm_eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused_elementwise:
            return cpu_elementwise.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # [T, intermediate] each
        return F.silu(gate) * up

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                pool: KVPool, logits_rows: torch.Tensor,
                between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64; logits_rows: [N] rows to score -> logits [N, vocab] float32.

        Writes every token's K/V into the pages `batch` names, then attends through them. On the
        CPU kernels each layer is one C call (kernels/cpu/layer.py), which computes exactly what
        the per-op loop below computes on them. `between_layers` is called before each layer; an
        exception it raises stops the forward there, leaving the K/V of the layers before it
        written into the batch's slots and nothing else (a step cut short, engine/runner.py).
        """
        c = self.config
        num_tokens = input_ids.shape[0]
        x = self.embed[input_ids] if self.embed_rows is None else self.embed_rows.rows(input_ids)  # [T, hidden]
        layer_tables = self.attention.layer_tables
        if self.fused_layers is not None and layer_tables is not None:  # built only with both (_fused_layers)
            slots, tables = layer_tables.checked(batch, pool.keys(0))
            x = self.fused_layers.run(x, self.rope.cos[positions], self.rope.sin[positions], pool.data, slots,
                                       tables, between_layers)
            return self.lm_head(self._norm(x[logits_rows], self.final_norm)).float()
        cos, sin = self.rope.tables(positions)
        for i, layer in enumerate(self.layers):
            if between_layers is not None:
                between_layers()
            h = self._norm(x, layer.attn_norm)
            qkv = layer.qkv(h)  # [T, q_size + 2 kv_size]
            qk = qkv[:, : c.q_size + c.kv_size].view(num_tokens, c.num_heads + c.num_kv_heads, c.head_dim)
            qk = self.rope.apply(qk, cos, sin)
            q = qk[:, : c.num_heads]  # [T, heads, head_dim]
            k = qk[:, c.num_heads:]  # [T, kv_heads, head_dim]
            v = qkv[:, c.q_size + c.kv_size:].view(num_tokens, c.num_kv_heads, c.head_dim)
            keys, values = pool.keys(i), pool.values(i)
            self.attention.store_kv(keys, values, k, v, batch)
            attn = self.attention.paged_attention(q, keys, values, batch)  # [T, heads, head_dim]
            x = x + layer.o(attn.reshape(num_tokens, c.q_size))
            h = self._norm(x, layer.mlp_norm)
            x = x + layer.down(self._silu_mul(layer.gate_up(h)))
        x = self._norm(x[logits_rows], self.final_norm)  # [N, hidden]
        return self.lm_head(x).float()  # [N, vocab]


class LlamaFamily:
    """The Llama family's config mapping, weight names and model (engine/models/family.py)."""

    name = "llama"
    architectures = ("llama", "mistral", "qwen2")
    hf_model_types = ("llama", "mistral", "qwen2")
    chat_template = None  # every file of the family carries its own

    def config_from_gguf(self, meta: GGUFMetadata, path: Path) -> ModelConfig:
        arch = str(meta.architecture)

        def get(key: str, default: Any = None) -> Any:
            return meta.required(f"{arch}.{key}", path, default)

        tensor_names = set(meta.tensor_names)
        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        tokens = meta.field("tokenizer.ggml.tokens") or []
        try:
            return ModelConfig(
                architecture=arch,
                num_layers=int(get("block_count")),
                hidden_size=hidden,
                intermediate_size=int(get("feed_forward_length")),
                num_heads=num_heads,
                num_kv_heads=int(get("attention.head_count_kv", num_heads)),
                head_dim=int(get("attention.key_length", hidden // num_heads)),
                vocab_size=int(get("vocab_size", len(tokens))),
                max_context_tokens=int(get("context_length")),
                rope_theta=float32_value(get("rope.freq_base", 10000.0)),
                rms_norm_eps=float32_value(get("attention.layer_norm_rms_epsilon", 1e-5)),
                tie_word_embeddings="output.weight" not in tensor_names,
                qkv_bias="blk.0.attn_q.bias" in tensor_names,
            )
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{path}: {e}") from e

    def config_from_hf(self, raw: dict[str, Any], source: str) -> ModelConfig:
        model_type = str(raw["model_type"])
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
                architecture=model_type,
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

    def canonical_name(self, gguf_name: str) -> str | None:
        return _NAMES.canonical(gguf_name)

    def from_gguf(self, name: str, tensor: torch.Tensor | GGUFTensor,
                  config: ModelConfig) -> torch.Tensor | GGUFTensor:
        if config.architecture not in _PERMUTED_QK_ARCHS:
            return tensor
        heads = (config.num_heads if name.endswith(("q_proj.weight", "q_proj.bias"))
                 else config.num_kv_heads if name.endswith(("k_proj.weight", "k_proj.bias")) else 0)
        return unpermuted(tensor, heads) if heads else tensor

    def expected_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
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

    def build(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device | str = "cpu", *,
              attention_backend: str = "auto", cpu_kernels: bool = True) -> LlamaModel:
        return LlamaModel(checkpoint, dtype, device, attention_backend=attention_backend, cpu_kernels=cpu_kernels)


FAMILY = LlamaFamily()
