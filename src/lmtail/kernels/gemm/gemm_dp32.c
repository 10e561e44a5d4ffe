/* lmtail: the bf16 GEMM in the declared "dp32" order (CPU kernels, all bit-equal).
 *
 * Shape legend: M rows of activations, H hidden (the summed axis), V columns,
 * NB = ceil(H/32) blocks of 32 K-lanes, Kp = 32*NB (H zero-padded), Vp = V rounded up to 32,
 * SW the width of one column strip (16: AVX2 and VDPBF16PS; 32: AVX-512 and plain C).
 *   a    [M, H]      bf16 bits, rows lda apart          activations
 *   w    [H, V]      bf16 bits, rows ldw apart          weight (plain layout), or
 *   wp   [Kp/2, Vp, 2] bf16 bits                        the amx32 packed layout (VNNI pairs,
 *        wp[(k/2)*2*Vp + 2*v + k%2] = w[k, v], 0 past H or V, subnormals stored as signed 0)
 *   out  [M, ldc]    fp32                               out[m*ldc + v] for v < V
 *
 * Numerics (the declaration; docs/gemm.md): for every (m, v) on its own
 *   acc = +0
 *   for block b = 0, 1, ..., NB-1 (lanes k = 32b + i; k >= H is a +0*+0 lane):
 *       t = +0
 *       for j = 0, 1, ..., 15:  t = fma(a[m,32b+2j+1], w[32b+2j+1,v], t)   (odd lane first)
 *                               t = fma(a[m,32b+2j],   w[32b+2j,v],   t)   (then even)
 *       acc = acc + t
 *   out = acc, a NaN stored as 0x7FC00000.
 * Every fma and add rounds once to nearest-even in fp32, then flushes a tiny result to the
 * zero of its sign (FTZ, tininess after rounding, as x86); every input (a, w, t, acc) is
 * read with DAZ (t and acc are FTZ results, never subnormal). This is what VDPBF16PS
 * computes per fp32 lane, one instruction per lane pair j (../shared/probes/dpbf16_order_probe.c).
 * Paths: "avx512bf16" (VDPBF16PS into a zeroed t, acc = acc + t under MXCSR FTZ|DAZ),
 * "avx512" and "avx2" (vector fmas under MXCSR FTZ|DAZ), "c" (plain C: the fma emulated
 * exactly in double, FTZ/DAZ in software). Work units are column tiles of NT columns, each
 * owned by one thread for all M rows; per chunk of KC lanes and per strip of SW columns the
 * weights are widened once into a panel (zero past H and V), then rows go through it in
 * register tiles. acc is parked in a per-thread [M, NT] buffer between blocks (an exact
 * fp32 store and load) and copied to out, NaN canonical, at the end of the tile. AVX2 with
 * fewer than MR rows reads the weight straight into registers, several strips at once
 * (direct_avx2), where the lanes are below H and the strips inside V. VDPBF16PS: dp_strip
 * (M <= 6, and plain weights with M <= 32), dpb_* (more rows: 64-column tiles over all K,
 * see there); every path's lanes hold the same words, so the same steps.
 */
#include "lmtail_kernels.h"

enum { ISA_C = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_BF16 = 3 };
enum { MR = 4, NT = 256, KC = 256, MAXT = LMTAIL_MAXT };
/* direct_avx2's column tiles (fewer than MR rows): rows of w read in runs of 2 KiB per chunk.
 * [1, 2880] x [2880, 25136] on 2 Zen 3 threads (bench_tail --stages): 11.9 ms through the
 * panel, 9.2 ms direct at 256 columns, 8.9 ms at 1024 (amx32's stream path: 7.0 ms). */
enum { NT_DIRECT = 1024 };
/* VDPBF16PS (dp_strip): at most DP_GMAX groups of 32 columns per strip, chunks of DP_KC lanes,
 * tiles of DP_NT1 columns for M <= 2 (a multiple of the strip widths 192 and 96), else NT. */
enum { DP_GMAX = 6, DP_KC = 128, DP_NT1 = 960 };
/* VDPBF16PS with M > 6 packed, M > DPB_PLAIN_M plain (dpb_*): column tiles of DPB_W columns,
 * chunks of DPB_KC lanes, row tiles of at most DPB_R rows. Plain weights with 7..32 rows stay
 * on dp_strip's 256-column tiles (their panel reads each weight row in 128-byte runs at 64
 * columns; measured on Zen 4, 1 thread, ms of CPU: M = 8 23.6 there vs 25.9, M = 32 equal). */
enum { DPB_W = 64, DPB_KC = 512, DPB_R = 3, DPB_PF_TILES = 16, DPB_PLAIN_M = 32 };
/* Threads per call: each thread gets at least MIN_WEIGHT weight elements (256 KiB) */
enum { MIN_WEIGHT = 1 << 17 };


typedef struct {
    const uint16_t *w;  /* plain [H, ldw] or packed [Kp/2, 2*Vp] */
    int packed;
    int64_t ldw, Vp;
    const float *aw;    /* [M, Kp] fp32, DAZ applied, zero past H (emulations) */
    const uint16_t *ab; /* [M, Kp] bf16, DAZ applied, zero past H (VDPBF16PS) */
    float *out;
    int64_t M, H, Kp, V, ldc, sw, ntiles, nt; /* nt: columns per tile (NT or NT_DIRECT) */
    int isa;
    int ahead;          /* claim each tile one ahead (tile_dpb prefetches the next one's lines) */
    int64_t next, done; /* next tile to take, tiles finished (atomic) */
} job_t;

/* w[k, v] in either layout, DAZ applied (0 past H and V). */
static inline uint16_t w_at(const job_t *j, int64_t k, int64_t v) {
    if (k >= j->H || v >= j->V) return 0;
    if (j->packed) return j->w[(k >> 1) * 2 * j->Vp + 2 * v + (k & 1)];
    return daz16(j->w[k * j->ldw + v]);
}

/* ---------------------------------------------------------------- plain C */
/* The fp32 panel of lanes [k0, k0+kc) x strip [c0, c0+sw): p[(k-k0)*sw + c] = w[k, c0+c]
 * widened, DAZ, 0 padded. */
static void panel_f32(const job_t *j, int64_t k0, int64_t kc, int64_t c0, float *p) {
    const int64_t sw = j->sw;
    for (int64_t k = k0; k < k0 + kc; ++k) {
        float *pk = p + (k - k0) * sw;
        if (!j->packed && k < j->H && c0 + sw <= j->V) { /* a whole row of the strip */
            const uint16_t *src = j->w + k * j->ldw + c0;
            for (int64_t c = 0; c < sw; ++c) pk[c] = bf16_daz(src[c]);
            continue;
        }
        for (int64_t c = 0; c < sw; ++c) pk[c] = bf16_to_f32(w_at(j, k, c0 + c));
    }
}

