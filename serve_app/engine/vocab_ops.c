/* The sampling path's passes over a vocabulary, one C call each: a row's logsumexp, its block maxima, its top values,
 * a cut below a floor, top-k / top-p's floor, and the coupled sampler's Gumbel-max choice; and whole decisions a row
 * at a time while it sits in the core's cache: warping (`warp_rows`), the draft's sampled choice and proposal
 * (`draft_sample`), the target's test and choice (`verify_rows`).
 *
 * A sampled row at a 128k vocabulary spends its time in a few whole-row passes (`sampling.py`): torch's
 * logsumexp is four of them (max, subtract into a new tensor, exp, sum) and a strided block max one more
 * at a reduction's speed, and a row's top 64 candidates (block maxima, a top-k of them, a gather, a top-k
 * again) cost a millisecond and a half at batch 32. At batch 32, fixed:4 they made two thirds of a top-p step's
 * sampling time. Here the logsumexp reads a row twice (its max, then the sum of exp(x - max), the row still in
 * cache) and writes nothing; the block maxima and the top values are one streaming pass each. Calling these one
 * after another still streamed each row from memory four or five times and wrote a float32 copy of it: the whole
 * decisions below read a row once, and the target's never writes its warped row out (a top-p step at 128k and batch
 * 32 went from ~1.6x a greedy step's time to ~1.3x).
 *
 * Where the CPU has AVX-512 the exp, log, hash and scans run 16 lanes at a time, lane by lane the same operations
 * as the 8-lane code, so the same bits (`use_wide_lanes` switches them, for the tests).
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

/* The largest of V values from element base (NaN skipped), and whether any is NaN (*nan). Four running maxima
 * (a max waits ~4 cycles for the one before it: one chain would take a 128k row at a quarter of the pace); the
 * largest is the same whichever order finds it. */
static inline float row_max(const void *x, long base, long V, int bf16, int *nan) {
    const long body = V & ~7L, quad = V & ~31L;
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0, bad = _mm256_setzero_ps();
    long i = 0;
    for (; i < quad; i += 32) {
        __m256 a = load8(x, base + i, bf16), b = load8(x, base + i + 8, bf16), c = load8(x, base + i + 16, bf16),
               d = load8(x, base + i + 24, bf16);
        const __m256 ab = _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)),
                     cd = _mm256_or_ps(_mm256_cmp_ps(c, c, _CMP_UNORD_Q), _mm256_cmp_ps(d, d, _CMP_UNORD_Q));
        bad = _mm256_or_ps(bad, _mm256_or_ps(ab, cd));
        m0 = _mm256_max_ps(a, m0);  /* max(v, m) keeps m where v is NaN */
        m1 = _mm256_max_ps(b, m1);
        m2 = _mm256_max_ps(c, m2);
        m3 = _mm256_max_ps(d, m3);
    }
    for (; i < body; i += 8) {
        __m256 v = load8(x, base + i, bf16);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m0 = _mm256_max_ps(v, m0);
    }
    float m = hmax8(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    *nan = _mm256_movemask_ps(bad) != 0;
    for (; i < V; i++) {
        float v = widen(x, base + i, bf16);
        *nan |= v != v;
        m = v > m ? v : m;
    }
    return m;
}

#define T512 __attribute__((target("avx512f,avx512bw,avx2,fma")))
static int wide_lanes;  /* set once by the library's constructor: this CPU runs the 16-lane loops (AVX-512) */
__attribute__((constructor)) static void detect_lanes(void) {
    __builtin_cpu_init();
    wide_lanes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

/* Tests compare the two widths: on = 0 keeps to 8 lanes, 1 uses 16 where the CPU has them. Returns the setting
 * before. */
int use_wide_lanes(int on) {
    const int before = wide_lanes;
    __builtin_cpu_init();
    wide_lanes = on && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    return before;
}

/* exp8 on 16 lanes (AVX-512) of d in [-87, 0] (a logsumexp's terms, less the max and clamped): exp8's operations
 * but its clamps, which change nothing there, so the same bits as exp8's */
T512 static inline __m512 exp16(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_POLY[i]));
    y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* row_logsumexp's chunk loop 16 lanes at a time: exp16 of 16 terms, added to the 8-lane sum as its two halves in
 * order (a half all at the clamp adds nothing, as in the 8-lane loop), so every lane sums the same terms in the same
 * order as the 8-lane loop: the same bits. Returns where the 8-lane loop goes on. */
