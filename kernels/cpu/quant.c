/* Quantized panels: the GGUF block types kept as they ship, decoded a chunk at a time inside the
 * GEMM (kernels.c) and for row lookups (the embedding), AVX2 + F16C.
 *
 * Layout. A panel holds 16 rows (lane j = row 16p + j). Its k is cut into chunks of 32; the
 * 4-bit values of a chunk are stored as 16 byte-pairs of k (byte j of pair i: row j's value at
 * k = 2i in the low nibble, k = 2i + 1 in the high one), so one 8-byte load widens to one half of
 * two k rows. Per chunk (bytes):
 *   Q4_0  d[16] f16 (32) | nibbles (256)                                     = 288
 *   Q4_1  d[16] f16 (32) | m[16] f16 (32) | nibbles (256)                    = 320
 *   Q5_0  d[16] f16 (32) | low nibbles (256) | fifth bits (64: byte j of octet o holds row j's
 *         bit for k = 8o .. 8o + 7)                                          = 352
 *   Q8_0  d[16] f16 (32) | 32 x 16 int8 (512)                                = 544
 * and per super-block of 256 k (8 chunks):
 *   Q4_K  d[16] f16 | dmin[16] f16 | sc[8][16] u8 | m[8][16] u8 (320) | 8 x nibbles (256)  = 2368
 *   Q6_K  d[16] f16 | sc[16][16] i8 (288) | 8 x (low nibbles (256) | high pairs (128: byte j
 *         of quad o holds row j's two high bits for k = 4o .. 4o + 3))                    = 3360
 * Bits per weight: 4.5, 5, 5.5, 8.5, 4.625, 6.5625 (the file's own: 4.5, 5, 5.5, 8.5, 4.5, 6.5625).
 *
 * Values. Each weight is the float32 the `gguf` package's dequantizer computes, by the same
 * operations in the same order (scales from f16 are exact; products and sums round once each):
 *   Q4_0 d * (q - 8)     Q4_1 d * q + m       Q5_0 d * (q - 16)     Q8_0 q * d
 *   Q4_K (d * sc) * q - (dmin * m)            Q6_K (d * sc) * (q - 32)
 * Every product here is exact in float32 (an f16 scale has 11 significant bits, times a K type's
 * sub-block factor at most 18, times a value at most 23 of the 24), so a product and the sum
 * after it may be one FMA: the one rounding left is the sum's, as in the dequantizer.
 */
#include "kernels.h"

#include <immintrin.h>
#include <string.h>

static inline __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256i u8x8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline __m256i i8x8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline __m256 fl(__m256i v) { return _mm256_cvtepi32_ps(v); }

#define LOW4(v) _mm256_and_si256((v), _mm256_set1_epi32(15))
#define HIGH4(v) _mm256_srli_epi32((v), 4)
/* bit s of each lane of v, as 0 or 16 (Q5_0's fifth bit) */
#define BIT16(v, s) _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32((v), (s)), _mm256_set1_epi32(1)), 4)
/* bits 2s, 2s + 1 of each lane of v, as 0, 16, 32 or 48 (Q6_K's two high bits) */
#define BITS2x16(v, s) _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32((v), 2 * (s)), _mm256_set1_epi32(3)), 4)

/* Each decoder is kept out of interprocedural optimization: GCC 12.2 at -O3 (IPA constant
 * propagation) dropped the calls of the Q4_0 and Q5_0 decoders from kvfence_decode_chunks
 * altogether, leaving their chunks undecoded (tests/kernels/test_cpu_quant.py caught it). */
#define DECODER __attribute__((noipa)) static void

/* out: 32 rows of 16 floats; half h writes lanes 8h .. 8h + 7 of each. */
DECODER chunk_q4_0(const uint8_t *b, float *out) {
    for (int h = 0; h < 2; h++) {
        __m256 d = f16x8(b + 16 * h);
        const __m256i eight = _mm256_set1_epi32(8);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            __m256i v = u8x8(b + 32 + 16 * i + 8 * h);
            _mm256_storeu_ps(out + (2 * i) * NR + 8 * h, _mm256_mul_ps(d, fl(_mm256_sub_epi32(LOW4(v), eight))));
            _mm256_storeu_ps(out + (2 * i + 1) * NR + 8 * h, _mm256_mul_ps(d, fl(_mm256_sub_epi32(HIGH4(v), eight))));
        }
    }
}

