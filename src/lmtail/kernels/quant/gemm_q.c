/* lmtail: y = a @ W^T over GGUF Q8_0 / Q4_1 weight blocks, in the declared "lanes32" order
 * (CPU kernels, all bit-equal; docs/quant.md, kernels/quant/gemm_q.py's gemm_q_decl).
 *
 * Shape legend: M rows of activations, K the summed axis (a multiple of 32), NB = K/32
 * blocks per weight row, N output columns (the weight's rows, GGUF row-major).
 *   a    [M, lda]     fp32                     activations, a[m*lda + k] for k < K
 *   w    [N, NB, BS]  bytes                    GGUF blocks, row n's blocks contiguous
 *        Q8_0 (BS = 34): d fp16, q[32] int8;   value j = fp32(d) * q[j]       (exact)
 *        Q4_1 (BS = 20): d fp16, m fp16, qs[16]; q[j] = qs[j] & 15, q[j+16] = qs[j] >> 4
 *                                              value j = fl32(fp32(d) * q[j] + fp32(m))
 *                                              (d*q is exact: one rounding, an fma)
 *   out  [M, ldc]     fp32                     out[m*ldc + n] for n < N
 * lmtail_gemm_q_cat takes up to CAT_MAX weights of one format and one K whose outputs sit side
 * by side by columns (q|k|v, gate|up): column n of the concatenation is row n - start of its
 * own weight. One call, one thread team, the units cut over all N columns; each element's
 * steps are the one-weight call's, so its bytes are too.
 *
 * Numerics (the declaration): for every (m, n) on its own, with w = the values above
 *   l[j] = +0 for j = 0..31
 *   for block b = 0, 1, ..., NB-1, for j = 0..31:  l[j] = fma(a[m, 32b+j], w[n, 32b+j], l[j])
 *   for h = 16, 8, 4, 2, 1: for j < h: l[j] = l[j] + l[j+h]      (the halving tree)
 *   out = l[0], a NaN stored as 0x7FC00000.
 * Every fma and add rounds once to nearest-even in fp32 with IEEE gradual underflow: MXCSR is
 * pinned to 0x1F80 (to nearest, exceptions masked, FTZ and DAZ off) for the call. inf/NaN
 * follow IEEE. Paths: "avx512" (2 zmm per 32 lanes), "avx2" (4 ymm), "c" (plain C, the fma
 * emulated exactly in double). Blocking over rows and columns only picks which elements share
 * a dequantized block; every element is computed by one thread, whole.
 */
#include "lmtail_kernels.h"
#include <sched.h> /* sched_yield */

enum { FMT_Q8_0 = 0, FMT_Q4_1 = 1 };
enum { ISA_C = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
/* Blocking: a unit is a chunk of columns taken by one thread. AVX2: M == 1 reads the blocks
 * directly (two columns at a time); 2 <= M below the lanes path reads each column's blocks
 * directly, ROWS_COLS columns at a time, in passes of rows that share each dequantized part
 * of a block (rows_cols_avx2): QUARTER_MIN_R..8 rows a quarter block at a time when K <=
 * QUARTER_MAX_K (8 rows of a stay in L1), 3-4 rows half a block at a time, 1-2 rows a whole
 * block; M >= LANES_MIN_M, or M >= 8 with K > QUARTER_MAX_K, takes the lanes path
 * (lanes_unit). AVX-512: M < LANES512_MIN_M = 16 in passes of R rows x C columns over whole
 * blocks (2 zmm; unit_512, rows_512), M >= 16 the AVX-512 lanes path (lanes_unit_512: 16
 * columns to a zmm, tiles of 4 rows x 48 columns). Threads: each gets at least MIN_WEIGHT
 * weights (or MIN_WORK multiply-adds).
 * PREFETCH: the direct paths and the lanes path's panels prefetch each weight row this many
 * bytes ahead (the head at M = 1, read from DRAM, ran about 2x faster with it on Zen 3; cached
 * sizes: no change). M == 1 (direct_avx2, rows_512) prefetches PREFETCH_M1 ahead: on Zen 3,
 * alternating, medians of 15, 1024 bytes vs 256 read the 30 layers' linears 5% and the Q8_0
 * head 6-9% faster on 1 and 2 threads (768: the head 1.5x slower; 2048: the head slower); at
 * M = 4 it lost 2-5%. */
enum { PREFETCH_M1 = 1024 };
enum { PREFETCH = 256, LANES_MIN_M = 17, QUARTER_MIN_R = 5, QUARTER_MAX_K = 768, ROWS_COLS = 8 };
enum { QK = 32, LANES_PANEL = 1 << 16, MIN_WEIGHT = 1 << 16, MIN_WORK = 1 << 20 };
/* The lanes path: about LANES_UNITS units per thread (balance). */
enum { LANES_UNITS = 4 };
/* Weights one lmtail_gemm_q_cat call takes. */
enum { CAT_MAX = 4 };
/* AVX-512 below the lanes path: rows per pass when K <= QUARTER_MAX_K (unit_512). */
enum { ROWS512 = 8 };

typedef struct {
    const float *a;
    float *at; /* [Q, 32, NB, 4] the lanes path's copy of a (lanes_at) */
    const uint8_t *w[CAT_MAX]; /* the weights' blocks; column n is in weight s when n < end[s] */
    int64_t end[CAT_MAX];
    int nw;
    float *out;
    int64_t lda, ldc, M, N, K, nb, bs, chunk, units;
    int fmt, isa, lanes; /* lanes: the lanes path on a vector path (lanes_unit) */
    int64_t next, done; /* next unit to take, units finished (atomic) */
    int at_taken, at_done; /* the lanes path: a worker copies at, at is copied (atomic) */
} job_t;

static inline uint16_t ld16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* Column n's first block (its weight's row n - start). */
static inline const uint8_t *col_w(const job_t *j, int64_t n) {
    int s = 0;
    while (s + 1 < j->nw && n >= j->end[s]) ++s;
    return j->w[s] + (n - (s ? j->end[s - 1] : 0)) * j->nb * j->bs;
}

/* fp16 bits -> fp32, exact (subnormal halves become normal floats; inf/NaN kept). */
static inline float half_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (e == 0x1F) return u2f(sign | 0x7F800000u | (mant << 13));
    if (e == 0) return u2f(f2u((float)mant * 0x1p-24f) | sign); /* mant * 2^-24: exact */
    return u2f(sign | ((e + 112) << 23) | (mant << 13));
}

/* ---------------------------------------------------------------- plain C */
/* The 32 values of one block (the format's exact fp32 values). */
static void deq_block_c(const uint8_t *blk, int fmt, float *v) {
    const float d = half_to_f32(ld16(blk));
    if (fmt == FMT_Q8_0) {
        for (int j = 0; j < QK; ++j) v[j] = d * (float)(int8_t)blk[2 + j];
        return;
    }
    const float m = half_to_f32(ld16(blk + 2));
    for (int j = 0; j < QK / 2; ++j) { /* d*q exact; one rounding of the add */
        v[j] = d * (float)(blk[4 + j] & 15) + m;
        v[j + 16] = d * (float)(blk[4 + j] >> 4) + m;
    }
}

