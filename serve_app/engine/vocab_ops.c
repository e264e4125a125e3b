/* The sampling path's passes over a vocabulary, one C call each: a row's logsumexp, its block maxima, its top values,
 * a cut below a floor, top-k / top-p's floor, and the coupled sampler's Gumbel-max choice.
 *
 * A sampled row at a 128k vocabulary spends its time in a few whole-row passes (`sampling.py`): torch's
 * logsumexp is four of them (max, subtract into a new tensor, exp, sum) and a strided block max one more
 * at a reduction's speed, and a row's top 64 candidates (block maxima, a top-k of them, a gather, a top-k
 * again) cost a millisecond and a half at batch 32. At batch 32, fixed:4 they made two thirds of a top-p step's
 * sampling time. Here the logsumexp reads a row twice (its max, then the sum of exp(x - max), the row still in
 * cache) and writes nothing; the block maxima and the top values are one streaming pass each.
 *
 * Rows are float32 or bfloat16 (bf16 = 1), a row stride in elements, the last dimension contiguous.
 * Batch-invariant: each row is computed the same way whatever the other rows or the threads, so a
 * request's probabilities do not depend on the batch it shares (seeded text the same at any k).
 */
#include <stdint.h>
#include <stdlib.h>

#include "lanes8.h"

#define MANY_ELEMENTS (1L << 16)  /* split rows over threads only when this much work pays for their start */
#define CHUNK 512                 /* elements summed in float32 lanes before their sum joins a double */

static inline float hmax8(__m256 v) {
    float l[8];
    _mm256_storeu_ps(l, v);
    float m = l[0];
    for (int i = 1; i < 8; i++) m = l[i] > m ? l[i] : m;
    return m;
}

/* The largest of V values from element base (NaN skipped), and whether any is NaN (*nan). */
static inline float row_max(const void *x, long base, long V, int bf16, int *nan) {
    const long body = V & ~7L;
    __m256 mv = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
    for (long i = 0; i < body; i += 8) {
        __m256 v = load8(x, base + i, bf16);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        mv = _mm256_max_ps(mv, v);
    }
    float m = hmax8(mv);
    *nan = _mm256_movemask_ps(bad) != 0;
    for (long i = body; i < V; i++) {
        float v = widen(x, base + i, bf16);
        *nan |= v != v;
        m = v > m ? v : m;
    }
    return m;
}

/* out[r] = log(sum(exp(x[r, :]))): -inf for a row of -inf, +inf where the row holds +inf, NaN where it holds NaN.
 * exp(x - max) is clamped below at exp(-87) (a normal float: no denormals, which CPUs handle ~25x slower);
 * against the row max's exp(0) = 1 the at most V * 1.7e-38 this adds is far below a float32 ulp. Each CHUNK of
 * terms is summed in 8 float32 lanes, the chunks' sums in double: within a few float32 ulps of the exact sum. */
void row_logsumexp(const void *x, long xs, long R, long V, float *out, int bf16, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    for (long r = 0; r < R; r++) {
        const long body = V & ~7L, base = r * xs;
        int nan;
        const float m = row_max(x, base, V, bf16, &nan);
        if (nan) { out[r] = NAN; continue; }
        if (isinf(m)) { out[r] = m; continue; }  /* every term -inf (an empty row), or an infinite logit */
        const __m256 mm = _mm256_set1_ps(m), floor = _mm256_set1_ps(-87.0f), tiny = exp8(floor);
        double total = 0.0;
        for (long c = 0; c < body; c += CHUNK) {
            const long end = c + CHUNK < body ? c + CHUNK : body;
            __m256 acc = _mm256_setzero_ps();
            for (long i = c; i < end; i += 8) {
                __m256 d = _mm256_max_ps(_mm256_sub_ps(load8(x, base + i, bf16), mm), floor);
                /* 8 lanes all at the clamp (most of a row top-k or top-p cut to -inf) add exp(-87) each: no exp */
                acc = _mm256_add_ps(acc, _mm256_movemask_ps(_mm256_cmp_ps(d, floor, _CMP_GT_OQ)) ? exp8(d) : tiny);
            }
            float l[8];
            _mm256_storeu_ps(l, acc);
            total += (double)(((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])));
        }
        for (long i = body; i < V; i++) {
            float d = widen(x, base + i, bf16) - m;
            total += (double)exp1(d > -87.0f ? d : -87.0f);
        }
        out[r] = (float)((double)m + log(total));
    }
}

