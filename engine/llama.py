"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Plain tensors, no autograd, token-major activations: a step is one flat batch of T tokens from
many sequences (see attention.AttentionBatch). Q/K/V and gate/up projections are fused into one
GEMM each, so a layer is four matrix multiplies whatever the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvfence.engine.attention import AttentionBatch
from kvfence.engine.attention_backend import CpuBackend, select_attention_backend
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.gguf_tensor import GGUFTensor
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.linear import Linear
from kvfence.engine.model_config import ModelConfig
from kvfence.engine.rope import Rope
from kvfence.kernels.cpu import elementwise as cpu_elementwise, gemm as cpu_gemm, layer as cpu_layer
from kvfence.kernels.cpu import library as cpu_kernels_library


@dataclasses.dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> q_size + 2 * kv_size (with the Q/K/V biases when the model has them)
    o: Linear  # q_size -> hidden
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden


class LlamaModel:
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
        """Every layer of a step in one C call each (kernels/cpu/layer.py), where the
        CPU backend attends and every linear is packed for it; None elsewhere."""
        c = self.config
        packed = [lin.packed for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        ready = [p for p in packed if p is not None]
        if (self.attention.name != "cpu" or len(ready) < len(packed)
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
        if self.fused_layers is not None and isinstance(self.attention, CpuBackend):  # only there (_fused_layers)
            slots, tables = self.attention.checked(batch, pool.keys(0))
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