/* One row x sw columns over kc lanes in plain C: acc parked in c[0..sw) (first: from +0). */
static void strip_c(const job_t *j, const float *a, const float *p, int64_t kc, float *c, int first) {
    float t[32];
    const int64_t sw = j->sw;
    for (int64_t b = 0; b < kc; b += 32) {
        for (int64_t v = 0; v < sw; ++v) t[v] = 0.0f;
        for (int64_t i = 0; i < 32; i += 2) {
            const float ao = a[b + i + 1], ae = a[b + i];
            const float *po = p + (b + i + 1) * sw, *pe = p + (b + i) * sw;
            for (int64_t v = 0; v < sw; ++v) {
                t[v] = fma_ftz(ao, po[v], t[v]);
                t[v] = fma_ftz(ae, pe[v], t[v]);
            }
        }
        for (int64_t v = 0; v < sw; ++v) c[v] = add_ftz(first && b == 0 ? 0.0f : c[v], t[v]);
    }
}

/* ---------------------------------------------------------------- AVX2 / AVX-512 */
#if defined(__x86_64__)
#define AVX2 LMTAIL_TARGET_AVX2_FMA
#define AVX512 LMTAIL_TARGET_AVX512
#define BF16 LMTAIL_TARGET_AVX512_BF16

/* panel_f32 with vector loads (the vector paths: MXCSR DAZ reads a subnormal as zero, so
 * the panel may keep it): rows < H of a whole strip, 16 columns per load; the rest (pad
 * rows, a strip past V on a plain weight) element by element. */
static AVX2 void panel_vec(const job_t *j, int64_t k0, int64_t kc, int64_t c0, float *p0) {
    const int64_t sw = j->sw;
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t k = k0; k < k0 + kc; ++k) {
        if (j->packed) { /* the pair (k, k+1): one dword per column; zero past H and V */
            if (k & 1) continue; /* written with its even row */
            const uint16_t *src = j->w + (k >> 1) * 2 * j->Vp + 2 * c0;
            for (int64_t c = 0; c < sw; c += 8) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(src + 2 * c));
                _mm256_store_ps(p0 + (k - k0) * sw + c, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
                _mm256_store_ps(p0 + (k + 1 - k0) * sw + c, _mm256_castsi256_ps(_mm256_and_si256(x, hi)));
            }
            continue;
        }
        if (k >= j->H || c0 + sw > j->V) {
            for (int64_t c = 0; c < sw; ++c) p0[(k - k0) * sw + c] = bf16_to_f32(w_at(j, k, c0 + c));
            continue;
        }
        const uint16_t *src = j->w + k * j->ldw + c0;
        for (int64_t c = 0; c < sw; c += 8) {
            const __m128i x = _mm_loadu_si128((const __m128i *)(src + c));
            _mm256_store_ps(p0 + (k - k0) * sw + c,
                            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16)));
        }
    }
}

/* ROWS rows x 16 columns (2 ymm) over all blocks; MXCSR has FTZ|DAZ; acc parked in c. */
static inline __attribute__((always_inline)) AVX2 void
tile_avx2(const int ROWS, const float *a, int64_t lda, const float *p, int64_t kc, float *c,
          int64_t ldc, int first) {
    for (int64_t b = 0; b < kc; b += 32) {
        __m256 t[MR][2];
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) t[r][0] = t[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 2
        for (int64_t i = b; i < b + 32; i += 2) {
            const __m256 wo0 = _mm256_load_ps(p + (i + 1) * 16), wo1 = _mm256_load_ps(p + (i + 1) * 16 + 8);
            const __m256 we0 = _mm256_load_ps(p + i * 16), we1 = _mm256_load_ps(p + i * 16 + 8);
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; ++r) {
                const __m256 ao = _mm256_broadcast_ss(a + r * lda + i + 1);
                const __m256 ae = _mm256_broadcast_ss(a + r * lda + i);
                t[r][0] = _mm256_fmadd_ps(ae, we0, _mm256_fmadd_ps(ao, wo0, t[r][0]));
                t[r][1] = _mm256_fmadd_ps(ae, we1, _mm256_fmadd_ps(ao, wo1, t[r][1]));
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r)
            for (int q = 0; q < 2; ++q) {
                float *cq = c + r * ldc + 8 * q;
                const __m256 acc = first && b == 0 ? _mm256_setzero_ps() : _mm256_load_ps(cq);
                _mm256_store_ps(cq, _mm256_add_ps(acc, t[r][q]));
            }
    }
}

/* Fewer than MR rows (decode): a tile of ROWS rows has only 2*ROWS t chains, each 32 fmas
 * deep per block, so the fma latency, not its throughput, would bound it. direct_avx2 runs
 * ROWS rows x S strips of 16 columns at once (2*ROWS*S chains) straight from the weight (no
 * panel: each bf16 widened in a register; MXCSR DAZ reads a subnormal as zero), lanes
 * [k0, k0+kc) all < H, columns [c0, c0+16S) all < V. The same steps per element as
 * tile_avx2: t from +0 per block, odd lane then even, acc = acc + t parked in c. */
static inline __attribute__((always_inline)) AVX2 __m256 wide8(const uint16_t *x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)x)), 16));
}

static inline __attribute__((always_inline)) AVX2 void
direct_avx2(const int ROWS, const int S, const job_t *j, const float *a, int64_t lda, int64_t k0, int64_t kc,
            int64_t c0, float *c, int64_t ldc, int first) {
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t b = k0; b < k0 + kc; b += 32) {
        __m256 t[3][4][2];
#pragma GCC unroll 12
        for (int r = 0; r < ROWS; ++r)
            for (int s = 0; s < S; ++s) t[r][s][0] = t[r][s][1] = _mm256_setzero_ps();
        for (int64_t i = b; i < b + 32; i += 2) {
            __m256 wo[4][2], we[4][2];
#pragma GCC unroll 4
            for (int s = 0; s < S; ++s)
                for (int q = 0; q < 2; ++q) {
                    const int64_t col = c0 + 16 * s + 8 * q;
                    if (j->packed) {
                        const uint16_t *px = j->w + (i >> 1) * 2 * j->Vp + 2 * col;
                        if (q == 0) _mm_prefetch((const char *)(px + 16 * 2 * j->Vp), _MM_HINT_T0); /* next block */
                        const __m256i x = _mm256_loadu_si256((const __m256i *)px);
                        we[s][q] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
                        wo[s][q] = _mm256_castsi256_ps(_mm256_and_si256(x, hi));
                    } else {
                        if (q == 0) { /* the next block's rows, these columns (32 bytes) */
                            _mm_prefetch((const char *)(j->w + (i + 32) * j->ldw + col), _MM_HINT_T0);
                            _mm_prefetch((const char *)(j->w + (i + 33) * j->ldw + col), _MM_HINT_T0);
                        }
                        we[s][q] = wide8(j->w + i * j->ldw + col);
                        wo[s][q] = wide8(j->w + (i + 1) * j->ldw + col);
                    }
                }
#pragma GCC unroll 3
            for (int r = 0; r < ROWS; ++r) {
                const __m256 ao = _mm256_broadcast_ss(a + r * lda + i + 1 - k0);
                const __m256 ae = _mm256_broadcast_ss(a + r * lda + i - k0);
#pragma GCC unroll 4
                for (int s = 0; s < S; ++s)
                    for (int q = 0; q < 2; ++q)
                        t[r][s][q] = _mm256_fmadd_ps(ae, we[s][q], _mm256_fmadd_ps(ao, wo[s][q], t[r][s][q]));
            }
        }
#pragma GCC unroll 12
        for (int r = 0; r < ROWS; ++r)
            for (int s = 0; s < S; ++s)
                for (int q = 0; q < 2; ++q) {
                    float *cq = c + r * ldc + 16 * s + 8 * q;
                    const __m256 acc = first && b == k0 ? _mm256_setzero_ps() : _mm256_load_ps(cq);
                    _mm256_store_ps(cq, _mm256_add_ps(acc, t[r][s][q]));
                }
    }
}