static void deq_row_c(const job_t *j, int64_t n, float *v) {
    const uint8_t *row = col_w(j, n);
    for (int64_t b = 0; b < j->nb; ++b) deq_block_c(row + b * j->bs, j->fmt, v + QK * b);
}

static float tree_c(float *l) {
    for (int h = 16; h >= 1; h >>= 1)
        for (int i = 0; i < h; ++i) l[i] = l[i] + l[i + h];
    return l[0];
}

static void unit_c(const job_t *j, int64_t c0, int64_t c1, float *wrow) {
    for (int64_t n = c0; n < c1; ++n) {
        deq_row_c(j, n, wrow);
        for (int64_t m = 0; m < j->M; ++m) {
            const float *am = j->a + m * j->lda;
            float l[QK] = {0};
            for (int64_t b = 0; b < j->nb; ++b)
                for (int i = 0; i < QK; ++i) l[i] = fma_rn(am[QK * b + i], wrow[QK * b + i], l[i]);
            j->out[m * j->ldc + n] = canon_nan(tree_c(l));
        }
    }
}

#if defined(__x86_64__)
#define AI inline __attribute__((always_inline))
/* ---------------------------------------------------------------- AVX2 (+FMA, F16C) */
#define AVX2 LMTAIL_TARGET_AVX2_F16C

/* 8 -> 1 of the halving tree: l[j] += l[j+4], l[j] += l[j+2], l[0] += l[1]. */
static AI AVX2 float tree8(__m256 t) {
    const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

/* acc[i] holds lanes 8i..8i+7: l[j] += l[j+16], then l[j] += l[j+8], then tree8. */
static AI AVX2 float tree_avx2(const __m256 *acc) {
    return tree8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3])));
}

/* The block's 32 values in 4 ymm (lanes 8i..8i+7 in v[i]). */
static AI AVX2 void deq_avx2(const uint8_t *blk, int fmt, __m256 *v) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(ld16(blk)));
    if (fmt == FMT_Q8_0) {
        for (int i = 0; i < 4; ++i) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * i));
            v[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        }
        return;
    }
    (void)d;
    int32_t dm;
    memcpy(&dm, blk, 4);
    const __m128 h = _mm_cvtph_ps(_mm_cvtsi32_si128(dm)); /* [d, m, 0, 0] */
    const __m256 d2 = _mm256_broadcastss_ps(h), m = _mm256_broadcastss_ps(_mm_movehdup_ps(h));
    /* bytes qs[8p..8p+7] widened: low nibbles are weights 8p.., high nibbles 16+8p.. */
    const __m256i f = _mm256_set1_epi32(15);
    const __m256i x0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 4)));
    const __m256i x1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 12)));
    const __m256i q[4] = {_mm256_and_si256(x0, f), _mm256_and_si256(x1, f), _mm256_srli_epi32(x0, 4),
                          _mm256_srli_epi32(x1, 4)};
    for (int i = 0; i < 4; ++i) v[i] = _mm256_fmadd_ps(d2, _mm256_cvtepi32_ps(q[i]), m);
}

/* M == 1: columns n, n+1 (C = 1 or 2) straight from the blocks. */
static AI AVX2 void direct_avx2(const job_t *j, int64_t n, int C, int fmt) {
    __m256 acc[2][4], v[4];
    for (int c = 0; c < 2; ++c)
        for (int i = 0; i < 4; ++i) acc[c][i] = _mm256_setzero_ps();
    const uint8_t *row[2] = {col_w(j, n), C > 1 ? col_w(j, n + 1) : NULL};
    for (int64_t b = 0; b < j->nb; ++b) {
        const float *ab = j->a + QK * b;
        for (int c = 0; c < C; ++c) {
            const uint8_t *blk = row[c] + b * j->bs;
            _mm_prefetch((const char *)blk + PREFETCH_M1, _MM_HINT_T0);
            deq_avx2(blk, fmt, v);
            for (int i = 0; i < 4; ++i)
                acc[c][i] = _mm256_fmadd_ps(_mm256_loadu_ps(ab + 8 * i), v[i], acc[c][i]);
        }
    }
    for (int c = 0; c < C; ++c) j->out[n + c] = canon_nan(tree_avx2(acc[c]));
}

/* Rows m0, m0+1 (R = 1 or 2) of column n straight from the blocks (whole blocks). */
static AI AVX2 void pair_avx2(const job_t *j, int64_t m0, int R, int64_t n, int fmt) {
    __m256 acc[2][4], v[4];
    for (int r = 0; r < 2; ++r)
        for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
    const uint8_t *row = col_w(j, n);
    for (int64_t b = 0; b < j->nb; ++b) {
        const uint8_t *blk = row + b * j->bs;
        _mm_prefetch((const char *)blk + PREFETCH, _MM_HINT_T0);
        deq_avx2(blk, fmt, v);
        for (int r = 0; r < R; ++r) {
            const float *ab = j->a + (m0 + r) * j->lda + QK * b;
            for (int i = 0; i < 4; ++i)
                acc[r][i] = _mm256_fmadd_ps(_mm256_loadu_ps(ab + 8 * i), v[i], acc[r][i]);
        }
    }
    for (int r = 0; r < R; ++r) j->out[(m0 + r) * j->ldc + n] = canon_nan(tree_avx2(acc[r]));
}

/* ymm i0 .. i0+S-1 of the block (lanes 8i .. 8i+7 each): deq_avx2's v[i0 ..], the same values. */
static AI AVX2 void deq_part_avx2(const uint8_t *blk, int fmt, int i0, int S, __m256 *v) {
    if (fmt == FMT_Q8_0) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(ld16(blk)));
        for (int s = 0; s < S; ++s) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * (i0 + s)));
            v[s] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        }
        return;
    }
    int32_t dm;
    memcpy(&dm, blk, 4);
    const __m128 hm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm)); /* [d, m, 0, 0] */
    const __m256 d = _mm256_broadcastss_ps(hm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(hm));
    for (int s = 0; s < S; ++s) { /* ymm i: low nibbles of qs[8i ..] (i < 2), high of qs[8(i-2) ..] */
        const int i = i0 + s;
        const __m128i qs = _mm_loadl_epi64((const __m128i *)(blk + 4 + 8 * (i & 1)));
        const __m256i x = _mm256_cvtepu8_epi32(qs);
        const __m256i q = i >= 2 ? _mm256_srli_epi32(x, 4) : _mm256_and_si256(x, _mm256_set1_epi32(15));
        v[s] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), m);
    }
}

