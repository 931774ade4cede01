"""The GGUF start-up cache (engine/gguf_cache.py): a warm load is the cold load, exactly, without
opening the file; a changed file, a damaged entry or an unwritable cache is a miss, never a
wrong model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kvfence.engine import gguf_cache, gguf_loader
from kvfence.engine.checkpoint import Checkpoint, load_checkpoint

from tiny_models import TinySpec, make_tiny_pair

TEXT = "hello world, the quick brown fox 1234"


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    return make_tiny_pair(tmp_path / "model", seed=5, spec=TinySpec(tensor_type="Q4_1"))[0]


def assert_same(a: Checkpoint, b: Checkpoint) -> None:
    assert a.config == b.config
    assert a.tokenizer.encode(TEXT) == b.tokenizer.encode(TEXT)
    assert a.tokenizer.chat_template == b.tokenizer.chat_template
    assert a.tokenizer.eos_token_ids == b.tokenizer.eos_token_ids
    assert set(a.tensors) == set(b.tensors)
    for name, t in a.tensors.items():
        assert t.dtype == b.tensors[name].dtype == torch.float32
        assert torch.equal(t, b.tensors[name]), name


def file_unread(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(path: Path) -> None:
        raise AssertionError(f"{path} was opened")
    monkeypatch.setattr(gguf_loader, "_open", refuse)


def test_a_warm_load_is_the_cold_load_without_reading_the_file(tiny_gguf: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    plain = load_checkpoint(tiny_gguf)
    cold = load_checkpoint(tiny_gguf, cache_dir=tmp_path / "cache")
    assert_same(plain, cold)
    file_unread(monkeypatch)
    assert_same(plain, load_checkpoint(tiny_gguf, cache_dir=tmp_path / "cache"))
    config_only = load_checkpoint(tiny_gguf, weights=False, cache_dir=tmp_path / "cache")
    assert config_only.config == plain.config and config_only.tensors == {}
    assert gguf_loader.read_metadata(tiny_gguf, tmp_path / "cache").tensor_names


def test_a_warm_load_can_be_written_to_without_touching_the_cache(tiny_gguf: Path, tmp_path: Path) -> None:
    """Cached weights are copy-on-write views: a process that scribbles on one changes nothing
    for the next."""
    plain = load_checkpoint(tiny_gguf)
    load_checkpoint(tiny_gguf, cache_dir=tmp_path / "cache")
    warm = load_checkpoint(tiny_gguf, cache_dir=tmp_path / "cache")
    warm.tensors["model.norm.weight"].fill_(7.0)
    assert_same(plain, load_checkpoint(tiny_gguf, cache_dir=tmp_path / "cache"))


def test_a_changed_file_is_read_again(tmp_path: Path) -> None:
    path = make_tiny_pair(tmp_path / "a", seed=5, spec=TinySpec(tensor_type="Q8_0"))[0]
    load_checkpoint(path, cache_dir=tmp_path / "cache")
    other = make_tiny_pair(tmp_path / "b", seed=6, spec=TinySpec(tensor_type="Q8_0"))[0]
    stat = path.stat()
    os.replace(other, path)  # same name, other weights
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    fresh = load_checkpoint(path)
    assert_same(fresh, load_checkpoint(path, cache_dir=tmp_path / "cache"))


@pytest.mark.parametrize("damage", ["truncated weights", "garbled index", "garbled metadata", "no weights"])
def test_a_damaged_entry_is_a_miss(tiny_gguf: Path, tmp_path: Path, damage: str) -> None:
    plain = load_checkpoint(tiny_gguf)
    load_checkpoint(tiny_gguf, cache_dir=tmp_path / "cache")
    (entry,) = (tmp_path / "cache").iterdir()
    if damage == "truncated weights":
        data = (entry / "tensors.f32").read_bytes()
        (entry / "tensors.f32").write_bytes(data[: len(data) // 2])
    elif damage == "garbled index":
        (entry / "tensors.json").write_text("{not json")
    elif damage == "garbled metadata":
        (entry / "metadata.json").write_text(json.dumps({"source": "elsewhere"}))
    else:
        (entry / "tensors.f32").unlink()
    assert_same(plain, load_checkpoint(tiny_gguf, cache_dir=tmp_path / "cache"))
    assert_same(plain, load_checkpoint(tiny_gguf, cache_dir=tmp_path / "cache"))  # and the entry is whole again


def test_weights_over_the_limit_are_not_cached(tiny_gguf: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_cache, "MAX_CACHED_WEIGHT_BYTES", 1024)
    plain = load_checkpoint(tiny_gguf, cache_dir=tmp_path / "cache")
    (entry,) = (tmp_path / "cache").iterdir()
    assert sorted(p.name for p in entry.iterdir()) == ["metadata.json"]
    assert_same(plain, load_checkpoint(tiny_gguf, cache_dir=tmp_path / "cache"))


def test_an_unwritable_cache_still_loads(tiny_gguf: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    assert_same(load_checkpoint(tiny_gguf), load_checkpoint(tiny_gguf, cache_dir=blocked))