DECODER chunk_q4_1(const uint8_t *b, float *out) {
    for (int h = 0; h < 2; h++) {
        __m256 d = f16x8(b + 16 * h), m = f16x8(b + 32 + 16 * h);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            __m256i v = u8x8(b + 64 + 16 * i + 8 * h);
            _mm256_storeu_ps(out + (2 * i) * NR + 8 * h, _mm256_fmadd_ps(d, fl(LOW4(v)), m));
            _mm256_storeu_ps(out + (2 * i + 1) * NR + 8 * h, _mm256_fmadd_ps(d, fl(HIGH4(v)), m));
        }
    }
}

DECODER chunk_q5_0(const uint8_t *b, float *out) {
    for (int h = 0; h < 2; h++) {
        __m256 d = f16x8(b + 16 * h);
        const __m256i sixteen = _mm256_set1_epi32(16);
#pragma GCC unroll 4
        for (int o = 0; o < 4; o++) {
            __m256i bits = u8x8(b + 288 + 16 * o + 8 * h);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {  /* pair 4o + i: k = 8o + 2i and 8o + 2i + 1 */
                __m256i v = u8x8(b + 32 + 16 * (4 * o + i) + 8 * h);
                __m256i lo = _mm256_or_si256(LOW4(v), BIT16(bits, 2 * i));
                __m256i hi = _mm256_or_si256(HIGH4(v), BIT16(bits, 2 * i + 1));
                _mm256_storeu_ps(out + (8 * o + 2 * i) * NR + 8 * h, _mm256_mul_ps(d, fl(_mm256_sub_epi32(lo, sixteen))));
                _mm256_storeu_ps(out + (8 * o + 2 * i + 1) * NR + 8 * h,
                                 _mm256_mul_ps(d, fl(_mm256_sub_epi32(hi, sixteen))));
            }
        }
    }
}

DECODER chunk_q8_0(const uint8_t *b, float *out) {
    for (int h = 0; h < 2; h++) {
        __m256 d = f16x8(b + 16 * h);
#pragma GCC unroll 32
        for (int kk = 0; kk < 32; kk++)
            _mm256_storeu_ps(out + kk * NR + 8 * h, _mm256_mul_ps(fl(i8x8(b + 32 + 16 * kk + 8 * h)), d));
    }
}

/* chunk j (0..7) of the super-block at s */
DECODER chunk_q4_k(const uint8_t *s, int j, float *out) {
    const uint8_t *q = s + 320 + 256 * j;
    for (int h = 0; h < 2; h++) {
        __m256 scale = _mm256_mul_ps(f16x8(s + 16 * h), fl(u8x8(s + 64 + 16 * j + 8 * h)));
        __m256 dm = _mm256_mul_ps(f16x8(s + 32 + 16 * h), fl(u8x8(s + 192 + 16 * j + 8 * h)));
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            __m256i v = u8x8(q + 16 * i + 8 * h);
            _mm256_storeu_ps(out + (2 * i) * NR + 8 * h, _mm256_fmsub_ps(scale, fl(LOW4(v)), dm));
            _mm256_storeu_ps(out + (2 * i + 1) * NR + 8 * h, _mm256_fmsub_ps(scale, fl(HIGH4(v)), dm));
        }
    }
}