/* Rows m0 .. m0+R-1 (R <= 8/S) of column n, S ymm of lanes at a time: lanes 0 .. 8S-1 over all
 * blocks, then the next 8S lanes, ... (each part dequantized once for the R rows; R*S
 * accumulators); then each row's tree. */
static AI AVX2 void rows_part_avx2(const job_t *j, int64_t m0, int R, int S, int64_t n, int fmt) {
    const int64_t nb = j->nb, lda = j->lda, bs = j->bs;
    const float *a = j->a + m0 * lda;
    const uint8_t *row = col_w(j, n);
    __m256 l[8][4];
    for (int i0 = 0; i0 < 4; i0 += S) {
        __m256 acc[8][2];
        for (int r = 0; r < R; ++r)
            for (int s = 0; s < S; ++s) acc[r][s] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            __m256 v[2];
            _mm_prefetch((const char *)row + b * bs + PREFETCH, _MM_HINT_T0);
            deq_part_avx2(row + b * bs, fmt, i0, S, v);
            for (int r = 0; r < R; ++r) {
                const float *ab = a + r * lda + QK * b + 8 * i0;
                for (int s = 0; s < S; ++s)
                    acc[r][s] = _mm256_fmadd_ps(_mm256_loadu_ps(ab + 8 * s), v[s], acc[r][s]);
            }
        }
        for (int r = 0; r < R; ++r)
            for (int s = 0; s < S; ++s) l[r][i0 + s] = acc[r][s];
    }
    for (int r = 0; r < R; ++r) j->out[(m0 + r) * j->ldc + n] = canon_nan(tree_avx2(l[r]));
}

/* Rows 0 .. M-1 of columns n0 .. n1-1 (2 <= M, below the lanes path): passes of R rows that
 * share each dequantized part of a block: QUARTER_MIN_R..8 rows a quarter block at a time (K
 * <= QUARTER_MAX_K: the rows of a stay in L1), 3-4 rows half a block at a time, 2 rows or 1 a
 * whole block at a time; each pass runs over the columns (at most ROWS_COLS: their blocks stay
 * in L1 or L2 for the next pass, the pass's rows of a in L1). Only which rows share a
 * dequantized value changes with M: each element's chains and tree are the declared ones. */
static AI AVX2 void rows_cols_avx2(const job_t *j, int64_t n0, int64_t n1, int fmt) {
    for (int64_t m = 0; m < j->M;) {
        const int64_t R = j->M - m;
#define PASS(RR, FN) { for (int64_t n = n0; n < n1; ++n) FN; m += RR; continue; }
        if (R >= QUARTER_MIN_R && j->K <= QUARTER_MAX_K) {
            if (R >= 8) PASS(8, rows_part_avx2(j, m, 8, 1, n, fmt))
            if (R == 7) PASS(7, rows_part_avx2(j, m, 7, 1, n, fmt))
            if (R == 6) PASS(6, rows_part_avx2(j, m, 6, 1, n, fmt))
            PASS(5, rows_part_avx2(j, m, 5, 1, n, fmt))
        }
        if (R >= 4) PASS(4, rows_part_avx2(j, m, 4, 2, n, fmt))
        if (R == 3) PASS(3, rows_part_avx2(j, m, 3, 2, n, fmt))
        if (R == 2) PASS(2, pair_avx2(j, m, 2, n, fmt))
        PASS(1, pair_avx2(j, m, 1, n, fmt))
#undef PASS
    }
}

/* The lanes path (AVX2, M >= LANES_MIN_M, or M >= 8 with K > QUARTER_MAX_K): the same lane
 * chains, computed lane by lane, 8 columns to a register, so a fma takes a broadcast
 * activation and a vector of 8 columns: a tile is 4 rows (a quad) x 24 columns (3 registers),
 * 12 accumulators, 7 loads per 12 fmas, each from one running pointer. The activations are
 * copied once per call by one worker (lanes_at_take), quads interleaved, rows past M zero; each
 * unit's weights are dequantized once into a panel, 24 columns to a tile, columns past the
 * unit zero:
 *   at [Q, 32, NB, 4]:       at[((q*32 + l)*NB + b)*4 + r] = a[4q + r, 32b + l]
 *   pt [T, 32, NB, 3, 8]:    pt[((t*32 + l)*NB + b)*24 + 8c + i] = w[c0 + 24t + 8c + i, 32b + l]
 * Lane l's chain over b = 0..NB-1 runs whole; the lanes run in the halving tree's left to right
 * leaf order (l = bit reversal of i, i = 0..31: 0, 16, 8, 24, 4, ...), so the tree is summed
 * as the leaves come (post-order, a left node parked until its right sibling: left + right,
 * the declared l[j] + l[j+h]). Each element's steps are the declared ones. */
static AI int bitrev5(int i) {
    return ((i & 1) << 4) | ((i & 2) << 2) | (i & 4) | ((i & 8) >> 2) | ((i & 16) >> 4);
}

/* The tile's results res [4, 24] into out rows m .. m+3 (those below M), columns n .. n+23
 * (those below c1), a NaN as 0x7FC00000. */
static AI AVX2 void lanes_store(const job_t *j, const float *res, int64_t m, int64_t n, int64_t c1) {
    const __m256 qnan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
    for (int r = 0; r < 4 && m + r < j->M; ++r)
        for (int c = 0; c < 3 && n + 8 * c < c1; ++c) {
            const float *x = res + 8 * (3 * r + c);
            float *o = j->out + (m + r) * j->ldc + n + 8 * c;
            const __m256 v = _mm256_load_ps(x), nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
            if (c1 - n - 8 * c >= 8) _mm256_storeu_ps(o, _mm256_blendv_ps(v, qnan, nan));
            else for (int64_t e = 0; e < c1 - n - 8 * c; ++e) o[e] = canon_nan(x[e]);
        }
}

/* Rows 4q .. 4q+3 of at x columns c0 + 24t .. c0 + 24t + 23 of the panel; park [6 heights, 12,
 * 8] holds the left nodes, then the root. Rows past M and columns past c1 are not stored. */
