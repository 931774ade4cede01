"""Tiny random Llama-family models written both as GGUF files and as Hugging Face directories.

Location: this helper lives next to the tests that use it (tests/engine/) because pytest's default
"prepend" import mode puts tests/engine/ on sys.path (there is no tests/__init__.py), not the rootdir;
import it as `from tiny_models import ...`.

The GGUF file is laid out the way llama.cpp's convert_hf_to_gguf.py writes one: `llama` Q/K
weights (and biases) permuted for interleaved RoPE with the converter's own `permute` (copied
below, not taken from kvfence), `qwen2` left unpermuted, 2-D weights in a selectable tensor type,
1-D tensors in F32, and a byte-level BPE ("gpt2") tokenizer in the metadata.

Both copies hold *the same float values*: every 2-D weight is quantized first, the quantized
bytes are dequantized with `gguf.quants.dequantize`, and those values are what the HF directory
stores. Loading either copy must therefore give identical weights and identical logits.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

# 2-D weight types the tests exercise (gguf 0.19's `quants.quantize` implements all of them).
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TEXT = "<|endoftext|>"
EOS_TEXT = "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2's tokenizer.json split pattern (HF side of the "qwen2" pre-tokenizer).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Text the BPE merges are learned from (with GPT-2's pre-tokenizer, for both families). Digits
# appear in runs, so merges join digits: GPT-2's pre-tokenizer (digit runs) can apply them, Qwen2's
# (one digit per piece) cannot, and a tokenizer built with the wrong one encodes numbers differently.
_CORPUS = (
    "the quick brown fox jumps over the lazy dog. the theory of there and then, "
    "hello world! hello there, world of the others. in the end, the tokens went on. "
    "2024 2025 1000 100 10 2048 4096 1024 12 123 1234 12345. "
    "user assistant system message content role: hello, how are you? i am fine, thanks.\n"
)
_NUM_MERGES = 40


@dataclasses.dataclass(frozen=True)
class TinySpec:
    arch: str = "llama"  # "llama" or "qwen2"
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    context_length: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # always True for qwen2; llama with attention_bias=True if set
    tensor_type: str = "F32"  # type of the 2-D weights in the GGUF file

    @property
    def has_bias(self) -> bool:
        return self.arch == "qwen2" or self.qkv_bias


@dataclasses.dataclass
class TinyTokenizer:
    tokens: list[str]  # id -> byte-level token text, specials last
    token_types: list[int]  # GGUF token types: 1 normal, 3 control
    merges: list[tuple[str, str]]
    pre: str  # GGUF tokenizer.ggml.pre
    add_bos: bool
    bos_id: int
    eos_id: int


@dataclasses.dataclass
class TinyModel:
    spec: TinySpec
    tokenizer: TinyTokenizer
    # Canonical (HF) name -> float32 values both copies hold (dequantized for 2-D weights).
    hf_tensors: dict[str, np.ndarray]
    # GGUF name -> (array to write, raw GGML type or None for plain F32/F16 arrays).
    gguf_tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]]

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer.tokens)


# ---------------------------------------------------------------------------------------------
# llama.cpp's conversion pieces, reproduced independently of kvfence.


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py `LlamaModel.permute` (numpy instead of torch)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _learn_merges(num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training on `_CORPUS` (most frequent pair first, ties by the pair's text)."""
    splitter = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words: dict[tuple[str, ...], int] = {}
    for piece, _ in splitter.pre_tokenize_str(_CORPUS):
        key = tuple(piece)
        words[key] = words.get(key, 0) + 1
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        counts: dict[tuple[str, str], int] = {}
        for word, freq in words.items():
            for pair in zip(word, word[1:]):
                counts[pair] = counts.get(pair, 0) + freq
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        merged: dict[tuple[str, ...], int] = {}
        for word, freq in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + freq
        words = merged
    return merges


def build_tokenizer(arch: str) -> TinyTokenizer:
    pre = "qwen2" if arch == "qwen2" else "gpt-2"
    table = bytes_to_unicode()
    tokens = [table[b] for b in range(256)]
    merges = _learn_merges(_NUM_MERGES)
    for a, b in merges:
        if a + b not in tokens:
            tokens.append(a + b)
    types = [1] * len(tokens)
    for special in SPECIAL_TOKENS:
        tokens.append(special)
        types.append(3)
    return TinyTokenizer(tokens=tokens, token_types=types, merges=merges, pre=pre,
                         add_bos=arch != "qwen2",  # Llama 3 style adds BOS; Qwen2 does not
                         bos_id=tokens.index(BOS_TEXT), eos_id=tokens.index(EOS_TEXT))


# ---------------------------------------------------------------------------------------------
# Weights.