T512 static long lse16(const void *x, long base, long i, long end, float m, __m256 *acc, int bf16) {
    const __m512 mm = _mm512_set1_ps(m), floor = _mm512_set1_ps(-87.0f);
    __m256 a = *acc;
    for (; i + 16 <= end; i += 16) {
        __m512 v = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                              _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + base + i))), 16))
                        : _mm512_loadu_ps((const float *)x + base + i);
        __m512 d = _mm512_max_ps(_mm512_sub_ps(v, mm), floor);
        const __mmask16 live = _mm512_cmp_ps_mask(d, floor, _CMP_GT_OQ);
        if (!live) continue;
        __m512 e = exp16(d);
        if (live & 0xff) a = _mm256_add_ps(a, _mm512_castps512_ps256(e));
        if (live >> 8) a = _mm256_add_ps(a, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    *acc = a;
    return i;
}

/* out[r] = log(sum(exp(x[r, :]))): -inf for a row of -inf, +inf where the row holds +inf, NaN where it holds NaN.
 * exp(x - max) is clamped below at exp(-87) (a normal float: no denormals, which CPUs handle ~25x slower);
 * against the row max's exp(0) = 1 the at most V * 1.7e-38 this adds is far below a float32 ulp. Eight terms all at
 * the clamp add nothing and take no exp (most of a row top-k or top-p cut to -inf). Each CHUNK of terms is summed
 * in 8 float32 lanes, the chunks' sums in double: within a few float32 ulps of the exact sum. */
void row_logsumexp(const void *x, long xs, long R, long V, float *out, int bf16, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    for (long r = 0; r < R; r++) {
        const long body = V & ~7L, base = r * xs;
        int nan;
        const float m = row_max(x, base, V, bf16, &nan);
        if (nan) { out[r] = NAN; continue; }
        if (isinf(m)) { out[r] = m; continue; }  /* every term -inf (an empty row), or an infinite logit */
        const __m256 mm = _mm256_set1_ps(m), floor = _mm256_set1_ps(-87.0f);
        double total = 0.0;
        for (long c = 0; c < body; c += CHUNK) {
            const long end = c + CHUNK < body ? c + CHUNK : body;
            __m256 acc = _mm256_setzero_ps();
            long i = c;
            if (wide_lanes) i = lse16(x, base, i, end, m, &acc, bf16);
            for (; i < end; i += 8) {
                __m256 d = _mm256_max_ps(_mm256_sub_ps(load8(x, base + i, bf16), mm), floor);
                if (_mm256_movemask_ps(_mm256_cmp_ps(d, floor, _CMP_GT_OQ))) acc = _mm256_add_ps(acc, exp8(d));
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

/* The 8-lane scan below, 16 lanes at a time where the CPU has AVX-512 (`top_items` asks `wide_lanes`): the same
 * values offered in the same order (a lane the stale smallest lets through is offered, and `offer` compares again),
 * so the same heap; at a 128k vocabulary the scan is ~1.6x faster. Returns where the 8-lane loop goes on. */
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


/* heap[0 .. width) = the `width` largest values of the row at x + base (in heap order), with their ids; among equal
 * values the smaller id ranks first. One pass: a min-heap of the best `width` so far, and 8 lanes at a time compared
 * with its smallest, which only a few of a row's values beat. NaNs are never taken. width <= V. */
static void heap_items(const void *x, long base, long V, long width, item_t *heap, int bf16) {
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
}

/* 16 lanes at a time (AVX-512) for `bounded_items`: lane[j] = max(lane[j], the row's values j, j + W, ...) over
 * `slices` slices of W (a multiple of 16), and the values >= t0 with their ids, in order, into found (from *n), up to
 * cap; returns where the 8-lane loop goes on, -1 past cap. The same lanes and values as the 8-lane loops. */
T512 static inline __m512 load16(const void *x, long i, int bf16) {
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                      _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i))), 16))
                : _mm512_loadu_ps((const float *)x + i);
}

T512 static void lane_max16(const void *x, long base, long W, long slices, float *lane, int bf16) {
    if (W == 128) {  /* width 64's lanes: in eight registers, not memory */
        __m512 m[8];
        for (int j = 0; j < 8; j++) m[j] = _mm512_loadu_ps(lane + 16 * j);
        for (long s = 0; s < slices; s++)
            for (int j = 0; j < 8; j++) m[j] = _mm512_max_ps(load16(x, base + s * 128 + 16 * j, bf16), m[j]);
        for (int j = 0; j < 8; j++) _mm512_storeu_ps(lane + 16 * j, m[j]);
        return;
    }
    for (long s = 0; s < slices; s++)
        for (long j = 0; j < W; j += 16)
            _mm512_storeu_ps(lane + j, _mm512_max_ps(load16(x, base + s * W + j, bf16), _mm512_loadu_ps(lane + j)));
}

T512 static long at_least16(const void *x, long base, long V, float t0, item_t *found, long *n, long cap, int bf16) {
    const __m512 tv = _mm512_set1_ps(t0);
    long i = 0, k = *n;
    for (; i + 16 <= V; i += 16) {
        __mmask16 m = _mm512_cmp_ps_mask(load16(x, base + i, bf16), tv, _CMP_GE_OQ);
        if (!m) continue;
        if (k + 16 > cap) return -1;
        for (; m; m &= m - 1) found[k++] = (item_t){widen(x, base + i + __builtin_ctz(m), bf16), i + __builtin_ctz(m)};
    }
    *n = k;
    return i;
}

