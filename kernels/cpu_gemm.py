"""The CPU's fp32 GEMM for decode-sized batches (cpu_gemm.c), built on first use and loaded
through ctypes.

Why: a decode step multiplies a few rows by every weight of the model, so it is a stream of the
weights; oneDNN's and MKL's small-M paths read them at a third to a half of this machine's memory
bandwidth (docs/benchmarks.md, "A floor for each step"). cpu_gemm.c packs each weight into
panels that are read once, in order, per step.

The library is compiled by the system's C compiler (`cc`, with `-mavx2 -mfma -fopenmp`) into
$KVFENCE_HOME/cache/kernels under a name that hashes the source and the flags, written by
rename, and reused by every later process. `available()` is False, with the reason in
`unavailable_reason()`, when the CPU lacks AVX2/FMA, no compiler is found, or the build fails:
callers then keep their oneDNN path. Set KVFENCE_CPU_GEMM=off to never use it.

ctypes releases the GIL for the call; OpenMP spreads the panels over `threads` threads.
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

SOURCE = Path(__file__).with_name("cpu_gemm.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno")
PANEL = 16  # output columns per packed panel (NR in cpu_gemm.c)


@dataclasses.dataclass(frozen=True)
class _Library:
    lib: ctypes.CDLL | None
    reason: str  # why lib is None


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def _build(directory: Path) -> Path:
    source = SOURCE.read_bytes()
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    key = hashlib.sha256(source + "\0".join(FLAGS).encode() + compiler.encode()).hexdigest()[:24]
    target = directory / f"cpu_gemm-{key}.so"
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".cpu_gemm-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _library() -> _Library:
    from kvfence.app.environment import cpu_gemm_setting, kvfence_home

    if cpu_gemm_setting() == "off":
        return _Library(None, "KVFENCE_CPU_GEMM=off")
    if not _cpu_has_avx2_fma():
        return _Library(None, "the CPU lacks AVX2 or FMA")
    try:
        path = _build(kvfence_home() / "cache" / "kernels")
        torch.get_num_threads()  # torch's OpenMP runtime is loaded first, so the library shares it
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return _Library(None, f"its build failed: {e}")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvfence_pack.argtypes = [ptr, i64, i64, ptr]
    lib.kvfence_pack.restype = None
    lib.kvfence_gemm.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.kvfence_gemm.restype = None
    return _Library(lib, "")


def available() -> bool:
    return _library().lib is not None


def unavailable_reason() -> str:
    return _library().reason


class PackedWeight:
    """W [N, K] float32 packed for `gemm` (and its bias, padded to whole panels)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        lib = _library().lib
        assert lib is not None, "cpu_gemm is unavailable: " + _library().reason
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"cpu_gemm packs 2-D float32 CPU weights, got {weight.dtype} {tuple(weight.shape)} "
                             f"on {weight.device}")
        w = weight.contiguous()
        self._lib = lib  # the library it was packed for, whatever `available()` says later
        self.n, self.k = w.shape
        panels = -(-self.n // PANEL)
        self.packed = torch.empty(panels * self.k * PANEL, dtype=torch.float32)
        lib.kvfence_pack(w.data_ptr(), self.n, self.k, self.packed.data_ptr())
        self.bias = None
        if bias is not None:
            self.bias = torch.zeros(panels * PANEL, dtype=torch.float32)
            self.bias[: self.n] = bias.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] float32."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"cpu_gemm wants x [M, {self.k}] float32, got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        self._lib.kvfence_gemm(x.data_ptr(), x.shape[0], self.k, self.packed.data_ptr(), self.n,
                               None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                               torch.get_num_threads())
        return y
