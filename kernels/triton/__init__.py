"""Triton kernels, each in its own module with a launcher that checks its arguments:
`paged_decode`, `paged_prefill`, `kv_store`; their torch references are in `reference`
(`page_digest` explains why page digests stay on the host).

Nothing is imported here: only importing a kernel module needs triton. Set TRITON_INTERPRET=1
before importing one to run it on the CPU.
"""