/* The largest value of each strided block of a row (B tokens a block, `sampling.BLOCK`; S = V / B): out[r, b] for
 * b < S is the max of x[r, b + i S] over i < B, and out[r, S] (where V % B) the max of the last V % B tokens.
 * out: [R, nb] float32, nb = S + (V % B != 0). A NaN in a block may or may not show in its maximum. */
static void block_max_row(const void *x, long base, long V, long B, float *o, int bf16) {
    const long S = V / B, body = S & ~7L;
    for (long b = 0; b < body; b += 8) {
        __m256 m = load8(x, base + b, bf16);
        for (long i = 1; i < B; i++) m = _mm256_max_ps(m, load8(x, base + i * S + b, bf16));
        _mm256_storeu_ps(o + b, m);
    }
    for (long b = body; b < S; b++) {
        float m = widen(x, base + b, bf16);
        for (long i = 1; i < B; i++) {
            float v = widen(x, base + i * S + b, bf16);
            m = v > m ? v : m;
        }
        o[b] = m;
    }
    if (V % B) {
        float m = widen(x, base + B * S, bf16);
        for (long i = B * S + 1; i < V; i++) {
            float v = widen(x, base + i, bf16);
            m = v > m ? v : m;
        }
        o[S] = m;
    }
}

void block_max(const void *x, long xs, long R, long V, long B, float *out, long nb, int bf16, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    for (long r = 0; r < R; r++) block_max_row(x, r * xs, V, B, out + r * nb, bf16);
}

/* ---- a row's `width` largest values ---- */
typedef struct { float v; long i; } item_t;

static inline int below(item_t a, item_t b) {  /* a ranks below b: a smaller value, or the same value further on */
    return a.v < b.v || (a.v == b.v && a.i > b.i);
}

static void sift_down(item_t *h, long n, long at) {  /* a min-heap by `below`: h[0] ranks lowest */
    for (;;) {
        long l = 2 * at + 1, r = l + 1, low = at;
        if (l < n && below(h[l], h[low])) low = l;
        if (r < n && below(h[r], h[low])) low = r;
        if (low == at) return;
        item_t t = h[at]; h[at] = h[low]; h[low] = t;
        at = low;
    }
}

static inline void offer(item_t *h, long n, float v, long i) {  /* v at id i replaces the lowest kept if above it */
    if (v > h[0].v) { h[0] = (item_t){v, i}; sift_down(h, n, 0); }
}

static int ranks_first(const void *a, const void *b) {  /* qsort: descending value, then ascending id */
    item_t x = *(const item_t *)a, y = *(const item_t *)b;
    return below(y, x) ? -1 : below(x, y) ? 1 : 0;
}

/* The 8-lane scan below, 16 lanes at a time where the CPU has AVX-512 (`top_items` asks `wide_lanes`): the same
 * values offered in the same order (a lane the stale smallest lets through is offered, and `offer` compares again),
 * so the same heap; at a 128k vocabulary the scan is ~1.6x faster. Returns where the 8-lane loop goes on. */
#define T512 __attribute__((target("avx512f,avx512bw,avx2,fma")))
T512 static long scan16(const void *x, long base, long V, long width, item_t *heap, int bf16, long i) {
    for (; i + 16 <= V; i += 16) {
        __m512 v = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                              _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + base + i))), 16))
                        : _mm512_loadu_ps((const float *)x + base + i);
        __mmask16 m = _mm512_cmp_ps_mask(v, _mm512_set1_ps(heap[0].v), _CMP_GT_OQ);
        for (; m; m &= m - 1)
            offer(heap, width, widen(x, base + i + __builtin_ctz(m), bf16), i + __builtin_ctz(m));
    }
    return i;
}

