/* The CPU kernels of a decode step, fp32, for x86-64 CPUs with AVX2 and FMA (kernels/cpu/library.py
 * builds this file and loads it):
 *   kvfence_pack / kvfence_gemm       y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), W in panels of float32
 *                                     or of a GGUF block type kept as it ships (quant.c)
 *   kvfence_decode_attention          each query row (a decode token, or a prefill chunk's token up to
 *                                     its position) over its sequence's KV pages, in place
 *   kvfence_store_kv                  a step's new K/V rows into their pages
 *   kvfence_rms_norm, kvfence_silu_mul  the element-wise steps of a layer, one call each
 *   kvfence_layer              all of the above for one layer of a step, one call
 *
 * GEMM. W is packed once (kvfence_pack) into panels of 16 output columns: panel p holds
 * W[16p .. 16p+15, k] for k = 0..K-1 as K rows of 16 floats, the last panel zero-padded. One panel
 * is one contiguous stream, so a decode step (M of 1 to a few dozen) reads every weight byte once,
 * sequentially, and at M = 1 runs at the memory's speed rather than a GEMM library's small-M
 * path. The micro-kernel keeps a 6 x 16 block of y in twelve ymm registers and walks k: two
 * vector loads of the panel, six broadcasts of x, twelve FMAs per k. Rows go in groups of six
 * while the panel stays in L1/L2; panels are split across `threads` OpenMP threads (the same
 * OpenMP runtime as torch's when it is loaded first: the library is found by its soname).
 *
 * Where the CPU has AVX-512 (checked once at load; kvfence_wide_blocks turns it off and on), rows
 * go in groups of sixteen instead: a 16 x 16 block in sixteen zmm registers, one load of the panel
 * and sixteen broadcasts per k, so each panel is read once for all sixteen rows of a batch-16
 * step, while it streams in from memory, rather than once per group of six. From 32 rows on (a
 * prefill chunk, a batch of 32), an 8 x 32 block over two panels: two loads and eight broadcasts
 * per sixteen FMAs (1.2x the 16-row block's GFLOP/s at 32-256 rows).
 *
 * The summation order over k is fixed (sequential, one FMA per k into each output's accumulator,
 * then + bias, then + y when accumulating), in every block alike, so a row's result does not
 * depend on M, on the other rows of the batch, or on which block computed it.
 */
#include "kernels.h"

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MR 6

void kvfence_pack(const float *w, int64_t n, int64_t k, float *packed) {
    int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * k * NR;
        for (int64_t kk = 0; kk < k; kk++) {
            for (int64_t j = 0; j < NR; j++) {
                int64_t row = p * NR + j;
                dst[kk * NR + j] = row < n ? w[row * k + kk] : 0.0f;
            }
        }
    }
}

/* Row r of the block: its two accumulators are named variables (an array would be kept in
 * memory by the compiler, and every FMA would store it). */
#define ROW_DECL(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();
#define ROW_FMA(r)                                                        \
    if (rows > r) {                                                       \
        __m256 xv = _mm256_broadcast_ss(x + r * ldx + kk);                \
        c##r##0 = _mm256_fmadd_ps(xv, w0, c##r##0);                       \
        c##r##1 = _mm256_fmadd_ps(xv, w1, c##r##1);                       \
    }
#define ROW_STORE(r)                                                      \
    if (rows > r) store_row(y + r * ldy, c##r##0, c##r##1, cols, bias, accumulate);

static inline __attribute__((always_inline)) void
store_row(float *y, __m256 a0, __m256 a1, int64_t cols, const float *bias, int accumulate) {
    if (bias) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(bias));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(bias + 8));
    }
    if (accumulate) {  /* y += the block: a residual added as torch adds it (one rounding) */
        float old[NR] = {0};
        memcpy(old, y, (size_t)cols * sizeof(float));
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(old));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(old + 8));
    }
    if (cols == NR) {
        _mm256_storeu_ps(y, a0);
        _mm256_storeu_ps(y + 8, a1);
    } else {
        float tmp[NR];
        _mm256_storeu_ps(tmp, a0);
        _mm256_storeu_ps(tmp + 8, a1);
        memcpy(y, tmp, (size_t)cols * sizeof(float));
    }
}

static inline __attribute__((always_inline)) void
block(const float *x, int64_t ldx, const float *panel, int64_t k, int rows,
      float *y, int64_t ldy, int64_t cols, const float *bias, const float *next, int accumulate) {
    ROW_DECL(0) ROW_DECL(1) ROW_DECL(2) ROW_DECL(3) ROW_DECL(4) ROW_DECL(5)
    for (int64_t kk = 0; kk < k; kk++) {
        if (next)  /* one line of the next panel per k: it streams in while this one computes */
            _mm_prefetch((const char *)(next + kk * NR), _MM_HINT_T1);
        __m256 w0 = _mm256_loadu_ps(panel + kk * NR);
        __m256 w1 = _mm256_loadu_ps(panel + kk * NR + 8);
        ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5)
    }
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)
}

/* The same block for each row count, so that the compiler drops the dead rows' registers. */
static void block_rows(const float *x, int64_t ldx, const float *panel, int64_t k, int rows,
                       float *y, int64_t ldy, int64_t cols, const float *bias, const float *next, int accumulate) {
    switch (rows) {
    case 6: block(x, ldx, panel, k, 6, y, ldy, cols, bias, next, accumulate); break;
    case 5: block(x, ldx, panel, k, 5, y, ldy, cols, bias, next, accumulate); break;
    case 4: block(x, ldx, panel, k, 4, y, ldy, cols, bias, next, accumulate); break;
    case 3: block(x, ldx, panel, k, 3, y, ldy, cols, bias, next, accumulate); break;
    case 2: block(x, ldx, panel, k, 2, y, ldy, cols, bias, next, accumulate); break;
    default: block(x, ldx, panel, k, 1, y, ldy, cols, bias, next, accumulate); break;
    }
}

/* ---- the 16-row block, AVX-512 ---------------------------------------------------------------- */

#define WR 16
#define AVX512 __attribute__((target("avx512f")))

static int wide;  /* the AVX-512 blocks in use: the CPU has AVX-512 and nobody turned them off */

__attribute__((constructor)) static void detect_wide(void) {
    wide = __builtin_cpu_supports("avx512f");
}

/* want 0: the 6-row blocks; want 1: the AVX-512 blocks where the CPU has AVX-512; else only asks.
 * Returns whether the AVX-512 blocks are in use. */
int kvfence_wide_blocks(int want) {
    if (want == 0 || want == 1)
        wide = want && __builtin_cpu_supports("avx512f");
    return wide;
}

static inline __attribute__((always_inline)) AVX512 void
store_wide(float *y, __m512 a, int64_t cols, const float *bias, int accumulate) {
    __mmask16 mask = (__mmask16)(cols >= WR ? 0xFFFF : (1u << cols) - 1);
    if (bias)
        a = _mm512_add_ps(a, _mm512_loadu_ps(bias));
    if (accumulate)
        a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(mask, y));
    _mm512_mask_storeu_ps(y, mask, a);
}