def _hf_dtype(tensor_type: str) -> torch.dtype:
    """What an HF checkpoint of this precision stores (values are exact in it)."""
    return {"F16": torch.float16, "BF16": torch.bfloat16}.get(tensor_type, torch.float32)


def _round_to(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(values).to(dtype).float().numpy()


def _quantize(values: np.ndarray, tensor_type: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None, np.ndarray]:
    """-> (array for GGUFWriter.add_tensor, raw_dtype, the float32 values a reader gets back)."""
    qtype = gguf.GGMLQuantizationType[tensor_type]
    data = gguf.quants.quantize(values.astype(np.float32), qtype)
    back = np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(values.shape)
    raw = None if tensor_type in ("F32", "F16") else qtype
    return data, raw, back


def build_tiny_model(spec: TinySpec, seed: int) -> TinyModel:
    if spec.arch not in ("llama", "qwen2"):
        raise ValueError(f"tiny models are llama or qwen2, not {spec.arch!r}")
    if spec.tensor_type not in TENSOR_TYPES:
        raise ValueError(f"tensor_type must be one of {TENSOR_TYPES}")
    rng = np.random.default_rng(seed)
    tok = build_tokenizer(spec.arch)
    vocab = len(tok.tokens)
    hidden, q_size, kv_size = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    ffn = spec.intermediate_size
    hf_dtype = _hf_dtype(spec.tensor_type)
    permute = spec.arch == "llama"  # llama.cpp permutes Q/K of `llama` (and Mistral) only

    hf: dict[str, np.ndarray] = {}
    gg: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]] = {}

    def matrix(hf_name: str, gguf_name: str, shape: tuple[int, int], std: float, n_perm: int | None = None) -> None:
        values = (rng.standard_normal(shape) * std).astype(np.float32)
        data, raw, back = _quantize(values, spec.tensor_type)
        if n_perm is not None and permute:
            # Quantization runs along each row, so permuting rows of the quantized bytes is
            # exactly what quantizing the converter's permuted matrix gives.
            data = llama_cpp_permute(data, n_perm, None)
        hf[hf_name] = back
        gg[gguf_name] = (np.ascontiguousarray(data), raw)

    def vector(hf_name: str, gguf_name: str, values: np.ndarray, n_perm: int | None = None) -> None:
        values = _round_to(values.astype(np.float32), hf_dtype)  # 1-D tensors are F32 in GGUF
        hf[hf_name] = values
        out = llama_cpp_permute(values, n_perm, None) if n_perm is not None and permute else values
        gg[gguf_name] = (np.ascontiguousarray(out), None)

    matrix("model.embed_tokens.weight", "token_embd.weight", (vocab, hidden), 1.0)
    for i in range(spec.num_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        vector(p + "input_layernorm.weight", b + "attn_norm.weight", 1.0 + 0.1 * rng.standard_normal(hidden))
        matrix(p + "self_attn.q_proj.weight", b + "attn_q.weight", (q_size, hidden), hidden ** -0.5 * 2,
               n_perm=spec.num_heads)
        matrix(p + "self_attn.k_proj.weight", b + "attn_k.weight", (kv_size, hidden), hidden ** -0.5 * 2,
               n_perm=spec.num_kv_heads)
        matrix(p + "self_attn.v_proj.weight", b + "attn_v.weight", (kv_size, hidden), hidden ** -0.5)
        if spec.has_bias:
            vector(p + "self_attn.q_proj.bias", b + "attn_q.bias", 0.5 * rng.standard_normal(q_size),
                   n_perm=spec.num_heads)
            vector(p + "self_attn.k_proj.bias", b + "attn_k.bias", 0.5 * rng.standard_normal(kv_size),
                   n_perm=spec.num_kv_heads)
            vector(p + "self_attn.v_proj.bias", b + "attn_v.bias", 0.5 * rng.standard_normal(kv_size))
        matrix(p + "self_attn.o_proj.weight", b + "attn_output.weight", (hidden, q_size), q_size ** -0.5)
        vector(p + "post_attention_layernorm.weight", b + "ffn_norm.weight", 1.0 + 0.1 * rng.standard_normal(hidden))
        matrix(p + "mlp.gate_proj.weight", b + "ffn_gate.weight", (ffn, hidden), hidden ** -0.5)
        matrix(p + "mlp.up_proj.weight", b + "ffn_up.weight", (ffn, hidden), hidden ** -0.5)
        matrix(p + "mlp.down_proj.weight", b + "ffn_down.weight", (hidden, ffn), ffn ** -0.5)
    vector("model.norm.weight", "output_norm.weight", 1.0 + 0.1 * rng.standard_normal(hidden))
    if not spec.tie_embeddings:
        matrix("lm_head.weight", "output.weight", (vocab, hidden), 0.3)
    return TinyModel(spec=spec, tokenizer=tok, hf_tensors=hf, gguf_tensors=gg)


# ---------------------------------------------------------------------------------------------
# Writers.


def write_gguf(model: TinyModel, path: Path, *, arch_name: str | None = None) -> Path:
    """Write `model` as llama.cpp's converter would; `arch_name` overrides general.architecture."""
    s, tok = model.spec, model.tokenizer
    arch = arch_name or s.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("model")
    w.add_name(f"tiny-{s.arch}")
    w.add_block_count(s.num_layers)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.hidden_size)
    w.add_feed_forward_length(s.intermediate_size)
    w.add_head_count(s.num_heads)
    w.add_head_count_kv(s.num_kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_norm_eps)
    w.add_rope_dimension_count(s.head_dim)
    w.add_vocab_size(model.vocab_size)
    w.add_file_type({"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}[s.tensor_type])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok.pre)
    w.add_token_list(tok.tokens)
    w.add_token_types(tok.token_types)
    w.add_token_merges([f"{a} {b}" for a, b in tok.merges])
    w.add_bos_token_id(tok.bos_id)
    w.add_eos_token_id(tok.eos_id)
    w.add_add_bos_token(tok.add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, (data, raw) in model.gguf_tensors.items():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_tokenizer(tok: TinyTokenizer) -> RustTokenizer:
    """The tokenizer.json a Hugging Face GPT-2 / Llama 3 / Qwen2 style model ships."""
    normal = {t: i for i, (t, kind) in enumerate(zip(tok.tokens, tok.token_types)) if kind == 1}
    inner = RustTokenizer(models.BPE(normal, tok.merges, fuse_unk=False, byte_fallback=False))
    if tok.pre == "qwen2":
        inner.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
    else:
        inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tok.add_bos:
        bos = tok.tokens[tok.bos_id]
        inner.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tok.bos_id)])
    else:
        inner.post_processor = processors.ByteLevel(trim_offsets=False)
    return inner