static AI AVX2 void lanes_tile(const job_t *j, const float *pt, int64_t q, int64_t t, int64_t c0,
                               int64_t c1, float *park) {
    const int64_t nb = j->nb;
    for (int i = 0; i < QK; ++i) {
        const int l = bitrev5(i);
        const float *pa = j->at + (q * QK + l) * nb * 4, *pw = pt + (t * QK + l) * nb * 24;
        __m256 acc[12]; /* [4 rows, 3 groups of 8 columns] */
        for (int x = 0; x < 12; ++x) acc[x] = _mm256_setzero_ps();
#pragma GCC unroll 2 /* medians ~4% faster at M = 256 on Zen 3 */
        for (int64_t b = 0; b < nb; ++b, pa += 4, pw += 24) {
            const __m256 w0 = _mm256_load_ps(pw), w1 = _mm256_load_ps(pw + 8), w2 = _mm256_load_ps(pw + 16);
            for (int r = 0; r < 4; ++r) {
                const __m256 av = _mm256_broadcast_ss(pa + r);
                acc[3 * r] = _mm256_fmadd_ps(av, w0, acc[3 * r]);
                acc[3 * r + 1] = _mm256_fmadd_ps(av, w1, acc[3 * r + 1]);
                acc[3 * r + 2] = _mm256_fmadd_ps(av, w2, acc[3 * r + 2]);
            }
        }
        int h = 0;
        for (int k = i; k & 1; k >>= 1, ++h) /* a right node: its parked left sibling + it */
            for (int x = 0; x < 12; ++x)
                acc[x] = _mm256_add_ps(_mm256_load_ps(park + (h * 12 + x) * 8), acc[x]);
        for (int x = 0; x < 12; ++x) _mm256_store_ps(park + (h * 12 + x) * 8, acc[x]); /* h = 5: the root */
    }
    lanes_store(j, park + 5 * 12 * 8, 4 * q, c0 + 24 * t, c1);
}

/* Quads q0 .. q1-1 of at from a (zero rows past M), 4 lanes x 4 rows transposed at a time. */
static AVX2 void lanes_at(const job_t *j, int64_t q0, int64_t q1) {
    const int64_t nb = j->nb;
    const float zero[QK] = {0};
    for (int64_t q = q0; q < q1; ++q) {
        const float *row[4];
        int64_t step[4];
        for (int r = 0; r < 4; ++r) {
            const int in = 4 * q + r < j->M;
            row[r] = in ? j->a + (4 * q + r) * j->lda : zero;
            step[r] = in ? QK : 0;
        }
        float *dst = j->at + q * QK * nb * 4;
        for (int64_t b = 0; b < nb; ++b)
            for (int k = 0; k < QK; k += 4) {
                __m128 x0 = _mm_loadu_ps(row[0] + step[0] * b + k);
                __m128 x1 = _mm_loadu_ps(row[1] + step[1] * b + k);
                __m128 x2 = _mm_loadu_ps(row[2] + step[2] * b + k);
                __m128 x3 = _mm_loadu_ps(row[3] + step[3] * b + k);
                _MM_TRANSPOSE4_PS(x0, x1, x2, x3); /* x_i: lane k+i of rows 0..3 */
                _mm_store_ps(dst + ((k + 0) * nb + b) * 4, x0);
                _mm_store_ps(dst + ((k + 1) * nb + b) * 4, x1);
                _mm_store_ps(dst + ((k + 2) * nb + b) * 4, x2);
                _mm_store_ps(dst + ((k + 3) * nb + b) * 4, x3);
            }
    }
}

/* The first worker to come (the caller's, as a rule) copies all of at, before its first unit;
 * the others start their first panels meanwhile (no worker waits on a helper that is late or
 * off its core). */
static AVX2 void lanes_at_take(job_t *j) {
    if (__atomic_exchange_n(&j->at_taken, 1, __ATOMIC_RELAXED)) return;
    lanes_at(j, 0, (j->M + 3) / 4);
    __atomic_store_n(&j->at_done, 1, __ATOMIC_RELEASE);
}

/* Wait until at is copied (by a running worker: it took the copy). */
static AVX2 void lanes_at_wait(const job_t *j) {
    for (int n = 1; !__atomic_load_n(&j->at_done, __ATOMIC_ACQUIRE); ++n) {
        lmtail_cpu_relax();
        if (n % 1024 == 0) sched_yield(); /* the copying worker may be off its core */
    }
}

/* The unit's panel (T = chunk/24 tiles, every 8 columns' blocks transposed 8 x 8 in registers),
 * then (all of at copied) each quad of rows over the tiles. */
static AVX2 __attribute__((noinline)) void lanes_unit(const job_t *j, int64_t c0, int64_t c1, float *pt, int fmt) {
    const int64_t nb = j->nb, T = (c1 - c0 + 23) / 24, Q = (j->M + 3) / 4;
    float *park = pt + j->chunk * j->K; /* [6, 12, 8] */
    float tmp[8 * QK] __attribute__((aligned(32))); /* [8 columns, 32 lanes] of one block */
    __m256 v[4];
    for (int64_t g = 0; g < 3 * T; ++g) {
        const int64_t cols = c1 - c0 - 8 * g; /* < 8: the group's columns past c1 are zero */
        float *dst = pt + (g / 3 * QK * nb) * 24 + 8 * (g % 3);
        const uint8_t *row[8];
        for (int64_t c = 0; c < 8; ++c) row[c] = c < cols ? col_w(j, c0 + 8 * g + c) : NULL;
        for (int64_t b = 0; b < nb; ++b) {
            for (int64_t c = 0; c < 8; ++c) {
                const uint8_t *blk = c < cols ? row[c] + b * j->bs : NULL;
                if (c < cols) _mm_prefetch((const char *)blk + PREFETCH, _MM_HINT_T0);
                if (c >= cols) for (int x = 0; x < 4; ++x) v[x] = _mm256_setzero_ps();
                else if (fmt == FMT_Q8_0) deq_avx2(blk, FMT_Q8_0, v);
                else deq_avx2(blk, FMT_Q4_1, v);
                for (int x = 0; x < 4; ++x) _mm256_store_ps(tmp + c * QK + 8 * x, v[x]);
            }
            for (int x = 0; x < 4; ++x) {
                __m256 r[8];
                for (int c = 0; c < 8; ++c) r[c] = _mm256_load_ps(tmp + c * QK + 8 * x);
                lmtail_transpose8(r); /* r[l]: lane 8x + l of the 8 columns */
                for (int l = 0; l < 8; ++l) _mm256_store_ps(dst + ((8 * x + l) * nb + b) * 24, r[l]);
            }
        }
    }
    lanes_at_wait(j); /* the copy of a overlaps the other workers' first panels */
    for (int64_t q = 0; q < Q; ++q) /* the quad's rows of at stay in L1 over the panel */
        for (int64_t t = 0; t < T; ++t) lanes_tile(j, pt, q, t, c0, c1, park);
}

/* Below the lanes path: M == 1 two columns at a time, else ROWS_COLS columns at a time, their
 * rows in passes (rows_cols_avx2). */
static AI AVX2 void unit_avx2_fmt(const job_t *j, int64_t c0, int64_t c1, int fmt) {
    if (j->M == 1) {
        for (int64_t n = c0; n < c1; n += 2) { /* C constant: the accumulators stay in registers */
            if (c1 - n >= 2) direct_avx2(j, n, 2, fmt);
            else direct_avx2(j, n, 1, fmt);
        }
        return;
    }
    for (int64_t n = c0; n < c1; n += ROWS_COLS) /* the pass's rows of a stay in L1 */
        rows_cols_avx2(j, n, c1 - n < ROWS_COLS ? c1 : n + ROWS_COLS, fmt);
}

