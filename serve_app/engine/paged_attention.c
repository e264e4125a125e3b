/* Attention of short packed rows (decoding, verifying drafts) read straight from the paged pool; float32.
 *
 * The gather backend copies every short row's keys and values out of the pool and hands SDPA a padded
 * batch; SDPA's CPU kernel is tiled for long query blocks and pays per (row, head) for a handful of
 * queries (32 rows x 3 queries x 300 keys x 9 heads: 4.4 ms a layer on 2 AVX2 cores, the copy 1.2 ms more).
 * Here one work item is (row, key-value head): its keys are read once from their blocks for all the
 * queries that share them (the row's fed tokens x the heads of the group), then its values once.
 *
 * q[t][h][d] (strides qs_t, qs_h), pools [slots][KV][D] contiguous, out [T][H][D] contiguous; all float32, or
 * all bfloat16 (bf16: a bfloat16 model's queries and pools, widened to float32 in registers as read, so they need
 * no float32 copy; each output rounded to bfloat16 as torch's cast of the float32 result would).
 * rows[b] = (offset, n, start): row b's queries are packed tokens offset .. offset + n - 1 at positions
 * start .. start + n - 1; query i sees keys at positions 0 .. start + i. tables[b][p / bs] is the pool block
 * holding position p. D is a multiple of 8.
 *
 * Each query's result is the same sum in the same order whatever else is in the batch (batch-invariant),
 * and differs from SDPA's only by float32 rounding (exp here: a polynomial within 2 ulp of expf).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x for x <= 0 (softmax after subtracting the max): range reduction by ln 2, a degree-6 polynomial. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static float expf1(float x) {  /* exp8 on one lane: the same value for a tail as for a full vector */
    float v[8];
    _mm256_storeu_ps(v, exp8(_mm256_set1_ps(x)));
    return v[0];
}

/* 8 dot products' partial vectors -> one vector of their 8 sums, in order. */
static inline __m256 sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* 8 pool values from element i of a float32 or (bf16) bfloat16 pool, as float32: a bfloat16 is the top half of
 * the float32 with the same bits. Inlined where bf16 is a constant, so the test folds away. */
static inline __attribute__((always_inline)) __m256 load8(const void *pool, long i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)pool + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)pool + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#define KEY(u) const long k##u = at[l + u < L ? l + u : l] + j * D;
#define DOT(u) a##u = _mm256_fmadd_ps(qd, load8(kp, k##u + d, bf16), a##u);
/* Named accumulators, not an array: GCC keeps an array of vectors in memory and stores it every step. */
#define VFMA(c) if (w8 > 8 * c) a##c = _mm256_fmadd_ps(p, load8(vp, v + 8 * c, bf16), a##c);
#define VPUT(c) if (w8 > 8 * c) store8(out, o + d + 8 * c, _mm256_mul_ps(a##c, inv), bf16);

/* 8 float32 results to element i of a float32 or (bf16) bfloat16 output, rounded to nearest even (torch's cast). */
static inline __attribute__((always_inline)) void store8(void *out, long i, __m256 f, int bf16) {
    if (!bf16) { _mm256_storeu_ps((float *)out + i, f); return; }
    __m256i u = _mm256_castps_si256(f);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    u = _mm256_blendv_epi8(u, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0xD8);
    _mm_storeu_si128((__m128i *)((uint16_t *)out + i), _mm256_castsi256_si128(packed));
}

/* One (row, kv head): the Q = n * G queries that read these keys. s: scratch [Q][L] scores, then weights.
 * Scores go 8 keys at a time: 8 independent FMA chains per query, one reduction for the 8 (a key past a
 * query's own position gets a score it never reads). Inlined into the two calls below, one per pool type. */