DECODER chunk_q6_k(const uint8_t *s, int j, float *out) {
    const uint8_t *q = s + 288 + 384 * j, *high = q + 256;
    const __m256i thirty_two = _mm256_set1_epi32(32);
    for (int h = 0; h < 2; h++) {
        __m256 d = f16x8(s + 16 * h);
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) {  /* sub-block 2j + half: k = 16 half .. 16 half + 15 */
            __m256 scale = _mm256_mul_ps(d, fl(i8x8(s + 32 + 16 * (2 * j + half) + 8 * h)));
#pragma GCC unroll 4
            for (int o = 0; o < 4; o++) {  /* quad 4 half + o: k = 16 half + 4o .. + 3, pairs 8 half + 2o, + 1 */
                __m256i bits = u8x8(high + 16 * (4 * half + o) + 8 * h);
                __m256i v0 = u8x8(q + 16 * (8 * half + 2 * o) + 8 * h);
                __m256i v1 = u8x8(q + 16 * (8 * half + 2 * o + 1) + 8 * h);
                __m256i q0 = _mm256_or_si256(LOW4(v0), BITS2x16(bits, 0));
                __m256i q1 = _mm256_or_si256(HIGH4(v0), BITS2x16(bits, 1));
                __m256i q2 = _mm256_or_si256(LOW4(v1), BITS2x16(bits, 2));
                __m256i q3 = _mm256_or_si256(HIGH4(v1), BITS2x16(bits, 3));
                float *row = out + (16 * half + 4 * o) * NR + 8 * h;
                _mm256_storeu_ps(row, _mm256_mul_ps(scale, fl(_mm256_sub_epi32(q0, thirty_two))));
                _mm256_storeu_ps(row + NR, _mm256_mul_ps(scale, fl(_mm256_sub_epi32(q1, thirty_two))));
                _mm256_storeu_ps(row + 2 * NR, _mm256_mul_ps(scale, fl(_mm256_sub_epi32(q2, thirty_two))));
                _mm256_storeu_ps(row + 3 * NR, _mm256_mul_ps(scale, fl(_mm256_sub_epi32(q3, thirty_two))));
            }
        }
    }
}

int64_t kvfence_panel_bytes(int format, int64_t k) {
    switch (format) {
    case KVF_F32: return k * NR * (int64_t)sizeof(float);
    case KVF_Q4_0: return k / CHUNK * 288;
    case KVF_Q4_1: return k / CHUNK * 320;
    case KVF_Q5_0: return k / CHUNK * 352;
    case KVF_Q8_0: return k / CHUNK * 544;
    case KVF_Q4_K: return k / 256 * 2368;
    case KVF_Q6_K: return k / 256 * 3360;
    default: return 0;
    }
}

void kvfence_decode_chunks(int format, const uint8_t *panel, int64_t first_chunk, int64_t chunks, float *out) {
    for (int64_t c = first_chunk; c < first_chunk + chunks; c++, out += CHUNK * NR) {
        switch (format) {
        case KVF_F32: memcpy(out, panel + c * CHUNK * NR * sizeof(float), CHUNK * NR * sizeof(float)); break;
        case KVF_Q4_0: chunk_q4_0(panel + c * 288, out); break;
        case KVF_Q4_1: chunk_q4_1(panel + c * 320, out); break;
        case KVF_Q5_0: chunk_q5_0(panel + c * 352, out); break;
        case KVF_Q8_0: chunk_q8_0(panel + c * 544, out); break;
        case KVF_Q4_K: chunk_q4_k(panel + c / 8 * 2368, (int)(c % 8), out); break;
        case KVF_Q6_K: chunk_q6_k(panel + c / 8 * 3360, (int)(c % 8), out); break;
        default: memset(out, 0, CHUNK * NR * sizeof(float)); break;
        }
    }
}

/* out[i, :] = W[rows[i], :] as float32 (an embedding lookup over a weight of any panel format);
 * every row index is checked by the caller (0 <= rows[i] < n). */
void kvfence_weight_rows(const struct kvfence_weight *w, const int64_t *rows, int64_t m, float *out, int threads) {
    int64_t k = w->k;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < m; i++) {
        int64_t p = rows[i] / NR, j = rows[i] % NR;
        const uint8_t *panel = w->data + w->panel_offset[p];
        float chunk[CHUNK * NR];
        float *dst = out + i * k;
        if (w->panel_format[p] == KVF_F32) {
            const float *src = (const float *)panel;
            for (int64_t kk = 0; kk < k; kk++)
                dst[kk] = src[kk * NR + j];
            continue;
        }
        for (int64_t c = 0; c < k / CHUNK; c++) {
            kvfence_decode_chunks(w->panel_format[p], panel, c, 1, chunk);
            for (int kk = 0; kk < CHUNK; kk++)
                dst[c * CHUNK + kk] = chunk[kk * NR + j];
        }
    }
}