static AVX2 void unit_avx2(const job_t *j, int64_t c0, int64_t c1, float *panel) {
    if (j->lanes) lanes_unit(j, c0, c1, panel, j->fmt); /* lmtail_gemm_q_cat picks */
    else if (j->fmt == FMT_Q8_0) unit_avx2_fmt(j, c0, c1, FMT_Q8_0);
    else unit_avx2_fmt(j, c0, c1, FMT_Q4_1);
}

/* ---------------------------------------------------------------- AVX-512 */
#define AVX512 LMTAIL_TARGET_AVX512_F16C

/* acc[0] holds lanes 0..15, acc[1] 16..31: l[j] += l[j+16], l[j] += l[j+8], then tree8. */
static AI AVX512 float tree_512(const __m512 *acc) {
    const __m512 s = _mm512_add_ps(acc[0], acc[1]);
    return tree8(_mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1)));
}

/* The block's 32 values in 2 zmm (lanes 0..15 in v[0], 16..31 in v[1]), the format's exact
 * values. Q8_0: fp32(d) * q (sign-extended, converted: exact). Q4_1: a 16-entry table of the
 * block's possible values T[q] = fl32(d*q + m), q = 0..15 (one fma: d*q exact, one rounding,
 * the declared value), then lane j's value is T[q[j]] (vpermps reads the low 4 bits of each
 * dword index: qs[j] itself for the low nibble, qs[j] >> 4 for the high one). */
static AI AVX512 void deq_512(const uint8_t *blk, int fmt, __m512 *v) {
    if (fmt == FMT_Q8_0) {
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(ld16(blk)));
        for (int i = 0; i < 2; ++i) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 2 + 16 * i));
            v[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
        }
        return;
    }
    int32_t dm;
    memcpy(&dm, blk, 4);
    const __m128 h = _mm_cvtph_ps(_mm_cvtsi32_si128(dm)); /* [d, m, 0, 0], exact */
    const __m512 d = _mm512_broadcastss_ps(h), m = _mm512_broadcastss_ps(_mm_movehdup_ps(h));
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 tab = _mm512_fmadd_ps(d, iota, m); /* T[q] = fl32(d*q + m) */
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 4))); /* qs[0..15] */
    v[0] = _mm512_permutexvar_ps(x, tab);                      /* T[qs & 15] */
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), tab); /* T[qs >> 4] */
}

/* Rows m0 .. m0+R-1 x columns n .. n+C-1 straight from the blocks: each block of each column
 * dequantized once (deq_512) for the R rows; R*C*2 accumulators, lane j of acc[r][c][j/16]
 * is the declared l[j] of element (m0+r, n+c): l[j] = fma(a[32b+j], w[32b+j], l[j]) for the
 * blocks in order, then the halving tree (tree_512). pf: the prefetch distance in bytes.
 * ESTIMATE (llvm-mca, not a measurement) of the block loop `for b` as gcc 12 -O3 compiles it,
 * cycles per iteration (one block of each of the C columns for the R rows), Q4_1 / Q8_0:
 *                     mca-14 sapphirerapids   mca-19 sapphirerapids   mca-19 znver4
 *   R = 1, C = 2            14.1 / 13.1             12.1 / 12.1          12.1 / 12.2
 *   R = 4, C = 2            21.3 / 19.6             20.1 / 24.1          24.1 / 21.4
 *   R = 8, C = 1            16.1 / 15.7             24.1 / 26.1          19.1 / 19.1
 * (llvm-mca-14 has no znver4 model: Debian's llvm-19 has. The M = 1 loop before the table,
 * Q4_1 with C = 2: 20.1 / 14.1 / 16.4.) On SPR the table's vpermps and vpmovzxbd share
 * port 5 with the second zmm FMA; on Zen 4 the model puts 3 cycles on vpmovzxbd zmm. */
static AI AVX512 void rows_512(const job_t *j, int64_t m0, const int R, const int C, int64_t n, int fmt,
                               const int pf) {
    __m512 acc[8][4][2];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm512_setzero_ps();
    const uint8_t *row[4];
    for (int c = 0; c < C; ++c) row[c] = col_w(j, n + c);
    const int64_t nb = j->nb, bs = j->bs, lda = j->lda;
    const float *a = j->a + m0 * lda;
    for (int64_t b = 0; b < nb; ++b, a += QK) {
        __m512 v[4][2];
        for (int c = 0; c < C; ++c) {
            const uint8_t *blk = row[c] + b * bs;
            _mm_prefetch((const char *)blk + pf, _MM_HINT_T0);
            deq_512(blk, fmt, v[c]);
        }
        for (int r = 0; r < R; ++r) {
            const __m512 a0 = _mm512_loadu_ps(a + r * lda), a1 = _mm512_loadu_ps(a + r * lda + 16);
            for (int c = 0; c < C; ++c) {
                acc[r][c][0] = _mm512_fmadd_ps(a0, v[c][0], acc[r][c][0]);
                acc[r][c][1] = _mm512_fmadd_ps(a1, v[c][1], acc[r][c][1]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) j->out[(m0 + r) * j->ldc + n + c] = canon_nan(tree_512(acc[r][c]));
}

/* One pass: rows m0 .. m0+R-1 over columns n0 .. n1-1, C at a time (the last 1..C-1 one at a
 * time). R, C, fmt constant after inlining: the accumulators stay in registers. */
static AI AVX512 void pass_512(const job_t *j, int64_t m0, const int R, const int C, int64_t n0, int64_t n1,
                               int fmt, const int pf) {
    int64_t n = n0;
    for (; n + C <= n1; n += C) rows_512(j, m0, R, C, n, fmt, pf);
    for (; n < n1; ++n) rows_512(j, m0, R, 1, n, fmt, pf);
}

#define PASS512_N(R, C)                                                                            \
    static AVX512 __attribute__((noinline)) void pass512_##R##_##C(const job_t *j, int64_t m0,     \
                                                                  int64_t n0, int64_t n1, int fmt) { \
        if (fmt == FMT_Q8_0) pass_512(j, m0, R, C, n0, n1, FMT_Q8_0, R == 1 ? PREFETCH_M1 : PREFETCH); \
        else pass_512(j, m0, R, C, n0, n1, FMT_Q4_1, R == 1 ? PREFETCH_M1 : PREFETCH);             \
    }
PASS512_N(1, 2) PASS512_N(2, 4) PASS512_N(3, 2) PASS512_N(4, 2) PASS512_N(5, 2) PASS512_N(6, 2)
PASS512_N(7, 1) PASS512_N(8, 1)
typedef void (*pass512_fn)(const job_t *, int64_t, int64_t, int64_t, int);
static const pass512_fn PASS512[9] = {0, pass512_1_2, pass512_2_4, pass512_3_2, pass512_4_2,
                                      pass512_5_2, pass512_6_2, pass512_7_1, pass512_8_1};

/* The AVX-512 lanes path (M >= LANES512_MIN_M): the AVX2 lanes path's order and copy of a (at,
 * quads of rows), 16 columns to a zmm: a tile is 4 rows x 48 columns (3 zmm), 12 accumulators,
 * per (lane, block) 3 loads of the panel and 4 broadcasts of a for 12 fmas. Why: the rows
 * passes load a zmm of a for every 1-2 fmas; in a harness on Zen 4 (hot L1, no tree) their
 * loops ran at 65-75% of the zmm FMA rate, this tile's at 99%. The panel costs a fixed
 * dequantization per unit, so the path pays from M = 16 on (Zen 4, alternated, thread CPU
 * time: M = 16 Q4_1 linears 0.70-0.96x the rows passes' time, the Q8_0 head 0.89-1.0x; M = 8
 * and 12 1.07-1.3x, so they stay on the rows passes; M >= 17 0.81-0.95x the AVX2 lanes path
 * it replaces there). The panel, one tile's, columns past the unit zero:
 *   pt [32, NB, 48]:         pt[(l*NB + b)*48 + 16g + i] = w[n0 + 16g + i, 32b + l]   (n0 the tile's)
 * built 16 columns at a time, one block of them at a time, dequantized across the columns
 * (lanes_group_512). Each lane's chain over b runs whole, the lanes in bit-reversed order, the tree
 * summed as the leaves come (lanes_tile's parking): each element's steps are the declared ones. */
enum { LANES512_MIN_M = 16, LANES512_W = 48 };

/* The tile's results res [4, 48] into out rows m .. m+3 (those below M), columns n .. n+47
 * (those below c1), a NaN as 0x7FC00000. */
static AI AVX512 void lanes_store_512(const job_t *j, const float *res, int64_t m, int64_t n, int64_t c1) {
    const __m512 qnan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000));
    for (int r = 0; r < 4 && m + r < j->M; ++r)
        for (int c = 0; c < 3 && n + 16 * c < c1; ++c) {
            const __m512 v = _mm512_load_ps(res + 16 * (3 * r + c));
            const int64_t left = c1 - n - 16 * c;
            const __mmask16 keep = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            _mm512_mask_storeu_ps(j->out + (m + r) * j->ldc + n + 16 * c, keep,
                                  _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), qnan));
        }
}