#define WIDE_DECL(r) __m512 d##r = _mm512_setzero_ps();
#define WIDE_FMA(r)                                                                      \
    if (rows > r)                                                                        \
        d##r = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + kk]), w, d##r);
#define WIDE_STORE(r)                                                                    \
    if (rows > r) store_wide(y + r * ldy, d##r, cols, bias, accumulate);
#define WIDE_ALL(M)                                                                      \
    M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)

static inline __attribute__((always_inline)) AVX512 void
wide_block(const float *x, int64_t ldx, const float *panel, int64_t k, int rows,
           float *y, int64_t ldy, int64_t cols, const float *bias, const float *next, int accumulate) {
    WIDE_ALL(WIDE_DECL)
    for (int64_t kk = 0; kk < k; kk++) {
        if (next)
            _mm_prefetch((const char *)(next + kk * NR), _MM_HINT_T1);
        __m512 w = _mm512_loadu_ps(panel + kk * NR);
        WIDE_ALL(WIDE_FMA)
    }
    WIDE_ALL(WIDE_STORE)
}

#define WIDE_CASE(r) case r + 1: wide_block(x, ldx, panel, k, r + 1, y, ldy, cols, bias, next, accumulate); break;

static AVX512 void wide_block_rows(const float *x, int64_t ldx, const float *panel, int64_t k, int rows,
                                   float *y, int64_t ldy, int64_t cols, const float *bias, const float *next,
                                   int accumulate) {
    switch (rows) {
    WIDE_ALL(WIDE_CASE)
    }
}

/* From this many rows on, a block prefetches the next panel while it computes (1.4x at 16 rows);
 * below, the computation per line is too short for that to beat the hardware's own prefetch
 * (a step's GEMMs 7% faster at 1 row without it, 4% at 4). */
#define PREFETCH_ROWS 6

/* ---- the 8-row block over two panels, AVX-512, for prefill chunks ------------------------------ */

#define PR 8            /* rows of a two-panel block */
#define PAIR_ROWS 8     /* from this many rows on (a batch of decodes, a prefill chunk), panels go in pairs:
                         * at 16 rows of the default model's Q4_1 a decode step takes 26.5 ms against
                         * 32.6 over one panel at a time, at 8 rows 18.6 against 21.6 */

#define PAIR_DECL(r) __m512 e##r = _mm512_setzero_ps(), f##r = _mm512_setzero_ps();
#define PAIR_FMA(r)                                                                      \
    if (rows > r) {                                                                      \
        __m512 xv = _mm512_set1_ps(x[r * ldx + kk]);                                     \
        e##r = _mm512_fmadd_ps(xv, w0, e##r);                                            \
        f##r = _mm512_fmadd_ps(xv, w1, f##r);                                            \
    }
#define PAIR_STORE(r)                                                                    \
    if (rows > r) {                                                                      \
        store_wide(y + r * ldy, e##r, NR, bias, accumulate);                             \
        store_wide(y + r * ldy + NR, f##r, cols1, bias ? bias + NR : 0, accumulate);     \
    }
#define PAIR_ALL(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)

/* Rows x 32 columns of y from panels p0 (16 whole columns) and p1 (cols1 of them): two panel
 * loads and eight broadcasts per k for sixteen FMAs, where the 16-row block needs seventeen
 * loads. Each output is the same FMA chain over k as in the other blocks. */
static inline __attribute__((always_inline)) AVX512 void
pair_block(const float *x, int64_t ldx, const float *p0, const float *p1, int64_t k, int rows,
           float *y, int64_t ldy, int64_t cols1, const float *bias, const float *next, int accumulate) {
    PAIR_ALL(PAIR_DECL)
    for (int64_t kk = 0; kk < k; kk++) {
        if (next) {  /* the next pair, a line of each per k, on the first row group only */
            _mm_prefetch((const char *)(next + kk * NR), _MM_HINT_T1);
            _mm_prefetch((const char *)(next + (k + kk) * NR), _MM_HINT_T1);
        }
        __m512 w0 = _mm512_loadu_ps(p0 + kk * NR), w1 = _mm512_loadu_ps(p1 + kk * NR);
        PAIR_ALL(PAIR_FMA)
    }
    PAIR_ALL(PAIR_STORE)
}

#define PAIR_CASE(r) case r + 1: pair_block(x, ldx, p0, p1, k, r + 1, y, ldy, cols1, bias, next, accumulate); break;

static AVX512 void pair_block_rows(const float *x, int64_t ldx, const float *p0, const float *p1, int64_t k,
                                   int rows, float *y, int64_t ldy, int64_t cols1, const float *bias,
                                   const float *next, int accumulate) {
    switch (rows) {
    PAIR_ALL(PAIR_CASE)
    }
}

/* ---- quantized panels (quant.c decodes them) ------------------------------------------------
 *
 * A decode step's rows (up to one block: 16 with AVX-512, 6 without) meet a quantized panel in one
 * pass: KC of k at a time are decoded into an L1 buffer (the F32 layout), and the block's FMAs walk
 * it, the accumulators held in registers across pieces; so the weights stream in at their own
 * size and each is decoded once per step. More rows than one block (a prefill chunk, a large
 * batch): the whole panel is decoded once into a per-thread buffer and the F32 blocks run over it.
 * Either way each output is the F32 blocks' FMA chain over the decoded values, in the same order.
 */

#define KC 256  /* k per decoded piece: 16 KB of floats */

static inline __attribute__((always_inline)) void
block_q(const float *x, int64_t ldx, int format, const uint8_t *data, int64_t k, int rows,
        float *y, int64_t ldy, int64_t cols, const float *bias, int accumulate, float *piece) {
    ROW_DECL(0) ROW_DECL(1) ROW_DECL(2) ROW_DECL(3) ROW_DECL(4) ROW_DECL(5)
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
        int64_t kc = k - k0 < KC ? k - k0 : KC;
        kvfence_decode_chunks(format, data, k0 / CHUNK, kc / CHUNK, piece);
        for (int64_t kk = k0; kk < k0 + kc; kk++) {
            __m256 w0 = _mm256_load_ps(piece + (kk - k0) * NR);
            __m256 w1 = _mm256_load_ps(piece + (kk - k0) * NR + 8);
            ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5)
        }
    }
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)
}

static void block_q_rows(const float *x, int64_t ldx, int format, const uint8_t *data, int64_t k, int rows,
                         float *y, int64_t ldy, int64_t cols, const float *bias, int accumulate) {
    float piece[KC * NR] __attribute__((aligned(64)));
    switch (rows) {
    case 6: block_q(x, ldx, format, data, k, 6, y, ldy, cols, bias, accumulate, piece); break;
    case 5: block_q(x, ldx, format, data, k, 5, y, ldy, cols, bias, accumulate, piece); break;
    case 4: block_q(x, ldx, format, data, k, 4, y, ldy, cols, bias, accumulate, piece); break;
    case 3: block_q(x, ldx, format, data, k, 3, y, ldy, cols, bias, accumulate, piece); break;
    case 2: block_q(x, ldx, format, data, k, 2, y, ldy, cols, bias, accumulate, piece); break;
    default: block_q(x, ldx, format, data, k, 1, y, ldy, cols, bias, accumulate, piece); break;
    }
}

