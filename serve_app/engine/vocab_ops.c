/* The sampling path's passes over a vocabulary, one C call each: a row's logsumexp and its block maxima.
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

/* out[r] = log(sum(exp(x[r, :]))): -inf for a row of -inf, +inf where the row holds +inf, NaN where it holds NaN.
 * exp(x - max) is clamped below at exp(-87) (a normal float: no denormals, which CPUs handle ~25x slower);
 * against the row max's exp(0) = 1 the at most V * 1.7e-38 this adds is far below a float32 ulp. Each CHUNK of
 * terms is summed in 8 float32 lanes, the chunks' sums in double: within a few float32 ulps of the exact sum. */
void row_logsumexp(const void *x, long xs, long R, long V, float *out, int bf16, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    for (long r = 0; r < R; r++) {
        const long body = V & ~7L, base = r * xs;
        __m256 mv = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
        for (long i = 0; i < body; i += 8) {
            __m256 v = load8(x, base + i, bf16);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            mv = _mm256_max_ps(mv, v);
        }
        float m = hmax8(mv);
        int nan = _mm256_movemask_ps(bad) != 0;
        for (long i = body; i < V; i++) {
            float v = widen(x, base + i, bf16);
            nan |= v != v;
            m = v > m ? v : m;
        }
        if (nan) { out[r] = NAN; continue; }
        if (isinf(m)) { out[r] = m; continue; }  /* every term -inf (an empty row), or an infinite logit */
        const __m256 mm = _mm256_set1_ps(m), floor = _mm256_set1_ps(-87.0f);
        double total = 0.0;
        for (long c = 0; c < body; c += CHUNK) {
            const long end = c + CHUNK < body ? c + CHUNK : body;
            __m256 acc = _mm256_setzero_ps();
            for (long i = c; i < end; i += 8)
                acc = _mm256_add_ps(acc, exp8(_mm256_max_ps(_mm256_sub_ps(load8(x, base + i, bf16), mm), floor)));
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
void block_max(const void *x, long xs, long R, long V, long B, float *out, long nb, int bf16, int threads) {
    const long S = V / B, body = S & ~7L;
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    for (long r = 0; r < R; r++) {
        const long base = r * xs;
        float *o = out + r * nb;
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

/* vals[r, :], ids[r, :] = the `width` largest values of row r, descending, and their token ids; among equal values
 * the smaller id first (so the set and its order are a function of the row alone). One pass: a min-heap of the
 * best `width` so far, and 8 lanes at a time compared with its smallest, which only a few of a row's values beat.
 * NaNs are never taken. width <= V; scratch: width items per thread, on the stack below 4096. */
void top_values(const void *x, long xs, long R, long V, long width, float *vals, long *ids, int bf16, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    for (long r = 0; r < R; r++) {
        item_t heap[width];
        const long base = r * xs;
        for (long i = 0; i < width; i++) {  /* the first width values seed it (NaN: -inf, ranked last) */
            float v = widen(x, base + i, bf16);
            heap[i] = (item_t){v == v ? v : -INFINITY, i};
        }
        for (long at = width / 2 - 1; at >= 0; at--) sift_down(heap, width, at);
        long i = width;
        for (; i + 8 <= V; i += 8) {  /* 8 lanes against the smallest kept: only the lanes above it are offered */
            int m = _mm256_movemask_ps(_mm256_cmp_ps(load8(x, base + i, bf16), _mm256_set1_ps(heap[0].v), _CMP_GT_OQ));
            for (; m; m &= m - 1)
                offer(heap, width, widen(x, base + i + __builtin_ctz(m), bf16), i + __builtin_ctz(m));
        }
        for (; i < V; i++) offer(heap, width, widen(x, base + i, bf16), i);
        qsort(heap, width, sizeof(item_t), ranks_first);
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
