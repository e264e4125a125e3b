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

/* The kernels a layer's products and attention call, reached through addresses Python hands over (`direct.py`):
 * bf16_amx.c / bf16_dot.c / bf16_linear.c share one signature; paged_attention.c's AVX2 item takes a last
 * dtype flag that its AVX512-BF16 item has not. */
typedef void (*product_fn)(const void *x, long M, long K, long xs, const void *wb, long N, const float *b, void *y,
                           long ys, int threads);
typedef void (*attend_fn)(const void *q, long qs_t, long qs_h, const void *kp, const void *vp, const int64_t *rows,
                          long B, const int64_t *tables, long tab_stride, long bs, long H, long KV, long D, float scale,
                          void *out, int threads);
typedef void (*attend_flag_fn)(const void *q, long qs_t, long qs_h, const void *kp, const void *vp,
                               const int64_t *rows, long B, const int64_t *tables, long tab_stride, long bs, long H,
                               long KV, long D, float scale, void *out, int threads, int bf16);

enum { QKV_FN, QKV_W, QKV_B, O_FN, O_W, O_B, GU_FN, GU_W, GU_B, DOWN_FN, DOWN_W, DOWN_B, NORM1, NORM2, K_POOL,
       V_POOL, LAYER_FIELDS };
enum { EPS1, EPS2, SCALE, LAYER_FLOATS };
enum { G_SPANS, G_ROWS, G_TABLES, G_STRIDE, G_BS, GROUP_FIELDS };

static void product(int64_t fn, const void *x, long M, long K, int64_t w, long N, int64_t b, void *y, int threads) {
    ((product_fn)(intptr_t)fn)(x, M, K, K, (const void *)(intptr_t)w, N, (const float *)(intptr_t)b, y, N, threads);
}

/* Layers [first, last) of a Llama decoder over T packed rows, as direct.py's Python loop calls its kernels one by
 * one (the same calls, the same arguments: the same bits). lw: LAYER_FIELDS addresses a layer (its products'
 * functions, packed weights and padded biases, its norms' weights, its key and value pools); lf: LAYER_FLOATS a
 * layer. h [T, hidden] is the residual stream (updated in place), x its normed copy (entering layer `first`: the
 * caller's, unless `norm_first`); qkv [T, (H + 2 KV) D], att [T, H D], out [T, hidden], gu [T, 2I], act [T, I]:
 * scratch. The attention: G groups of rows (GROUP_FIELDS each: spans, rows, block tables, their stride, block
 * size) by `attend` (flag < 0: the item without a dtype flag). The last layer leaves its MLP's output in out. */
void decoder_layers(long first, long last, long L, const int64_t *lw, const float *lf, void *h, void *x, void *qkv,
                    void *att, void *out, void *gu, void *act, long T, long hidden, long H, long KV, long D, long I,
                    int bf16, int threads, const void *cos, const void *sin, long cs, const int64_t *slots, long G,
                    const int64_t *groups, int64_t attend, int flag, int norm_first) {
    const long width = (H + 2 * KV) * D;
    for (long i = first; i < last; i++) {
        const int64_t *a = lw + i * LAYER_FIELDS;
        const float *f = lf + i * LAYER_FLOATS;
        void *kp = (void *)(intptr_t)a[K_POOL], *vp = (void *)(intptr_t)a[V_POOL];
        if (i == first && norm_first)
            add_rms_norm(h, hidden, NULL, 0, NULL, hidden, (const void *)(intptr_t)a[NORM1], f[EPS1], x, hidden, T,
                         hidden, bf16, threads);
        product(a[QKV_FN], x, T, hidden, a[QKV_W], width, a[QKV_B], qkv, threads);
        rotary(qkv, width, D, T, H + KV, D, cos, sin, cs, bf16, threads, kp, vp, slots, H, KV);
        for (long g = 0; g < G; g++) {
            const int64_t *e = groups + g * GROUP_FIELDS;
            const int64_t *spans = (const int64_t *)(intptr_t)e[G_SPANS], *tables = (const int64_t *)(intptr_t)e[G_TABLES];
            if (flag < 0)
                ((attend_fn)(intptr_t)attend)(qkv, width, D, kp, vp, spans, e[G_ROWS], tables, e[G_STRIDE], e[G_BS], H,
                                             KV, D, f[SCALE], att, threads);
            else
                ((attend_flag_fn)(intptr_t)attend)(qkv, width, D, kp, vp, spans, e[G_ROWS], tables, e[G_STRIDE],
                                                  e[G_BS], H, KV, D, f[SCALE], att, threads, flag);
        }
        product(a[O_FN], att, T, H * D, a[O_W], hidden, a[O_B], out, threads);
        add_rms_norm(h, hidden, out, hidden, h, hidden, (const void *)(intptr_t)a[NORM2], f[EPS2], x, hidden, T, hidden,
                     bf16, threads);
        product(a[GU_FN], x, T, hidden, a[GU_W], 2 * I, a[GU_B], gu, threads);
        silu_mul(gu, 2 * I, act, I, T, I, bf16, threads);
        product(a[DOWN_FN], act, T, I, a[DOWN_W], hidden, a[DOWN_B], out, threads);
        if (i + 1 < L)
            add_rms_norm(h, hidden, out, hidden, h, hidden, (const void *)(intptr_t)a[LAYER_FIELDS + NORM1],
                         lf[(i + 1) * LAYER_FLOATS + EPS1], x, hidden, T, hidden, bf16, threads);
    }
}
