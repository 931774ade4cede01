"""Load a Llama-family GGUF file: config, weights (dequantized, or with `keep_blocks` the matrices
of the block types the CPU GEMM multiplies as they ship, as engine/gguf_tensor.GGUFTensor), tokenizer.

GGUF (llama.cpp's format) stores the Q and K projections of `llama`-architecture models permuted
for interleaved-pair RoPE. This loader un-permutes them per head so the model can use the
rotate-half RoPE that Hugging Face checkpoints use; mixing the two conventions is silently wrong.
`qwen2` files are stored unpermuted (llama.cpp runs them with NeoX RoPE) and are left as they are.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from kvfence.engine.checkpoint import Checkpoint, CheckpointError, Tensors, check_tensors
from kvfence.engine.gguf_cache import GGUFCache
from kvfence.engine.gguf_tensor import GGUFTensor
from kvfence.engine.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from kvfence.engine.tokenizer import tokenizer_from_gguf_fields

# Quantization types this loader dequantizes (through the `gguf` package).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
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
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's per-frequency RoPE divisors, kept under the GGUF name
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# Architectures whose Q/K weights the GGUF converter permuted for interleaved RoPE.
_PERMUTED_QK_ARCHS = ("llama",)


def canonical_name(gguf_name: str) -> str | None:
    """Map a GGUF tensor name to its canonical (HF) name; None for tensors the model does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave: rows (head, pair, 2) -> (head, 2, pair)."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    return (w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])
             .transpose(1, 2).reshape(w.shape).contiguous())


def permute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The GGUF converter's permutation (inverse of `unpermute_qk`); used to write GGUF files."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    return (w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:])
             .transpose(1, 2).reshape(w.shape).contiguous())