static inline __attribute__((always_inline)) AVX512 void
wide_block_q(const float *x, int64_t ldx, int format, const uint8_t *data, int64_t k, int rows,
             float *y, int64_t ldy, int64_t cols, const float *bias, int accumulate, float *piece) {
    WIDE_ALL(WIDE_DECL)
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
        int64_t kc = k - k0 < KC ? k - k0 : KC;
        kvfence_decode_chunks(format, data, k0 / CHUNK, kc / CHUNK, piece);
        for (int64_t kk = k0; kk < k0 + kc; kk++) {
            __m512 w = _mm512_load_ps(piece + (kk - k0) * NR);
            WIDE_ALL(WIDE_FMA)
        }
    }
    WIDE_ALL(WIDE_STORE)
}

#define WIDE_Q_CASE(r) \
    case r + 1: wide_block_q(x, ldx, format, data, k, r + 1, y, ldy, cols, bias, accumulate, piece); break;

static AVX512 void wide_block_q_rows(const float *x, int64_t ldx, int format, const uint8_t *data, int64_t k,
                                     int rows, float *y, int64_t ldy, int64_t cols, const float *bias,
                                     int accumulate) {
    float piece[KC * NR] __attribute__((aligned(64)));
    switch (rows) {
    WIDE_ALL(WIDE_Q_CASE)
    }
}

/* A buffer of this thread's, of at least `floats` floats (kept for the thread's life). */
static float *thread_buffer(int64_t floats) {
    static __thread float *buffer;
    static __thread int64_t capacity;
    if (capacity < floats) {
        free(buffer);
        buffer = aligned_alloc(64, (size_t)(floats * sizeof(float) + 63) / 64 * 64);
        if (!buffer)
            abort();  /* out of memory: never compute over a missing buffer */
        capacity = floats;
    }
    return buffer;
}

/* Panel p as F32 panel floats: its own memory, or decoded into `into`. */
static const float *panel_floats(const struct kvfence_weight *w, int64_t p, float *into) {
    const uint8_t *data = w->data + w->panel_offset[p];
    if (w->panel_format[p] == KVF_F32)
        return (const float *)data;
    kvfence_decode_chunks(w->panel_format[p], data, 0, w->k / CHUNK, into);
    return into;
}

/* Every row of y's columns [16p, 16p + 16) from panel p. */
static void one_panel(const float *x, int64_t m, const struct kvfence_weight *w, int64_t p, float *y,
                      int accumulate) {
    int64_t n = w->n, k = w->k, panels = (n + NR - 1) / NR;
    int64_t col = p * NR;
    int64_t cols = n - col < NR ? n - col : NR;
    const float *b = w->bias ? w->bias + col : 0;
    int format = w->panel_format[p];
    int64_t group = wide ? WR : MR;
    if (format != KVF_F32 && m <= group) {  /* one pass, decoded piece by piece */
        const uint8_t *data = w->data + w->panel_offset[p];
        if (wide)
            wide_block_q_rows(x, k, format, data, k, (int)m, y + col, n, cols, b, accumulate);
        else
            block_q_rows(x, k, format, data, k, (int)m, y + col, n, cols, b, accumulate);
        return;
    }
    const float *panel = panel_floats(w, p, format == KVF_F32 ? 0 : thread_buffer(k * NR));
    const float *next = p + 1 < panels && m >= PREFETCH_ROWS && format == KVF_F32
                        && w->panel_format[p + 1] == KVF_F32 ? (const float *)(w->data + w->panel_offset[p + 1]) : 0;
    for (int64_t r = 0; r < m; r += group) {
        int rows = m - r < group ? (int)(m - r) : (int)group;
        const float *prefetch = r == 0 ? next : 0;
        if (wide)
            wide_block_rows(x + r * k, k, panel, k, rows, y + r * n + col, n, cols, b, prefetch, accumulate);
        else
            block_rows(x + r * k, k, panel, k, rows, y + r * n + col, n, cols, b, prefetch, accumulate);
    }
}

/* ---- a few rows over four panels at once, AVX-512 -----------------------------------------------
 *
 * Each output's sum over k is one dependent chain of FMAs (the fixed summation order), so one or
 * two rows over one panel keep one or two chains in flight and the step waits on the FMA's
 * latency, not its throughput or the memory. Up to QUAD_ROWS rows go over QUAD panels at once
 * instead: four to sixteen independent chains, each the same chain as in the blocks above. A
 * quantized panel is decoded QKC of k at a time into an L1 buffer (four pieces of 4 KB); a
 * float32 panel is read where it lies.
 */

#define QUAD 4
#define QUAD_ROWS 4
#define QKC 64

#define QDECL(r) __m512 q##r##0 = _mm512_setzero_ps(), q##r##1 = q##r##0, q##r##2 = q##r##0, q##r##3 = q##r##0;
#define QFMA(r)                                                                          \
    if (rows > r) {                                                                      \
        __m512 xv = _mm512_set1_ps(x[r * ldx + kk]);                                     \
        q##r##0 = _mm512_fmadd_ps(xv, w0, q##r##0);                                      \
        q##r##1 = _mm512_fmadd_ps(xv, w1, q##r##1);                                      \
        q##r##2 = _mm512_fmadd_ps(xv, w2, q##r##2);                                      \
        q##r##3 = _mm512_fmadd_ps(xv, w3, q##r##3);                                      \
    }
