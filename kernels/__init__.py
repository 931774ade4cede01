"""The kernels, by where they run:

- `kernels.cpu`: C kernels of a CPU worker's steps (GEMM over float32 or GGUF block weights,
  attention over the pool's pages in place, the element-wise steps, a whole layer per call), built
  by the system's C compiler on first use and called through ctypes;
- `kernels.triton`: Triton kernels of a GPU worker's attention and KV stores (`paged_decode`,
  `paged_prefill`, `kv_store`), with their torch references in `reference`.

This package imports nothing of kvfence; nothing is imported here, so `import kvfence.kernels`
needs neither triton nor a compiler.
"""
