/* A Llama decoder layer's small ops, one call each: residual add with RMSNorm, rotary on queries and keys, SiLU
 * times up. Between its products a layer runs about thirty small torch ops (casts, pow, mean, rsqrt, cat, mul,
 * add); at a decode step's few rows each costs its dispatch, not its arithmetic (8 of a 29 ms batch-1 step of
 * SmolLM2-135M on a 2-core CPU went there). Here each is one pass over its rows.
 *
 * Activations are float32 or bfloat16 (bf16 = 1), rows with a stride, the last dimension contiguous. In
 * bfloat16 every op rounds where torch's does (a bfloat16 op computes in float32 and rounds its result, to
 * nearest even), so rotary and the residual add give torch's bits; SiLU's exp (libm's against torch's
 * vectorised one) and the norm's sum of squares (added in order here, in lanes there) may differ in the last
 * float32 bit, which the rounding to bfloat16 nearly always hides. Float32 likewise, to rounding.
 *
 * Batch-invariant: a row's result is computed the same way whatever the other rows, so a token's output
 * does not depend on how a step packed it (speculation's verify against a plain decode). Rows are split over
 * OpenMP threads only when there are enough of them to pay for the threads' start.
 */
#include <string.h>

#include "lanes8.h"

#define MANY_ROWS 16

/* h_out = h + delta (when delta is given; else h as it is), normed = w * rmsnorm(h_out), as transformers'
 * LlamaRMSNorm: float32 x, x * 1 / sqrt(mean(x^2) + eps), rounded to the activations' dtype, times the weight.
 * h_out may be NULL (no delta). T rows of D; strides in elements. */
void add_rms_norm(const void *h, long hs, const void *delta, long ds, void *h_out, long hos, const void *w, float eps,
                  void *normed, long ns, long T, long D, int bf16, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (T >= MANY_ROWS)
    for (long t = 0; t < T; t++) {
        const long body = D & ~7L;
        __m256 acc = _mm256_setzero_ps();
        float tail = 0.0f;
        for (long i = 0; i < body; i += 8) {
            __m256 v = load8(h, t * hs + i, bf16);
            if (delta) {
                v = round8(_mm256_add_ps(v, load8(delta, t * ds + i, bf16)), bf16);
                store8(h_out, t * hos + i, v, bf16);
            }
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        for (long i = body; i < D; i++) {
            float v = widen(h, t * hs + i, bf16);
            if (delta) {
                v = rnd(v + widen(delta, t * ds + i, bf16), bf16);
                store(h_out, t * hos + i, v, bf16);
            }
            tail += v * v;
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        sum += tail;
        const void *src = delta ? h_out : h;
        long ss = delta ? hos : hs;
        float r = 1.0f / sqrtf(sum / (float)D + eps);
        __m256 rv = _mm256_set1_ps(r);
        for (long i = 0; i < body; i += 8) {
            __m256 y = round8(_mm256_mul_ps(load8(src, t * ss + i, bf16), rv), bf16);
            store8(normed, t * ns + i, round8(_mm256_mul_ps(load8(w, i, bf16), y), bf16), bf16);
        }
        for (long i = body; i < D; i++)
            store(normed, t * ns + i, rnd(widen(w, i, bf16) * rnd(widen(src, t * ss + i, bf16) * r, bf16), bf16), bf16);
    }
}

/* In place on the first H heads of each row of qk (row stride ts, head stride hs, D per head, D a multiple of
 * 16): x * cos + rotate_half(x) * sin, with rotate_half's negation already on sin's first half (sin_signed), so
 * the three roundings are torch's: x * cos, the rotated x * sin, their sum. cos, sin: [T, D], row stride cs.
 * With kp: then row t's KV key heads (heads first .. first + KV - 1, rotated) and the KV value heads after them go
 * to pool slot slots[t] of kp and vp ([slots][KV][D], contiguous): the layer's cache write, while the row is hot. */
void rotary(void *qk, long ts, long hs, long T, long H, long D, const void *cos, const void *sin_signed, long cs,
            int bf16, int threads, void *kp, void *vp, const int64_t *slots, long first, long KV) {
    const long half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(threads) if (T >= MANY_ROWS)
    for (long t = 0; t < T; t++) {
        for (long hd = 0; hd < H; hd++) {
            long base = t * ts + hd * hs;
            for (long i = 0; i < half; i += 8) {  /* lanes i (first half) and i + half (second) together */
                __m256 a = load8(qk, base + i, bf16), b = load8(qk, base + half + i, bf16);
                __m256 ca = load8(cos, t * cs + i, bf16), cb = load8(cos, t * cs + half + i, bf16);
                __m256 sa = load8(sin_signed, t * cs + i, bf16), sb = load8(sin_signed, t * cs + half + i, bf16);
                __m256 na = round8(_mm256_add_ps(round8(_mm256_mul_ps(a, ca), bf16), round8(_mm256_mul_ps(b, sa), bf16)), bf16);
                __m256 nb = round8(_mm256_add_ps(round8(_mm256_mul_ps(b, cb), bf16), round8(_mm256_mul_ps(a, sb), bf16)), bf16);
                store8(qk, base + i, na, bf16);
                store8(qk, base + half + i, nb, bf16);
            }
        }
        if (kp) {
            const long e = bf16 ? 2 : 4;
            for (long h = 0; h < KV; h++) {
                memcpy((char *)kp + (slots[t] * KV + h) * D * e, (char *)qk + (t * ts + (first + h) * hs) * e, D * e);
                memcpy((char *)vp + (slots[t] * KV + h) * D * e, (char *)qk + (t * ts + (first + KV + h) * hs) * e, D * e);
            }
        }
    }
}

/* out = silu(gate) * up, gate and up side by side in gu ([T, 2I], row stride gs): silu(g) = g / (1 + exp(-g)),
 * rounded, times up, rounded (torch's F.silu then a multiply). out: [T, I], row stride os. */
void silu_mul(const void *gu, long gs, void *out, long os, long T, long I, int bf16, int threads) {
    const __m256 one = _mm256_set1_ps(1.0f), minus = _mm256_set1_ps(-0.0f);
    const long body = I & ~7L;
    #pragma omp parallel for schedule(static) num_threads(threads) if (T >= MANY_ROWS)
    for (long t = 0; t < T; t++) {
        for (long i = 0; i < body; i += 8) {
            __m256 g = load8(gu, t * gs + i, bf16);
            __m256 a = round8(_mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, minus)))), bf16);
            store8(out, t * os + i, round8(_mm256_mul_ps(a, load8(gu, t * gs + I + i, bf16)), bf16), bf16);
        }
        for (long i = body; i < I; i++) {
            float g = widen(gu, t * gs + i, bf16);
            float a = rnd(g / (1.0f + exp1(-g)), bf16);
            store(out, t * os + i, rnd(a * widen(gu, t * gs + I + i, bf16), bf16), bf16);
        }
    }
}