#define QSTORE(r)                                                                        \
    if (rows > r) {                                                                      \
        store_wide(y + r * ldy, q##r##0, NR, bias, accumulate);                          \
        store_wide(y + r * ldy + NR, q##r##1, NR, bias ? bias + NR : 0, accumulate);     \
        store_wide(y + r * ldy + 2 * NR, q##r##2, NR, bias ? bias + 2 * NR : 0, accumulate); \
        store_wide(y + r * ldy + 3 * NR, q##r##3, cols3, bias ? bias + 3 * NR : 0, accumulate); \
    }
#define QUAD_ALL(M) M(0) M(1) M(2) M(3)

/* Rows x 64 columns of y from panels p .. p + 3 (the last with cols3 columns). */
static inline __attribute__((always_inline)) AVX512 void
quad_block(const float *x, int64_t ldx, const struct kvfence_weight *w, int64_t p, int rows, float *y,
           int64_t ldy, int64_t cols3, const float *bias, int accumulate, float *pieces) {
    const int64_t k = w->k;
    const float *src[QUAD];
    QUAD_ALL(QDECL)
    for (int64_t k0 = 0; k0 < k; k0 += QKC) {
        int64_t kc = k - k0 < QKC ? k - k0 : QKC;
        for (int g = 0; g < QUAD; g++) {
            const uint8_t *data = w->data + w->panel_offset[p + g];
            int format = w->panel_format[p + g];
            if (format == KVF_F32) {
                src[g] = (const float *)data + k0 * NR;
            } else {
                kvfence_decode_chunks(format, data, k0 / CHUNK, kc / CHUNK, pieces + g * QKC * NR);
                src[g] = pieces + g * QKC * NR;
            }
        }
        for (int64_t kk = k0, i = 0; kk < k0 + kc; kk++, i += NR) {
            __m512 w0 = _mm512_loadu_ps(src[0] + i), w1 = _mm512_loadu_ps(src[1] + i);
            __m512 w2 = _mm512_loadu_ps(src[2] + i), w3 = _mm512_loadu_ps(src[3] + i);
            QUAD_ALL(QFMA)
        }
    }
    QUAD_ALL(QSTORE)
}

static AVX512 void quad_block_rows(const float *x, int64_t ldx, const struct kvfence_weight *w, int64_t p, int rows,
                                   float *y, int64_t ldy, int64_t cols3, const float *bias, int accumulate) {
    float pieces[QUAD * QKC * NR] __attribute__((aligned(64)));
    switch (rows) {
    case 4: quad_block(x, ldx, w, p, 4, y, ldy, cols3, bias, accumulate, pieces); break;
    case 3: quad_block(x, ldx, w, p, 3, y, ldy, cols3, bias, accumulate, pieces); break;
    case 2: quad_block(x, ldx, w, p, 2, y, ldy, cols3, bias, accumulate, pieces); break;
    default: quad_block(x, ldx, w, p, 1, y, ldy, cols3, bias, accumulate, pieces); break;
    }
}

/* The same blocks with the four panels' weights decoded in registers, pair of k by pair of k,
 * straight into the FMAs (no round trip through a buffer): for four panels of one block type. Each value is computed by the operations quant.c's decoders use (there in
 * 8-lane halves, here in 16 lanes), so the bits are theirs. */

static inline AVX512 __m512 z_f16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline AVX512 __m512 z_u8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline AVX512 __m512 z_i8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* bits [s, s + n) of each lane of v, shifted to bit 4 (Q5_0's fifth bit, Q6_K's two high bits) */
static inline AVX512 __m512i z_high(__m512i v, int s, int n) {
    return _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(v, (unsigned)s), _mm512_set1_epi32((1 << n) - 1)), 4);
}

/* Chunk c of a panel: its per-row scale a and offset b, and where its values are. */
static inline __attribute__((always_inline)) AVX512 const uint8_t *
z_chunk(int format, const uint8_t *panel, int64_t c, __m512 *a, __m512 *b) {
    switch (format) {
    case KVF_Q4_0: *a = z_f16(panel + c * 288); return panel + c * 288 + 32;
    case KVF_Q4_1: *a = z_f16(panel + c * 320); *b = z_f16(panel + c * 320 + 32); return panel + c * 320 + 64;
    case KVF_Q8_0: *a = z_f16(panel + c * 544); return panel + c * 544 + 32;
    case KVF_Q5_0: *a = z_f16(panel + c * 352); return panel + c * 352 + 32;
    case KVF_Q6_K: {  /* chunk j of its super-block: a for its first 16 k, b for the next 16 */
        const uint8_t *s = panel + c / 8 * 3360;
        int64_t j = c % 8;
        *a = _mm512_mul_ps(z_f16(s), z_i8(s + 32 + 16 * (2 * j)));
        *b = _mm512_mul_ps(z_f16(s), z_i8(s + 32 + 16 * (2 * j + 1)));
        return s + 288 + 384 * j;
    }
    default: {  /* KVF_Q4_K: chunk j of its super-block */
        const uint8_t *s = panel + c / 8 * 2368;
        int64_t j = c % 8;
        *a = _mm512_mul_ps(z_f16(s), z_u8(s + 64 + 16 * j));
        *b = _mm512_mul_ps(z_f16(s + 32), z_u8(s + 192 + 16 * j));
        return s + 320 + 256 * j;
    }
    }
}

/* The values of pair i (k = 2i, 2i + 1) of a chunk whose values are at q. */
static inline __attribute__((always_inline)) AVX512 void
z_pair(int format, const uint8_t *q, int i, __m512 a, __m512 b, __m512 *w0, __m512 *w1) {
    if (format == KVF_Q8_0) {
        *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * i)))), a);
        *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * i + 16)))),
                            a);
        return;
    }
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * i)));
    __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(v, 4);
    switch (format) {
    case KVF_Q5_0: {  /* the fifth bits of pair i: bits 2(i % 4), + 1 of octet i / 4's byte */
        __m512i bits = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 256 + 16 * (i / 4))));
        lo = _mm512_sub_epi32(_mm512_or_si512(lo, z_high(bits, 2 * (i % 4), 1)), _mm512_set1_epi32(16));
        hi = _mm512_sub_epi32(_mm512_or_si512(hi, z_high(bits, 2 * (i % 4) + 1, 1)), _mm512_set1_epi32(16));
        *w0 = _mm512_mul_ps(a, _mm512_cvtepi32_ps(lo));
        *w1 = _mm512_mul_ps(a, _mm512_cvtepi32_ps(hi));
        break;
    }
    case KVF_Q6_K: {  /* the high bits of pair i: bits 4(i % 2) .. + 3 of quad i / 2's byte */
        __m512i bits = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 256 + 16 * (i / 2))));
        lo = _mm512_sub_epi32(_mm512_or_si512(lo, z_high(bits, 4 * (i % 2), 2)), _mm512_set1_epi32(32));
        hi = _mm512_sub_epi32(_mm512_or_si512(hi, z_high(bits, 4 * (i % 2) + 2, 2)), _mm512_set1_epi32(32));
        __m512 scale = i < 8 ? a : b;
        *w0 = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(lo));
        *w1 = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(hi));
        break;
    }
    case KVF_Q4_0:
        *w0 = _mm512_mul_ps(a, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, _mm512_set1_epi32(8))));
        *w1 = _mm512_mul_ps(a, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, _mm512_set1_epi32(8))));
        break;
    case KVF_Q4_1:
        *w0 = _mm512_fmadd_ps(a, _mm512_cvtepi32_ps(lo), b);
        *w1 = _mm512_fmadd_ps(a, _mm512_cvtepi32_ps(hi), b);
        break;
    default:  /* KVF_Q4_K */
        *w0 = _mm512_fmsub_ps(a, _mm512_cvtepi32_ps(lo), b);
        *w1 = _mm512_fmsub_ps(a, _mm512_cvtepi32_ps(hi), b);
        break;
    }
}