/* `heap_items` with a bound first, which spares the heap nearly all its offers (each a sift through log2(width)
 * levels: ~550 of them at a 128k vocabulary and width 64, most of the pass's time). W strided lanes (lane j holds
 * tokens j, j + W, ...), W twice width rounded up to 16 lanes, each have a largest value: W values, so the width-th
 * largest of them, t0, is at most the width-th largest of the row, and only values >= t0 (~100 of 128k; ~300 with
 * W = width, where t0 is the smallest lane's largest) can be among the largest. Those go to the heap in the order
 * of their ids, as every value does in `heap_items`, so the heap ends the same. Returns 0, having done nothing, where
 * the bound does not pay: a short row, fewer than width lanes above -inf, more than `cap` values >= t0. */
static int bounded_items(const void *x, long base, long V, long width, item_t *heap, int bf16) {
    const long W0 = (width + 15) & ~15L, cap = W0 * 16 > 1024 ? W0 * 16 : 1024;
    const long W = V / (2 * W0) >= 16 ? 2 * W0 : W0;
    const long slices = V / W;
    if (slices < 16) return 0;
    float *lane = malloc(W * sizeof(float));
    for (long j = 0; j < W; j++) lane[j] = -INFINITY;
    if (wide_lanes) lane_max16(x, base, W, slices, lane, bf16);
    else
        for (long s = 0; s < slices; s++)  /* max(v, lane) keeps the lane where v is NaN */
            for (long j = 0; j < W; j += 8)
                _mm256_storeu_ps(lane + j, _mm256_max_ps(load8(x, base + s * W + j, bf16), _mm256_loadu_ps(lane + j)));
    heap_items(lane, 0, W, width, heap, 0);  /* the lanes' width largest: heap[0] the smallest of them */
    const float t0 = heap[0].v;
    free(lane);
    if (!(t0 > -INFINITY)) return 0;
    item_t *found = malloc(cap * sizeof(item_t));
    long n = 0, i = 0;
    if (wide_lanes && (i = at_least16(x, base, V, t0, found, &n, cap, bf16)) < 0) { free(found); return 0; }
    const __m256 tv = _mm256_set1_ps(t0);
    for (; i + 8 <= V; i += 8) {
        int m = _mm256_movemask_ps(_mm256_cmp_ps(load8(x, base + i, bf16), tv, _CMP_GE_OQ));
        if (m && n + 8 > cap) { free(found); return 0; }
        for (; m; m &= m - 1) found[n++] = (item_t){widen(x, base + i + __builtin_ctz(m), bf16), i + __builtin_ctz(m)};
    }
    for (; i < V; i++) {
        const float v = widen(x, base + i, bf16);
        if (v >= t0) {
            if (n == cap) { free(found); return 0; }
            found[n++] = (item_t){v, i};
        }
    }
    /* n >= W >= width: the lanes' maxima are all >= t0 */
    for (long j = 0; j < width; j++) heap[j] = found[j];
    for (long at = width / 2 - 1; at >= 0; at--) sift_down(heap, width, at);
    for (long j = width; j < n; j++) offer(heap, width, found[j].v, found[j].i);
    free(found);
    return 1;
}

/* heap[0 .. width) = the `width` largest values of the row at x + base, descending, with their ids; among equal
 * values the smaller id first (so the set and its order are a function of the row alone, whichever way found).
 * NaNs are never taken. width <= V. */
