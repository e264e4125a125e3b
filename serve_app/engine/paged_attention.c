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

#include "bf16_put.h"

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

/* at[l]: where position l's keys and values start in the pools, for l < L (block by block: no division a key). */
static inline void offsets(long *at, long L, const int64_t *table, long bs, long stride) {
    for (long b = 0, l = 0; l < L; b++)
        for (long u = 0, base = table[b] * bs * stride; u < bs && l < L; u++, l++) at[l] = base + u * stride;
}

/* Softmax of each query's row of scores (rows of stride L) over the keys it sees (query t * G + g: keys
 * 0 .. start + t), zeros past them; each row's sum to sums. */
static inline __attribute__((always_inline)) void softmax(float *s, long L, long n, long G, long start, float *sums) {
    for (long t = 0; t < n; t++) {  /* softmax of each query's row over the keys it sees; zeros past them */
        const long len = start + t + 1;
        for (long g = 0; g < G; g++) {
            float *r = s + (t * G + g) * L;
            __m256 mx = _mm256_set1_ps(-INFINITY);  /* the max, 8 lanes at a time (any order gives the same) */
            long l = 0;
            for (; l + 8 <= len; l += 8) mx = _mm256_max_ps(_mm256_loadu_ps(r + l), mx);  /* a NaN score is skipped */
            float v8[8], m = -INFINITY;
            _mm256_storeu_ps(v8, mx);
            for (long u = 0; u < 8; u++) m = v8[u] > m ? v8[u] : m;
            for (; l < len; l++) m = r[l] > m ? r[l] : m;
            __m256 mv = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
            l = 0;
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
    offsets(at, L, table, bs, KV * D);
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
    softmax(s, L, n, G, start, sums);
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

/* ---- bfloat16 pools on CPUs with AVX512-BF16 ------------------------------------------------------------------
 * The AVX2 item above widens every key it reads once per query and sums each score across lanes one by one: at a
 * decode row's 3 queries per key-value head that is ~60 ns a key, several times what reading the key costs. Here a
 * query's 16 keys at a time: each score is a vdpbf16ps chain over the head's 32-pair chunks (bfloat16 products are
 * exact in float32; a lane adds two of them, then the next chunk), and one shuffle tree (`sum16`) sums the 16
 * chains' lanes at once. A value is widened once for the queries of its token that share it, whose sums go in
 * float32 lane by lane as the AVX2 item's do. Every sum's order is fixed by the query's position alone, so
 * batch-invariance holds as above; scores differ from the float32 item's by float32 rounding. */
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

/* 16 vectors -> one whose lane u is the sum of vector u's 16 lanes (pairs within 128-bit lanes, then across). */
T512 static inline __attribute__((always_inline)) __m512 pair1(__m512 x, __m512 y) {  /* x, y -> per 128: x02 y02 x13 y13 */
    return _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
}
T512 static inline __attribute__((always_inline)) __m512 pair2(__m512 x, __m512 y) {  /* -> per 128: x y (of x's pairs) */
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x), _mm512_castps_pd(y))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x), _mm512_castps_pd(y))));
}
T512 static inline __attribute__((always_inline)) __m512 pair3(__m512 x, __m512 y) {  /* 128-bit lanes 0+1, 2+3 */
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}
T512 static inline __attribute__((always_inline)) __m512 sum16(
        __m512 a0, __m512 a1, __m512 a2, __m512 a3, __m512 a4, __m512 a5, __m512 a6, __m512 a7,
        __m512 a8, __m512 a9, __m512 a10, __m512 a11, __m512 a12, __m512 a13, __m512 a14, __m512 a15) {
    const __m512 w0 = pair2(pair1(a0, a1), pair1(a2, a3)), w1 = pair2(pair1(a4, a5), pair1(a6, a7));
    const __m512 w2 = pair2(pair1(a8, a9), pair1(a10, a11)), w3 = pair2(pair1(a12, a13), pair1(a14, a15));
    return pair3(pair3(w0, w1), pair3(w2, w3));
}