static inline __attribute__((always_inline)) AVX512 void
quad_block_z(int format, const float *x, int64_t ldx, const struct kvfence_weight *w, int64_t p, int rows,
             float *y, int64_t ldy, int64_t cols3, const float *bias, int accumulate) {
    const uint8_t *p0 = w->data + w->panel_offset[p], *p1 = w->data + w->panel_offset[p + 1];
    const uint8_t *p2 = w->data + w->panel_offset[p + 2], *p3 = w->data + w->panel_offset[p + 3];
    QUAD_ALL(QDECL)
    for (int64_t c = 0; c < w->k / CHUNK; c++) {
        __m512 a0, a1, a2, a3, b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;
        const uint8_t *q0 = z_chunk(format, p0, c, &a0, &b0), *q1 = z_chunk(format, p1, c, &a1, &b1);
        const uint8_t *q2 = z_chunk(format, p2, c, &a2, &b2), *q3 = z_chunk(format, p3, c, &a3, &b3);
        for (int i = 0; i < CHUNK / 2; i++) {
            __m512 w0, w1, w2, w3, n0, n1, n2, n3;
            z_pair(format, q0, i, a0, b0, &w0, &n0);
            z_pair(format, q1, i, a1, b1, &w1, &n1);
            z_pair(format, q2, i, a2, b2, &w2, &n2);
            z_pair(format, q3, i, a3, b3, &w3, &n3);
            int64_t kk = c * CHUNK + 2 * i;
            QUAD_ALL(QFMA)
            kk++;
            w0 = n0, w1 = n1, w2 = n2, w3 = n3;
            QUAD_ALL(QFMA)
        }
    }
    QUAD_ALL(QSTORE)
}

#define QZ_ROWS(F)                                                                                      \
    switch (rows) {                                                                                     \
    case 4: quad_block_z(F, x, ldx, w, p, 4, y, ldy, cols3, bias, accumulate); break;                   \
    case 3: quad_block_z(F, x, ldx, w, p, 3, y, ldy, cols3, bias, accumulate); break;                   \
    case 2: quad_block_z(F, x, ldx, w, p, 2, y, ldy, cols3, bias, accumulate); break;                   \
    default: quad_block_z(F, x, ldx, w, p, 1, y, ldy, cols3, bias, accumulate); break;                  \
    }

/* Whether quad_block_z_rows takes panels p .. p + 3: all of one block type (any but F32). */
static int quad_in_registers(const struct kvfence_weight *w, int64_t p) {
    int format = w->panel_format[p];
    if (format == KVF_F32)
        return 0;
    return w->panel_format[p + 1] == format && w->panel_format[p + 2] == format && w->panel_format[p + 3] == format;
}

static AVX512 void quad_block_z_rows(const float *x, int64_t ldx, const struct kvfence_weight *w, int64_t p, int rows,
                                     float *y, int64_t ldy, int64_t cols3, const float *bias, int accumulate) {
    switch (w->panel_format[p]) {
    case KVF_Q4_0: QZ_ROWS(KVF_Q4_0) break;
    case KVF_Q4_1: QZ_ROWS(KVF_Q4_1) break;
    case KVF_Q8_0: QZ_ROWS(KVF_Q8_0) break;
    case KVF_Q5_0: QZ_ROWS(KVF_Q5_0) break;
    case KVF_Q6_K: QZ_ROWS(KVF_Q6_K) break;
    default: QZ_ROWS(KVF_Q4_K) break;
    }
}

/* This thread's share of the panels for a few rows: a contiguous run of them (the team's runs
 * differ by at most one panel), walked four at a time, the rest one by one; then the team waits
 * for all (as an `omp for` would). */
static AVX512 void quad_panels(const float *x, int64_t m, const struct kvfence_weight *w, float *y, int accumulate) {
    int64_t n = w->n, k = w->k, panels = (n + NR - 1) / NR;
    int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    int64_t lo = panels * me / team, hi = panels * (me + 1) / team, p = lo;
    for (; p + QUAD <= hi; p += QUAD) {
        int64_t col = p * NR, cols3 = n - col - 3 * NR < NR ? n - col - 3 * NR : NR;
        if (quad_in_registers(w, p))
            quad_block_z_rows(x, k, w, p, (int)m, y + col, n, cols3, w->bias ? w->bias + col : 0, accumulate);
        else
            quad_block_rows(x, k, w, p, (int)m, y + col, n, cols3, w->bias ? w->bias + col : 0, accumulate);
    }
    for (; p < hi; p++)
        one_panel(x, m, w, p, y, accumulate);
    #pragma omp barrier
}

/* The panels shared out over the calling OpenMP team (an orphaned `omp for`: kvfence_gemm opens
 * a team for it, kvfence_layer calls it inside its own). accumulate: y += x @ W^T.
 * Up to QUAD_ROWS rows go over four panels at once (quad_panels); from PAIR_ROWS rows on (a batch
 * of decodes, a prefill chunk), with AVX-512, eight at a time over two panels; the rows between,
 * or without AVX-512, sixteen (or six) at a time over one. */
static void gemm_panels(const float *x, int64_t m, const struct kvfence_weight *w, float *y, int accumulate) {
    int64_t n = w->n, k = w->k, panels = (n + NR - 1) / NR;
    if (m <= 0)  /* no rows (an empty step's logits): nothing to read, not even x */
        return;
    if (wide && m <= QUAD_ROWS) {
        quad_panels(x, m, w, y, accumulate);
        return;
    }
    if (!wide || m < PAIR_ROWS) {
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++)
            one_panel(x, m, w, p, y, accumulate);
        return;
    }
    #pragma omp for schedule(static)
    for (int64_t q = 0; q < (panels + 1) / 2; q++) {
        int64_t p = 2 * q;
        if (p + 1 == panels) {  /* an odd last panel alone */
            one_panel(x, m, w, p, y, accumulate);
            continue;
        }
        int both_f32 = w->panel_format[p] == KVF_F32 && w->panel_format[p + 1] == KVF_F32;
        float *decoded = both_f32 ? 0 : thread_buffer(2 * k * NR);
        const float *p0 = panel_floats(w, p, decoded), *p1 = panel_floats(w, p + 1, decoded ? decoded + k * NR : 0);
        int64_t col = p * NR, cols1 = n - col - NR < NR ? n - col - NR : NR;
        const float *b = w->bias ? w->bias + col : 0;
        const float *next = both_f32 && p + 3 < panels && w->panel_format[p + 2] == KVF_F32
                            && w->panel_format[p + 3] == KVF_F32 ? (const float *)(w->data + w->panel_offset[p + 2]) : 0;
        for (int64_t r = 0; r < m; r += PR) {
            int rows = m - r < PR ? (int)(m - r) : PR;
            pair_block_rows(x + r * k, k, p0, p1, k, rows, y + r * n + col, n, cols1, b, r == 0 ? next : 0,
                            accumulate);
        }
    }
}

void kvfence_gemm(const float *x, int64_t m, const struct kvfence_weight *w, float *y, int threads) {
    #pragma omp parallel num_threads(threads)
    gemm_panels(x, m, w, y, 0);
}