static int wide_lanes;  /* set once by the library's constructor: this CPU runs scan16 */
__attribute__((constructor)) static void detect_lanes(void) {
    __builtin_cpu_init();
    wide_lanes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

/* heap[0 .. width) = the `width` largest values of the row at x + base, descending, with their ids; among equal
 * values the smaller id first (so the set and its order are a function of the row alone). One pass: a min-heap of the
 * best `width` so far, and 8 lanes at a time compared with its smallest, which only a few of a row's values beat.
 * NaNs are never taken. width <= V. */
static void top_items(const void *x, long base, long V, long width, item_t *heap, int bf16) {
    for (long i = 0; i < width; i++) {  /* the first width values seed it (NaN: -inf, ranked last) */
        float v = widen(x, base + i, bf16);
        heap[i] = (item_t){v == v ? v : -INFINITY, i};
    }
    for (long at = width / 2 - 1; at >= 0; at--) sift_down(heap, width, at);
    long i = width;
    if (wide_lanes) i = scan16(x, base, V, width, heap, bf16, i);
    for (; i + 8 <= V; i += 8) {  /* 8 lanes against the smallest kept: only the lanes above it are offered */
        int m = _mm256_movemask_ps(_mm256_cmp_ps(load8(x, base + i, bf16), _mm256_set1_ps(heap[0].v), _CMP_GT_OQ));
        for (; m; m &= m - 1)
            offer(heap, width, widen(x, base + i + __builtin_ctz(m), bf16), i + __builtin_ctz(m));
    }
    for (; i < V; i++) offer(heap, width, widen(x, base + i, bf16), i);
    qsort(heap, width, sizeof(item_t), ranks_first);
}

/* vals[r, :], ids[r, :] = row r's `width` largest values and their token ids (`top_items`); scratch: width items per
 * thread, on the stack below 4096. */
void top_values(const void *x, long xs, long R, long V, long width, float *vals, long *ids, int bf16, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    for (long r = 0; r < R; r++) {
        item_t heap[width];
        top_items(x, r * xs, V, width, heap, bf16);
        for (long j = 0; j < width; j++) {
            vals[r * width + j] = heap[j].v;
            ids[r * width + j] = heap[j].i;
        }
    }
}

/* x[r, i] = -inf where x[r, i] < floor[r], in place on float32 rows (a top-p / top-k / min-p cut): one pass, where
 * a comparison into a mask and a masked fill are two and a mask's write. NaN stays (it is not below anything). */
void cut_below(float *x, long xs, long R, long V, const float *floor, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    for (long r = 0; r < R; r++) {
        float *row = x + r * xs;
        const float f = floor[r];
        const __m256 fv = _mm256_set1_ps(f), minus = _mm256_set1_ps(-INFINITY);
        const long body = V & ~7L;
        for (long i = 0; i < body; i += 8) {
            __m256 v = _mm256_loadu_ps(row + i);
            _mm256_storeu_ps(row + i, _mm256_blendv_ps(v, minus, _mm256_cmp_ps(v, fv, _CMP_LT_OQ)));
        }
        for (long i = body; i < V; i++)
            if (row[i] < f) row[i] = -INFINITY;
    }
}

/* out[r, :] = x[r, :] / t[r] in float32 (x float32 or bfloat16; out's row stride os; t NULL: x widened alone):
 * torch's `x / t[:, None]` for a float32 t, whose type promotion widens x (exactly) then divides (IEEE's rounding),
 * or `x.float()`: the same bits, in one pass (torch's took ~1.8x as long for 32 rows of a 128k vocabulary). */
void scale_rows(const void *x, long xs, long R, long V, const float *t, float *out, long os, int bf16, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    for (long r = 0; r < R; r++) {
        const float tr = t ? t[r] : 1.0f;  /* x / 1 is x: the widening alone */
        const __m256 tv = _mm256_set1_ps(tr);
        const long body = V & ~7L;
        for (long i = 0; i < body; i += 8)
            _mm256_storeu_ps(out + r * os + i, _mm256_div_ps(load8(x, r * xs + i, bf16), tv));
        for (long i = body; i < V; i++) out[r * os + i] = widen(x, r * xs + i, bf16) / tr;
    }
}

/* ---- the coupled sampler's Gumbel-max choice (`sampling.gumbel_argmax`) ---- */
/* sampling.py's constants: _MULT, _SALT_MIN, _SALT_AT, BLOCK, SCAN[0] (the tests hold the two paths to one choice) */
#define MULT0 0x2545F491u
#define MULT1 0x7FEB352Du
#define MULT2 0x5BD1E995u
#define SALT_MIN 0x3C6EF372u
#define SALT_AT 0x1B873593u
#define GBLOCK 16
#define FIRST_BLOCKS 32

/* natural log of 8 positive normal lanes to about a float32 ulp (Cephes' logf: m in [sqrt(1/2), sqrt(2)) by the
 * exponent, then a degree-9 polynomial); the noise's arguments are never 0, negative, denormal or infinite */
static inline __m256 log8(__m256 x) {
    const __m256i xi = _mm256_castps_si256(x);
    __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(xi, 23), _mm256_set1_epi32(126)));
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(xi, _mm256_set1_epi32(0x007FFFFF)),
                                                   _mm256_set1_epi32(0x3F000000)));  /* in [0.5, 1) */
    const __m256 low = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
    e = _mm256_sub_ps(e, _mm256_and_ps(low, _mm256_set1_ps(1.0f)));
    m = _mm256_sub_ps(_mm256_add_ps(m, _mm256_and_ps(low, m)), _mm256_set1_ps(1.0f));
    const __m256 z = _mm256_mul_ps(m, m);
    __m256 y = _mm256_set1_ps(7.0376836292e-2f);
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.1514610310e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(1.1676998740e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.2420140846e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(1.4249322787e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.6668057665e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(2.0000714765e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-2.4999993993e-1f));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(3.3333331174e-1f));
    y = _mm256_mul_ps(_mm256_mul_ps(y, m), z);
    y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
    y = _mm256_fnmadd_ps(z, _mm256_set1_ps(0.5f), y);
    return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(m, y));
}

