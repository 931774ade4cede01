/* What kernels.c and quant.c share: the weight a GEMM multiplies by, and the panel formats.
 *
 * A weight W [n, k] is cut into panels of NR = 16 output rows (the last zero-padded). Each panel is
 * stored in one format, at its own byte offset:
 *   KVF_F32   k rows of 16 floats: W[16p + j, kk] at kk * 16 + j (kvfence_pack's layout);
 *   KVF_Q*    the GGUF block types, their blocks of the panel's 16 rows interleaved so that one
 *             chunk of 32 k decodes to 32 x 16 floats in the F32 layout (quant.c says how).
 * Decoding a chunk computes each weight exactly as the `gguf` package dequantizes it (the same
 * float32 operations, in the same order), so a GEMM over quantized panels gives the bits of the
 * same GEMM over the float32 weights the file dequantizes to.
 */
#ifndef KVFENCE_CPU_KERNELS_H
#define KVFENCE_CPU_KERNELS_H

#include <stdint.h>

#define NR 16    /* output rows (y columns) per panel */
#define CHUNK 32 /* k per decoded chunk: every block type's rows are whole chunks */

enum kvfence_format { KVF_F32 = 0, KVF_Q4_0 = 1, KVF_Q4_1 = 2, KVF_Q5_0 = 3, KVF_Q8_0 = 4, KVF_Q4_K = 5,
                      KVF_Q6_K = 6 };

struct kvfence_weight {
    const uint8_t *data;          /* every panel */
    const int64_t *panel_offset;  /* [panels] byte offset of panel p in data */
    const int32_t *panel_format;  /* [panels] its enum kvfence_format */
    const float *bias;            /* NULL, or n floats padded to a multiple of 16 */
    int64_t n, k;                 /* W is [n, k]; k a multiple of CHUNK for quantized panels */
};

/* W[16p .. 16p + 15, 32c .. 32c + 32 * chunks) of a quantized panel as chunks * 32 rows of 16 floats.
 * Hidden: a library's GEMM always calls its own (tests load mutated builds beside the real one). */
__attribute__((visibility("hidden")))
void kvfence_decode_chunks(int format, const uint8_t *panel, int64_t first_chunk, int64_t chunks, float *out);

/* Bytes of one panel of `format` over k (k % 32 == 0; k % 256 == 0 for the K types); 0 if unknown. */
int64_t kvfence_panel_bytes(int format, int64_t k);

#endif