/* Rows 4q .. 4q+3 of at x columns c0 + 48t .. c0 + 48t + 47 of the panel; park [6 heights, 12,
 * 16] holds the left nodes, then the root (lanes_tile's order).
 * ESTIMATE (llvm-mca, not a measurement) of the block loop `for b` as gcc 12 -O3 compiles it
 * (12 fmas, 3 loads, 4 broadcasts), cycles per iteration: mca-19 znver4 15.7, mca-14
 * sapphirerapids 6.5, mca-14 icelake-server 6.5, mca-19 sapphirerapids 12.1 (llvm-mca-14 has
 * no znver4 model). Measured on Zen 4, the same loop alone in a harness: 3.6 zmm fmas per ns,
 * the machine's zmm FMA rate (1 a cycle); in the kernel the tile took ~1.25x the time of that
 * rate's fmas (the chains of 18 blocks at K = 576, the tree, the panel read from L2).
 * (Tiles of 8 rows, 24 accumulators, ran 1.13-1.28x slower on Zen 4.) */
static AI AVX512 void lanes_tile_512(const job_t *j, const float *pt, int64_t q, int64_t t, int64_t c0,
                                     int64_t c1, float *park, int64_t f0, int64_t f1) {
    const int64_t nb = j->nb, row_bytes = nb * j->bs;
    for (int i = 0; i < QK; ++i) {
        const int l = bitrev5(i);
        for (int64_t c = f0 + i; c < f1; c += QK) { /* the next tile's weight rows, into L2 */
            const char *w = (const char *)col_w(j, c);
            for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(w + o, _MM_HINT_T1);
        }
        const float *pa = j->at + (q * QK + l) * nb * 4, *pw = pt + (t * QK + l) * nb * LANES512_W;
        __m512 acc[12]; /* [4 rows, 3 groups of 16 columns] */
        for (int x = 0; x < 12; ++x) acc[x] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b, pa += 4, pw += LANES512_W) {
            const __m512 w0 = _mm512_load_ps(pw), w1 = _mm512_load_ps(pw + 16), w2 = _mm512_load_ps(pw + 32);
            for (int r = 0; r < 4; ++r) {
                const __m512 av = _mm512_set1_ps(pa[r]);
                acc[3 * r] = _mm512_fmadd_ps(av, w0, acc[3 * r]);
                acc[3 * r + 1] = _mm512_fmadd_ps(av, w1, acc[3 * r + 1]);
                acc[3 * r + 2] = _mm512_fmadd_ps(av, w2, acc[3 * r + 2]);
            }
        }
        int h = 0;
        for (int k = i; k & 1; k >>= 1, ++h) /* a right node: its parked left sibling + it */
            for (int x = 0; x < 12; ++x)
                acc[x] = _mm512_add_ps(_mm512_load_ps(park + (h * 12 + x) * 16), acc[x]);
        for (int x = 0; x < 12; ++x) _mm512_store_ps(park + (h * 12 + x) * 16, acc[x]); /* h = 5: the root */
    }
    lanes_store_512(j, park + 5 * 12 * 16, 4 * q, c0 + LANES512_W * t, c1);
}

/* The 16 bytes at offset off of each of 16 blocks blk[0..15] as 4 dword vectors: g[s] lane c
 * = bytes off+4s .. off+4s+3 of blk[c] (little endian). The loads put column 4k + i in
 * 128-bit lane k of w[i]; then a 4 x 4 dword transpose in each 128-bit lane. */