/* sampling._hash32 in uint32 (its masked arithmetic shifts are these logical ones), 8 ids under one key */
static inline __m256i hash8(__m256i id, uint32_t key) {
    __m256i v = _mm256_add_epi32(_mm256_set1_epi32((int)key), _mm256_mullo_epi32(id, _mm256_set1_epi32((int)MULT0)));
    v = _mm256_xor_si256(v, _mm256_srli_epi32(v, 16));
    v = _mm256_mullo_epi32(v, _mm256_set1_epi32((int)MULT1));
    v = _mm256_xor_si256(v, _mm256_srli_epi32(v, 15));
    v = _mm256_mullo_epi32(v, _mm256_set1_epi32((int)MULT2));
    return _mm256_xor_si256(v, _mm256_srli_epi32(v, 16));
}

static inline uint32_t hash1(uint32_t id, uint32_t key) {
    uint32_t v = key + id * MULT0;
    v ^= v >> 16;
    v *= MULT1;
    v ^= v >> 15;
    v *= MULT2;
    return v ^ (v >> 16);
}

/* sampling._expo: Exp(1) variables -log(u), u the hash's top 24 bits + 1/2 over 2^24 (exact before the log) */
static inline __m256 expo8(__m256i id, uint32_t key) {
    __m256i h = _mm256_srli_epi32(hash8(id, key), 8);
    __m256 u = _mm256_add_ps(_mm256_cvtepi32_ps(h), _mm256_set1_ps(0.5f));
    return _mm256_sub_ps(_mm256_setzero_ps(), log8(_mm256_mul_ps(u, _mm256_set1_ps(1.0f / 16777216.0f))));
}

/* One block's tokens scored: logit - log E(x), E(x) = E_min at the block's drawn position, E_min + Exp(1) elsewhere
 * (sampling.noise_e); the best (highest score, then smallest id) joins *best / *choice. */