static void top_items(const void *x, long base, long V, long width, item_t *heap, int bf16) {
    if (!bounded_items(x, base, V, width, heap, bf16)) heap_items(x, base, V, width, heap, bf16);
    for (long n = width - 1; n > 0; n--) {  /* heapsort: the lowest left goes last, so the highest ends first */
        const item_t low = heap[0];
        heap[0] = heap[n];
        heap[n] = low;
        sift_down(heap, n, 0);
    }
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

/* x / t by a reciprocal and one correction (Markstein's): q0 = x * (1 / t), e = x - q0 t exactly (an FMA), q0 + e / t
 * as q0 + e (1 / t) rounded once (an FMA) is x / t correctly rounded, so IEEE's division's bits, while x and t are
 * far from the ends of float32's range (no underflow or overflow on the way: QUOTIENT_SAFE); ~3x the pace of a
 * division, which has one slow unit per core. Elsewhere (zeros, NaN, infinities, tiny or huge values: 8 or 16
 * lanes holding any) the division itself. */
#define QUOTIENT_SAFE(t) ((t) >= 0x1p-27f && (t) < 0x1p8f)

static inline __m256 quotient8(__m256 v, __m256 tv, __m256 rv, int safe_t) {
    const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
    const __m256 ok = _mm256_and_ps(_mm256_cmp_ps(a, _mm256_set1_ps(0x1p-100f), _CMP_GT_OQ),
                                    _mm256_cmp_ps(a, _mm256_set1_ps(0x1p100f), _CMP_LT_OQ));
    if (!safe_t || _mm256_movemask_ps(ok) != 0xff) return _mm256_div_ps(v, tv);
    const __m256 q0 = _mm256_mul_ps(v, rv);
    return _mm256_fmadd_ps(_mm256_fnmadd_ps(q0, tv, v), rv, q0);
}

T512 static long scale16(const void *x, long base, long V, float tr, float *out, int bf16) {
    const __m512 tv = _mm512_set1_ps(tr), rv = _mm512_set1_ps(1.0f / tr);
    long i = 0;
    for (; i + 16 <= V; i += 16) {
        const __m512 v = load16(x, base + i, bf16), a = _mm512_abs_ps(v);
        const __mmask16 ok = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0x1p-100f), _CMP_GT_OQ) &
                             _mm512_cmp_ps_mask(a, _mm512_set1_ps(0x1p100f), _CMP_LT_OQ);
        __m512 q;
        if (ok == 0xffff) {
            const __m512 q0 = _mm512_mul_ps(v, rv);
            q = _mm512_fmadd_ps(_mm512_fnmadd_ps(q0, tv, v), rv, q0);
        } else {
            q = _mm512_div_ps(v, tv);
        }
        _mm512_storeu_ps(out + i, q);
    }
    return i;
}

/* out[r, :] = x[r, :] / t[r] in float32 (x float32 or bfloat16; out's row stride os; t NULL: x widened alone):
 * torch's `x / t[:, None]` for a float32 t, whose type promotion widens x (exactly) then divides (IEEE's rounding),
 * or `x.float()`: the same bits, in one pass (torch's took ~1.8x as long for 32 rows of a 128k vocabulary). */
void scale_rows(const void *x, long xs, long R, long V, const float *t, float *out, long os, int bf16, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    for (long r = 0; r < R; r++) {
        const float tr = t ? t[r] : 1.0f;  /* x / 1 is x: the widening alone */
        const int safe = QUOTIENT_SAFE(tr);
        const __m256 tv = _mm256_set1_ps(tr), rv = _mm256_set1_ps(1.0f / tr);
        const long body = V & ~7L;
        long i = wide_lanes && safe ? scale16(x, r * xs, body, tr, out + r * os, bf16) : 0;
        for (; i < body; i += 8)
            _mm256_storeu_ps(out + r * os + i, quotient8(load8(x, r * xs + i, bf16), tv, rv, safe));
        for (; i < V; i++) out[r * os + i] = widen(x, r * xs + i, bf16) / tr;
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

/* Cephes' logf polynomial in m - 1, highest degree first (log8 and log16 share it) */
static const float LOG_POLY[9] = {7.0376836292e-2f, -1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f,
                                  1.4249322787e-1f, -1.6668057665e-1f, 2.0000714765e-1f, -2.4999993993e-1f,
                                  3.3333331174e-1f};

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
    __m256 y = _mm256_set1_ps(LOG_POLY[0]);
    for (int i = 1; i < 9; i++) y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(LOG_POLY[i]));
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

/* log8, hash8 and expo8 on 16 lanes (AVX-512): each lane the same operations in the same order, so the same bits */
T512 static inline __m512 log16(__m512 x) {
    const __m512i xi = _mm512_castps_si512(x);
    __m512 e = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(xi, 23), _mm512_set1_epi32(126)));
    __m512 m = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(xi, _mm512_set1_epi32(0x007FFFFF)),
                                                   _mm512_set1_epi32(0x3F000000)));  /* in [0.5, 1) */
    const __mmask16 low = _mm512_cmp_ps_mask(m, _mm512_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
    e = _mm512_mask_sub_ps(e, low, e, _mm512_set1_ps(1.0f));
    m = _mm512_sub_ps(_mm512_mask_add_ps(m, low, m, m), _mm512_set1_ps(1.0f));
    const __m512 z = _mm512_mul_ps(m, m);
    __m512 y = _mm512_set1_ps(LOG_POLY[0]);
    for (int i = 1; i < 9; i++) y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(LOG_POLY[i]));
    y = _mm512_mul_ps(_mm512_mul_ps(y, m), z);
    y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
    y = _mm512_fnmadd_ps(z, _mm512_set1_ps(0.5f), y);
    return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(m, y));
}

T512 static inline __m512i hash16(__m512i id, uint32_t key) {
    __m512i v = _mm512_add_epi32(_mm512_set1_epi32((int)key), _mm512_mullo_epi32(id, _mm512_set1_epi32((int)MULT0)));
    v = _mm512_xor_si512(v, _mm512_srli_epi32(v, 16));
    v = _mm512_mullo_epi32(v, _mm512_set1_epi32((int)MULT1));
    v = _mm512_xor_si512(v, _mm512_srli_epi32(v, 15));
    v = _mm512_mullo_epi32(v, _mm512_set1_epi32((int)MULT2));
    return _mm512_xor_si512(v, _mm512_srli_epi32(v, 16));
}

