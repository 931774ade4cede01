"""The CPU kernels of a decode step (kernels.c, with the quantized weights' decoding in
quant.c), built on first use and loaded through ctypes; their Python faces are
kernels/cpu/gemm.py, kernels/cpu/attention.py and kernels/cpu/elementwise.py.

Why: a decode step multiplies a few rows by every weight of the model, so it is a stream of the
weights, and reads every sequence's KV pages once; oneDNN's small-M GEMM reads the weights at a
third to a half of this machine's memory bandwidth, and the torch attention path copies every
page it reads (docs/benchmarks.md, "A floor for each step").

The library is compiled by the system's C compiler (`cc`, with `-mavx2 -mfma -mf16c -fopenmp`) into
the cache folder of its `Place` ($KVFENCE_HOME/cache/kernels for the command line) under a name
that hashes the sources and the flags, written by rename, and reused by every later process.
`available()` is False, with the reason in `unavailable_reason()`, when the place switches them off
(KVFENCE_CPU_KERNELS=off), the CPU lacks AVX2/FMA/F16C, no compiler is found, or the build fails:
callers then keep their torch/oneDNN paths.

ctypes releases the GIL for each call; OpenMP spreads the work over torch's intra-op thread
count (the library shares torch's OpenMP runtime: it is loaded after torch's, and found by its
soname).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).with_name(name) for name in ("kernels.c", "quant.c"))
HEADERS = (Path(__file__).with_name("kernels.h"),)
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=off")


@dataclasses.dataclass(frozen=True)
class _Library:
    lib: ctypes.CDLL | None
    reason: str  # why lib is None
    expected: bool = True  # False when it failed where it should have built (a compiler error)


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "")
    except OSError:
        return False
    return all(f" {flag}" in flags for flag in ("avx2", "fma", "f16c"))


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def _build(directory: Path, sources: tuple[Path, ...] = SOURCES) -> Path:
    """The library built from `sources` (and HEADERS) into `directory`, once per content and flags."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    text = b"\0".join(path.read_bytes() for path in (*sources, *HEADERS))
    key = hashlib.sha256(text + "\0".join(FLAGS).encode() + compiler.encode()).hexdigest()[:24]
    target = directory / f"cpu_kernels-{key}.so"
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".cpu_kernels-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, f"-I{HEADERS[0].parent}", *map(str, sources), "-o", tmp],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@dataclasses.dataclass(frozen=True)
class Place:
    """Where the library is built, and whether it may be used at all: the process decides, not
    this package (the command line from KVFENCE_HOME and KVFENCE_CPU_KERNELS, app/config/environment.py
    `kernel_place`). Until a process says (`use`), the default cache folder, switched on."""

    cache_dir: Path = Path.home() / ".cache" / "kvfence" / "cache" / "kernels"
    off: str = ""  # why the kernels are switched off ("": they are on)


_place = Place()


def use(place: Place) -> None:
    """Build into, and switch by, `place` from now on; a library loaded under another place is
    let go, so the next caller gets it as `place` says."""
    global _place
    if place != _place:
        _place = place
        _library.cache_clear()


@functools.cache
def _library() -> _Library:
    if _place.off:
        return _Library(None, _place.off)
    if not _cpu_has_avx2_fma():
        return _Library(None, "the CPU lacks AVX2, FMA or F16C")
    if _compiler() is None:
        return _Library(None, "no C compiler (cc or gcc) on PATH")
    try:
        lib = load(_build(_place.cache_dir))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return _Library(None, f"its build failed: {e}", expected=False)
    return _Library(lib, "")


def load(path: Path) -> ctypes.CDLL:
    """The library at `path` with its functions declared (tests load mutated builds through it)."""
    torch.get_num_threads()  # torch's OpenMP runtime is loaded first, so the library shares it
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvfence_pack.argtypes = [ptr, i64, i64, ptr]
    lib.kvfence_pack.restype = None
    lib.kvfence_gemm.argtypes = [ptr, i64, ptr, ptr, ctypes.c_int]
    lib.kvfence_gemm.restype = None
    lib.kvfence_weight_rows.argtypes = [ptr, ptr, i64, ptr, ctypes.c_int]
    lib.kvfence_weight_rows.restype = None
    lib.kvfence_panel_bytes.argtypes = [ctypes.c_int, i64]
    lib.kvfence_panel_bytes.restype = i64
    lib.kvfence_decode_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64,
                                             i64, ctypes.c_float, ptr, i64, ctypes.c_int]
    lib.kvfence_decode_attention.restype = None
    lib.kvfence_store_kv.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    lib.kvfence_store_kv.restype = None
    lib.kvfence_rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float]
    lib.kvfence_rms_norm.restype = None
    lib.kvfence_silu_mul.argtypes = [ptr, ptr, i64, i64]
    lib.kvfence_silu_mul.restype = None
    lib.kvfence_wide_blocks.argtypes = [ctypes.c_int]
    lib.kvfence_wide_blocks.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL:
    """The loaded library; only when `available()`."""
    lib = _library().lib
    assert lib is not None, "the CPU kernels are unavailable: " + _library().reason
    return lib


def available() -> bool:
    return _library().lib is not None


def unavailable_reason() -> str:
    return _library().reason


def unavailable_as_expected() -> bool:
    """True when they are available, or unavailable for a reason of the machine or the settings
    (no AVX2/FMA, no compiler, switched off); False when the build failed where it should work."""
    return _library().expected
