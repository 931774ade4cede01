/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), fp32, for x86-64 CPUs with AVX2 and FMA.
 *
 * W is packed once (kvfence_pack) into panels of 16 output columns: panel p holds
 * W[16p .. 16p+15, k] for k = 0..K-1 as K rows of 16 floats, the last panel zero-padded. One panel
 * is one contiguous stream, so a decode step (M of 1 to a few dozen) reads every weight byte once,
 * sequentially, and at M = 1 runs at the memory's speed rather than a GEMM library's small-M
 * path. The micro-kernel keeps a 6 x 16 block of y in twelve ymm registers and walks k: two
 * vector loads of the panel, six broadcasts of x, twelve FMAs per k. Rows go in groups of six
 * while the panel stays in L1/L2; panels are split across `threads` OpenMP threads (the same
 * OpenMP runtime as torch's when it is loaded first: the library is found by its soname).
 *
 * The summation order over k is fixed (sequential), so a row's result does not depend on M or on
 * the other rows of the batch.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define NR 16
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
    if (rows > r) store_row(y + r * ldy, c##r##0, c##r##1, cols, bias);

static inline __attribute__((always_inline)) void
store_row(float *y, __m256 a0, __m256 a1, int64_t cols, const float *bias) {
    if (bias) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(bias));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(bias + 8));
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
      float *y, int64_t ldy, int64_t cols, const float *bias) {
    ROW_DECL(0) ROW_DECL(1) ROW_DECL(2) ROW_DECL(3) ROW_DECL(4) ROW_DECL(5)
    for (int64_t kk = 0; kk < k; kk++) {
        __m256 w0 = _mm256_loadu_ps(panel + kk * NR);
        __m256 w1 = _mm256_loadu_ps(panel + kk * NR + 8);
        ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5)
    }
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)
}

/* The same block for each row count, so that the compiler drops the dead rows' registers. */
static void block_rows(const float *x, int64_t ldx, const float *panel, int64_t k, int rows,
                       float *y, int64_t ldy, int64_t cols, const float *bias) {
    switch (rows) {
    case 6: block(x, ldx, panel, k, 6, y, ldy, cols, bias); break;
    case 5: block(x, ldx, panel, k, 5, y, ldy, cols, bias); break;
    case 4: block(x, ldx, panel, k, 4, y, ldy, cols, bias); break;
    case 3: block(x, ldx, panel, k, 3, y, ldy, cols, bias); break;
    case 2: block(x, ldx, panel, k, 2, y, ldy, cols, bias); break;
    default: block(x, ldx, panel, k, 1, y, ldy, cols, bias); break;
    }
}

/* bias: NULL, or N floats padded to a multiple of 16 (the padding is never stored to y). */
void kvfence_gemm(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                  const float *bias, float *y, int threads) {
    int64_t panels = (n + NR - 1) / NR;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const float *panel = packed + p * k * NR;
        int64_t col = p * NR;
        int64_t cols = n - col < NR ? n - col : NR;
        const float *b = bias ? bias + col : 0;
        for (int64_t r = 0; r < m; r += MR) {
            int rows = m - r < MR ? (int)(m - r) : MR;
            block_rows(x + r * k, k, panel, k, rows, y + r * n + col, n, cols, b);
        }
    }
}
