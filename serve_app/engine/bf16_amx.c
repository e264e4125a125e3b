/* y[M, N] = x[M, K] . W[N, K]^T (+ b[N]) on Intel AMX (tdpbf16ps): bfloat16 activations and weights, float32
 * sums, bfloat16 out. The weights come packed as `bf16_dot.c` takes them, wb[N / 16][K / 2][16][2], which is AMX's
 * B operand as it is: 16 k pairs of one block are a 16 x 64-byte tile, rows 64 bytes apart.
 *
 * Why beside bf16_dot: on a 2-core Xeon with AMX (this project's other 2-core machine), vdpbf16ps pays for every
 * row it adds (SmolLM2-135M's gate and up, 576 x 3072, its weights in cache: 55 us at 1 row, 177 at 8, 603 at 32),
 * while one tdpbf16ps multiplies up to 16 rows by a 32 x 16 block (58 / 63 / 103 us; oneDNN's AMX product 150 /
 * 161 / 186 us, and it depends on the batch). From memory (a model's layers, 15-20 GB/s on that VM) 60 such
 * weights take 174 us each at 8 rows, 225 at 32.
 *
 * Up to 16 rows, a thread walks 4 blocks of 16 outputs at a time (C tiles 0-3); past 16, 2 blocks and two row blocks
 * of 16, so each B tile loaded feeds both (C tiles 0-3 again, two A tiles): 15% less at 17-32 rows.
 *
 * Batch-invariant by construction: y[m, n] is one chain of tdpbf16ps over its k tiles in order (each row's sums
 * are its own: the tile's other rows never enter them), plus the bias, rounded once to bfloat16, in every row
 * count and thread count. Not the same bits as bf16_dot (the instruction sums a tile's 16 pairs its own way).
 *
 * K must be a multiple of 32 (the caller keeps bf16_dot otherwise). Each call configures its threads' tiles; the
 * process asks Linux for AMX's state once (`bf16_amx_init`).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16_put.h"

#define GROUP 4
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))

/* 0 where this process may use AMX's tiles (Linux hands out their state on request). */
int bf16_amx_init(void) {
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

/* The tiles for `rows` rows at once: up to 16, C0-C3 and A (tmm0-4) of that many rows and B (tmm5-6) of 16 k pairs;
 * 17-32, two row blocks against two column blocks: C (tmm0-1: the first 16 rows, tmm2-3: the rest), A (tmm4: the
 * first rows, tmm5: the rest), B (tmm6-7). */
TARGET static void configure(int rows) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64;
    if (rows <= 16) {  /* tmm7 unused: a tile with columns must have rows, so it has neither */
        for (int t = 0; t < 7; t++) c.rows[t] = (uint8_t)(t < 5 ? rows : 16);
        c.colsb[7] = 0;
    } else {
        const uint8_t rest = (uint8_t)(rows - 16), r[8] = {16, 16, rest, rest, 16, rest, 16, 16};
        memcpy(c.rows, r, 8);
    }
    _tile_loadconfig(&c);
}

/* A stored C tile (acc: `rows` rows of 16 float32 sums) of output block j into y's rows from m. */
TARGET static inline void out(const float *acc, int rows, uint16_t *y, long ys, long m, long j, long N, const float *b) {
    const long n0 = j * BLOCK, nn = N - n0 < BLOCK ? N - n0 : BLOCK;
    for (int r = 0; r < rows; r++) put(y + (m + r) * ys + n0, _mm512_loadu_ps(acc + r * BLOCK), b ? b + n0 : 0, nn);
}

/* block g's k tile t into B tile bt (5 and 6 in turn: one loads while the other multiplies), times A into C g */
#define DP(g, bt) if (G > g) { _tile_loadd(bt, w + (g) * stride + t * 16 * 2 * BLOCK, 64); _tile_dpbf16ps(g, 4, bt); }
#define OUT(g) if (G > g) { _tile_stored(g, acc, 64); out(acc, R, y, ys, m, j0 + (g), N, b); }

