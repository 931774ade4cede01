"""GGUF and Hugging Face copies of one tiny model load to the same config, weights and logits."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfence.engine.attention import build_attention_batch
from kvfence.engine.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from kvfence.engine.models.llama import permute_qk, unpermute_qk
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.registry import build_model
from kvfence.engine.model_config import UnsupportedModelError

# tiny_models sits in tests/: pytest (prepend import mode) puts that folder on sys.path for tests/conftest.py.
from tiny_models import CHAT_TEMPLATE, TENSOR_TYPES, TinySpec, llama_cpp_permute, make_tiny_pair

PAGE_SIZE = 4
PAGE_TABLE = [7, 2, 10, 5, 1, 11, 3]  # scattered pages, none of them page 0 (the decode padding page)
PROMPT = "hello world, the quick brown fox 1234"
DECODE_TOKENS = [17, 268, 290, 3]


def run_logits(ckpt: Checkpoint, prompt_ids: list[int]) -> torch.Tensor:
    """fp32 logits of every prompt position (two prefill chunks) and of a few decode steps."""
    model = build_model(ckpt, torch.float32)
    pool = KVPool(ckpt.config, num_pages=12, page_size_tokens=PAGE_SIZE, dtype=torch.float32)
    n = len(prompt_ids)
    assert n + len(DECODE_TOKENS) <= len(PAGE_TABLE) * PAGE_SIZE
    out = []
    first = 7  # chunk boundaries cross pages: [0, 7) then [7, n)
    for start, end in ((0, first), (first, n)):
        batch = build_attention_batch(PAGE_SIZE, [], [(PAGE_TABLE, start, end - start)], torch.device("cpu"))
        ids = torch.tensor(prompt_ids[start:end], dtype=torch.int64)
        positions = torch.arange(start, end, dtype=torch.int64)
        out.append(model.forward(ids, positions, batch, pool, torch.arange(end - start)))
    for step, token in enumerate(DECODE_TOKENS):
        kv_len = n + step + 1
        batch = build_attention_batch(PAGE_SIZE, [(PAGE_TABLE, kv_len)], [], torch.device("cpu"))
        out.append(model.forward(torch.tensor([token]), torch.tensor([kv_len - 1]), batch, pool,
                                 torch.tensor([0])))
    return torch.cat(out)


def assert_same_model(gguf_path: Path, hf_dir: Path, spec: TinySpec) -> None:
    g, h = load_checkpoint(gguf_path), load_checkpoint(hf_dir)
    assert g.config.architecture == h.config.architecture == spec.arch
    assert g.config == dataclasses.replace(h.config, architecture=g.config.architecture)
    assert g.config.tie_word_embeddings == spec.tie_embeddings
    assert g.config.qkv_bias == spec.has_bias
    assert set(g.tensors) == set(h.tensors)
    for name, t in h.tensors.items():  # exact: both hold the same dequantized values
        assert torch.equal(g.tensors[name], t.float()), name
    prompt = g.tokenizer.encode(PROMPT)
    assert prompt == h.tokenizer.encode(PROMPT)
    lg, lh = run_logits(g, prompt), run_logits(h, prompt)
    assert lg.shape == (len(prompt) + len(DECODE_TOKENS), g.config.vocab_size)
    assert lg.std() > 0.5  # not a degenerate model whose logits agree trivially
    torch.testing.assert_close(lg, lh, rtol=1e-5, atol=1e-5)


def gguf_tensor_types(path: Path) -> dict[str, str]:
    reader = gguf.GGUFReader(str(path))
    return {t.name: t.tensor_type.name for t in reader.tensors}


@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
def test_gguf_and_hf_llama_agree(tmp_path: Path, tensor_type: str) -> None:
    spec = TinySpec(tensor_type=tensor_type)
    gguf_path, hf_dir, _ = make_tiny_pair(tmp_path, seed=1, spec=spec)
    types = gguf_tensor_types(gguf_path)
    assert types["blk.0.attn_q.weight"] == types["output.weight"] == tensor_type
    assert types["blk.1.attn_norm.weight"] == "F32"
    assert_same_model(gguf_path, hf_dir, spec)


@pytest.mark.parametrize("spec", [
    TinySpec(arch="qwen2", rope_theta=1_000_000.0, rms_norm_eps=1e-6),
    TinySpec(arch="qwen2", rope_theta=1_000_000.0, rms_norm_eps=1e-6, tensor_type="Q8_0", tie_embeddings=True),
    TinySpec(arch="llama", qkv_bias=True, tensor_type="Q4_1"),  # llama.cpp permutes Q/K biases too
    TinySpec(arch="llama", tie_embeddings=True),
    TinySpec(arch="llama", tie_embeddings=True, tensor_type="Q4_0"),
], ids=["qwen2", "qwen2-q8_0-tied", "llama-bias-q4_1", "llama-tied", "llama-tied-q4_0"])
def test_gguf_and_hf_variants_agree(tmp_path: Path, spec: TinySpec) -> None:
    gguf_path, hf_dir, _ = make_tiny_pair(tmp_path, seed=2, spec=spec)
    types = gguf_tensor_types(gguf_path)
    assert ("output.weight" in types) == (not spec.tie_embeddings)
    assert ("blk.0.attn_q.bias" in types) == spec.has_bias
    assert_same_model(gguf_path, hf_dir, spec)


@pytest.mark.parametrize("spec", [TinySpec(), TinySpec(arch="qwen2", tensor_type="BF16")], ids=["llama", "qwen2-bf16"])
def test_sharded_safetensors_agree(tmp_path: Path, spec: TinySpec) -> None:
    gguf_path, hf_dir, _ = make_tiny_pair(tmp_path, seed=3, spec=spec, shards=2)
    assert not (hf_dir / "model.safetensors").exists()
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    assert_same_model(gguf_path, hf_dir, spec)


def test_qk_permutation_is_taken_into_account(tmp_path: Path) -> None:
    """Guard on the comparison itself: GGUF Q/K rows differ from HF's, and only un-permuting fixes it."""
    gguf_path, hf_dir, _ = make_tiny_pair(tmp_path, seed=4)
    reader = gguf.GGUFReader(str(gguf_path))
    raw_q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    stored = torch.from_numpy(np.array(raw_q.data, dtype=np.float32))
    hf_q = load_checkpoint(hf_dir).tensors["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(stored, hf_q)
    assert torch.equal(unpermute_qk(stored, 4), hf_q)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizers_agree(tmp_path: Path, arch: str) -> None:
    gguf_path, hf_dir, model = make_tiny_pair(tmp_path, seed=5, spec=TinySpec(arch=arch))
    g, h = load_checkpoint(gguf_path).tokenizer, load_checkpoint(hf_dir).tokenizer
    texts = [
        "hello world",
        "The theory of there, 2024 and 12345!",
        "  leading spaces\tand tabs\nand newlines\n\n",
        "ünïcödé 日本語 🙂",
        "<|im_start|>user\nhello<|im_end|>\n",
        "",
    ]
    for text in texts:
        ids = g.encode(text)
        assert ids == h.encode(text), text
        assert g.decode(ids) == h.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    # Merges are used (not just one token per byte) and digits follow the family's pre-tokenizer.
    assert len(g.encode("hello world", add_bos=False)) < len("hello world")
    # Digit merges apply after GPT-2's pre-tokenizer (digit runs), never after Qwen2's (single digits).
    assert len(g.encode(" 12345 2024", add_bos=False)) == (11 if arch == "qwen2" else 4)
    tok = model.tokenizer
    assert g.bos_token_id == h.bos_token_id == tok.bos_id
    assert g.eos_token_ids == h.eos_token_ids and tok.eos_id in g.eos_token_ids
    assert g.add_bos == h.add_bos == (arch == "llama")
    assert g.chat_template == h.chat_template == CHAT_TEMPLATE
    assert g.vocab_size == h.vocab_size == len(tok.tokens)


@pytest.mark.parametrize("shape,heads", [((64, 8), 4), ((32, 8), 2), ((48,), 3), ((16, 2, 3), 1)])
def test_permute_round_trip(shape: tuple[int, ...], heads: int) -> None:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    p = permute_qk(w, heads)
    assert not torch.equal(p, w)
    assert torch.equal(unpermute_qk(p, heads), w)
    assert torch.equal(permute_qk(unpermute_qk(w, heads), heads), w)
    # The same permutation llama.cpp's converter applies.
    assert torch.equal(p, torch.from_numpy(llama_cpp_permute(w.numpy(), heads, None)))


# ---------------------------------------------------------------------------------------------
# Broken and unsupported checkpoints.


@pytest.fixture(scope="module")
def good_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    gguf_path, hf_dir, _ = make_tiny_pair(tmp_path_factory.mktemp("good"), seed=6,
                                          spec=TinySpec(tensor_type="Q8_0"))
    return gguf_path, hf_dir


def test_bad_magic(tmp_path: Path, good_pair: tuple[Path, Path]) -> None:
    data = bytearray(good_pair[0].read_bytes())
    data[:4] = b"GGML"
    path = tmp_path / "bad-magic.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="bad-magic.gguf") as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("where", ["tensor-data", "last-tensor", "metadata"])
def test_truncated_gguf(tmp_path: Path, good_pair: tuple[Path, Path], where: str) -> None:
    data = good_pair[0].read_bytes()
    reader = gguf.GGUFReader(str(good_pair[0]))
    data_start = min(int(t.data_offset) for t in reader.tensors)
    data_end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)  # before the final padding
    del reader
    cut = {"tensor-data": (data_start + data_end) // 2, "last-tensor": data_end - 1, "metadata": data_start // 2}[where]
    assert 0 < cut < len(data)
    path = tmp_path / f"truncated-{where}.gguf"
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)


