"""C kernels of a CPU worker's steps (kernels.c, quant.c), built on first use (`library`) and
called through ctypes: `gemm` (float32 panels, or GGUF block types kept as they ship: `quant`),
`attention` (over the pool's pages in place, every table bounds-checked), `elementwise` (RMS norm,
SiLU-and-multiply) and `layer` (every step of a decoder layer in one call).

Nothing is imported here; each module loads the library when first asked.
"""