T512 static inline __m512 expo16(__m512i id, uint32_t key) {
    __m512i h = _mm512_srli_epi32(hash16(id, key), 8);
    __m512 u = _mm512_add_ps(_mm512_cvtepi32_ps(h), _mm512_set1_ps(0.5f));
    return _mm512_sub_ps(_mm512_setzero_ps(), log16(_mm512_mul_ps(u, _mm512_set1_ps(1.0f / 16777216.0f))));
}

/* `gumbel_row`'s bounds of full blocks (below S) 16 at a time from block b: e_min = E / 16, bound -= log e_min, groups
 * of 16 blocks all -inf skipped (as 8 at a time: their bound stays -inf). Returns where the 8-lane loop goes on. */
T512 static long bounds16(float *bound, float *e_min, long b, long S, uint32_t key) {
    for (; b + 16 <= S; b += 16) {
        const __m512 bm = _mm512_loadu_ps(bound + b);
        if (!_mm512_cmp_ps_mask(bm, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ)) continue;
        const __m512i id = _mm512_add_epi32(_mm512_set1_epi32((int)b),
                                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        const __m512 e = _mm512_div_ps(expo16(id, key + SALT_MIN), _mm512_set1_ps((float)GBLOCK));
        _mm512_storeu_ps(e_min + b, e);
        _mm512_storeu_ps(bound + b, _mm512_sub_ps(bm, log16(e)));
    }
    return b;
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

/* argmax over the tokens t of a row of V at x + base of x[t] - log E(t), E the coupled sampler's Exp(1) noise under
 * key (`sampling.gumbel_argmax`, the same Gumbel-max choice): every block's bound max logit - log E_min (one pass for
 * the maxima, one over the blocks), then blocks token by token in descending bound until the next bound is below the
 * best score: the FIRST_BLOCKS highest from a heap, and where those do not settle it (flat rows) every block sorted.
 * A row of -inf (or NaN) gets its first token. */
static long gumbel_row(const void *x, long base, long V, uint32_t key, int bf16) {
    const long S = V / GBLOCK, nb = S + (V % GBLOCK != 0), body = nb & ~7L;
    float *bound = malloc(2 * nb * sizeof(float)), *e_min = bound + nb;
    block_max_row(x, base, V, GBLOCK, bound, bf16);
    const __m256 full = _mm256_set1_ps((float)GBLOCK);
    long b = wide_lanes ? bounds16(bound, e_min, 0, S, key) : 0;
    for (; b < body; b += 8) {  /* blocks below S are full: size 16 */
        /* 8 blocks of -inf (a top-p cut row's nearly all): their bound stays -inf, and they are never scored */
        if (!_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(bound + b), _mm256_set1_ps(-INFINITY), _CMP_NEQ_UQ)))
            continue;
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
    return choice >= 0 ? choice : 0;
}

/* out[r] = row r's `gumbel_row` under keys[r]. */
void gumbel_argmax(const void *x, long xs, long R, long V, const int32_t *keys, long *out, int bf16, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    for (long r = 0; r < R; r++) out[r] = gumbel_row(x, r * xs, V, (uint32_t)keys[r], bf16);
}

/* ---- top-k / top-p: the value a row is cut below (`sampling._truncate`) ---- */
/* How many of the `in_k` candidates (descending) a row keeps: candidate i stays while the mass before it (a running
 * sum in double, each partial rounded to float32, less p_i, as torch's cumsum of float32 rows keeps it) is below
 * top_p, p_i = exp(v_i - norm); at least one. */
static long nucleus(const item_t *top, long in_k, float norm, float top_p) {
    double cum = 0.0;
    long kept = 0;
    for (long i = 0; i < in_k; i++) {
        const float p = exp1(top[i].v - norm);
        cum += (double)p;
        kept += (float)cum - p < top_p;
    }
    return kept > 0 ? kept : 1;
}

/* The smallest value a row of V keeps under top_k (0: off) and top_p, from its `width` largest values (descending):
 * those kept by `nucleus` with norm the whole row's logsumexp (total; top-k's own k values where top-k is on and
 * within the candidates), a candidate i < k at most; NaN where the nucleus may reach past the candidates. */
static float floor_of(const item_t *top, long width, long V, long top_k, float top_p, float total) {
    const long k = top_k > 0 && top_k < V ? top_k : V;
    const int within = k <= width;
    float norm = total;
    if (top_k > 0 && within) {  /* top-k renormalizes over its own k values */
        double s = 0.0;
        const float m = top[0].v;
        for (long i = 0; i < k; i++) s += (double)exp1(top[i].v - m);
        norm = isinf(m) ? m : (float)((double)m + log(s));
    }
    const long kept = nucleus(top, k < width ? k : width, norm, top_p);
    return width == V || within || (kept < width && k == V) ? top[kept - 1].v : NAN;
}

/* `floor_of` a float32 row of V: candidates widen 8x (from 64, or top-k) while the nucleus may reach past them;
 * past `widest` NaN (the caller's torch path takes the row). With `kept` (room for `widest` items; else NULL) also
 * the values the floor keeps, where the candidates hold them all (the next value is below the floor): their ids into
 * kept[0 .. *n_kept), and with `kept_lse` (else NULL) their logsumexp; *n_kept = -1 and *kept_lse NaN where they
 * may not. */
static float row_floor(const float *x, long V, long top_k, float top_p, long widest, item_t *kept, long *n_kept,
                       float *kept_lse) {
    long width = top_k > 0 ? (top_k > 64 ? top_k : 64) : 64;
    width = width < V ? width : V;
    float total = NAN;  /* the whole row's normaliser: only top-p alone reads it (top-k starts within its k) */
    if (top_k <= 0) row_logsumexp(x, V, 1, V, &total, 0, 1);
    if (kept) *n_kept = -1;
    if (kept_lse) *kept_lse = NAN;
    while (width <= widest) {
        item_t *top = malloc(width * sizeof(item_t));
        top_items(x, 0, V, width, top, 0);
        const float f = floor_of(top, width, V, top_k, top_p, total);
        if (kept && f == f && (width == V || top[width - 1].v < f) && isfinite(top[0].v)) {
            double s = 0.0;
            long n = 0;
            for (; n < width && top[n].v >= f; n++) {
                if (kept_lse) s += (double)exp1(top[n].v - top[0].v);
                kept[n] = top[n];
            }
            *n_kept = n;
            if (kept_lse) *kept_lse = (float)((double)top[0].v + log(s));
        }
        free(top);
        if (f == f || width == widest) return f;
        width = width * 8 < V ? width * 8 : V;
        width = width < widest ? width : widest;
    }
    return NAN;
}

/* floor[r] = row r's `row_floor` under top_k[r] and top_p[r]. x: float32 rows. */
void top_p_floor(const float *x, long xs, long R, long V, const long *top_k, const float *top_p, float *floor,
                 long widest, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    for (long r = 0; r < R; r++) floor[r] = row_floor(x + r * xs, V, top_k[r], top_p[r], widest, NULL, NULL, NULL);
}

/* ---- warping in one call (`sampling.warp_`) ---- */
/* out[r, :] = row r of x divided by t[r] (t NULL: widened alone), cut below its top-k / top-p floor where cut[r]
 * (floor[r]: `row_floor`'s, -inf uncut; NaN where the nucleus outgrows `widest`, the row then left uncut for the
 * caller). Each row is scaled, searched and cut while it sits in the core's cache, where scale_rows, top_p_floor and
 * cut_below one after another stream the whole block from memory three times: the same bits, faster. out may be x
 * itself (float32 rows, changed in place). */
void warp_rows(const void *x, long xs, long R, long V, const float *t, const int32_t *cut, const long *top_k,
               const float *top_p, float *out, long os, float *floor, long widest, int bf16, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    for (long r = 0; r < R; r++) {
        float *row = out + r * os;
        scale_rows((const char *)x + r * xs * (bf16 ? 2 : 4), xs, 1, V, t ? t + r : NULL, row, os, bf16, 1);
        floor[r] = -INFINITY;
        if (cut[r]) {
            floor[r] = row_floor(row, V, top_k[r], top_p[r], widest, NULL, NULL, NULL);
            if (floor[r] == floor[r]) cut_below(row, os, 1, V, floor + r, 1);
        }
    }
}

/* ---- the target's decision for a sampled row (`sampling.verify_walk`) ---- */
#define SPARSE 256  /* a nucleus of at most this many tokens is scored block by block, the row not cut */
/* `bytes` of this thread's scratch space `slot` (0: a row of floats, 1: a row's kept candidates), kept between calls
 * (the pool's threads live on): a fresh 512 KB block per call would be mapped and faulted in page by page. */
static void *scratch(int slot, long bytes) {
    static __thread void *space[2] = {NULL, NULL};
    static __thread long size[2] = {0, 0};
    if (size[slot] < bytes) {
        free(space[slot]);
        space[slot] = malloc(bytes);
        size[slot] = bytes;
    }
    return space[slot];
}

/* Block by block (`gumbel_row`'s blocks) the tokens of a float32 row that share a block with one of kept[0 .. n):
 * each block holding one visited once (its id into blocks[], their count returned), its tokens below f cut. */
static long kept_blocks(float *row, long V, float f, const item_t *kept, long n, long *blocks) {
    const long S = V / GBLOCK;
    long nb = 0;
    for (long i = 0; i < n; i++) {
        const long b = kept[i].i < GBLOCK * S ? kept[i].i % S : S, size = b < S ? GBLOCK : V % GBLOCK;
        long seen = 0;
        while (seen < nb && blocks[seen] != b) seen++;
        if (seen < nb) continue;
        blocks[nb++] = b;
        for (long t = 0; t < size; t++) {
            const long tok = b < S ? b + t * S : GBLOCK * S + t;
            if (row[tok] < f) row[tok] = -INFINITY;
        }
    }
    return nb;
}

/* `gumbel_row` of a row whose finite values all lie in blocks[0 .. nb) (`kept_blocks`: a nucleus of a few tokens,
 * the rest of the row not cut, never read): only those blocks can hold the winner, so only they are scored. The
 * same scores and tie order, so the same choice, without a pass over the row. */
static long sparse_gumbel(const float *row, long V, const long *blocks, long nb, uint32_t key) {
    const long S = V / GBLOCK;
    long choice = -1;
    float best = -INFINITY;
    for (long i = 0; i < nb; i++) {
        const long size = blocks[i] < S ? GBLOCK : V % GBLOCK;
        float e[8];  /* the block's E_min, as gumbel_row's 8 lanes make it */
        _mm256_storeu_ps(e, _mm256_div_ps(expo8(_mm256_set1_epi32((int)blocks[i]), key + SALT_MIN),
                                          _mm256_set1_ps((float)size)));
        score_block(row, 0, V, blocks[i], e[0], key, 0, &best, &choice);
    }
    return choice >= 0 ? choice : 0;
}



/* For each row a: the raw logits row rows[a] of x, warped as `warp_rows` warps it (t NULL: unscaled) in a scratch row
 * that stays in the core's cache, then where test[a] the rejection test of the draft's token d[a] against its
 * proposal q (qv / qi [R, n]: `speculative.accept_rejection` with u[a]; accepted[a] = 1 and token[a] = d[a] on
 * acceptance) and on rejection the recovered token, drawn by `gumbel_row` under keys[a] from the residual
 * (`speculative.residual_logits_`); where not test[a] (a seeded row's coupled choice, a bonus token) `gumbel_row`
 * of the warped row. token[a] = -1 where the nucleus outgrows `widest` (the caller's torch path takes the row).
 * The warped rows never reach memory: the passes one by one wrote a float32 copy of every row and read it back
 * three times. x may be float32 or bfloat16 rows; the warped row and the choices are those of `warp_rows` and
 * `gumbel_row`. Where the floor's candidates hold every value it keeps, the kept values' logsumexp comes from them
 * (a few float32 ulps from `row_logsumexp` of the cut row), and where they are few (the usual nucleus, up to SPARSE)
 * the rest of the row is never cut nor read again: the choice comes from their blocks alone (`sparse_gumbel`), so a
 * row costs its scaling, its floor's two passes and nothing after. A wider nucleus is cut at once, before a residual
 * lowers kept values below the floor. A row with nothing to warp, cut or test is chosen from x as it
 * is. The test's probabilities and the residual use libm's expf / logf (within an ulp of torch's). */
void verify_rows(const void *x, long xs, long V, const long *rows, long R, const float *t, const int32_t *cut,
                 const long *top_k, const float *top_p, const int32_t *test, const long *d, const float *qv,
                 const int32_t *qi, long n, const float *u, const int32_t *keys, long *token, int32_t *accepted,
                 long widest, int bf16, int threads) {
    #pragma omp parallel num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS)
    {
        float *row = scratch(0, V * sizeof(float));
        item_t *kept = scratch(1, widest * sizeof(item_t));
        long blocks[SPARSE];
        #pragma omp for schedule(static)
        for (long a = 0; a < R; a++) {
            accepted[a] = 0;
            if (!t && !cut[a] && !test[a]) {  /* nothing to warp or test: the choice over the logits as they are */
                token[a] = gumbel_row(x, rows[a] * xs, V, (uint32_t)keys[a], bf16);
                continue;
            }
            scale_rows((const char *)x + rows[a] * xs * (bf16 ? 2 : 4), xs, 1, V, t ? t + a : NULL, row, V, bf16, 1);
            token[a] = -1;
            float f = -INFINITY, lse = NAN;  /* the floor, and where known the kept values' logsumexp */
            long n_kept = -1, nb = -1;  /* the kept values' count where all are among the floor's candidates (in
                                           kept), and the blocks they lie in where few: only those cut and scored */
            if (cut[a]) {
                f = row_floor(row, V, top_k[a], top_p[a], widest, kept, &n_kept, test[a] ? &lse : NULL);
                if (f != f) continue;
                if (n_kept >= 0 && n_kept <= SPARSE) nb = kept_blocks(row, V, f, kept, n_kept, blocks);
                else cut_below(row, V, 1, V, &f, 1);  /* now, before a residual lowers kept values below f */
            }
            if (test[a]) {
                if (lse != lse) row_logsumexp(row, V, 1, V, &lse, 0, 1);  /* not from the candidates: the cut row's */
                const float *q = qv + a * n;
                const int32_t *ids = qi + a * n;
                float q_x = 0.0f;
                for (long j = 0; j < n; j++) q_x += ids[j] == d[a] ? q[j] : 0.0f;
                const float x_d = row[d[a]] < f ? -INFINITY : row[d[a]];
                if (u[a] * q_x < expf(x_d - lse)) {  /* accepted: the warped row is not needed further */
                    accepted[a] = 1;
                    token[a] = d[a];
                    continue;
                }
                /* the residual max(0, p - q) on q's support (q = 0: padding, left as it is); a row with no residual
                 * mass keeps p; repeated ids take the smaller logit */
                float old[n], r[n], held_p = 0.0f, mass = 0.0f;
                for (long j = 0; j < n; j++) {
                    old[j] = row[ids[j]] < f ? -INFINITY : row[ids[j]];  /* the row may not be cut yet */
                    const float p = expf(old[j] - lse), rj = p - q[j];
                    r[j] = q[j] > 0 && rj > 0 ? rj : 0.0f;
                    held_p += q[j] > 0 ? p : 0.0f;
                    mass += r[j];
                }
                const float off = 1.0f - held_p > 0 ? 1.0f - held_p : 0.0f;
                const int empty = mass + off <= 0;
                for (long j = 0; j < n; j++) {
                    const float v = empty || !(q[j] > 0) ? old[j] : logf(r[j]) + lse;
                    row[ids[j]] = v < row[ids[j]] ? v : row[ids[j]];
                }
            }
            /* a nucleus of a few tokens: only their blocks (the rest of the row never cut); else the whole row, cut */
            token[a] = nb >= 0 ? sparse_gumbel(row, V, blocks, nb, (uint32_t)keys[a])
                               : gumbel_row(row, 0, V, (uint32_t)keys[a], 0);
        }
    }
}

/* ---- the draft's sampled choice (`sampling.draft_choice`) ---- */
/* For each row r = rows[a]: q over the row's n most likely tokens, divided by t[r], cut by its top-k / top-p
 * (where cut[r]; `row_floor` on those n values) and renormalized (softmax), into values[r, :] and their ids into
 * ids[r, :] (descending; cut tokens keep their id with q 0); token[r] = the id at the first position whose running
 * sum of q exceeds u[r] times the whole sum (inverse-CDF, `speculative.sample`). A row whose largest value is not
 * finite (every token masked, or NaN) is left to the caller: token[r] = -1; returns how many were. Any q is exact
 * for rejection sampling as long as the target verifies against it, so these bits need not be torch's softmax's. */
long draft_sample(const void *x, long xs, long V, const long *rows, long R, long n, const float *t,
                  const int32_t *cut, const long *top_k, const float *top_p, const float *u, long *token,
                  float *values, int32_t *ids, int bf16, int threads) {
    long left = 0;
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= MANY_ELEMENTS) \
        reduction(+ : left)
    for (long a = 0; a < R; a++) {
        const long r = rows[a];
        item_t heap[n];
        float v[n], *q = values + r * n;
        top_items(x, r * xs, V, n, heap, bf16);
        for (long j = 0; j < n; j++) v[j] = heap[j].v / t[r];
        token[r] = -1;
        if (!isfinite(v[0])) {
            left++;
            continue;
        }
        float f = -INFINITY;
        if (cut[r]) {  /* `row_floor` of the n values, which are their own candidates, in order */
            item_t top[n];
            float total = NAN;
            for (long j = 0; j < n; j++) top[j] = (item_t){v[j], j};
            if (top_k[r] <= 0) row_logsumexp(v, n, 1, n, &total, 0, 1);
            f = floor_of(top, n, n, top_k[r], top_p[r], total);
        }
        double s = 0.0;
        for (long j = 0; j < n; j++) {  /* a cut or masked (-inf) token: q exactly 0, as softmax gives it */
            q[j] = v[j] >= f && v[j] > -INFINITY ? exp1(v[j] - v[0]) : 0.0f;
            s += (double)q[j];
            ids[r * n + j] = (int32_t)heap[j].i;
        }
        double cum = 0.0;  /* the cdf as torch's cumsum of float32 keeps it: a double sum, each partial rounded */
        for (long j = 0; j < n; j++) {
            q[j] = (float)((double)q[j] / s);
            cum += (double)q[j];
        }
        const float target = u[r] * (float)cum;
        long at = 0;
        for (cum = 0.0; at < n - 1 && (float)(cum += (double)q[at]) <= target; at++) {}
        token[r] = heap[at].i;
    }
    return left;
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