def test_missing_path(tmp_path: Path) -> None:
    path = tmp_path / "no-such-model.gguf"
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)


def _write_foreign_gguf(path: Path, arch: str, keys: dict[str, int | float]) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        if isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c", "d"])
    w.add_token_merges([])
    w.add_tensor("token_embd.weight", np.zeros((4, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,keys", [
    # What llama.cpp writes for GPT-NeoX (Pythia): the same shape keys as llama, a different block.
    ("gpt_neox", {"context_length": 2048, "embedding_length": 64, "block_count": 2, "feed_forward_length": 256,
                  "rope.dimension_count": 4, "attention.head_count": 4, "attention.layer_norm_epsilon": 1e-5}),
    # RWKV6 has no attention heads at all: it must still be reported as an unknown architecture.
    ("rwkv6", {"context_length": 1048576, "embedding_length": 64, "block_count": 2, "feed_forward_length": 224,
               "attention.layer_norm_epsilon": 1e-5, "wkv.head_size": 16, "rescale_every_n_layers": 6}),
])
def test_gguf_unknown_architecture(tmp_path: Path, arch: str, keys: dict[str, int | float]) -> None:
    path = tmp_path / f"{arch}.gguf"
    _write_foreign_gguf(path, arch, keys)
    with pytest.raises(UnsupportedModelError) as e:
        load_checkpoint(path)
    assert arch in str(e.value) and str(path) in str(e.value)


def test_hf_unknown_architecture(tmp_path: Path, good_pair: tuple[Path, Path]) -> None:
    hf_dir = tmp_path / "bert"
    shutil.copytree(good_pair[1], hf_dir)
    (hf_dir / "config.json").write_text(json.dumps({
        "architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 256, "vocab_size": 299,
        "hidden_act": "gelu", "layer_norm_eps": 1e-12, "type_vocab_size": 2,
    }))
    with pytest.raises(UnsupportedModelError) as e:
        load_checkpoint(hf_dir)
    assert "bert" in str(e.value) and str(hf_dir) in str(e.value)


@pytest.mark.parametrize("shards", [1, 2])
def test_hf_missing_tensor(tmp_path: Path, shards: int) -> None:
    _, hf_dir, _ = make_tiny_pair(tmp_path, seed=7, shards=shards)
    missing = "model.layers.1.mlp.down_proj.weight"
    for file in hf_dir.glob("*.safetensors"):
        tensors = load_file(str(file))
        if missing in tensors:
            del tensors[missing]
            save_file(tensors, str(file), metadata={"format": "pt"})
            break
    else:
        pytest.fail(f"{missing} not written")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(hf_dir)
    assert missing in str(e.value) and str(hf_dir) in str(e.value)


def test_hf_truncated_safetensors(tmp_path: Path, good_pair: tuple[Path, Path]) -> None:
    hf_dir = tmp_path / "cut"
    shutil.copytree(good_pair[1], hf_dir)
    shard = hf_dir / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(hf_dir)
    assert str(shard) in str(e.value)


@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_a_checkpoint_without_weights_has_the_same_config_and_tokenizer(tmp_path: Path, kind: str) -> None:
    """What a front end whose workers hold the weights loads: the model's identity and its tokenizer."""
    gguf_path, hf_dir, _ = make_tiny_pair(tmp_path, seed=5, spec=TinySpec())
    path = gguf_path if kind == "gguf" else hf_dir
    full, light = load_checkpoint(path), load_checkpoint(path, weights=False)
    assert light.tensors == {} and light.config == full.config
    text = "<|im_start|>user\nhello world<|im_end|>\n"
    assert light.tokenizer.encode(text) == full.tokenizer.encode(text)