def _open(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on bad files
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


@dataclasses.dataclass(frozen=True)
class GGUFMetadata:
    """A GGUF file's key-value metadata (plain Python values) and the names of its tensors: all
    that its config and tokenizer are built from."""

    fields: dict[str, Any]
    tensor_names: list[str]
    # name -> (GGUF type name, shape as [rows, values per row] or [values]): what `kvfence check`
    # sizes the weights from without reading them
    tensor_types: dict[str, tuple[str, list[int]]] = dataclasses.field(default_factory=dict)

    def field(self, key: str, default: Any = None) -> Any:
        value = self.fields.get(key)
        return default if value is None else value


def metadata_of(reader: Any) -> GGUFMetadata:
    return GGUFMetadata(fields={key: f.contents() for key, f in reader.fields.items()},
                        tensor_names=[t.name for t in reader.tensors],
                        tensor_types={t.name: (t.tensor_type.name, [int(d) for d in reversed(t.shape)])
                                      for t in reader.tensors})


def read_metadata(path: Path, cache_dir: Path | None = None) -> GGUFMetadata:
    """`path`'s metadata: from the start-up cache (engine/gguf_cache.py) when `cache_dir` holds
    it, else parsed from the file (and stored there)."""
    return _metadata(path, GGUFCache(cache_dir, path) if cache_dir is not None else None)[0]


def _metadata(path: Path, cache: GGUFCache | None) -> tuple[GGUFMetadata, Any]:
    """The metadata, and the file's reader when it had to be opened (else None)."""
    meta = cache.metadata() if cache is not None else None
    if meta is not None:
        return meta, None
    reader = _open(path)
    meta = metadata_of(reader)
    if cache is not None:
        cache.store_metadata(meta)
    return meta, reader


def _float32_value(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06): the number the converter was given, as config.json has it."""
    f = float(value)
    return float(str(np.float32(f))) if float(np.float32(f)) == f else f


def config_from_fields(meta: GGUFMetadata, path: Path) -> ModelConfig:
    arch = meta.field("general.architecture")
    if arch is None:
        raise CheckpointError(f"{path}: GGUF has no general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:  # before its keys: other families lack llama's keys
        raise UnsupportedModelError(f"{path}: unknown architecture {arch!r}; kvfence runs "
                                    f"{', '.join(SUPPORTED_ARCHITECTURES)}")

    def get(key: str, default: Any = None) -> Any:
        value = meta.field(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{path}: GGUF is missing {arch}.{key}")
        return value

    tensor_names = set(meta.tensor_names)
    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    tokens = meta.field("tokenizer.ggml.tokens") or []
    try:
        return ModelConfig(
            architecture=str(arch),
            num_layers=int(get("block_count")),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("attention.key_length", hidden // num_heads)),
            vocab_size=int(get("vocab_size", len(tokens))),
            max_context_tokens=int(get("context_length")),
            rope_theta=_float32_value(get("rope.freq_base", 10000.0)),
            rms_norm_eps=_float32_value(get("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
        )
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{path}: {e}") from e


def _dequantize(t: Any, path: Path) -> torch.Tensor:
    import gguf

    kind = _kind(t, path)
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except Exception as e:
        raise CheckpointError(f"{path}: tensor {t.name} ({kind}) cannot be dequantized: {e}") from e
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    if not arr.flags.writeable:  # unquantized tensors are read-only views of the memory map
        arr = arr.copy()
    return torch.from_numpy(arr)


def _kind(t: Any, path: Path) -> str:
    kind: str = t.tensor_type.name
    if kind not in SUPPORTED_TENSOR_TYPES:
        raise CheckpointError(f"{path}: tensor {t.name} has unsupported type {kind}; "
                              f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}")
    return kind


def _blocks(t: Any, path: Path) -> GGUFTensor | None:
    """A matrix of a block type the CPU GEMM keeps (kernels/cpu/quant.py) as its rows of blocks
    (copied out of the file's mapping); None for anything else."""
    from kvfence.kernels.cpu.quant import BLOCKS

    kind = _kind(t, path)
    if kind not in BLOCKS or len(t.shape) != 2:
        return None
    cols, rows = (int(d) for d in t.shape)  # GGUF lists dims innermost first
    per_block, block_bytes = BLOCKS[kind]
    if cols % per_block or int(t.n_bytes) != rows * cols // per_block * block_bytes:
        raise CheckpointError(f"{path}: tensor {t.name} ({kind}) has {int(t.n_bytes)} bytes for {rows} x {cols}")
    return GGUFTensor(kind, np.array(t.data, dtype=np.uint8).reshape(rows, -1), (rows, cols))


def _tensors(reader: Any, config: ModelConfig, path: Path,
                         keep_blocks: bool = False) -> dict[str, torch.Tensor | GGUFTensor]:
    """Every tensor the model uses under its canonical name (Q/K un-permuted), plus
    `rope_freqs.weight` when the file has it: dequantized to float32, or with `keep_blocks` the
    matrices of kept block types as GGUFTensor."""
    size = path.stat().st_size
    tensors: dict[str, torch.Tensor | GGUFTensor] = {}
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise CheckpointError(f"{path}: truncated, tensor {t.name} ends past the end of the file")
        name = ROPE_FREQS if t.name == ROPE_FREQS else canonical_name(t.name)
        if name is None:
            continue
        kept = _blocks(t, path) if keep_blocks else None
        w: torch.Tensor | GGUFTensor = kept if kept is not None else _dequantize(t, path)
        if config.architecture in _PERMUTED_QK_ARCHS:
            heads = (config.num_heads if name.endswith(("q_proj.weight", "q_proj.bias"))
                     else config.num_kv_heads if name.endswith(("k_proj.weight", "k_proj.bias")) else 0)
            if heads:
                w = w.with_rows(lambda rows: unpermute_qk(rows, heads)) if isinstance(w, GGUFTensor) \
                    else unpermute_qk(w, heads)
        tensors[name] = w
    return tensors


def load_gguf(path: Path, weights: bool = True, cache_dir: Path | None = None,
              keep_blocks: bool = False) -> Checkpoint:
    """Load `path` (without `weights`: its config and tokenizer only); raise CheckpointError (or
    UnsupportedModelError) with the file named. With `cache_dir`, what an earlier load of the same
    file (same path, size and modification time) left there is read instead of the file
    (engine/gguf_cache.py): start-up in seconds, the same checkpoint. `keep_blocks`: matrices of
    the block types kernels/cpu/quant.py keeps stay as they ship (GGUFTensor; read straight from
    the file, nothing cached)."""
    cache = GGUFCache(cache_dir, path) if cache_dir is not None else None
    meta, reader = _metadata(path, cache)
    config = config_from_fields(meta, path)
    tensors: Tensors = {}
    if weights and keep_blocks:
        tensors = _tensors(reader if reader is not None else _open(path), config, path, keep_blocks)
    elif weights:
        cached = cache.tensors() if cache is not None else None
        if cached is None:
            # without keep_blocks every tensor is dequantized: all are torch.Tensor
            cached = cast(dict[str, torch.Tensor], _tensors(reader if reader is not None else _open(path), config, path))
            if cache is not None:
                cache.store_tensors(cached)
        tensors = dict(cached)
    rope_freq_factors = tensors.pop(ROPE_FREQS, None)
    if isinstance(rope_freq_factors, GGUFTensor):  # never: only matrices are kept in block types
        raise CheckpointError(f"{path}: {ROPE_FREQS} is not a vector")
    if weights:
        check_tensors(config, tensors, str(path))
    tokenizer = tokenizer_from_gguf_fields(meta.field, str(path))
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer, source=str(path),
                      rope_freq_factors=rope_freq_factors)