def hf_config(spec: TinySpec, vocab_size: int, tok: TinyTokenizer) -> dict:
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if spec.arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": spec.arch,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.context_length,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "vocab_size": vocab_size,
        "tie_word_embeddings": spec.tie_embeddings,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "torch_dtype": {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(
            _hf_dtype(spec.tensor_type), "float32"),
        "use_cache": True,
    }
    if spec.arch == "qwen2":
        cfg.update({"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": spec.num_layers})
    else:
        cfg.update({"head_dim": spec.head_dim, "attention_bias": spec.qkv_bias, "mlp_bias": False})
    return cfg


def write_hf_dir(model: TinyModel, directory: Path, *, shards: int = 1) -> Path:
    """config.json, model.safetensors (or `shards` files + index), tokenizer files."""
    s, tok = model.spec, model.tokenizer
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(s, model.vocab_size, tok), indent=2))
    dtype = _hf_dtype(s.tensor_type)
    tensors = {name: torch.from_numpy(v.copy()).to(dtype) for name, v in model.hf_tensors.items()}
    for name, t in tensors.items():  # the stored values are exactly the GGUF's dequantized ones
        assert torch.equal(t.float(), torch.from_numpy(model.hf_tensors[name])), name
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = list(tensors)
        weight_map: dict[str, str] = {}
        for k in range(shards):
            file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = names[k::shards]
            save_file({n: tensors[n] for n in part}, str(directory / file), metadata={"format": "pt"})
            weight_map.update({n: file for n in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    hf_tokenizer(tok).save(str(directory / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": s.context_length,
        "chat_template": CHAT_TEMPLATE,
        "eos_token": EOS_TEXT,
        "pad_token": BOS_TEXT,
        "clean_up_tokenization_spaces": False,
    }
    if s.arch == "qwen2":
        tok_cfg["bos_token"] = None  # as Qwen2 ships it; the BOS id comes from generation_config
        tok_cfg["add_bos_token"] = False
        (directory / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": tok.bos_id, "eos_token_id": [tok.eos_id, tok.bos_id]}))
    else:
        tok_cfg["bos_token"] = BOS_TEXT  # add_bos_token absent: inferred from the post-processor
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return directory


def make_tiny_pair(tmp_dir: Path, seed: int, *, spec: TinySpec | None = None,
                   shards: int = 1) -> tuple[Path, Path, TinyModel]:
    """Build one tiny model and write it both ways under `tmp_dir` -> (gguf file, HF dir, model)."""
    spec = spec or TinySpec()
    model = build_tiny_model(spec, seed)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = write_gguf(model, tmp_dir / f"tiny-{spec.arch}-{spec.tensor_type}.gguf")
    hf_dir = write_hf_dir(model, tmp_dir / f"tiny-{spec.arch}-hf", shards=shards)
    return gguf_path, hf_dir, model