/* rows x strips: 1 x 4, 2 x 2, 3 x 2 (8 to 12 chains) */
enum { DIRECT_S1 = 4, DIRECT_S2 = 2, DIRECT_S3 = 2 };
#define DIRECT2_N(R, S)                                                                                \
    static AVX2 __attribute__((noinline)) void direct2_##R(const job_t *j, const float *a, int64_t lda, \
                                                           int64_t k0, int64_t kc, int64_t c0, float *c, \
                                                           int64_t ldc, int first) {                    \
        direct_avx2(R, S, j, a, lda, k0, kc, c0, c, ldc, first);                                        \
    }
DIRECT2_N(1, DIRECT_S1) DIRECT2_N(2, DIRECT_S2) DIRECT2_N(3, DIRECT_S3)
typedef void (*direct_fn)(const job_t *, const float *, int64_t, int64_t, int64_t, int64_t, float *, int64_t, int);
static const direct_fn DIRECT2[MR] = {0, direct2_1, direct2_2, direct2_3};
static const int DIRECT_S[MR] = {0, DIRECT_S1, DIRECT_S2, DIRECT_S3};

#define TILE2_N(R)                                                                          \
    static AVX2 __attribute__((noinline)) void tile2_##R(const float *a, int64_t lda,       \
                                                         const float *p, int64_t kc,       \
                                                         float *c, int64_t ldc, int first) { \
        tile_avx2(R, a, lda, p, kc, c, ldc, first);                                         \
    }
TILE2_N(1) TILE2_N(2) TILE2_N(3) TILE2_N(4)
typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int);
static const tile_fn TILE2[MR + 1] = {0, tile2_1, tile2_2, tile2_3, tile2_4};

/* ROWS rows x 32 columns (2 zmm) over all blocks; MXCSR has FTZ|DAZ; acc parked in c. */
static inline __attribute__((always_inline)) AVX512 void
tile_512(const int ROWS, const float *a, int64_t lda, const float *p, int64_t kc, float *c,
         int64_t ldc, int first) {
    for (int64_t b = 0; b < kc; b += 32) {
        __m512 t[MR][2];
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) t[r][0] = t[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 2
        for (int64_t i = b; i < b + 32; i += 2) {
            const __m512 wo0 = _mm512_load_ps(p + (i + 1) * 32), wo1 = _mm512_load_ps(p + (i + 1) * 32 + 16);
            const __m512 we0 = _mm512_load_ps(p + i * 32), we1 = _mm512_load_ps(p + i * 32 + 16);
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; ++r) {
                const __m512 ao = _mm512_set1_ps(a[r * lda + i + 1]);
                const __m512 ae = _mm512_set1_ps(a[r * lda + i]);
                t[r][0] = _mm512_fmadd_ps(ae, we0, _mm512_fmadd_ps(ao, wo0, t[r][0]));
                t[r][1] = _mm512_fmadd_ps(ae, we1, _mm512_fmadd_ps(ao, wo1, t[r][1]));
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r)
            for (int q = 0; q < 2; ++q) {
                float *cq = c + r * ldc + 16 * q;
                const __m512 acc = first && b == 0 ? _mm512_setzero_ps() : _mm512_load_ps(cq);
                _mm512_store_ps(cq, _mm512_add_ps(acc, t[r][q]));
            }
    }
}

#define TILE512_N(R)                                                                        \
    static AVX512 __attribute__((noinline)) void tile512_##R(const float *a, int64_t lda,   \
                                                             const float *p, int64_t kc,   \
                                                             float *c, int64_t ldc, int first) { \
        tile_512(R, a, lda, p, kc, c, ldc, first);                                          \
    }
TILE512_N(1) TILE512_N(2) TILE512_N(3) TILE512_N(4)
static const tile_fn TILE512[MR + 1] = {0, tile512_1, tile512_2, tile512_3, tile512_4};

/* VDPBF16PS straight from the weight (no panel). A strip is G groups of 32 columns; per lane
 * pair i (rows i, i+1 of w) each group is loaded as two 64-byte rows and interleaved in
 * registers into two VNNI operands (plain layout: vpunpcklwd / vpunpckhwd, the even row's
 * bf16 in the low half of each dword; packed layout: two aligned loads, already pairs). The
 * lanes of the operands are a fixed permutation of the group's columns (dp_col), so t and
 * the parked acc hold the columns in that order and the tile's last copy puts them back.
 * Per block, for each of the R rows: t = +0, 16 VDPBF16PS over pairs i = 0, 2, .., 30 (odd
 * lane then even, DAZ, FTZ: the instruction), then acc = acc + t (vaddps under MXCSR
 * FTZ|DAZ): the declared steps. EDGE: masked loads, zero for a row at or past H or a column
 * at or past V (the tile's last strip, the chunk that holds H). */

/* The column (0..31 within the group) that lane p (0..31: lanes 0..15 of the first operand,
 * 16..31 of the second) of a group holds. */
static inline int dp_col(int packed, int p) {
    if (packed) return p;
    const int x = p & 15; /* unpack lo/hi: lane 4L + i of 128-bit lane L is column 8L + i (+4 for hi) */
    return 8 * (x >> 2) + 4 * (p >> 4) + (x & 3);
}

