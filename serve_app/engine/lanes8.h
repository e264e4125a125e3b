/* Eight float32 lanes read from and written to float32 or bfloat16 (bf16 = 1) rows, rounded as torch rounds, and
 * exp of eight lanes: the helpers the C kernels over activations and logits share (`decoder_ops.c`, `vocab_ops.c`).
 * Included by source, so `ckernels` hashes this file with each source that includes it. AVX2 and FMA. */
#ifndef SPECSERVE_LANES8_H
#define SPECSERVE_LANES8_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* ---- 8 lanes of float32, read from and written to either dtype ---- */
static inline __m256 load8(const void *p, long i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    __m128i v = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

static inline __m256 round8(__m256 f, int bf16) {  /* to the nearest bfloat16, ties to even (torch's), NaN kept */
    if (!bf16) return f;
    __m256i u = _mm256_castps_si256(f);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    u = _mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u));
    __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(u), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}

static inline void store8(void *p, long i, __m256 f, int bf16) {  /* f already rounded where bf16 */
    if (!bf16) { _mm256_storeu_ps((float *)p + i, f); return; }
    __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(f), 16);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0xD8);
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_castsi256_si128(packed));
}

/* ---- one lane, for the tails ---- */
static inline float widen(const void *p, long i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float rnd(float f, int bf16) {
    if (!bf16) return f;
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) u = 0x7fc00000u;
    else u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static inline void store(void *p, long i, float f, int bf16) {  /* f already rounded where bf16 */
    if (!bf16) { ((float *)p)[i] = f; return; }
    uint32_t u;
    memcpy(&u, &f, 4);
    ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
}

/* Cephes' expf polynomial in x - n ln 2, highest degree first (the 16-lane exp of `vocab_ops.c` shares it) */
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                  1.6666665459e-1f, 5.0000001201e-1f};

/* exp of 8 lanes to about a float32 ulp (Cephes' expf: 2^n times a degree-6 polynomial); inf past 88.72 as expf */
static inline __m256 exp8(__m256 x) {
    __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(88.72283935546875f), _CMP_GT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_POLY[i]));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
}

static inline float exp1(float x) {  /* exp8 on one lane: the tails round as the body does */
    float v[8] = {x}, r[8];
    _mm256_storeu_ps(r, exp8(_mm256_loadu_ps(v)));
    return r[0];
}

#endif