static void score_block(const void *x, long base, long V, long b, float e_min, uint32_t key, int bf16,
                        float *best, long *choice) {
    const long S = V / GBLOCK, size = b < S ? GBLOCK : V % GBLOCK;
    const uint32_t h = hash1((uint32_t)b, key + SALT_AT) & 0x7FFFFFFFu;
    const long at = size == GBLOCK ? (long)(h & (GBLOCK - 1)) : (long)(h % (uint32_t)size);
    int32_t ids[GBLOCK];
    float logit[GBLOCK];
    for (long i = 0; i < GBLOCK; i++) {  /* the short block's padding repeats its first token, then is skipped */
        ids[i] = (int32_t)(b < S ? b + i * S : GBLOCK * S + (i < size ? i : 0));
        logit[i] = widen(x, base + ids[i], bf16);
    }
    float score[GBLOCK];
    for (long i = 0; i < GBLOCK; i += 8) {
        __m256 e = _mm256_add_ps(_mm256_set1_ps(e_min), expo8(_mm256_loadu_si256((const __m256i *)(ids + i)), key));
        _mm256_storeu_ps(score + i, e);
    }
    score[at] = e_min;
    for (long i = 0; i < GBLOCK; i += 8)
        _mm256_storeu_ps(score + i, _mm256_sub_ps(_mm256_loadu_ps(logit + i), log8(_mm256_loadu_ps(score + i))));
    for (long i = 0; i < size; i++)
        if (score[i] > *best || (score[i] == *best && ids[i] < *choice)) { *best = score[i]; *choice = ids[i]; }
}

/* out[r] = argmax over tokens of x[r, t] - log E(t), E the coupled sampler's Exp(1) noise under keys[r]
 * (`sampling.gumbel_argmax`, the same Gumbel-max choice): every block's bound max logit - log E_min (one pass for
 * the maxima, one over the blocks), then blocks token by token in descending bound until the next bound is below the
 * best score: the FIRST_BLOCKS highest from a heap, and where those do not settle it (flat rows) every block sorted.
 * A row of -inf (or NaN) gets its first token. */
