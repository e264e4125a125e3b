/* A block of 16 float32 sums (+ bias) rounded once to bfloat16 (to nearest even, as torch; NaN kept quiet) and
 * stored (nn < 16: the first nn). Shared by bf16_dot.c and bf16_amx.c: their outputs round alike. */
#include <immintrin.h>
#include <stdint.h>

#define BLOCK 16

__attribute__((target("avx512f,avx512bw,avx512vl"))) static inline void put(uint16_t *y, __m512 acc, const float *b,
                                                                             long nn) {
    if (b) acc = _mm512_add_ps(acc, _mm512_loadu_ps(b));
    __m512i u = _mm512_castps_si512(acc);  /* round to nearest even; NaN kept quiet */
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q);
    u = _mm512_mask_mov_epi32(u, nan, _mm512_set1_epi32(0x7fc0));
    __m256i h = _mm512_cvtepi32_epi16(u);
    if (nn == BLOCK) _mm256_storeu_si256((__m256i *)y, h);
    else _mm256_mask_storeu_epi16(y, (__mmask16)((1u << nn) - 1), h);
}