/* ---- decode attention ------------------------------------------------------------------------
 *
 * q: [B, H, D] (H = kv_heads * group query heads; D a multiple of 8), out: [B, H, D].
 * keys/values: one layer of the pool; query row b reads the table row rows[b] (several rows may
 * share one: the tokens of a prefill chunk each read their sequence's table, up to their own
 * position), and the key of token t of that table, KV head h, is at
 *   keys + table[rows[b], t / page_size] * page_stride + h * head_stride + (t % page_size) * D
 * (values alike), for t < kv_lens[b]. Nothing else of the pool is read: the page table names the
 * pages (the runner's owner check has admitted every one of them before the step).
 *
 * Per (sequence, KV head), on one thread, for each query of the group: its scores against the key
 * rows, page by page, eight rows at a time (score_rows), an exact-max softmax with a vectorized
 * exp, then the sum of the value rows weighted by the unnormalized probabilities (64 output dims
 * in registers), scaled once at the end. The group's queries re-read the same rows from L2. Keys
 * are summed in order, so a sequence's result does not depend on the other sequences of the step.
 */

/* exp(x) for 8 floats: Cody-Waite range reduction and a degree-5 polynomial (the Cephes expf),
 * within 2 ulp of expf over the range softmax uses (x <= 0); below -88.37 (and -inf) it is 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);  /* exp of these is 0 (so is exp(-inf)) */
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The sum of v's lanes as ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)): the order in which
 * score_rows reduces eight rows at once, so a row's score does not depend on its neighbours. */
static inline float tree_sum8(__m256 v) {
    __m256 x = _mm256_hadd_ps(v, v);
    x = _mm256_hadd_ps(x, x);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1)));
}

/* out[j] = (q . k_j) * scale for n contiguous key rows of d floats (d % 8 == 0). Eight rows at a
 * time: one FMA chain per row, then the eight sums reduced together (six hadds, two lane swaps and
 * an add instead of a horizontal sum per row); the rows left over take the same order one by one. */
static inline void score_rows(const float *q, const float *k, int64_t n, int64_t d, float scale, float *out) {
    const __m256 sc = _mm256_set1_ps(scale);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const float *r = k + j * d;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t i = 0; i < d; i += 8) {
            __m256 qv = _mm256_loadu_ps(q + i);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + i), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + d + i), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + 2 * d + i), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + 3 * d + i), a3);
            a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + 4 * d + i), a4);
            a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + 5 * d + i), a5);
            a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + 6 * d + i), a6);
            a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + 7 * d + i), a7);
        }
        __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
        __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(sums, sc));
    }
    for (; j < n; j++) {
        const float *r = k + j * d;
        __m256 a = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(r + i), a);
        out[j] = tree_sum8(a) * scale;
    }
}

/* The value rows v[0..n) weighted by p[0..n), added into o[0..d) in row order. */
static inline void add_value_rows(const float *v, const float *p, int64_t n, int64_t d, float *o) {
    int64_t c = 0;
    for (; c + 64 <= d; c += 64) {  /* 64 output dims in eight registers */
        __m256 o0 = _mm256_loadu_ps(o + c), o1 = _mm256_loadu_ps(o + c + 8), o2 = _mm256_loadu_ps(o + c + 16),
               o3 = _mm256_loadu_ps(o + c + 24), o4 = _mm256_loadu_ps(o + c + 32), o5 = _mm256_loadu_ps(o + c + 40),
               o6 = _mm256_loadu_ps(o + c + 48), o7 = _mm256_loadu_ps(o + c + 56);
        for (int64_t t = 0; t < n; t++) {
            const float *vc = v + t * d + c;
            __m256 w = _mm256_broadcast_ss(p + t);
            o0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vc), o0);
            o1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vc + 8), o1);
            o2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vc + 16), o2);
            o3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vc + 24), o3);
            o4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vc + 32), o4);
            o5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vc + 40), o5);
            o6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vc + 48), o6);
            o7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vc + 56), o7);
        }
        _mm256_storeu_ps(o + c, o0); _mm256_storeu_ps(o + c + 8, o1);
        _mm256_storeu_ps(o + c + 16, o2); _mm256_storeu_ps(o + c + 24, o3);
        _mm256_storeu_ps(o + c + 32, o4); _mm256_storeu_ps(o + c + 40, o5);
        _mm256_storeu_ps(o + c + 48, o6); _mm256_storeu_ps(o + c + 56, o7);
    }
    for (; c < d; c += 8) {  /* what is left of head_dim, eight at a time */
        __m256 acc = _mm256_loadu_ps(o + c);
        for (int64_t t = 0; t < n; t++)
            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(p + t), _mm256_loadu_ps(v + t * d + c), acc);
        _mm256_storeu_ps(o + c, acc);
    }
}

/* s[0..n): scores in, exp(s - max) out (an exact max), with s[n..n + 8) set so the last vector of
 * eight adds 0; returns 1 / the sum of the exps. */
static inline float softmax_scores(float *s, int64_t n) {
    float m = -INFINITY;
    for (int64_t t = 0; t < n; t++)
        m = s[t] > m ? s[t] : m;
    for (int64_t t = n; t < n + 8; t++)
        s[t] = -INFINITY;
    __m256 mv = _mm256_set1_ps(m), sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
        _mm256_storeu_ps(s + t, p);
        sum = _mm256_add_ps(sum, p);
    }
    return 1.0f / hsum8(sum);
}

static void attend_one(const float *q, float *out, const float *keys, const float *values,
                       const int64_t *table, int64_t kv_len, int64_t page_size, int64_t page_stride,
                       int64_t head_offset, int group, int64_t d, float scale, float *scores) {
    /* scores: [group][kv_len + 8]; each query of the group walks the rows (K and V stay in L2) */
    int64_t ld = kv_len + 8;
    for (int g = 0; g < group; g++) {
        const float *qg = q + g * d;
        float *s = scores + g * ld;
        for (int64_t page_i = 0, t = 0; t < kv_len; page_i++) {
            int64_t n = kv_len - t < page_size ? kv_len - t : page_size;
            score_rows(qg, keys + table[page_i] * page_stride + head_offset, n, d, scale, s + t);
            t += n;
        }
        __m256 inv = _mm256_set1_ps(softmax_scores(s, kv_len));
        float *o = out + g * d;
        memset(o, 0, (size_t)d * sizeof(float));
        for (int64_t page_i = 0, t = 0; t < kv_len; page_i++) {
            int64_t n = kv_len - t < page_size ? kv_len - t : page_size;
            add_value_rows(values + table[page_i] * page_stride + head_offset, s + t, n, d, o);
            t += n;
        }
        for (int64_t c = 0; c < d; c += 8)  /* scaled once at the end */
            _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(o + c), inv));
    }
}