/* ESTIMATE (llvm-mca, not a measurement) of the pair loop `for i` as gcc 12 -O3 compiles it
 * (one lane pair, all R x G x 2 chains; the prefetch taken), cycles per iteration:
 *                           VDPBF16PS  mca-14 sapphirerapids  mca-19 sapphirerapids  mca-19 znver4
 *   R = 1, G = 6 plain          12            19.1                   36.1                 36.1
 *   R = 2, G = 3 plain          12            12.1                   30.1                 36.1
 *   R = 6, G = 2 plain          24            14.6                   52.1                 72.1
 *   R = 6, G = 2 pair panel     24            12.1                   48.1                 72.1
 *   R = 6, G = 2 packed         24            12.4                   48.1                 72.1
 * The models disagree on VDPBF16PS zmm itself (mca-14 SPR: 2 per cycle; mca-19: 1 per 2
 * cycles on SPR, 1 per 3 on Zen 4; llvm-mca-14 has no znver4 model). Measured on a Zen 4
 * (2 shared, loaded cores, 1 thread, M = 128, alternated with a bare loop of 24 independent
 * VDPBF16PS): 0.49-0.86 ns per VDPBF16PS in the kernel, 0.58-1.30 ns in the bare loop. */
static inline __attribute__((always_inline)) BF16 void
dp_strip(const int R, const int G, const int EDGE, const int PACKED, const job_t *j, const uint16_t *a,
         int64_t lda, int64_t k0, int64_t kc, int64_t c0, float *c, int64_t ldc, int first) {
    const int64_t ldw = PACKED == 1 ? 2 * j->Vp : j->ldw, H = j->H;
    __mmask32 cm[DP_GMAX], cl[DP_GMAX], ch[DP_GMAX]; /* EDGE: columns < V; packed: each half */
    for (int g = 0; g < G; ++g) {
        const int64_t left = j->V - (c0 + 32 * g);
        cm[g] = left >= 32 ? 0xFFFFFFFFu : left <= 0 ? 0 : (__mmask32)((1u << left) - 1);
        cl[g] = left > 0 ? 0xFFFFFFFFu : 0;  /* packed: zero past V up to Vp, no read past Vp */
        ch[g] = left > 16 ? 0xFFFFFFFFu : 0;
    }
    for (int64_t b = k0; b < k0 + kc; b += 32) {
        __m512 t[6][DP_GMAX][2];
        for (int r = 0; r < R; ++r)
            for (int g = 0; g < G; ++g) t[r][g][0] = t[r][g][1] = _mm512_setzero_ps();
        for (int64_t i = b; i < b + 32; i += 2) {
            /* plain: rows i, i+1 at p, p + ldw; packed: the pair row i/2 (32 columns = 64 words) */
            const uint16_t *p = PACKED == 2 ? j->w + ((i - k0) >> 1) * 64 * G
                                : PACKED ? j->w + (i >> 1) * ldw + 2 * c0 : j->w + i * ldw + c0;
            __m512i wl[DP_GMAX], wh[DP_GMAX];
            for (int g = 0; g < G; ++g) {
                if (PACKED == 2) { /* dp_panel's pairs, in the plain layout's lane order */
                    wl[g] = _mm512_load_si512((const void *)(p + 64 * g));
                    wh[g] = _mm512_load_si512((const void *)(p + 64 * g + 32));
                    continue;
                }
                if (PACKED) {
                    wl[g] = EDGE ? _mm512_maskz_loadu_epi16(cl[g], p + 64 * g) : _mm512_loadu_si512((const void *)(p + 64 * g));
                    wh[g] = EDGE ? _mm512_maskz_loadu_epi16(ch[g], p + 64 * g + 32)
                                 : _mm512_loadu_si512((const void *)(p + 64 * g + 32));
                    continue;
                }
                if (!EDGE && i + DP_KC + 1 < H) { /* M <= 6 (no panel): the next chunk's rows, these columns */
                    _mm_prefetch((const char *)(p + DP_KC * ldw + 32 * g), _MM_HINT_T0);
                    _mm_prefetch((const char *)(p + (DP_KC + 1) * ldw + 32 * g), _MM_HINT_T0);
                }
                const __m512i x0 = EDGE ? _mm512_maskz_loadu_epi16(i < H ? cm[g] : 0, p + 32 * g)
                                        : _mm512_loadu_si512((const void *)(p + 32 * g));
                const __m512i x1 = EDGE ? _mm512_maskz_loadu_epi16(i + 1 < H ? cm[g] : 0, p + ldw + 32 * g)
                                        : _mm512_loadu_si512((const void *)(p + ldw + 32 * g));
                wl[g] = _mm512_unpacklo_epi16(x0, x1); /* dword = (w[i, col], w[i+1, col]) */
                wh[g] = _mm512_unpackhi_epi16(x0, x1);
            }
            for (int r = 0; r < R; ++r) {
                uint32_t pair;
                memcpy(&pair, a + r * lda + (i - k0), 4); /* (a[i], a[i+1]): a[i+1] is the odd lane */
                const __m512bh av = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int g = 0; g < G; ++g) {
                    t[r][g][0] = _mm512_dpbf16_ps(t[r][g][0], av, (__m512bh)wl[g]);
                    t[r][g][1] = _mm512_dpbf16_ps(t[r][g][1], av, (__m512bh)wh[g]);
                }
            }
        }
        for (int r = 0; r < R; ++r)
            for (int g = 0; g < G; ++g)
                for (int h = 0; h < 2; ++h) {
                    float *cq = c + r * ldc + 32 * g + 16 * h;
                    const __m512 acc = first && b == 0 ? _mm512_setzero_ps() : _mm512_load_ps(cq);
                    _mm512_store_ps(cq, _mm512_add_ps(acc, t[r][g][h]));
                }
    }
}

typedef void (*dp_fn)(const job_t *, const uint16_t *, int64_t, int64_t, int64_t, int64_t, float *, int64_t, int);
#define DP_N(R, G, E, P)                                                                                     \
    static BF16 __attribute__((noinline)) void dp_##R##_##E##P(const job_t *j, const uint16_t *a, int64_t lda, \
                                                                int64_t k0, int64_t kc, int64_t c0, float *c, \
                                                                int64_t ldc, int first) {                  \
        dp_strip(R, G, E, P, j, a, lda, k0, kc, c0, c, ldc, first);                                        \
    }
#define DP_ROWS(E, P) DP_N(1, 6, E, P) DP_N(2, 3, E, P) DP_N(3, 2, E, P) DP_N(4, 2, E, P) DP_N(5, 2, E, P) \
    DP_N(6, 2, E, P)