static inline __attribute__((always_inline)) void item(
        const void *q, long qs_t, long qs_h, const void *kp, const void *vp, long off, long n, long start,
        const int64_t *table, long bs, long H, long KV, long D, long j, float scale, void *out, float *s, int bf16) {
    const long G = H / KV, Q = n * G, L = start + n;
    const __m256 sc = _mm256_set1_ps(scale);
    long *at = (long *)(s + ((Q * L + Q + 1) & ~1L));  /* [L] where position l's keys and values start in the pools */
    for (long l = 0; l < L; l++) at[l] = (table[l / bs] * bs + l % bs) * KV * D;
    for (long l = 0; l < L; l += 8) {
        KEY(0) KEY(1) KEY(2) KEY(3) KEY(4) KEY(5) KEY(6) KEY(7)
        for (long i = 0; i < Q; i++) {
            const long qq = (off + i / G) * qs_t + (j * G + i % G) * qs_h;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (long d = 0; d < D; d += 8) {
                const __m256 qd = load8(q, qq + d, bf16);
                DOT(0) DOT(1) DOT(2) DOT(3) DOT(4) DOT(5) DOT(6) DOT(7)
            }
            float v[8];
            _mm256_storeu_ps(v, _mm256_mul_ps(sum8(a0, a1, a2, a3, a4, a5, a6, a7), sc));
            for (long u = 0; u < 8 && l + u < L; u++) s[i * L + l + u] = v[u];
        }
    }
    float *sums = s + Q * L;
    for (long t = 0; t < n; t++) {  /* softmax of each query's row over the keys it sees; zeros past them */
        const long len = start + t + 1;
        for (long g = 0; g < G; g++) {
            float *r = s + (t * G + g) * L;
            float m = -INFINITY;
            for (long l = 0; l < len; l++) m = r[l] > m ? r[l] : m;
            __m256 mv = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
            long l = 0;
            for (; l + 8 <= len; l += 8) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(r + l), mv));
                _mm256_storeu_ps(r + l, e);
                acc = _mm256_add_ps(acc, e);
            }
            float sum = hsum(acc);
            for (; l < len; l++) { r[l] = expf1(r[l] - m); sum += r[l]; }
            for (l = len; l < L; l++) r[l] = 0.0f;
            sums[t * G + g] = sum;
        }
    }
    for (long i = 0; i < Q; i++) {  /* values: 64 of a query's outputs at a time, summed in registers */
        const long t = i / G, len = start + t + 1;
        const float *w = s + i * L;
        const long o = ((off + t) * H + j * G + i % G) * D;
        const __m256 inv = _mm256_set1_ps(1.0f / sums[i]);
        for (long d = 0; d < D; d += 64) {
            const long w8 = D - d < 64 ? D - d : 64;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (long l = 0; l < len; l++) {
                const __m256 p = _mm256_set1_ps(w[l]);
                const long v = at[l] + j * D + d;
                VFMA(0) VFMA(1) VFMA(2) VFMA(3) VFMA(4) VFMA(5) VFMA(6) VFMA(7)
            }
            VPUT(0) VPUT(1) VPUT(2) VPUT(3) VPUT(4) VPUT(5) VPUT(6) VPUT(7)
        }
    }
}

void paged_attention(const void *q, long qs_t, long qs_h, const void *kp, const void *vp, const int64_t *rows,
                     long B, const int64_t *tables, long tab_stride, long bs, long H, long KV, long D, float scale,
                     void *out, int threads, int bf16) {
    long most = 0;
    for (long b = 0; b < B; b++) {
        const long n = rows[3 * b + 1], L = rows[3 * b + 2] + n, need = n * (H / KV) * (L + 1) + 2 * L + 2;
        most = need > most ? need : most;
    }
#pragma omp parallel num_threads(threads)
    {
        float *s = malloc(sizeof(float) * most);
#pragma omp for schedule(dynamic)
        for (long w = 0; w < B * KV; w++) {
            const long b = w / KV;
            const long off = rows[3 * b], n = rows[3 * b + 1], start = rows[3 * b + 2];
            if (bf16)
                item(q, qs_t, qs_h, kp, vp, off, n, start, tables + b * tab_stride, bs, H, KV, D, w % KV, scale, out, s, 1);
            else
                item(q, qs_t, qs_h, kp, vp, off, n, start, tables + b * tab_stride, bs, H, KV, D, w % KV, scale, out, s, 0);
        }
        free(s);
    }
}
