/* y[M, N] = x[M, K] . W[N, K]^T (+ b[N]): bfloat16 activations and weights, float32 sums, bfloat16 out; for CPUs
 * with AVX512-BF16 (vdpbf16ps: 16 lanes, each adding two bfloat16 products to a float32 sum).
 *
 * A decode step's few rows wait on reading the weights. oneDNN's packed bfloat16 product streams SmolLM2-135M's
 * 30 layers of projections at about 19 GB/s on 2 cores of an EPYC with AVX512-BF16 (the memory gives ~33 GB/s
 * to a plain sum); this kernel reads each weight once per tile of rows, in the order it is stored.
 *
 * Weights come packed in blocks of 16 outputs and pairs of k: wb[N / 16][K / 2][16][2] bfloat16 (N padded with
 * zero rows), so one 64-byte read holds a k pair for 16 outputs: vdpbf16ps's operand as it is. A row's k pair
 * is one 32-bit broadcast. Four blocks and up to six rows share the reads: 24 accumulators.
 *
 * Batch-invariant by construction: y[m, n] is one chain of vdpbf16ps over the k pairs in order, plus the bias,
 * rounded once to bfloat16 (to nearest even, as torch), in every tile shape and thread count, so a row's output
 * never depends on what else is in the batch.
 */
#include <immintrin.h>
#include <stdint.h>

#include "bf16_put.h"

#define GROUP 4
#define ROWS 6
#define TARGET __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))

#define ACC(r) __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = a##r##0, a##r##2 = a##r##0, a##r##3 = a##r##0;
#define DOT(r) if (R > r) { __m512bh v = (__m512bh)_mm512_set1_epi32(x[r][p]); \
    a##r##0 = _mm512_dpbf16_ps(a##r##0, w0, v); if (G > 1) a##r##1 = _mm512_dpbf16_ps(a##r##1, w1, v); \
    if (G > 2) a##r##2 = _mm512_dpbf16_ps(a##r##2, w2, v); if (G > 3) a##r##3 = _mm512_dpbf16_ps(a##r##3, w3, v); }
#define PUT(r) if (R > r) { uint16_t *yr = y + (m + r) * ys + n0; \
    put(yr, a##r##0, b ? b + n0 : 0, nn(0)); if (G > 1) put(yr + BLOCK, a##r##1, b ? b + n0 + BLOCK : 0, nn(1)); \
    if (G > 2) put(yr + 2 * BLOCK, a##r##2, b ? b + n0 + 2 * BLOCK : 0, nn(2)); \
    if (G > 3) put(yr + 3 * BLOCK, a##r##3, b ? b + n0 + 3 * BLOCK : 0, nn(3)); }

/* R rows from m against G blocks from j0. x[r]: row m + r as k pairs (32 bits each). */
TARGET static inline __attribute__((always_inline)) void tile(const int R, const int G, const uint32_t *const *x,
        long KP, const uint16_t *wb, long j0, long N, const float *b, uint16_t *y, long ys, long m) {
    ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5)
    const uint16_t *w = wb + j0 * KP * 2 * BLOCK;
    const long stride = KP * 2 * BLOCK;
    for (long p = 0; p < KP; p++) {
        const long at = p * 2 * BLOCK;
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + at), w1 = w0, w2 = w0, w3 = w0;
        if (G > 1) w1 = (__m512bh)_mm512_loadu_si512(w + stride + at);
        if (G > 2) w2 = (__m512bh)_mm512_loadu_si512(w + 2 * stride + at);
        if (G > 3) w3 = (__m512bh)_mm512_loadu_si512(w + 3 * stride + at);
        DOT(0) DOT(1) DOT(2) DOT(3) DOT(4) DOT(5)
    }
    const long n0 = j0 * BLOCK;
#define nn(g) (N - n0 - (g) * BLOCK < BLOCK ? N - n0 - (g) * BLOCK : BLOCK)
    PUT(0) PUT(1) PUT(2) PUT(3) PUT(4) PUT(5)
#undef nn
}

#define ROWS_CASES(G) switch (R) { \
    case 6: tile(6, G, xr, KP, wb, j, N, b, y, ys, m); break; case 5: tile(5, G, xr, KP, wb, j, N, b, y, ys, m); break; \
    case 4: tile(4, G, xr, KP, wb, j, N, b, y, ys, m); break; case 3: tile(3, G, xr, KP, wb, j, N, b, y, ys, m); break; \
    case 2: tile(2, G, xr, KP, wb, j, N, b, y, ys, m); break; default: tile(1, G, xr, KP, wb, j, N, b, y, ys, m); }

/* x: M rows of K bfloat16 (K even), row stride xs; wb: packed weights (above) of N outputs; b: float32 bias padded
 * to whole blocks, or NULL; y: M rows of N bfloat16, row stride ys. Groups of blocks split over OpenMP threads. */
TARGET void bf16_dot(const uint16_t *x, long M, long K, long xs, const uint16_t *wb, long N, const float *b,
                     uint16_t *y, long ys, int threads) {
    const long KP = K / 2, blocks = (N + BLOCK - 1) / BLOCK, groups = (blocks + GROUP - 1) / GROUP;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long g = 0; g < groups; g++) {
        const long j = g * GROUP, G = blocks - j < GROUP ? blocks - j : GROUP;
        for (long m = 0; m < M; m += ROWS) {
            const long R = M - m < ROWS ? M - m : ROWS;
            const uint32_t *xr[ROWS];
            for (long r = 0; r < ROWS; r++) xr[r] = (const uint32_t *)(x + (m + (r < R ? r : 0)) * xs);
            if (G == 4) { ROWS_CASES(4) } else if (G == 3) { ROWS_CASES(3) }
            else if (G == 2) { ROWS_CASES(2) } else { ROWS_CASES(1) }
        }
    }
}