/* rows x groups of 32 columns: 1 x 6, 2 x 3, 3..6 x 2 (12 to 24 chains of t) */
DP_ROWS(0, 0) DP_ROWS(1, 0) DP_ROWS(0, 1) DP_ROWS(1, 1) DP_N(3, 2, 0, 2) DP_N(4, 2, 0, 2) DP_N(5, 2, 0, 2)
DP_N(6, 2, 0, 2)
#define DP_TAB(E, P) {0, dp_1_##E##P, dp_2_##E##P, dp_3_##E##P, dp_4_##E##P, dp_5_##E##P, dp_6_##E##P}
static const dp_fn DP[2][2][7] = {{DP_TAB(0, 0), DP_TAB(0, 1)}, {DP_TAB(1, 0), DP_TAB(1, 1)}}; /* [edge][packed][R] */
static const dp_fn DP_PANEL[7] = {0, 0, 0, dp_3_02, dp_4_02, dp_5_02, dp_6_02}; /* R >= 3, G = 2 */
static const int DP_G[7] = {0, 6, 3, 2, 2, 2, 2};

/* The plain weight's lanes [k0, k0+kc) x columns [c0, c0+64) as VNNI pairs, once for all row
 * tiles (M > 6): pp[((i-k0)/2)*128 + 64g + 32h + ..] = the operand dp_strip builds for pair i,
 * group g, half h (vpunpcklwd / vpunpckhwd, zero for a row at or past H or a column at or past
 * V): the same words in the same lanes, so the same steps. The rows [pk0, pk0+kc) x columns
 * [pc0, pc0+64) of the next panel are prefetched meanwhile (pk0 < 0: none): the row tiles'
 * compute then overlaps the next panel's reads. ESTIMATE (llvm-mca, not a measurement) of the
 * pair loop, whole rows and the prefetch taken: 7.1 cycles per pair (mca-14 sapphirerapids),
 * 6.1 (mca-19 sapphirerapids), 5.4 (mca-19 znver4), against 16-24 VDPBF16PS per pair for
 * each of the 2-22 row tiles that read the panel. */
static BF16 void dp_panel(const job_t *j, int64_t k0, int64_t kc, int64_t c0, uint16_t *pp, int64_t pk0,
                          int64_t pc0) {
    const int64_t ldw = j->ldw;
    __mmask32 cm[2];
    for (int g = 0; g < 2; ++g) {
        const int64_t left = j->V - (c0 + 32 * g);
        cm[g] = left >= 32 ? 0xFFFFFFFFu : left <= 0 ? 0 : (__mmask32)((1u << left) - 1);
    }
    for (int64_t i = k0; i < k0 + kc; i += 2) {
        const uint16_t *p = j->w + i * ldw + c0;
        uint16_t *q = pp + ((i - k0) >> 1) * 128;
        const int64_t pk = pk0 + (i - k0);
        if (pk0 >= 0 && pk + 1 < j->H && pc0 + 64 <= j->V) {
            const char *x = (const char *)(j->w + pk * ldw + pc0);
            _mm_prefetch(x, _MM_HINT_T0);
            _mm_prefetch(x + 64, _MM_HINT_T0);
            _mm_prefetch(x + 2 * ldw, _MM_HINT_T0);
            _mm_prefetch(x + 2 * ldw + 64, _MM_HINT_T0);
        }
        const int inside = i + 1 < j->H && cm[1] == 0xFFFFFFFFu; /* plain loads, no mask */
        for (int g = 0; g < 2; ++g) {
            const __m512i x0 = inside ? _mm512_loadu_si512((const void *)(p + 32 * g))
                                      : _mm512_maskz_loadu_epi16(i < j->H ? cm[g] : 0, p + 32 * g);
            const __m512i x1 = inside ? _mm512_loadu_si512((const void *)(p + ldw + 32 * g))
                                      : _mm512_maskz_loadu_epi16(i + 1 < j->H ? cm[g] : 0, p + ldw + 32 * g);
            _mm512_store_si512((void *)(q + 64 * g), _mm512_unpacklo_epi16(x0, x1));
            _mm512_store_si512((void *)(q + 64 * g + 32), _mm512_unpackhi_epi16(x0, x1));
        }
    }
}

/* ---- many rows on VDPBF16PS (dpb_*): column tiles of DPB_W = 64 columns ----
 * Tile t (columns [c0, c0+64), c0 = 64t) for all M rows, chunk by chunk of DPB_KC lanes:
 *   1. dpb_panel: the chunk of the tile's weight as VNNI pairs in natural column order:
 *      pp[((i-k0)/2)*128 + 32q + 2c + e] = w[i+e, c0 + 16q + c] (q = 0..3 the 16-column
 *      quarters, c = 0..15, e = 0 the even lane, 1 the odd), 0 at or past H or V. Plain
 *      layout: two rows interleaved with vpermt2w; packed: the pair row copied as it is (its
 *      words are already these). DPB_KC*128 bytes.
 *   2. dpb_rows: row tiles of R <= DPB_R rows (M split as evenly as can be); per block of 32
 *      lanes, for each row: t = +0, 16 VDPBF16PS over the pairs in order (odd lane then
 *      even, DAZ, FTZ: the instruction), then acc = acc + t (vaddps, MXCSR FTZ|DAZ), acc in
 *      registers over the chunk and parked in a [M, 64] buffer between chunks (an exact
 *      store and load): the declared steps, the same words in the same lanes as every path.
 *   3. at the tile's end acc is stored to out, NaN canonical, columns at or past V masked off.
 * With a packed weight and few row tiles, each block prefetches (into L2) a share of the next
 * chunk's lines (tile_dpb). */
typedef struct { /* the next chunk's weight lines, spread over this chunk's blocks */
    const char *base;  /* NULL: none */
    int64_t stride;    /* bytes between rows (plain: a row of w; packed: a pair row) */
    int64_t rows, lines, per_block; /* rows to fetch, 64-byte lines per row, rows per block */
} dpb_pf;

/* The vpermt2w indices: even row's word c and odd row's word c interleaved, c in the low
 * (q = 0) or high (q = 1) 16 columns of a group of 32. */
static BF16 __m512i dpb_idx(int hi) {
    uint16_t x[32];
    for (int c = 0; c < 16; ++c) {
        x[2 * c] = (uint16_t)(16 * hi + c);
        x[2 * c + 1] = (uint16_t)(32 + 16 * hi + c);
    }
    return _mm512_loadu_si512((const void *)x);
}