static AI AVX512 void seg16_512(const uint8_t *const *blk, int off, __m512i *g) {
    __m512i w[4];
    for (int i = 0; i < 4; ++i) {
        __m512i x = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(blk[i] + off)));
        x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(blk[4 + i] + off)), 1);
        x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(blk[8 + i] + off)), 2);
        w[i] = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(blk[12 + i] + off)), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(w[0], w[1]), t1 = _mm512_unpackhi_epi32(w[0], w[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(w[2], w[3]), t3 = _mm512_unpackhi_epi32(w[2], w[3]);
    g[0] = _mm512_unpacklo_epi64(t0, t2);
    g[1] = _mm512_unpackhi_epi64(t0, t2);
    g[2] = _mm512_unpacklo_epi64(t1, t3);
    g[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* Panel group g (16 columns c0 + 16g ..; those past c1 read a zero block: +0) into pt, one
 * block of the 16 columns at a time, dequantized lane by lane across the columns (the
 * format's values, deq_512's ops per value): d, m and the quants of the 16 blocks as dword
 * vectors over the columns (seg16_512), then per lane j one vector of the 16 columns' values:
 *   Q8_0: fp32(d) * q[j]                  (q[j] the sign-extended byte: exact)
 *   Q4_1: fma(fp32(d), q[j], fp32(m))     (= fl32(d*q + m): d*q exact, one rounding)
 * (The first version, deq_512 per column then two 16 x 16 fp32 transposes, took ~1.2x this
 * one's panel time.) ESTIMATE (llvm-mca, not a measurement) of the block loop `for b` as gcc
 * 12 -O3 compiles it, cycles per iteration (16 columns, 512 values), Q4_1 / Q8_0: mca-19
 * znver4 106 / 114, mca-14 sapphirerapids 108 / 117, mca-14 icelake-server 108 / 117, mca-19
 * sapphirerapids 140 / 163; against 4 x 32 x 15.7 / 3 = 670 cycles of tiles for 16 rows. */
static AI AVX512 void lanes_group_512(const job_t *j, int64_t c0, int64_t c1, int64_t g, float *pt, int fmt) {
    static const uint8_t zero_block[64 + PREFETCH] __attribute__((aligned(64))); /* its prefetch too */
    const int64_t nb = j->nb, cols = c1 - c0 - 16 * g;
    float *dst = pt + 16 * g; /* g = 0, 1, 2: the tile's 16-column groups */
    const uint8_t *row[16];
    int64_t step[16]; /* a column past c1: the zero block at every b */
    for (int64_t c = 0; c < 16; ++c) {
        row[c] = c < cols ? col_w(j, c0 + 16 * g + c) : zero_block;
        step[c] = c < cols ? j->bs : 0;
    }
    for (int64_t b = 0; b < nb; ++b, dst += LANES512_W) {
        const uint8_t *blk[16];
        for (int c = 0; c < 16; ++c) {
            blk[c] = row[c] + b * step[c];
            _mm_prefetch((const char *)blk[c] + PREFETCH, _MM_HINT_T0);
        }
        __m512i h[4], q[8];
        seg16_512(blk, 0, h); /* h[0]: d | m << 16 (Q4_1), d | q[0..1] << 16 (Q8_0) */
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h[0]));
        if (fmt == FMT_Q8_0) {
            seg16_512(blk, 2, q);
            seg16_512(blk, 18, q + 4);
#pragma GCC unroll 32 /* constant shifts, the quants in registers */
            for (int l = 0; l < QK; ++l) {
                const int t = l & 3;
                const __m512i x = _mm512_srai_epi32(t == 3 ? q[l >> 2] : _mm512_slli_epi32(q[l >> 2], 24 - 8 * t), 24);
                _mm512_store_ps(dst + l * nb * LANES512_W, _mm512_mul_ps(d, _mm512_cvtepi32_ps(x)));
            }
        } else {
            const __m512 m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h[0], 16)));
            const __m512i f = _mm512_set1_epi32(15);
            seg16_512(blk, 4, q);
#pragma GCC unroll 16 /* constant shifts, the quants in registers */
            for (int l = 0; l < QK / 2; ++l) { /* byte l: low nibble lane l, high nibble lane l + 16 */
                const int t = l & 3;
                const __m512i x = t ? _mm512_srli_epi32(q[l >> 2], 8 * t) : q[l >> 2];
                const __m512i lo = _mm512_and_si512(x, f);
                const __m512i hi = t == 3 ? _mm512_srli_epi32(x, 4) : _mm512_and_si512(_mm512_srli_epi32(x, 4), f);
                _mm512_store_ps(dst + l * nb * LANES512_W, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lo), m));
                _mm512_store_ps(dst + (l + 16) * nb * LANES512_W, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(hi), m));
            }
        }
    }
}

/* The unit's tiles (columns c0 + 48t .., t < T = chunk/48) one after the other: the tile's
 * panel (pt holds one tile: [1, 32, NB, 48]), then (all of at copied) each quad of rows over
 * it, the first quad's lanes prefetching the next 48 columns' weight rows into L2 (the next
 * tile's, or past c1 the next unit's). Why: with the weights in DRAM, a panel built from them
 * alone waits on memory while the tiles leave it idle: the whole unit's panel first, at M =
 * 16 on a 70 MB Q4_1 weight, took 1.12x the rows passes' time on Zen 4. */
static AVX512 void lanes_unit_512(const job_t *j, int64_t c0, int64_t c1, float *pt) {
    const int64_t T = (c1 - c0 + LANES512_W - 1) / LANES512_W, Q = (j->M + 3) / 4;
    float *park = pt + LANES512_W * j->K; /* [6, 12, 16] */
    for (int64_t t = 0; t < T; ++t) {
        const int64_t n0 = c0 + LANES512_W * t; /* the tile's first column */
        for (int64_t g = 0; g < 3; ++g) {
            if (j->fmt == FMT_Q8_0) lanes_group_512(j, n0, c1, g, pt, FMT_Q8_0);
            else lanes_group_512(j, n0, c1, g, pt, FMT_Q4_1);
        }
        if (t == 0) lanes_at_wait(j); /* the copy of a overlaps the other workers' first panels */
        const int64_t f0 = n0 + LANES512_W, f1 = f0 + LANES512_W < j->N ? f0 + LANES512_W : j->N;
        for (int64_t q = 0; q < Q; ++q) /* the quad's rows of at stay in L1 over the tile */
            lanes_tile_512(j, pt, q, 0, n0, c1, park, q == 0 ? f0 : 0, q == 0 ? f1 : 0);
    }
}

/* Rows 0 .. M-1 of columns c0 .. c1-1 (M < LANES512_MIN_M; else the lanes path): the columns in groups
 * of ROWS_COLS (M == 1: the whole unit), each group's rows in passes of up to ROWS512 rows
 * (the pass's rows of a stay in L1: ROWS512 rows when K <= QUARTER_MAX_K, else 4). Only which
 * rows and columns share a dequantized block changes with M: each element's chains and tree
 * are the declared ones. */
static AVX512 void unit_512(const job_t *j, int64_t c0, int64_t c1, float *panel) {
    if (j->lanes) { /* M >= LANES512_MIN_M: the AVX-512 lanes path (lmtail_gemm_q_cat picks) */
        lanes_unit_512(j, c0, c1, panel);
        return;
    }
    const int most = j->K <= QUARTER_MAX_K ? ROWS512 : 4;
    const int64_t group = j->M == 1 ? c1 - c0 : ROWS_COLS;
    for (int64_t n = c0; n < c1; n += group) {
        const int64_t n1 = c1 - n < group ? c1 : n + group;
        for (int64_t m = 0; m < j->M;) {
            int R = j->M - m < most ? (int)(j->M - m) : most;
            if (R == most && j->M - m < 2 * most && j->M - m > most) R = (int)((j->M - m + 1) / 2); /* even passes */
            PASS512[R](j, m, n, n1, j->fmt);
            m += R;
        }
    }
}
#endif