/* 16 bfloat16 values at p, widened to float32. */
T512 static inline __attribute__((always_inline)) __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#define K16(u) const uint16_t *k##u = kp + at[l + u < L ? l + u : l] + j * D;
#define DP(u) a##u = _mm512_dpbf16_ps(a##u, qc, (__m512bh)_mm512_loadu_si512(k##u + c));
/* up to 4 queries x 64 of their outputs in registers: query g's chunk c */
#define VACC(g) __m512 v##g##0 = _mm512_setzero_ps(), v##g##1 = v##g##0, v##g##2 = v##g##0, v##g##3 = v##g##0;
#define VF(g) if (nq > g) { const __m512 p = _mm512_set1_ps(w[g][l]); v##g##0 = _mm512_fmadd_ps(p, x0, v##g##0); \
    if (nc > 1) v##g##1 = _mm512_fmadd_ps(p, x1, v##g##1); if (nc > 2) v##g##2 = _mm512_fmadd_ps(p, x2, v##g##2); \
    if (nc > 3) v##g##3 = _mm512_fmadd_ps(p, x3, v##g##3); }
#define VP(g) if (nq > g) { uint16_t *y = out16 + o[g] + d; const __m512 inv = _mm512_set1_ps(1.0f / sumj[i0 + g]); \
    put(y, _mm512_mul_ps(v##g##0, inv), 0, 16); if (nc > 1) put(y + 16, _mm512_mul_ps(v##g##1, inv), 0, 16); \
    if (nc > 2) put(y + 32, _mm512_mul_ps(v##g##2, inv), 0, 16); if (nc > 3) put(y + 48, _mm512_mul_ps(v##g##3, inv), 0, 16); }

/* As `item`, for bfloat16 queries, pools and output and key-value heads j0 .. j1 - 1 of one row; D a multiple of
 * 32. A row's heads in one item read each position's keys (and values) as one run of memory, which the CPU's
 * prefetchers follow; heads apart are for batches too small to share out by rows. s: scratch [heads][Q][Lp]
 * scores (Lp: L rounded up to 16), then the sums, then L offsets. */
T512 static void item16(const uint16_t *q, long qs_t, long qs_h, const uint16_t *kp, const uint16_t *vp, long off,
                        long n, long start, const int64_t *table, long bs, long H, long KV, long D, long j0, long j1,
                        float scale, uint16_t *out16, float *s) {
    const long G = H / KV, Q = n * G, L = start + n, Lp = (L + 15) & ~15L, J = j1 - j0;
    float *sums = s + J * Q * Lp;
    long *at = (long *)(sums + ((J * Q + 1) & ~1L));
    offsets(at, L, table, bs, KV * D);
    const __m512 sc = _mm512_set1_ps(scale);
    for (long l = 0; l < L; l += 16) {  /* scores: keys l .. l + 15 (past L: key l again, never read) */
        for (long u = l + 16; u < l + 32 && u < L; u++)  /* the next 16 positions: on their way while these are summed */
            for (long x = j0 * D; x < j1 * D; x += 32) _mm_prefetch((const char *)(kp + at[u] + x), _MM_HINT_T0);
        for (long u = l; u < l + 16 && u < L; u++)  /* and these positions' values, for the sums after the softmax */
            for (long x = j0 * D; x < j1 * D; x += 32) _mm_prefetch((const char *)(vp + at[u] + x), _MM_HINT_T1);
        for (long j = j0; j < j1; j++) {
            K16(0) K16(1) K16(2) K16(3) K16(4) K16(5) K16(6) K16(7)
            K16(8) K16(9) K16(10) K16(11) K16(12) K16(13) K16(14) K16(15)
            float *sj = s + (j - j0) * Q * Lp;
            for (long i = 0; i < Q; i++) {
                const uint16_t *qi = q + (off + i / G) * qs_t + (j * G + i % G) * qs_h;
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
                __m512 a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
                for (long c = 0; c < D; c += 32) {
                    const __m512bh qc = (__m512bh)_mm512_loadu_si512(qi + c);
                    DP(0) DP(1) DP(2) DP(3) DP(4) DP(5) DP(6) DP(7) DP(8) DP(9) DP(10) DP(11) DP(12) DP(13) DP(14) DP(15)
                }
                _mm512_storeu_ps(sj + i * Lp + l, _mm512_mul_ps(sum16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11,
                                                                      a12, a13, a14, a15), sc));
            }
        }
    }
    for (long j = j0; j < j1; j++) softmax(s + (j - j0) * Q * Lp, Lp, n, G, start, sums + (j - j0) * Q);
    for (long j = j0; j < j1; j++) {
        const float *sj = s + (j - j0) * Q * Lp, *sumj = sums + (j - j0) * Q;
        for (long t = 0; t < n; t++) {  /* values: a token's queries (4 at a time) share each widened value */
            const long len = start + t + 1;
            for (long i0 = t * G; i0 < (t + 1) * G; i0 += 4) {
                const long nq = (t + 1) * G - i0 < 4 ? (t + 1) * G - i0 : 4;
                const float *w[4];
                long o[4];
                for (long g = 0; g < 4; g++) {
                    const long i = i0 + (g < nq ? g : 0);
                    w[g] = sj + i * Lp;
                    o[g] = ((off + t) * H + j * G + i % G) * D;
                }
                for (long d = 0; d < D; d += 64) {
                    const long nc = (D - d) / 16 < 4 ? (D - d) / 16 : 4;
                    VACC(0) VACC(1) VACC(2) VACC(3)
                    for (long l = 0; l < len; l++) {
                        const uint16_t *v = vp + at[l] + j * D + d;
                        if (l + 8 < len) {  /* a value 8 positions on: on its way while this one is summed */
                            _mm_prefetch((const char *)(vp + at[l + 8] + j * D + d), _MM_HINT_T0);
                            _mm_prefetch((const char *)(vp + at[l + 8] + j * D + d + 16 * nc - 1), _MM_HINT_T0);
                        }
                        const __m512 x0 = widen16(v), x1 = nc > 1 ? widen16(v + 16) : x0;
                        const __m512 x2 = nc > 2 ? widen16(v + 32) : x0, x3 = nc > 3 ? widen16(v + 48) : x0;
                        VF(0) VF(1) VF(2) VF(3)
                    }
                    VP(0) VP(1) VP(2) VP(3)
                }
            }
        }
    }
}

void paged_attention_bf16(const void *q, long qs_t, long qs_h, const void *kp, const void *vp, const int64_t *rows,
                          long B, const int64_t *tables, long tab_stride, long bs, long H, long KV, long D, float scale,
                          void *out, int threads) {
    long most = 0, most_row = 0;  /* scratch floats an item of one head, of a whole row's heads */
    for (long b = 0; b < B; b++) {
        const long n = rows[3 * b + 1], L = rows[3 * b + 2] + n, Lp = (L + 15) & ~15L;
        const long one = n * (H / KV) * (Lp + 1) + 2 * L + 4, row = KV * n * (H / KV) * (Lp + 1) + 2 * L + 4;
        most = one > most ? one : most;
        most_row = row > most_row ? row : most_row;
    }
    /* heads an item takes: a whole row's once rows share out evenly over the threads and its scores fit in a few
     * MB (long contexts keep an item per head: its scratch is KV times smaller) */
    const long per = B >= 4 * threads && most_row <= (1L << 20) ? KV : 1;
    if (per > 1) most = most_row;
#pragma omp parallel num_threads(threads)
    {
        float *s = aligned_alloc(64, sizeof(float) * ((most + 15) & ~15L));
#pragma omp for schedule(dynamic)
        for (long w = 0; w < B * KV / per; w++) {
            const long b = w * per / KV, j0 = w * per % KV;
            item16((const uint16_t *)q, qs_t, qs_h, (const uint16_t *)kp, (const uint16_t *)vp, rows[3 * b],
                   rows[3 * b + 1], rows[3 * b + 2], tables + b * tab_stride, bs, H, KV, D, j0, j0 + per, scale,
                   (uint16_t *)out, s);
        }
        free(s);
    }
}