static BF16 void dpb_panel(const job_t *j, int64_t c0, int64_t k0, int64_t kc, uint16_t *pp) {
    const int64_t H = j->H, ldw = j->ldw, np = kc / 2, q0 = k0 / 2;
    if (j->packed) {
        const int64_t ld = 2 * j->Vp;
        const int in0 = c0 < j->Vp, in1 = c0 + 32 < j->Vp; /* groups inside Vp (Vp: 32k) */
        for (int64_t q = q0; q < q0 + np; ++q) {
            const uint16_t *src = j->w + q * ld + 2 * c0;
            uint16_t *dst = pp + (q - q0) * 128;
            for (int g = 0; g < 2; ++g) {
                const int in = g ? in1 : in0;
                const __m512i x0 = in ? _mm512_loadu_si512((const void *)(src + 64 * g)) : _mm512_setzero_si512();
                const __m512i x1 = in ? _mm512_loadu_si512((const void *)(src + 64 * g + 32)) : _mm512_setzero_si512();
                _mm512_store_si512((void *)(dst + 64 * g), x0);
                _mm512_store_si512((void *)(dst + 64 * g + 32), x1);
            }
        }
        return;
    }
    const __m512i lo = dpb_idx(0), hi = dpb_idx(1);
    __mmask32 cm[2];
    for (int g = 0; g < 2; ++g) {
        const int64_t left = j->V - (c0 + 32 * g);
        cm[g] = left >= 32 ? 0xFFFFFFFFu : left <= 0 ? 0 : (__mmask32)((1u << left) - 1);
    }
    const int whole = cm[1] == 0xFFFFFFFFu;
    for (int64_t q = q0; q < q0 + np; ++q) {
        const int64_t i = 2 * q;
        const uint16_t *p = j->w + i * ldw + c0;
        uint16_t *dst = pp + (q - q0) * 128;
        const int inside = whole && i + 1 < H;
        for (int g = 0; g < 2; ++g) {
            const __m512i x0 = inside ? _mm512_loadu_si512((const void *)(p + 32 * g))
                                      : _mm512_maskz_loadu_epi16(i < H ? cm[g] : 0, p + 32 * g);
            const __m512i x1 = inside ? _mm512_loadu_si512((const void *)(p + ldw + 32 * g))
                                      : _mm512_maskz_loadu_epi16(i + 1 < H ? cm[g] : 0, p + ldw + 32 * g);
            _mm512_store_si512((void *)(dst + 64 * g), _mm512_permutex2var_epi16(x0, lo, x1));
            _mm512_store_si512((void *)(dst + 64 * g + 32), _mm512_permutex2var_epi16(x0, hi, x1));
        }
    }
}

/* ESTIMATE (llvm-mca, not a measurement) of the pair loop `for i` below as gcc 12 -O3 compiles
 * it for R = 3 (4 panel loads, 3 vpbroadcastd, 12 VDPBF16PS, no spill), cycles per pair:
 * mca-14 sapphirerapids 6.4, mca-19 sapphirerapids 24.1, mca-19 znver4 36.1 (mca-14 has no
 * znver4 model and rejects AVX-512 under znver3). The models' VDPBF16PS zmm throughputs
 * differ (2 per cycle; 1 per 2; 1 per 3). MEASURED on this Zen 4 (CPU time, 1 thread): the
 * same loop alone 0.28-0.29 ns per VDPBF16PS (panel from L2, acc in registers), a bare loop
 * of 24 independent VDPBF16PS 0.28-0.30 ns: the instruction's rate; in the whole GEMM at
 * M = 128 (H = 2880, V = 25136) 0.35-0.39 ns (packed), the rest in the panel, the
 * activations' and the weight's reads. */
static inline __attribute__((always_inline)) BF16 void
dpb_rows(const int R, const uint16_t *pp, const uint16_t *a, int64_t lda, int64_t nb, float *acc,
         int first, dpb_pf pf, int64_t pf_row) {
    __m512 s[DPB_R][4]; /* acc of the R rows x 64 columns, in registers over the chunk */
    for (int r = 0; r < R; ++r)
        for (int q = 0; q < 4; ++q) s[r][q] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + r * DPB_W + 16 * q);
    for (int64_t b = 0; b < nb; ++b) {
        __m512 t[DPB_R][4];
        for (int r = 0; r < R; ++r)
            for (int q = 0; q < 4; ++q) t[r][q] = _mm512_setzero_ps();
        const uint16_t *pb = pp + b * 16 * 128;
        const uint16_t *ab = a + 32 * b;
        for (int64_t i = 0; i < 16; ++i) {
            const __m512bh w0 = (__m512bh)_mm512_load_si512((const void *)(pb + 128 * i));
            const __m512bh w1 = (__m512bh)_mm512_load_si512((const void *)(pb + 128 * i + 32));
            const __m512bh w2 = (__m512bh)_mm512_load_si512((const void *)(pb + 128 * i + 64));
            const __m512bh w3 = (__m512bh)_mm512_load_si512((const void *)(pb + 128 * i + 96));
            for (int r = 0; r < R; ++r) {
                uint32_t pair;
                memcpy(&pair, ab + r * lda + 2 * i, 4); /* (a[2i], a[2i+1]): the odd lane is high */
                const __m512bh av = (__m512bh)_mm512_set1_epi32((int)pair);
                t[r][0] = _mm512_dpbf16_ps(t[r][0], av, w0);
                t[r][1] = _mm512_dpbf16_ps(t[r][1], av, w1);
                t[r][2] = _mm512_dpbf16_ps(t[r][2], av, w2);
                t[r][3] = _mm512_dpbf16_ps(t[r][3], av, w3);
            }
        }
        for (int r = 0; r < R; ++r)
            for (int q = 0; q < 4; ++q) s[r][q] = _mm512_add_ps(s[r][q], t[r][q]); /* acc = acc + t */
        if (pf.base) /* this block's share of the next chunk's weight lines */
            for (int64_t k = pf_row + b * pf.per_block, e = k + pf.per_block; k < e && k < pf.rows; ++k)
                for (int64_t l = 0; l < pf.lines; ++l) _mm_prefetch(pf.base + k * pf.stride + 64 * l, _MM_HINT_T1);
    }
    for (int r = 0; r < R; ++r)
        for (int q = 0; q < 4; ++q) _mm512_store_ps(acc + r * DPB_W + 16 * q, s[r][q]);
}

typedef void (*dpb_fn)(const uint16_t *, const uint16_t *, int64_t, int64_t, float *, int, dpb_pf, int64_t);
#define DPB_N(R)                                                                                        \
    static BF16 __attribute__((noinline)) void dpb_##R(const uint16_t *pp, const uint16_t *a, int64_t lda, \
                                                       int64_t nb, float *acc, int first, dpb_pf pf, int64_t pf_row) { \
        dpb_rows(R, pp, a, lda, nb, acc, first, pf, pf_row);                                                   \
    }
DPB_N(1) DPB_N(2) DPB_N(3)
static const dpb_fn DPB[DPB_R + 1] = {0, dpb_1, dpb_2, dpb_3};