/* A block of rows reading the same table (a prefill chunk's consecutive tokens): their keys and
 * values go a tile at a time (a page's rows, at most ATTEND_TILE: 4 KB of keys at head_dim 64)
 * through every query of every row of the block, so the block reads its context once from L2/L3
 * rather than once per token. Each query's sums keep attend_one's order: a score is one key row's
 * FMA chain (score_rows: the same bits in a block of eight or alone), the softmax is the same, and
 * each output dim adds the weighted value rows in key order, its running sum kept in `out`
 * between tiles; so a row gets the same bits in a block or alone. */
#define ATTEND_TILE 16
#define ATTEND_BLOCK 4

/* Runs the body (the last argument) for every tile of the block's keys or values (`base`), every
 * row r of the block that reads into it and every query g of the group: `tile` points at the
 * tile's first row, key index `at`, of which row r reads `m` (> 0). */
#define FOR_EACH_TILE(base, ...)                                                                   \
    for (int64_t page_i = 0, t = 0; t < longest; page_i++) {                                       \
        int64_t n = longest - t < page_size ? longest - t : page_size;                             \
        for (int64_t t0 = 0; t0 < n; t0 += ATTEND_TILE) {                                          \
            const float *tile = (base) + table[page_i] * page_stride + head_offset + t0 * d;       \
            int64_t at = t + t0;                                                                   \
            for (int r = 0; r < nr; r++) {                                                         \
                int64_t m = kv_lens[r] - at;                                                       \
                m = m < n - t0 ? m : n - t0;                                                       \
                m = m < ATTEND_TILE ? m : ATTEND_TILE;                                             \
                for (int g = 0; m > 0 && g < group; g++) { __VA_ARGS__ }                           \
            }                                                                                      \
        }                                                                                          \
        t += n;                                                                                    \
    }

/* Rows r < nr of one KV head: row r's group of queries at q + r * ldq, its output at out + r * ldo,
 * its keys the first kv_lens[r] of `table`. scores: nr * group * (max(kv_lens) + 8) floats. */
static void attend_block(const float *q, int64_t ldq, float *out, int64_t ldo, int nr, const int64_t *kv_lens,
                         const float *keys, const float *values, const int64_t *table, int64_t page_size,
                         int64_t page_stride, int64_t head_offset, int group, int64_t d, float scale,
                         float *scores) {
    int64_t longest = 0;
    for (int r = 0; r < nr; r++)
        longest = kv_lens[r] > longest ? kv_lens[r] : longest;
    int64_t ld = longest + 8;
    FOR_EACH_TILE(keys, score_rows(q + r * ldq + g * d, tile, m, d, scale, scores + (r * group + g) * ld + at);)
    float inv[nr * group];
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < group; g++) {  /* row r's keys only */
            inv[r * group + g] = softmax_scores(scores + (r * group + g) * ld, kv_lens[r]);
            memset(out + r * ldo + g * d, 0, (size_t)d * sizeof(float));
        }
    FOR_EACH_TILE(values, add_value_rows(tile, scores + (r * group + g) * ld + at, m, d, out + r * ldo + g * d);)
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < group; g++) {  /* scaled once at the end */
            float *o = out + r * ldo + g * d;
            __m256 iv = _mm256_set1_ps(inv[r * group + g]);
            for (int64_t c = 0; c < d; c += 8)
                _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(o + c), iv));
        }
}

/* The starts of the step's row blocks: runs of up to ATTEND_BLOCK consecutive rows reading the same
 * table row; first[nb] = batch. Returns nb. */
static int64_t row_blocks(const int64_t *rows, int64_t batch, int64_t *first) {
    int64_t nb = 0;
    for (int64_t b = 0; b < batch;) {
        int64_t e = b + 1;
        while (e < batch && e - b < ATTEND_BLOCK && rows[e] == rows[b])
            e++;
        first[nb++] = b;
        b = e;
    }
    first[nb] = batch;
    return nb;
}

/* Every (row block, KV head) of a step over the calling OpenMP team (an orphaned `omp for`). Row b's
 * queries of head h are at q + b * ldq + h * group * d (its output likewise in out, ldo). A block
 * of one row is attend_one; longer blocks share their tiles (attend_block), with the same bits.
 * Jobs go head by head, block by block within a head, handed out one at a time, so consecutive
 * blocks of a chunk read one head's context while it is in this thread's caches. */
static void attend_rows(const float *q, int64_t ldq, float *out, int64_t ldo, const int64_t *first, int64_t nb,
                        const float *keys, const float *values, const int64_t *table, const int64_t *rows,
                        int64_t max_pages, const int64_t *kv_lens, int64_t kv_heads, int64_t group, int64_t d,
                        int64_t page_size, int64_t page_stride, int64_t head_stride, float scale, float *scores) {
    #pragma omp for schedule(dynamic, 1)
    for (int64_t job = 0; job < nb * kv_heads; job++) {
        int64_t h = job % kv_heads, b = first[job / kv_heads], nr = first[job / kv_heads + 1] - b;
        const float *qb = q + b * ldq + h * group * d;
        float *ob = out + b * ldo + h * group * d;
        const int64_t *tb = table + rows[b] * max_pages;
        if (nr == 1)
            attend_one(qb, ob, keys, values, tb, kv_lens[b], page_size, page_stride, h * head_stride, (int)group, d,
                       scale, scores);
        else
            attend_block(qb, ldq, ob, ldo, (int)nr, kv_lens + b, keys, values, tb, page_size, page_stride,
                         h * head_stride, (int)group, d, scale, scores);
    }
}

/* scratch: threads * ATTEND_BLOCK * group * (max(kv_lens) + 8) floats. */
void kvfence_decode_attention(const float *q, float *out, const float *keys, const float *values,
                              const int64_t *table, const int64_t *rows, int64_t max_pages,
                              const int64_t *kv_lens, int64_t batch,
                              int64_t kv_heads, int64_t group, int64_t d, int64_t page_size,
                              int64_t page_stride, int64_t head_stride, float scale, float *scratch,
                              int64_t scratch_per_thread, int threads) {
    int64_t *first = malloc((size_t)(batch + 1) * sizeof(int64_t));
    if (!first)
        abort();
    int64_t nb = row_blocks(rows, batch, first), ld = kv_heads * group * d;
    #pragma omp parallel num_threads(threads)
    attend_rows(q, ld, out, ld, first, nb, keys, values, table, rows, max_pages, kv_lens, kv_heads, group, d,
                page_size, page_stride, head_stride, scale, scratch + omp_get_thread_num() * scratch_per_thread);
    free(first);
}

/* ---- KV store --------------------------------------------------------------------------------
 *
 * Token t's k[t, h, :] and v[t, h, :] (k, v: [T, kv_heads, D], rows contiguous) go to
 * keys/values + slot_pages[t] * page_stride + h * head_stride + slot_offsets[t] * D. The slots are
 * checked by the caller (every page inside the pool, every offset inside a page).
 */