/* R (<= 16) rows from m against G (<= 4) blocks from j0. */
TARGET static inline __attribute__((always_inline)) void tile(const int G, int R, const uint16_t *x, long xs,
        long KT, const uint16_t *wb, long j0, long N, const float *b, uint16_t *y, long ys, long m) {
    float acc[16 * BLOCK];
    const long stride = KT * 32 * BLOCK;  /* one block's packed weights, in bfloat16s */
    const uint16_t *w = wb + j0 * stride;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (long t = 0; t < KT; t++) {
        _tile_loadd(4, x + m * xs + t * 32, xs * 2);
        DP(0, 5) DP(1, 6) DP(2, 5) DP(3, 6)
    }
    OUT(0) OUT(1) OUT(2) OUT(3)
}

/* 17-32 rows from m against blocks j0 and j0 + 1: each B tile feeds both row blocks (R: all the rows). */
TARGET static void tile22(int R, const uint16_t *x, long xs, long KT, const uint16_t *wb, long j0, long N,
                          const float *b, uint16_t *y, long ys, long m) {
    float acc[16 * BLOCK];
    const long stride = KT * 32 * BLOCK;
    const uint16_t *w = wb + j0 * stride;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (long t = 0; t < KT; t++) {
        _tile_loadd(4, x + m * xs + t * 32, xs * 2);
        _tile_loadd(5, x + (m + 16) * xs + t * 32, xs * 2);
        _tile_loadd(6, w + t * 16 * 2 * BLOCK, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(7, w + stride + t * 16 * 2 * BLOCK, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, acc, 64); out(acc, 16, y, ys, m, j0, N, b);
    _tile_stored(1, acc, 64); out(acc, 16, y, ys, m, j0 + 1, N, b);
    _tile_stored(2, acc, 64); out(acc, R - 16, y, ys, m + 16, j0, N, b);
    _tile_stored(3, acc, 64); out(acc, R - 16, y, ys, m + 16, j0 + 1, N, b);
}

/* x: M rows of K bfloat16 (K a multiple of 32), row stride xs; wb: packed weights of N outputs; b: float32 bias
 * padded to whole blocks, or NULL; y: M rows of N bfloat16, row stride ys. Groups of blocks split over OpenMP
 * threads; each thread walks its group's rows (the group's weights stay in its cache). */
TARGET void bf16_amx(const uint16_t *x, long M, long K, long xs, const uint16_t *wb, long N, const float *b,
                     uint16_t *y, long ys, int threads) {
    const long KT = K / 32, blocks = (N + BLOCK - 1) / BLOCK;
    /* up to 16 rows: 4 blocks a tile walk; more: 2 blocks, so each B tile feeds two row blocks */
    const long per = M <= 16 ? GROUP : 2, groups = (blocks + per - 1) / per;
    /* configured per call: another library's AMX code (oneDNN's) may load its own tiles on these threads */
    #pragma omp parallel num_threads(threads)
    {
        int rows = 0;
        #pragma omp for schedule(static)
        for (long g = 0; g < groups; g++) {
            const long j = g * per, G = blocks - j < per ? blocks - j : per;
            for (long m = 0; m < M;) {
                const long left = M - m;
                if (left > 16 && G == 2) {
                    const int R = left < 32 ? (int)left : 32;
                    if (R != rows) { configure(R); rows = R; }
                    tile22(R, x, xs, KT, wb, j, N, b, y, ys, m);
                    m += R;
                    continue;
                }
                const int R = left < 16 ? (int)left : 16;
                if (R != rows) { configure(R); rows = R; }
                if (G == 4) tile(4, R, x, xs, KT, wb, j, N, b, y, ys, m);
                else if (G == 3) tile(3, R, x, xs, KT, wb, j, N, b, y, ys, m);
                else if (G == 2) tile(2, R, x, xs, KT, wb, j, N, b, y, ys, m);
                else tile(1, R, x, xs, KT, wb, j, N, b, y, ys, m);
                m += R;
            }
        }
        if (rows) _tile_release();
    }
}