/* acc [M, ldacc] (columns c0 ..) -> out, NaN canonical, columns < V only */
static BF16 void dpb_store(const job_t *j, const float *acc, int64_t ldacc, int64_t M, int64_t c0) {
    const __m512 qnan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000));
    for (int64_t c = 0; c < ldacc; c += 16) {
        const int64_t left = j->V - (c0 + c);
        const __mmask16 cm = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        if (!cm) break;
        for (int64_t r = 0; r < M; ++r) {
            const __m512 x = _mm512_load_ps(acc + r * ldacc + c);
            const __m512 y = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), qnan);
            _mm512_mask_storeu_ps(j->out + r * j->ldc + c0 + c, cm, y);
        }
    }
}

/* The packed weight's lines of chunk [k0, k0+kc) of tile t (its pair rows, 4 lines each),
 * spread over `blocks` blocks; t >= ntiles: none. */
static dpb_pf dpb_prefetch(const job_t *j, int64_t t, int64_t k0, int64_t blocks) {
    dpb_pf pf = {0};
    if (t >= j->ntiles) return pf;
    const int64_t kc = j->Kp - k0 < DPB_KC ? j->Kp - k0 : DPB_KC, c0 = t * j->nt;
    const int64_t nc = j->Vp - c0 < j->nt ? j->Vp - c0 : j->nt;
    pf.base = (const char *)(j->w + (k0 / 2) * 2 * j->Vp + 2 * c0);
    pf.stride = 4 * j->Vp, pf.rows = kc / 2, pf.lines = nc / 16;
    pf.per_block = (pf.rows + blocks - 1) / blocks;
    return pf;
}

/* Tile t (M > 6): columns [c0, c0 + 64), chunk by chunk of DPB_KC lanes: the chunk's panel,
 * then the row tiles. acc [M, 64]. With a packed weight and at most DPB_PF_TILES row tiles
 * (too few VDPBF16PS per chunk to hide the reads), the row tiles prefetch the next chunk's
 * lines (this tile's, or the first chunk of `next`, the tile this thread takes next;
 * >= ntiles: none). Measured on Zen 4, 1 thread, ms of CPU (min of 10, A B B A): packed
 * M = 8 12.4 with it, 20.1 without; M = 128 100.0 / 103.8; plain M = 32 48.4 / 44.5. */
static void tile_dpb(const job_t *j, int64_t t, int64_t next, uint16_t *pp, float *acc) {
    const int64_t c0 = t * DPB_W, M = j->M, tiles = (M + DPB_R - 1) / DPB_R;
    const int pfon = j->packed && tiles <= DPB_PF_TILES;
    for (int64_t k0 = 0; k0 < j->Kp; k0 += DPB_KC) {
        const int64_t kc = j->Kp - k0 < DPB_KC ? j->Kp - k0 : DPB_KC, nbc = kc / 32;
        dpb_panel(j, c0, k0, kc, pp);
        dpb_pf pf = {0};
        if (pfon)
            pf = k0 + DPB_KC < j->Kp ? dpb_prefetch(j, t, k0 + DPB_KC, tiles * nbc)
                                     : dpb_prefetch(j, next, 0, tiles * nbc);
        for (int64_t q = 0, m = 0; q < tiles; ++q) { /* rows m .. m+R-1 */
            const int64_t R = (M - m) / (tiles - q) + ((M - m) % (tiles - q) != 0);
            DPB[R](pp, j->ab + m * j->Kp + k0, j->Kp, nbc, acc + m * DPB_W, k0 == 0, pf, q * nbc * pf.per_block);
            m += R;
        }
    }
    dpb_store(j, acc, DPB_W, M, c0);
}

/* Tile t on VDPBF16PS: rows in tiles of R (M <= 2: one; else 3..6 rows, as even as can be),
 * per chunk of DP_KC lanes: strips of 32*G columns, row tiles inside (a strip's chunk of w
 * stays in L1 over the row tiles); acc [M, ldacc] in dp_col order, copied to out at the end. */
static void tile_dp(const job_t *j, int64_t t, float *acc, int64_t ldacc, uint16_t *pp) {
    const int64_t nt = j->nt, c0 = t * nt, nc = j->V - c0 < nt ? j->V - c0 : nt;
    const int64_t M = j->M, tiles = M <= 2 ? 1 : (M + 5) / 6;
    const int G = DP_G[M <= 2 ? M : 3];
    for (int64_t k0 = 0; k0 < j->Kp; k0 += DP_KC) {
        const int64_t kc = j->Kp - k0 < DP_KC ? j->Kp - k0 : DP_KC;
        const int kedge = k0 + kc > j->H;
        for (int64_t s = 0; s < nc; s += 32 * G) {
            const int edge = kedge || c0 + s + 32 * G > j->V;
            const int panel = tiles > 1 && !j->packed; /* M > 6: the pairs built once */
            job_t jp;
            if (panel) {
                const int last = s + 32 * G >= nc; /* the next panel: next strip, or the next chunk's first */
                dp_panel(j, k0, kc, c0 + s, pp, last ? (k0 + DP_KC < j->Kp ? k0 + DP_KC : -1) : k0,
                         last ? c0 : c0 + s + 32 * G);
                jp = *j;
                jp.w = pp;
            }
            for (int64_t q = 0, m = 0; q < tiles; ++q) { /* rows m .. m+R-1 */
                const int64_t R = (M - m) / (tiles - q) + ((M - m) % (tiles - q) != 0);
                const dp_fn f = panel ? DP_PANEL[R] : DP[edge][j->packed][R];
                f(panel ? &jp : j, j->ab + m * j->Kp + k0, j->Kp, k0, kc, c0 + s, acc + m * ldacc + s, ldacc, k0 == 0);
                m += R;
            }
        }
    }
    for (int64_t m = 0; m < M; ++m)
        for (int64_t p = 0; p < (nc + 31) / 32 * 32; ++p) {
            const int64_t col = (p & ~31) + dp_col(j->packed, (int)(p & 31));
            if (col < nc) j->out[m * j->ldc + c0 + col] = canon_nan(acc[m * ldacc + p]);
        }
}
#endif

/* ---------------------------------------------------------------- one tile */
/* Tile t: all M rows x columns [c0, c0+nc), nc <= nt. panel: KC*sw fp32 (or the bf16 pair
 * panel); acc [M, nt] fp32: the tile's acc, copied to out (NaN canonical) at the end. */