/* ---------------------------------------------------------------- workers */
static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    const unsigned csr = lmtail_mxcsr_pin(LMTAIL_MXCSR_IEEE);
    /* the panel: plain C one row [K]; the AVX2 lanes path [chunk, K], the AVX-512 one [48, K];
     * and their parked lanes */
    float *panel = NULL;
    const int64_t rows = j->isa == ISA_C ? 1 : !j->lanes ? 0 : j->isa == ISA_AVX512 ? LANES512_W : j->chunk;
    const int64_t extra = j->lanes ? 6 * 12 * 16 : 0; /* the lanes paths' parked nodes (AVX2 uses half) */
    const int ok = rows == 0 || !posix_memalign((void **)&panel, 64, sizeof(float) * (rows * j->K + extra));
#if defined(__x86_64__)
    if (j->lanes) lanes_at_take(j); /* also without a panel: lanes_unit waits for at */
#endif
    while (ok) { /* a worker without a panel takes no unit; the others take them all */
        const int64_t u = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (u >= j->units) break;
        const int64_t c0 = u * j->chunk, c1 = j->N - c0 < j->chunk ? j->N : c0 + j->chunk;
#if defined(__x86_64__)
        if (j->isa == ISA_AVX512) unit_512(j, c0, c1, panel);
        else if (j->isa == ISA_AVX2) unit_avx2(j, c0, c1, panel);
        else
#endif
            unit_c(j, c0, c1, panel);
        __atomic_fetch_add(&j->done, 1, __ATOMIC_RELAXED);
    }
    free(panel);
    lmtail_mxcsr_restore(csr);
    return NULL;
}

/* ---------------------------------------------------------------- exported */
/* 1 if this CPU runs `isa` (0 c, 1 avx2: AVX2+FMA+F16C, 2 avx512: F/BW/VL/DQ+F16C). */
int lmtail_gemm_q_has(int isa) {
    if (isa == ISA_C) return 1;
#if defined(__x86_64__)
    const int f16c = lmtail_cpu_has(LMTAIL_CPU_F16C);
    if (isa == ISA_AVX2) return f16c && lmtail_cpu_has(LMTAIL_ISA_AVX2);
    if (isa == ISA_AVX512)
        return f16c && lmtail_cpu_has(LMTAIL_ISA_AVX512) && lmtail_cpu_has(LMTAIL_ISA_AVX2);
#endif
    return 0;
}

/* out = [W_0; W_1; ...]^T applied to a: the nw (1..CAT_MAX) weights ws[s] of ns[s] rows each
 * (one format, one K) as one weight of N = sum ns columns, in the lanes32 order, on up to
 * nthreads threads with `isa`. fmt: 0 Q8_0, 1 Q4_1. Returns 0 on success, -1 on an
 * unavailable isa, -2 when a buffer cannot be allocated, -3 on a bad shape, format or count. */
int lmtail_gemm_q_cat(const float *a, int64_t lda, const uint8_t *const *ws, const int64_t *ns, int nw, int fmt,
                      int64_t K, float *out, int64_t ldc, int64_t M, int nthreads, int isa) {
    if (!lmtail_gemm_q_has(isa)) return -1;
    if ((fmt != FMT_Q8_0 && fmt != FMT_Q4_1) || K <= 0 || K % QK || M < 0 || nw < 1 || nw > CAT_MAX) return -3;
    job_t j;
    memset(&j, 0, sizeof j);
    int64_t N = 0;
    for (int s = 0; s < nw; ++s) {
        if (ns[s] < 0) return -3;
        j.w[s] = ws[s];
        j.end[s] = N += ns[s];
    }
    if (M == 0 || N == 0) return 0;
    j.nw = nw; j.a = a; j.lda = lda; j.fmt = fmt; j.N = N; j.K = K; j.nb = K / QK;
    j.bs = fmt == FMT_Q8_0 ? 34 : 20; j.out = out; j.ldc = ldc; j.M = M; j.isa = isa;
    if (nthreads < 1) nthreads = 1;
    const int64_t by_weight = N * K / MIN_WEIGHT, by_work = M * N * K / MIN_WORK;
    const int64_t work = by_weight > by_work ? by_weight : by_work;
    if (nthreads > work) nthreads = work < 1 ? 1 : (int)work;
    /* about 4 units per thread (even widths); the lanes paths: multiples of 24 (AVX2) or 48 columns, a
     * panel of at most LANES_PANEL floats, about LANES_UNITS units per thread or more */
    j.chunk = ((N + 4 * nthreads - 1) / (4 * nthreads) + 1) / 2 * 2;
    /* the lanes path, or below it rows_cols_avx2 / unit_512's passes */
    j.lanes = isa == ISA_AVX512 ? M >= LANES512_MIN_M
              : isa == ISA_AVX2 && (M >= LANES_MIN_M || (M >= 8 && K > QUARTER_MAX_K));
    float *at = NULL;
    if (j.lanes) {
        if (isa == ISA_AVX512) { /* whole tiles, about LANES_UNITS units per thread, rounded down
                                  * (q|k|v's 20 tiles on 2 threads: 10 units of 2, not 7 of 3) */
            const int64_t tiles = (N + LANES512_W - 1) / LANES512_W, per = tiles / (LANES_UNITS * nthreads);
            j.chunk = (per < 1 ? 1 : per) * LANES512_W;
        } else {
            const int64_t most = LANES_PANEL / K / 24 * 24;
            const int64_t even = (N + LANES_UNITS * nthreads - 1) / (LANES_UNITS * nthreads);
            j.chunk = (even + 23) / 24 * 24;
            if (j.chunk > most) j.chunk = most;
            if (j.chunk < 24) j.chunk = 24;
        }
        if (posix_memalign((void **)&at, 64, sizeof(float) * ((M + 3) / 4 * 4) * K)) return -2;
        j.at = at; /* filled by a worker (lanes_at_take) */
    }
    if (j.chunk < 2) j.chunk = 2;
    j.units = (N + j.chunk - 1) / j.chunk;
    if (nthreads > j.units) nthreads = (int)j.units;
    lmtail_parallel(worker, &j, nthreads);
    free(at);
    return j.done == j.units ? 0 : -2;
}

/* out = a @ W^T: lmtail_gemm_q_cat of the one weight w [N, K]. */
int lmtail_gemm_q(const float *a, int64_t lda, const uint8_t *w, int fmt, int64_t N, int64_t K,
                  float *out, int64_t ldc, int64_t M, int nthreads, int isa) {
    return lmtail_gemm_q_cat(a, lda, &w, &N, 1, fmt, K, out, ldc, M, nthreads, isa);
}
