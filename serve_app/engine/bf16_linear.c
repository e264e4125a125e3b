/* y[M, N] = x[M, K] . W[N, K]^T (+ b[N]): float32 activations, bfloat16 weights, float32 arithmetic.
 *
 * For CPUs with AVX2 and FMA but no bfloat16 arithmetic (oneDNN packs bfloat16 only with avx512_bf16 or
 * avx_ne_convert; torch's own bfloat16 matmul reads a matrix at ~1 GB/s from 4 rows up there). A decode
 * step waits on reading the weights, so half the bytes is about half the time while the rows are few.
 *
 * The weights come packed in blocks of 16 outputs: wb[N / 16][K][16] (the last block zero-padded), so one
 * 32-byte read gives a k's 16 weights, widened to float32 in registers (a bfloat16 is the top half of a
 * float32). Up to 6 rows of x share each read: 12 accumulators of 8 lanes, an FMA per row and half-block
 * per k, a broadcast x[m][k] per row. SmolLM2-135M's linears, 30 layers and the head, 2 threads of an AVX2
 * EPYC, against oneDNN's packed float32 (`specserve bench linears`): 0.41 / 0.38 / 0.46 / 0.51 / 0.73 / 0.76x
 * the time at 1 / 4 / 8 / 16 / 32 / 64 rows (17.3 against 43.2 ms at 1 row: 15.5 GB/s of weights).
 *
 * Batch-invariant by construction: y[m, n] is one FMA chain over k = 0..K-1 in order, plus the bias, in
 * every tile shape and thread count, so a row's output never depends on what else is in the batch.
 * Blocks are split over OpenMP threads (the runtime torch loaded: libgomp.so.1, by soname).
 */
#include <immintrin.h>
#include <stdint.h>

#define BLOCK 16
#define ROWS 6

static inline __m256 widen8(const uint16_t *p) {  /* 8 bfloat16 -> 8 float32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* R rows of x (stride xs) against one block of 16 outputs; writes the first nn of them. The accumulators are
 * named, not an array: GCC keeps an array of vectors in memory and stores it every k. */
#define ROW_FMA(r) if (R > r) { __m256 v = _mm256_broadcast_ss(x + r * xs + k); \
    a##r##0 = _mm256_fmadd_ps(v, w0, a##r##0); a##r##1 = _mm256_fmadd_ps(v, w1, a##r##1); }
#define ROW_PUT(r) if (R > r) put16(y + r * ys, a##r##0, a##r##1, b, nn);

static inline void put16(float *out, __m256 lo, __m256 hi, const float *b, long nn) {
    if (b) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(b));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(b + 8));
    }
    if (nn == BLOCK) {
        _mm256_storeu_ps(out, lo);
        _mm256_storeu_ps(out + 8, hi);
    } else {
        float t[BLOCK];
        _mm256_storeu_ps(t, lo);
        _mm256_storeu_ps(t + 8, hi);
        for (long j = 0; j < nn; j++) out[j] = t[j];
    }
}

static inline __attribute__((always_inline)) void tile(const int R, const float *x, long xs, long K,
                                                       const uint16_t *wb, const float *b, float *y, long ys, long nn) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
           a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    for (long k = 0; k < K; k++) {
        __m256 w0 = widen8(wb + k * BLOCK), w1 = widen8(wb + k * BLOCK + 8);
        ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5)
    }
    ROW_PUT(0) ROW_PUT(1) ROW_PUT(2) ROW_PUT(3) ROW_PUT(4) ROW_PUT(5)
}

/* x: M rows of K float32, row stride xs; wb: packed weights (above) of N outputs; b: the bias padded to
 * whole blocks, or NULL; y: M rows of N float32, row stride ys. */
void bf16_linear(const float *x, long M, long K, long xs, const uint16_t *wb, long N, const float *b,
                 float *y, long ys, int threads) {
    long blocks = (N + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long j = 0; j < blocks; j++) {
        const uint16_t *w = wb + j * K * BLOCK;
        const float *bj = b ? b + j * BLOCK : 0;
        long n0 = j * BLOCK, nn = N - n0 < BLOCK ? N - n0 : BLOCK;
        for (long m = 0; m < M; m += ROWS) {
            const float *xm = x + m * xs;
            float *ym = y + m * ys + n0;
            switch (M - m < ROWS ? M - m : ROWS) {  /* constant R per case: the row loops unroll */
                case 6: tile(6, xm, xs, K, w, bj, ym, ys, nn); break;
                case 5: tile(5, xm, xs, K, w, bj, ym, ys, nn); break;
                case 4: tile(4, xm, xs, K, w, bj, ym, ys, nn); break;
                case 3: tile(3, xm, xs, K, w, bj, ym, ys, nn); break;
                case 2: tile(2, xm, xs, K, w, bj, ym, ys, nn); break;
                default: tile(1, xm, xs, K, w, bj, ym, ys, nn); break;
            }
        }
    }
}