static void tile(const job_t *j, int64_t t, int64_t next, void *panel, float *acc) {
#if defined(__x86_64__)
    if (j->isa == ISA_BF16 && j->nt == DPB_W) {
        tile_dpb(j, t, next, (uint16_t *)panel, acc);
        return;
    }
    if (j->isa == ISA_BF16) {
        tile_dp(j, t, acc, j->nt + 32 * DP_GMAX, (uint16_t *)panel);
        return;
    }
#endif
    const int64_t sw = j->sw, nt = j->nt, c0 = t * nt, nc = j->V - c0 < nt ? j->V - c0 : nt;
    for (int64_t k0 = 0; k0 < j->Kp; k0 += KC) {
        const int64_t kc = j->Kp - k0 < KC ? j->Kp - k0 : KC;
        const int first = k0 == 0;
        int64_t s = 0;
#if defined(__x86_64__)
        if (j->isa == ISA_AVX2 && j->M < MR && k0 + kc <= j->H) { /* decode rows: direct_avx2 */
            const int64_t w16 = 16 * DIRECT_S[j->M];
            for (; s + w16 <= nc; s += w16)
                DIRECT2[j->M](j, j->aw + k0, j->Kp, k0, kc, c0 + s, acc + s, nt, first);
        }
#endif
        for (; s < nc; s += sw) {
#if defined(__x86_64__)
            if (j->isa != ISA_C) panel_vec(j, k0, kc, c0 + s, (float *)panel);
            else
#endif
                panel_f32(j, k0, kc, c0 + s, (float *)panel);
            for (int64_t m = 0; m < j->M; m += MR) {
                const int rows = j->M - m < MR ? (int)(j->M - m) : MR;
                float *c = acc + m * nt + s;
#if defined(__x86_64__)
                if (j->isa == ISA_AVX512)
                    TILE512[rows](j->aw + m * j->Kp + k0, j->Kp, (const float *)panel, kc, c, nt, first);
                else if (j->isa == ISA_AVX2)
                    TILE2[rows](j->aw + m * j->Kp + k0, j->Kp, (const float *)panel, kc, c, nt, first);
                else
#endif
                    for (int r = 0; r < rows; ++r)
                        strip_c(j, j->aw + (m + r) * j->Kp + k0, (const float *)panel, kc, c + nt * r, first);
            }
        }
    }
    for (int64_t m = 0; m < j->M; ++m)
        for (int64_t c = 0; c < nc; ++c) j->out[m * j->ldc + c0 + c] = canon_nan(acc[m * nt + c]);
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    /* round to nearest, exceptions masked; FTZ|DAZ for the vector paths (the plain C path
     * does both in software and needs IEEE subnormals from the hardware) */
    const unsigned csr = lmtail_mxcsr_pin(j->isa == ISA_C ? LMTAIL_MXCSR_IEEE : LMTAIL_MXCSR_FTZ_DAZ);
    void *panel = NULL;
    float *acc = NULL;
    const int64_t np = j->isa == ISA_BF16 && j->nt == DPB_W ? DPB_KC * 128 : (int64_t)sizeof(float) * KC * 32;
    int ok = !posix_memalign(&panel, 64, np) &&
             !posix_memalign((void **)&acc, 64, sizeof(float) * j->M * (j->nt + 32 * DP_GMAX));
    /* a worker without buffers takes no tile; the others take them all. With j->ahead each
     * tile is claimed one ahead, so the one in hand knows the next (tile_dpb prefetches its
     * weight); only where there are many tiles per thread, so no thread idles for it. */
    int64_t t = ok ? __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED) : j->ntiles;
    while (t < j->ntiles) {
        const int64_t next = j->ahead ? __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED) : j->ntiles;
        tile(j, t, next, panel, acc);
        __atomic_fetch_add(&j->done, 1, __ATOMIC_RELAXED);
        t = j->ahead ? next : __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
    }
    lmtail_mxcsr_restore(csr);
    free(panel);
    free(acc);
    return NULL;
}

/* ---------------------------------------------------------------- exported */
/* 1 if this CPU runs `isa`. */
int lmtail_dp32_has(int isa) {
    if (isa == ISA_C) return 1;
    if (isa == ISA_AVX2) return lmtail_cpu_has(LMTAIL_ISA_AVX2);
    if (isa == ISA_AVX512) return lmtail_cpu_has(LMTAIL_ISA_AVX512);
    if (isa == ISA_BF16) return lmtail_cpu_has(LMTAIL_ISA_AVX512 | LMTAIL_CPU_AVX512_BF16);
    return 0;
}

/* out = a @ w in the dp32 order on up to nthreads threads with `isa` (one lmtail_dp32_has
 * accepts). Returns 0 on success, -1 on an unavailable isa, -2 when a buffer cannot be
 * allocated. */
int lmtail_dp32_gemm(const uint16_t *a, int64_t lda, const uint16_t *w, int64_t ldw, int packed,
                     float *out, int64_t M, int64_t H, int64_t V, int64_t ldc, int nthreads,
                     int isa) {
    if (!lmtail_dp32_has(isa)) return -1;
    if (M <= 0 || V <= 0) return 0; /* nothing to write (the decode paths index by M) */
    const int64_t Kp = (H + 31) / 32 * 32;
    job_t j;
    memset(&j, 0, sizeof j);
    j.w = w; j.packed = packed; j.ldw = ldw; j.Vp = (V + 31) / 32 * 32;
    j.out = out; j.M = M; j.H = H; j.Kp = Kp; j.V = V; j.ldc = ldc; j.isa = isa;
    j.sw = isa == ISA_AVX2 || isa == ISA_BF16 ? 16 : 32;
    j.nt = isa == ISA_AVX2 && M < MR ? NT_DIRECT : isa == ISA_BF16 && M <= 2 ? DP_NT1
         : isa == ISA_BF16 && M > (packed ? 6 : DPB_PLAIN_M) ? DPB_W : NT;
    j.ntiles = (V + j.nt - 1) / j.nt;
    float *aw = NULL;
    uint16_t *ab = NULL;
    if (isa == ISA_BF16) {
        if (posix_memalign((void **)&ab, 64, sizeof(uint16_t) * (M * Kp + 2))) return -2;
        for (int64_t m = 0; m < M; ++m)
            for (int64_t k = 0; k < Kp; ++k) ab[m * Kp + k] = k < H ? daz16(a[m * lda + k]) : 0;
        j.ab = ab;
    } else {
        if (posix_memalign((void **)&aw, 64, sizeof(float) * (M * Kp + 1))) return -2;
        for (int64_t m = 0; m < M; ++m)
            for (int64_t k = 0; k < Kp; ++k) aw[m * Kp + k] = k < H ? bf16_daz(a[m * lda + k]) : 0.0f;
        j.aw = aw;
    }
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAXT) nthreads = MAXT;
    const int64_t work = Kp * V / MIN_WEIGHT; /* each thread reads at least MIN_WEIGHT of w */
    if (nthreads > work) nthreads = work < 1 ? 1 : (int)work;
    if (nthreads > j.ntiles) nthreads = (int)j.ntiles;
    j.ahead = isa == ISA_BF16 && j.nt == DPB_W && packed && j.ntiles >= 4 * (int64_t)nthreads;
    lmtail_parallel(worker, &j, nthreads);
    free(aw);
    free(ab);
    return j.done == j.ntiles ? 0 : -2;
}
