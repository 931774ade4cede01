"""The kernels compile for Hopper (sm_90) without a GPU: Triton's frontend, LLVM and the ptxas in
Triton's wheel. The interpreter runs Python semantics and accepts code the compiler refuses; this
keeps CI (no GPU) honest about the compiled path. Runs in a subprocess without TRITON_INTERPRET,
since `triton.jit` fixes interpreted vs compiled at import. On a CUDA machine the other tests
compile the kernels for real, so it is skipped there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kvfence.kernels.triton.kv_store import _store_kernel
    from kvfence.kernels.triton.paged_decode import _combine_kernel, _decode_kernel
    from kvfence.kernels.triton.paged_prefill import _prefill_kernel

    def arg_type(name, dtype):
        if name.endswith("_ptr"):
            if name in ("table_ptr", "ctx_ptr", "cu_ptr", "cached_ptr", "flag_ptr"):
                return "*i32"
            if name in ("tags_ptr", "lease_ptr", "page_ptr", "offset_ptr"):
                return "*i64"
            return "*fp32" if name.startswith("part_") else "*" + dtype
        if name == "scale_log2":
            return "fp32"
        return "i64" if name in ("stride_kp", "stride_cp") else "i32"

    def build(fn, dtype, **consts):
        sig = {n: "constexpr" if n in consts else arg_type(n, dtype) for n in fn.arg_names}
        compiled = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                  options={"enable_fp_fusion": True})
        assert compiled.asm["cubin"], fn.__name__

    dot = dict(DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32")
    common = dict(PAGE_SIZE=16, GROUP=3, HEAD_DIM=64, BLOCK_D=64, BLOCK_N=64, **dot)
    build(_decode_kernel, "bf16", NUM_SPLITS=1, BLOCK_G=16, CHECK_OWNER=True, **common)
    build(_decode_kernel, "bf16", NUM_SPLITS=4, BLOCK_G=16, CHECK_OWNER=False, **common)
    build(_combine_kernel, "bf16", HEAD_DIM=64, NUM_SPLITS=4, BLOCK_S=4, BLOCK_D=64)
    build(_prefill_kernel, "bf16", BLOCK_M=64, CHECK_OWNER=True, **common)
    build(_store_kernel, "bf16", PAGE_SIZE=16, KV_HEADS=3, HEAD_DIM=64, BLOCK_H=4, BLOCK_D=64, CHECK_OWNER=True)
    print("compiled")
''')


@pytest.mark.skipif(torch.cuda.is_available(), reason="the other kernel tests compile for the real GPU")
def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