void kvfence_store_kv(const float *k, const float *v, float *keys, float *values, const int64_t *slot_pages,
                      const int64_t *slot_offsets, int64_t tokens, int64_t kv_heads, int64_t d,
                      int64_t page_stride, int64_t head_stride) {
    for (int64_t t = 0; t < tokens; t++) {
        int64_t base = slot_pages[t] * page_stride + slot_offsets[t] * d;
        for (int64_t h = 0; h < kv_heads; h++) {
            memcpy(keys + base + h * head_stride, k + (t * kv_heads + h) * d, (size_t)d * sizeof(float));
            memcpy(values + base + h * head_stride, v + (t * kv_heads + h) * d, (size_t)d * sizeof(float));
        }
    }
}

/* ---- element-wise ----------------------------------------------------------------------------
 *
 * kvfence_rms_norm: y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, rows of d floats (d % 8 == 0).
 * kvfence_silu_mul: y[r, i] = silu(gu[r, i]) * gu[r, n + i] for i < n (n % 8 == 0): the gate and
 * up halves of one fused projection. One thread each: at decode sizes a call is microseconds.
 */
static inline void rms_norm_row(const float *x, const float *w, float *y, int64_t d, float eps) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)d + eps));
    for (int64_t i = 0; i < d; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv), _mm256_loadu_ps(w + i)));
}

static inline void silu_mul_row(const float *g, float *y, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const float *u = g + n;
    for (int64_t i = 0; i < n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
}

void kvfence_rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t d, float eps) {
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row(x + r * d, w, y + r * d, d, eps);
}

void kvfence_silu_mul(const float *gu, float *y, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row(gu + r * 2 * n, y + r * n, n);
}

/* ---- one decoder layer of a decode step ------------------------------------------------------
 *
 * kvfence_layer runs a whole Llama layer for B token rows, in place on the residual stream
 * x [B, hidden], inside one OpenMP team (a barrier between phases instead of a thread fork and a
 * Python dispatch per op). A row is a decode sequence's one token or one token of a prefill chunk;
 * every row's K/V is stored before any row attends, and a row attends over its table's keys up to
 * its own position, so a chunk's tokens are causal:
 *
 *   h = rms_norm(x, attn_norm); qkv = h @ Wqkv^T (+ bias); rotate q and k (rope); store k, v into
 *   their slots; attn = attention(q, the pages of `table`); x += attn @ Wo^T;
 *   h = rms_norm(x, mlp_norm); gu = h @ Wgate_up^T; act = silu(gate) * up; x += act @ Wdown^T.
 *
 * Each phase computes exactly what the one-op-per-call path computes (the same GEMM panels and
 * summation order, the same attention, rope as x*cos + rot(x)*sin without contraction), so its
 * results equal that path's bit for bit (tests/kernels/test_cpu_layer.py). The slots and tables
 * are checked by the caller once per step (kernels/cpu/attention.py), as for the separate calls.
 */
struct kvfence_layer_weights {
    const float *attn_norm, *mlp_norm;    /* [hidden] */
    const struct kvfence_weight *qkv;     /* [qkv_n, hidden] (with the Q/K/V biases, if any) */
    const struct kvfence_weight *o;       /* [hidden, q_size] */
    const struct kvfence_weight *gate_up; /* [2 * inter, hidden] */
    const struct kvfence_weight *down;    /* [hidden, inter] */
};

struct kvfence_step {
    int64_t batch, hidden, heads, kv_heads, d, inter;
    float eps, scale;
    const float *cos, *sin;                   /* [B, d]: (cos, cos) and (-sin, sin) per position */
    const int64_t *slot_pages, *slot_offsets; /* [B] where each new K/V row goes */
    const int64_t *table;                     /* [S, max_pages]: row rows[b] is what row b reads */
    const int64_t *rows;                      /* [B] */
    int64_t max_pages;
    const int64_t *kv_lens;                   /* [B] keys incl. the new one */
    int64_t page_size, page_stride, head_stride;
    float *h, *qkv, *attn, *gu, *act;         /* scratch: [B, hidden], [B, qkv_n], [B, q], [B, 2 inter], [B, inter] */
    float *scores;                            /* threads * scores_per_thread */
    int64_t scores_per_thread;                /* at least ATTEND_BLOCK * group * (longest kv_len + 8) */
    int threads;
};

/* x[0..d) of one head, rotated in place: out = x * cos + rot(x) * sin, rot(x) = (x2, x1) for the
 * halves x1, x2 (sin holds (-sin, sin)); d % 16 == 0. */
static inline void rope_head(float *x, const float *cos, const float *sin, int64_t d) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i += 8) {
        __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
        _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(cos + i)),
                                              _mm256_mul_ps(x2, _mm256_loadu_ps(sin + i))));
        _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(cos + half + i)),
                                                     _mm256_mul_ps(x1, _mm256_loadu_ps(sin + half + i))));
    }
}

void kvfence_layer(const struct kvfence_layer_weights *w, const struct kvfence_step *s,
                          float *x, float *keys, float *values) {
    const int64_t b_n = s->batch, hidden = s->hidden, d = s->d, group = s->heads / s->kv_heads;
    const int64_t q_size = s->heads * d, kv_size = s->kv_heads * d, qkv_n = q_size + 2 * kv_size;
    int64_t *first = malloc((size_t)(b_n + 1) * sizeof(int64_t));
    if (!first)
        abort();
    int64_t nb = row_blocks(s->rows, b_n, first);
    #pragma omp parallel num_threads(s->threads)
    {
        float *scores = s->scores + omp_get_thread_num() * s->scores_per_thread;
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < b_n; b++)
            rms_norm_row(x + b * hidden, w->attn_norm, s->h + b * hidden, hidden, s->eps);
        gemm_panels(s->h, b_n, w->qkv, s->qkv, 0);
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < b_n; b++) {
            float *row = s->qkv + b * qkv_n;
            for (int64_t hh = 0; hh < s->heads + s->kv_heads; hh++)
                rope_head(row + hh * d, s->cos + b * d, s->sin + b * d, d);
            int64_t base = s->slot_pages[b] * s->page_stride + s->slot_offsets[b] * d;
            for (int64_t h = 0; h < s->kv_heads; h++) {
                memcpy(keys + base + h * s->head_stride, row + q_size + h * d, (size_t)d * sizeof(float));
                memcpy(values + base + h * s->head_stride, row + q_size + kv_size + h * d, (size_t)d * sizeof(float));
            }
        }
        attend_rows(s->qkv, qkv_n, s->attn, q_size, first, nb, keys, values, s->table, s->rows, s->max_pages,
                    s->kv_lens, s->kv_heads, group, d, s->page_size, s->page_stride, s->head_stride, s->scale, scores);
        gemm_panels(s->attn, b_n, w->o, x, 1);
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < b_n; b++)
            rms_norm_row(x + b * hidden, w->mlp_norm, s->h + b * hidden, hidden, s->eps);
        gemm_panels(s->h, b_n, w->gate_up, s->gu, 0);
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < b_n; b++)
            silu_mul_row(s->gu + b * 2 * s->inter, s->act + b * s->inter, s->inter);
        gemm_panels(s->act, b_n, w->down, x, 1);
    }
    free(first);
}
