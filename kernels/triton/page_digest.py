"""Page digests on the GPU: not implemented, on purpose. A CUDA pool's pages are digested on the host.

What is digested (transports/core/digest.py): xxh3_64 over one whole page of the pool, all layers, K
and V: `page_nbytes` = page_size x 46,080 bytes for the default model in float32 (737,280 bytes at
16 tokens per page), half that in bfloat16.

What a CUDA pool does instead: every built-in transport moves host bytes, so a CUDA pool is staged
through pinned host buffers (transports/core/staging.py). The sender digests the staged bytes it sends;
the receiver digests the staged bytes that landed and copies them into its pool only when they
verify (transports/core/receiver.py). Those are the bytes a digest has to cover. A digest computed on
the GPU would cover the pool instead: on the sending side it would not see the device-to-host copy,
and on the receiving side it could only run after the copy into the pool, which is exactly what
"verify, then copy" keeps a failed transfer from doing. It would also buy little: the host digests
at ~25 GB/s per core, several times what a transport moves here (~5.5 GB/s over loopback TCP).

Could it be bit-identical? Yes, with moderate effort. Pages are far above xxh3's 240-byte
threshold, so the long-input path runs: eight 64-bit accumulators; per 64-byte stripe, each lane
adds `lo32(x ^ secret) * hi32(x ^ secret)` (a 32x32->64 multiply) and the swapped neighbour's
input; every 16 stripes (1 KiB, the default 192-byte secret) a scramble `acc = (acc ^ (acc >> 47) ^
secret) * PRIME32_1`; then the last stripe, a merge with 64x64->128 multiplies folded to 64 bits,
and an avalanche. Triton has wrapping uint64 multiply, xor and shifts; the 128-bit product would be
built from 32-bit halves. Within a block the 16 stripes are a [16, 8] tile summed per lane (wrapping
adds commute), but the scrambles chain the blocks: one program per page walks 720 dependent blocks
(float32 page), so the GPU is parallel only across pages. Roughly 150 lines plus bit-identity tests
against `xxhash.xxh3_64`; and it has no caller.

When it would be worth writing: a transport that moves GPU memory directly (e.g. NIXL with VRAM
registration, no host staging) must digest where the bytes are. Then write it here as above — one
program per page, the block loop sequential, the scramble and merge in uint64 — and test it
bit-for-bit against `xxhash.xxh3_64` on random pages of the real page size under TRITON_INTERPRET.
"""