void gumbel_argmax(const void *x, long xs, long R, long V, const int32_t *keys, long *out, int bf16, int threads) {
    const long S = V / GBLOCK, nb = S + (V % GBLOCK != 0), body = nb & ~7L;
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    for (long r = 0; r < R; r++) {
        const long base = r * xs;
        const uint32_t key = (uint32_t)keys[r];
        float *bound = malloc(2 * nb * sizeof(float)), *e_min = bound + nb;
        block_max_row(x, base, V, GBLOCK, bound, bf16);
        const __m256 full = _mm256_set1_ps((float)GBLOCK);
        for (long b = 0; b < body; b += 8) {  /* blocks below S are full: size 16 */
            __m256i id = _mm256_add_epi32(_mm256_set1_epi32((int)b), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            __m256 size = b + 8 <= S ? full : _mm256_blendv_ps(full, _mm256_set1_ps((float)(V % GBLOCK)),
                _mm256_castsi256_ps(_mm256_cmpgt_epi32(id, _mm256_set1_epi32((int)S - 1))));
            __m256 e = _mm256_div_ps(expo8(id, key + SALT_MIN), size);
            _mm256_storeu_ps(e_min + b, e);
            _mm256_storeu_ps(bound + b, _mm256_sub_ps(_mm256_loadu_ps(bound + b), log8(e)));
        }
        if (body < nb) {  /* the last blocks through 8 lanes of which the tail's are used */
            float eb[8], lg[8];
            __m256i id = _mm256_add_epi32(_mm256_set1_epi32((int)body), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            __m256 size = _mm256_blendv_ps(full, _mm256_set1_ps((float)(V % GBLOCK ? V % GBLOCK : GBLOCK)),
                _mm256_castsi256_ps(_mm256_cmpgt_epi32(id, _mm256_set1_epi32((int)S - 1))));
            __m256 e = _mm256_div_ps(expo8(id, key + SALT_MIN), size);
            _mm256_storeu_ps(eb, e);
            _mm256_storeu_ps(lg, log8(e));
            for (long b = body; b < nb; b++) { e_min[b] = eb[b - body]; bound[b] -= lg[b - body]; }
        }
        /* the FIRST_BLOCKS (+ 1: the bound after the last) highest bounds, descending */
        const long first = nb < FIRST_BLOCKS + 1 ? nb : FIRST_BLOCKS + 1;
        item_t top[FIRST_BLOCKS + 1];
        top_items(bound, 0, nb, first, top, 0);
        float best = -INFINITY;
        long choice = -1, done = 0;
        for (; done < first; done++) {
            if (top[done].v < best || top[done].v == -INFINITY) break;
            score_block(x, base, V, top[done].i, e_min[top[done].i], key, bf16, &best, &choice);
        }
        if (done == first && first < nb && top[first - 1].v >= best && top[first - 1].v > -INFINITY) {
            item_t *all = malloc(nb * sizeof(item_t));  /* flat: every block by bound, past those already scored */
            top_items(bound, 0, nb, nb, all, 0);
            for (long j = first; j < nb && all[j].v >= best && all[j].v > -INFINITY; j++)
                score_block(x, base, V, all[j].i, e_min[all[j].i], key, bf16, &best, &choice);
            free(all);
        }
        free(bound);
        out[r] = choice >= 0 ? choice : 0;
    }
}

/* ---- top-k / top-p: the value a row is cut below (`sampling._truncate`) ---- */
/* floor[r] = the smallest value row r keeps under top_k[r] (0: off) and top_p[r]: its candidates, the `width`
 * largest values, descending; p_i = exp(v_i - norm), norm the whole row's logsumexp (top-k's own k values where
 * top-k is on and within the candidates); a candidate i < k stays while the mass before it (a running sum in double,
 * each partial rounded to float32, less p_i, as torch's cumsum of float32 rows keeps it) is below top_p. Candidates
 * widen 8x (from 64, or top-k) while the nucleus may reach past them; past `widest` the row's floor is NaN (the
 * caller's torch path takes it). x: float32 rows. */
void top_p_floor(const float *x, long xs, long R, long V, const long *top_k, const float *top_p, float *floor,
                 long widest, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    for (long r = 0; r < R; r++) {
        const long k = top_k[r] > 0 && top_k[r] < V ? top_k[r] : V;
        long width = top_k[r] > 0 ? (k > 64 ? k : 64) : 64;
        width = width < V ? width : V;
        float total = NAN;  /* the whole row's normaliser: only top-p alone reads it (top-k starts within its k) */
        if (top_k[r] <= 0) row_logsumexp(x + r * xs, xs, 1, V, &total, 0, 1);
        floor[r] = NAN;
        while (width <= widest) {
            item_t *top = malloc(width * sizeof(item_t));
            top_items(x, r * xs, V, width, top, 0);
            const int within = k <= width;
            float norm = total;
            if (top_k[r] > 0 && within) {  /* top-k renormalizes over its own k values */
                double s = 0.0;
                const float m = top[0].v;
                for (long i = 0; i < k; i++) s += (double)exp1(top[i].v - m);
                norm = isinf(m) ? m : (float)((double)m + log(s));
            }
            const long in_k = k < width ? k : width;
            double cum = 0.0;
            long kept = 0;
            for (long i = 0; i < in_k; i++) {
                const float p = exp1(top[i].v - norm);
                cum += (double)p;
                kept += (float)cum - p < top_p[r];
            }
            kept = kept > 0 ? kept : 1;
            const float at_kept = top[kept - 1].v;
            free(top);
            if (width == V || within || (kept < width && k == V)) { floor[r] = at_kept; break; }
            if (width == widest) break;
            width = width * 8 < V ? width * 8 : V;
            width = width < widest ? width : widest;
        }
    }
}

/* out[r] = the first index of row r's largest value, as torch's max(dim=-1).indices on a CPU: NaN counts as the
 * largest (the first NaN's index). Two passes, the row still in cache for the second. */
void row_argmax(const void *x, long xs, long R, long V, int64_t *out, int bf16, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    for (long r = 0; r < R; r++) {
        const long body = V & ~7L, base = r * xs;
        int nan;
        const float m = row_max(x, base, V, bf16, &nan);
        long at = 0;
        if (nan) {
            while (at < V && widen(x, base + at, bf16) == widen(x, base + at, bf16)) at++;
        } else {
            const __m256 mm = _mm256_set1_ps(m);
            long i = 0;
            for (; i < body; i += 8)
                if (_mm256_movemask_ps(_mm256_cmp_ps(load8(x, base + i, bf16), mm, _CMP_EQ_OQ))) break;
            while (i < V && widen(x, base + i, bf16) != m) i++;
            at = i < V ? i : 0;  /* a row of -inf: index 0, as torch */
        }
        out[r] = at;
    }
}
