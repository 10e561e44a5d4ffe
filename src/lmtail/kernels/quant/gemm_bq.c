/* lmtail: y = a @ W^T over GGUF Q8_0 / Q4_1 weights in the declared "bq32" order: block-wise
 * algebra whose every tile product is exact, so AMX TDPBF16PS computes it (CPU kernels, all
 * bit-equal; docs/quant.md "gemm_bq", kernels/quant/gemm_bq.py's gemm_bq_decl).
 *
 * Shape legend: M rows of activations, K the summed axis (K = 32*NB), NB blocks per weight row,
 * N output columns, Ng = ceil(N/16) column groups of 16 (columns past N: q = d = m = 0).
 *   a    [M, lda]            fp32      activations, a[m*lda + k] for k < K
 *   q    [Ng, NB, 16, 16, 2] bf16 bits the block's exact small integers, VNNI pairs:
 *                                      q[g, b, i, c, h] = q_int[16g + c, 32b + 2i + h]
 *                                      (Q8_0: the int8 q; Q4_1: the 4-bit 0..15), exact in bf16
 *   d, m [Ng, NB, 16]        fp32      fp32(d_b), fp32(m_b) of column 16g + c (m: Q4_1 only)
 *   out  [M, ldc]            fp32      out[m*ldc + n] for n < N
 * (kernels/quant/gemm_bq.py's pack_bq makes q, d, m once, at load, from the file's blocks.)
 *
 * Numerics (the declaration "bq32"), for every (m, n) on its own; MXCSR 0x9FC0 for the whole
 * call (round to nearest-even, exceptions masked, FTZ and DAZ, x86 semantics: tininess after
 * rounding), which is what AMX applies to its tile part:
 * 1. Split each fp32 a[m,k] exactly into three bf16 parts by truncation: p0 = a with its low
 *    16 bits cleared; r = a - p0 (exact); p1 = r with its low 16 bits cleared; p2 = r - p1
 *    (exact, a bf16 value). A non-finite a: p0 = a (a NaN: the bf16 quiet NaN 0x7FC0),
 *    p1 = p2 = +0. A part that is zero or subnormal is stored as +0 (DAZ reads a subnormal
 *    part as a zero, and a zero part never changes a chain that starts at +0); so a subnormal
 *    a has three +0 parts. The split is computed once per row per call (split_512 on the
 *    AVX-512 and AMX paths, split_c on the others: the same bytes, lmtail_bq_split).
 * 2. The block's exact small integers q[n,k] as bf16 (exact).
 * 3. Per block b: c = +0; for part p = 0, 1, 2: e = +0, o = +0; for i = 0..15:
 *    e = fma(p[m,32b+2i], q[n,32b+2i], e), o = fma(p[m,32b+2i+1], q[n,32b+2i+1], o);
 *    then c = c + (e + o). (Exactly what TDPBF16PS does per tile instruction: C tile = c,
 *    one instruction per part.) Every product is exact (8 x 8 significant bits).
 * 4. y = +0 before block 0; after each block: Q8_0: y = fma(fp32(d_b), c, y). Q4_1:
 *    y = fma(fp32(d_b), c, y), then y = fma(fp32(m_b), s[m,b], y), where s[m,b] is step 3's c
 *    with every q = 1 (it depends on m and b only: computed once per row and block, s_row).
 * 5. out = y, a NaN stored as 0x7FC00000.
 * Every fma and add rounds once, then flushes a result tiny after rounding to the zero of its
 * sign (FTZ); inputs are read with DAZ (none is subnormal here: parts are flushed, fp16 d and
 * m are normal in fp32, c, s, y are FTZ results). inf/NaN follow IEEE.
 * Cost: 3 parts = 3x the multiply-adds of lanes32 (gemm_q); AMX computes them at the tile rate.
 * Paths: "amx" (tile instructions: A tiles = the parts, B tiles = q, one C tile per 16
 * columns and block, the y epilogue in AVX-512), "avx512" and "avx2" (vector fmas under MXCSR
 * 0x9FC0), "c" (plain C: the fma emulated exactly in double, FTZ/DAZ in software). Blocking
 * over rows and columns only picks which elements share registers or tiles; every element is
 * computed whole by one thread, and rows never share a sum.
 */
#include "lmtail_kernels.h"

enum { FMT_Q8_0 = 0, FMT_Q4_1 = 1 };
enum { ISA_C = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AMX = 3 };
/* QK lanes per block; GW columns per group (one zmm of fp32, one C tile); TILE_Q bf16 per
 * group and block (16 pairs x 16 columns x 2); MR512 rows per AVX-512 pass; a thread gets at
 * least MIN_WEIGHT weights or MIN_WORK multiply-adds; about UNITS units per thread. */
enum { QK = 32, GW = 16, TILE_Q = 512, MR512 = 4, MIN_WEIGHT = 1 << 16, MIN_WORK = 1 << 20, UNITS = 4 };

typedef struct {
    const uint16_t *q;     /* [Ng, NB, 16, 32] */
    const float *d, *mn;   /* [Ng, NB, 16]; mn NULL for Q8_0 */
    const float *pf;       /* [M, 3, K] the parts widened to fp32 (vector and C paths) */
    const uint16_t *pb;    /* [3, Mp, K] the parts as bf16, rows past M zero (AMX) */
    const float *s;        /* [M, NB] step 4's s (Q4_1) */
    float *out;
    int64_t ldc, M, Mp, N, K, nb, ng, chunk, units; /* chunk: groups per unit */
    int fmt, isa;
    int64_t next, done; /* next unit to take, units finished (atomic) */
} job_t;

/* ---------------------------------------------------------------- the split (step 1) and s */
/* A bf16 pattern that is zero or subnormal -> +0. */
static inline uint16_t flushz16(uint32_t h) { return (h & 0x7F80u) ? (uint16_t)h : 0; }

/* The three parts of one fp32 a (step 1), any MXCSR: the subtractions are exact, and a
 * subnormal difference (kept under IEEE, flushed under FTZ) ends as a +0 part either way. */
static inline void split1(float a, uint16_t *p) {
    const uint32_t u = f2u(a), ex = u & 0x7F800000u;
    if (ex == 0x7F800000u) {
        p[0] = (u & 0x7FFFFFu) ? 0x7FC0 : (uint16_t)(u >> 16);
        p[1] = p[2] = 0;
        return;
    }
    if (ex == 0) {
        p[0] = p[1] = p[2] = 0;
        return;
    }
    p[0] = (uint16_t)(u >> 16);
    const float r = a - u2f(u & 0xFFFF0000u);
    const uint32_t ur = f2u(r);
    const float r2 = r - u2f(ur & 0xFFFF0000u);
    p[1] = flushz16(ur >> 16);
    p[2] = flushz16(f2u(r2) >> 16);
}

/* Row m's parts: pf[3][K] fp32 (and pb[p*pstride + k] bf16 when pb). */
static void split_c(const float *a, int64_t K, float *pf, uint16_t *pb, int64_t pstride) {
    for (int64_t k = 0; k < K; ++k) {
        uint16_t p[3];
        split1(a[k], p);
        for (int t = 0; t < 3; ++t) {
            pf[t * K + k] = bf16_to_f32(p[t]);
            if (pb) pb[t * pstride + k] = p[t];
        }
    }
}

/* s[b] for one row (step 4: step 3's c with q = 1; fma(p, 1, e) is the add e + p): add_ftz,
 * the same bytes under any MXCSR (its inputs are never subnormal). pf: the row's [3][K]. */
static void s_row(const float *pf, int64_t K, float *s) {
    for (int64_t b = 0; b < K / QK; ++b) {
        float c = 0.0f;
        for (int t = 0; t < 3; ++t) {
            const float *p = pf + t * K + QK * b;
            float e = 0.0f, o = 0.0f;
            for (int i = 0; i < QK; i += 2) {
                e = add_ftz(e, p[i]);
                o = add_ftz(o, p[i + 1]);
            }
            c = add_ftz(c, add_ftz(e, o));
        }
        s[b] = c;
    }
}

/* s_row with the hardware's fp32 adds: the same bytes when MXCSR has FTZ|DAZ (0x9FC0: an add
 * of two non-subnormal floats rounded, then flushed when tiny, is add_ftz). The vector and AMX
 * paths' prologue runs it; its six chains per block are independent (no branch per add). */
static void s_row_ftz(const float *pf, int64_t K, float *s) {
    for (int64_t b = 0; b < K / QK; ++b) {
        float e[3] = {0.0f, 0.0f, 0.0f}, o[3] = {0.0f, 0.0f, 0.0f};
        for (int i = 0; i < QK; i += 2)
            for (int t = 0; t < 3; ++t) {
                e[t] = e[t] + pf[t * K + QK * b + i];
                o[t] = o[t] + pf[t * K + QK * b + i + 1];
            }
        float c = 0.0f;
        for (int t = 0; t < 3; ++t) c = c + (e[t] + o[t]);
        s[b] = c;
    }
}

/* ---------------------------------------------------------------- plain C */
/* Step 3 for column n (group g, column c of it), row m, block b. */
static float block_c(const job_t *j, const float *pr, int64_t g, int c, int64_t b) {
    const uint16_t *qb = j->q + (g * j->nb + b) * TILE_Q + 2 * c;
    float acc = 0.0f;
    for (int t = 0; t < 3; ++t) {
        const float *p = pr + t * j->K + QK * b;
        float e = 0.0f, o = 0.0f;
        for (int i = 0; i < 16; ++i) {
            e = fma_ftz(p[2 * i], bf16_to_f32(qb[32 * i]), e);
            o = fma_ftz(p[2 * i + 1], bf16_to_f32(qb[32 * i + 1]), o);
        }
        acc = add_ftz(acc, add_ftz(e, o));
    }
    return acc;
}

static void unit_c(const job_t *j, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
        for (int c = 0; c < GW && GW * g + c < j->N; ++c)
            for (int64_t m = 0; m < j->M; ++m) {
                const float *pr = j->pf + m * 3 * j->K;
                float y = 0.0f;
                for (int64_t b = 0; b < j->nb; ++b) {
                    const int64_t x = (g * j->nb + b) * GW + c;
                    y = fma_ftz(j->d[x], block_c(j, pr, g, c, b), y);
                    if (j->fmt == FMT_Q4_1) y = fma_ftz(j->mn[x], j->s[m * j->nb + b], y);
                }
                j->out[m * j->ldc + GW * g + c] = canon_nan(y);
            }
}

#if defined(__x86_64__)
#define AI inline __attribute__((always_inline))
/* ---------------------------------------------------------------- AVX-512 */
#define AVX512 LMTAIL_TARGET_AVX512

/* Row a's parts (step 1) 16 lanes at a time, the ops of split1 (MXCSR 0x9FC0: a subnormal
 * difference is flushed here, kept by split1 under IEEE; either way a +0 part). */
static AVX512 void split_512(const float *a, int64_t K, float *pf, uint16_t *pb, int64_t pstride) {
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u), expo = _mm512_set1_epi32(0x7F800000);
    const __m512i man = _mm512_set1_epi32(0x7FFFFF), qnan = _mm512_set1_epi32(0x7FC00000);
    const __m512i e16 = _mm512_set1_epi32(0x7F800000);
    for (int64_t k = 0; k < K; k += 16) { /* K is a multiple of 32 */
        const __m512i u = _mm512_loadu_si512(a + k), ex = _mm512_and_si512(u, expo);
        const __mmask16 inf_nan = _mm512_cmpeq_epi32_mask(ex, expo);
        const __mmask16 nan = inf_nan & _mm512_test_epi32_mask(u, man);
        const __mmask16 normal = ~inf_nan & _mm512_test_epi32_mask(u, expo);
        const __m512i h0 = _mm512_and_si512(u, hi);
        const __m512 r = _mm512_sub_ps(_mm512_castsi512_ps(u), _mm512_castsi512_ps(h0));
        const __m512i h1 = _mm512_and_si512(_mm512_castps_si512(r), hi);
        const __m512 r2 = _mm512_sub_ps(r, _mm512_castsi512_ps(h1));
        const __m512i h2 = _mm512_and_si512(_mm512_castps_si512(r2), hi);
        __m512i part[3];
        part[0] = _mm512_mask_mov_epi32(_mm512_maskz_mov_epi32(normal | inf_nan, h0), nan, qnan);
        /* p1, p2: +0 unless a is normal and the part's exponent is nonzero */
        part[1] = _mm512_maskz_mov_epi32(normal & _mm512_test_epi32_mask(h1, e16), h1);
        part[2] = _mm512_maskz_mov_epi32(normal & _mm512_test_epi32_mask(h2, e16), h2);
        for (int t = 0; t < 3; ++t) {
            _mm512_storeu_ps(pf + t * K + k, _mm512_castsi512_ps(part[t]));
            if (pb) _mm256_storeu_si256((__m256i *)(pb + t * pstride + k),
                                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(part[t], 16)));
        }
    }
}

/* Rows m0 .. m0+R-1 x the 16 columns of group g (mk: those < N), all blocks: step 3 as vector
 * fmas (lane c = column 16g + c; 6 chains e, o per row: part t, even / odd lanes), step 4's
 * y in registers. MXCSR 0x9FC0, so each fma / add is the declared FTZ one. q, d, m are read
 * unaligned (a BqPacked's tensors need not start on 64 bytes).
 * ESTIMATE (llvm-mca, not a measurement) of the pair loop `for i` as gcc 12 -O3 compiles it at
 * R = 4 (one 64-byte q load, 2 integer ops, 24 fmas with {1to16} broadcast activations, and
 * one zmm spilled and reloaded: 31 live zmm), cycles per iteration (200 iterations):
 * mca-14 sapphirerapids 14.1 (block RThroughput 13.5), mca-14 icelake-server 14.1, mca-19
 * sapphirerapids 25.1, mca-19 znver4 24.1 (mca-14 has no znver4 model and its znver3 no
 * AVX-512). 24 fmas at 2 zmm FMAs a cycle are 12 cycles: the loop is FMA-bound (SPR mca-14),
 * 0.5 cycle per fma on Zen 4 / mca-19 (1 zmm fma a cycle). */
static AI AVX512 void rows_512(const int R, const job_t *j, int64_t m0, int64_t g, __mmask16 mk) {
    const int64_t nb = j->nb, K = j->K;
    const uint16_t *qg = j->q + g * nb * TILE_Q;
    const float *dg = j->d + g * nb * GW, *mg = j->mn ? j->mn + g * nb * GW : NULL;
    const float *P = j->pf + m0 * 3 * K; /* [R][3][K] */
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 y[MR512];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512 e[MR512][3], o[MR512][3];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
            for (int t = 0; t < 3; ++t) e[r][t] = o[r][t] = _mm512_setzero_ps();
        const uint16_t *qb = qg + b * TILE_Q;
        const float *pb = P + QK * b;
        for (int i = 0; i < 16; ++i) {
            const __m512i x = _mm512_loadu_si512(qb + 32 * i);
            const __m512 qe = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
            const __m512 qo = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
                for (int t = 0; t < 3; ++t) {
                    const float *pp = pb + (3 * r + t) * K + 2 * i;
                    e[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(pp[0]), qe, e[r][t]);
                    o[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(pp[1]), qo, o[r][t]);
                }
        }
        const __m512 dv = _mm512_loadu_ps(dg + GW * b);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            __m512 c = _mm512_add_ps(_mm512_setzero_ps(), _mm512_add_ps(e[r][0], o[r][0]));
            c = _mm512_add_ps(c, _mm512_add_ps(e[r][1], o[r][1]));
            c = _mm512_add_ps(c, _mm512_add_ps(e[r][2], o[r][2]));
            y[r] = _mm512_fmadd_ps(dv, c, y[r]);
            if (mg) y[r] = _mm512_fmadd_ps(_mm512_loadu_ps(mg + GW * b), _mm512_set1_ps(j->s[(m0 + r) * nb + b]), y[r]);
        }
    }
    const __m512 qnan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
        const __m512 v = _mm512_mask_mov_ps(y[r], _mm512_cmp_ps_mask(y[r], y[r], _CMP_UNORD_Q), qnan);
        _mm512_mask_storeu_ps(j->out + (m0 + r) * j->ldc + GW * g, mk, v);
    }
}

#define ROWS512_N(R) \
    static AVX512 __attribute__((noinline)) void rows512_##R(const job_t *j, int64_t m0, int64_t g, __mmask16 mk) { \
        rows_512(R, j, m0, g, mk); \
    }
ROWS512_N(1) ROWS512_N(2) ROWS512_N(3) ROWS512_N(4)
typedef void (*rows512_fn)(const job_t *, int64_t, int64_t, __mmask16);
static const rows512_fn ROWS512[MR512 + 1] = {0, rows512_1, rows512_2, rows512_3, rows512_4};

static inline __mmask16 cols_mask(const job_t *j, int64_t g) {
    const int64_t left = j->N - GW * g;
    return left >= GW ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

static AVX512 void unit_512(const job_t *j, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
        for (int64_t m = 0; m < j->M; m += MR512) {
            const int R = j->M - m < MR512 ? (int)(j->M - m) : MR512;
            ROWS512[R](j, m, g, cols_mask(j, g));
        }
}

/* ---------------------------------------------------------------- AVX2 */
#define AVX2 LMTAIL_TARGET_AVX2_FMA

/* Row m x 8 columns (half h of group g): rows_512's steps on 8 lanes. */
static AVX2 void row_avx2(const job_t *j, int64_t m, int64_t g, int h) {
    const int64_t nb = j->nb, K = j->K;
    const uint16_t *qg = j->q + g * nb * TILE_Q + 16 * h;
    const float *dg = j->d + g * nb * GW + 8 * h, *mg = j->mn ? j->mn + g * nb * GW + 8 * h : NULL;
    const float *P = j->pf + m * 3 * K;
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 y = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256 e[3], o[3];
        for (int t = 0; t < 3; ++t) e[t] = o[t] = _mm256_setzero_ps();
        const uint16_t *qb = qg + b * TILE_Q;
        const float *pb = P + QK * b;
        for (int i = 0; i < 16; ++i) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(qb + 32 * i));
            const __m256 qe = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
            const __m256 qo = _mm256_castsi256_ps(_mm256_and_si256(x, hi));
            for (int t = 0; t < 3; ++t) {
                e[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(pb + t * K + 2 * i), qe, e[t]);
                o[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(pb + t * K + 2 * i + 1), qo, o[t]);
            }
        }
        __m256 c = _mm256_add_ps(_mm256_setzero_ps(), _mm256_add_ps(e[0], o[0]));
        c = _mm256_add_ps(c, _mm256_add_ps(e[1], o[1]));
        c = _mm256_add_ps(c, _mm256_add_ps(e[2], o[2]));
        y = _mm256_fmadd_ps(_mm256_loadu_ps(dg + GW * b), c, y);
        if (mg) y = _mm256_fmadd_ps(_mm256_loadu_ps(mg + GW * b), _mm256_broadcast_ss(j->s + m * nb + b), y);
    }
    float v[8];
    _mm256_storeu_ps(v, y);
    for (int c = 0; c < 8 && GW * g + 8 * h + c < j->N; ++c) j->out[m * j->ldc + GW * g + 8 * h + c] = canon_nan(v[c]);
}

static AVX2 void unit_avx2(const job_t *j, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
        for (int h = 0; h < 2 && GW * g + 8 * h < j->N; ++h)
            for (int64_t m = 0; m < j->M; ++m) row_avx2(j, m, g, h);
}

/* ---------------------------------------------------------------- AMX */
#define AMX LMTAIL_TARGET_AMX

/* The one tile configuration: palette 1, tiles 0-7 all 16 rows x 64 bytes, 8-15 unused.
 * A static const object in .rodata, never a local: GCC's _tile_loadconfig names only an
 * 8-byte memory operand, so the stores filling a local config are dead to the compiler and
 * get dropped, and LDTILECFG faults (#GP) on the half-written bytes (gemm_amx32.c's lesson).
 * Checked in the generated code (gcc 12 -O3, the kernels' flags): `objdump -d` of the built
 * library shows amx_config as `ldtilecfg 0x44d7(%rip)  # 7000 <AMX_CFG>` then `ret`, and
 * `objdump -t` AMX_CFG as a 0x40-byte object in .rodata: no stores build a config
 * (tests/test_gemm_bq.py runs tests/test_amx_config.py's assembly check on this file). */
static const lmtail_tilecfg AMX_CFG = {
    .palette_id = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

static AMX void amx_config(void) { _tile_loadconfig(&AMX_CFG); }
static AMX void amx_release(void) { _tile_release(); }

/* Rows m0 .. m0+15 (of the padded Mp) x groups g, g+1 (G = 1 or 2 of them): tiles 0-1 C (one
 * per group), 2-4 A (the three parts: 16 rows x 32 lanes of block b), 5-6 B (the group's q,
 * 16 pairs x 16 columns). Per block: C = 0, then one TDPBF16PS per part (step 3, exactly:
 * each instruction is c = c + (e + o) over the part's 16 pairs), the C tiles stored to cbuf,
 * and y = fma(d, c, y) (+ fma(m, s, y)) in AVX-512 on ybuf, the rows below M only.
 * ESTIMATE (llvm-mca, not a measurement: no AMX CPU here) of the block loop `for b` at G = 2,
 * Q8_0, 16 rows (5 tile loads, 2 tilezero, 6 TDPBF16PS, 2 tile stores, then 32 x (load c, fma
 * into y, store y)): neither mca-14 nor mca-19 models the tile instructions (each is
 * "unsupported", a 100-cycle placeholder latency), so only the AVX-512 epilogue is estimated:
 * 33.2 cycles per block (mca-14 sapphirerapids; mca-19 32.2; Block RThroughput 33 / 32: the
 * 32 stores and 64 loads), against the 6 TDPBF16PS of 16 x 16 x 32 pair products each. */
static AMX void tile_amx(const job_t *j, int64_t m0, int64_t g, int G, float *cbuf, float *ybuf) {
    const int64_t nb = j->nb, K = j->K, rows = j->M - m0 < 16 ? j->M - m0 : 16;
    const uint16_t *A = j->pb + m0 * K;
    for (int64_t x = 0; x < 16 * 32; x += 16) _mm512_store_ps(ybuf + x, _mm512_setzero_ps());
    for (int64_t b = 0; b < nb; ++b) {
        _tile_loadd(2, A + QK * b, 2 * K);
        _tile_loadd(3, A + j->Mp * K + QK * b, 2 * K);
        _tile_loadd(4, A + 2 * j->Mp * K + QK * b, 2 * K);
        _tile_loadd(5, j->q + (g * nb + b) * TILE_Q, 64);
        _tile_zero(0);
        _tile_dpbf16ps(0, 2, 5);
        _tile_dpbf16ps(0, 3, 5);
        _tile_dpbf16ps(0, 4, 5);
        if (G > 1) {
            _tile_loadd(6, j->q + ((g + 1) * nb + b) * TILE_Q, 64);
            _tile_zero(1);
            _tile_dpbf16ps(1, 2, 6);
            _tile_dpbf16ps(1, 3, 6);
            _tile_dpbf16ps(1, 4, 6);
        }
        _tile_stored(0, cbuf, 128);
        if (G > 1) _tile_stored(1, cbuf + 16, 128);
        for (int h = 0; h < G; ++h) {
            const int64_t x = ((g + h) * nb + b) * GW;
            const __m512 dv = _mm512_loadu_ps(j->d + x);
            if (j->fmt == FMT_Q4_1) {
                const __m512 mv = _mm512_loadu_ps(j->mn + x);
                for (int64_t r = 0; r < rows; ++r) {
                    float *yr = ybuf + 32 * r + 16 * h;
                    __m512 y = _mm512_fmadd_ps(dv, _mm512_load_ps(cbuf + 32 * r + 16 * h), _mm512_load_ps(yr));
                    y = _mm512_fmadd_ps(mv, _mm512_set1_ps(j->s[(m0 + r) * nb + b]), y);
                    _mm512_store_ps(yr, y);
                }
            } else {
                for (int64_t r = 0; r < rows; ++r) {
                    float *yr = ybuf + 32 * r + 16 * h;
                    _mm512_store_ps(yr, _mm512_fmadd_ps(dv, _mm512_load_ps(cbuf + 32 * r + 16 * h), _mm512_load_ps(yr)));
                }
            }
        }
    }
    const __m512 qnan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000));
    for (int h = 0; h < G; ++h) {
        const __mmask16 mk = cols_mask(j, g + h);
        for (int64_t r = 0; r < rows; ++r) {
            const __m512 y = _mm512_load_ps(ybuf + 32 * r + 16 * h);
            _mm512_mask_storeu_ps(j->out + (m0 + r) * j->ldc + GW * (g + h), mk,
                                  _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), qnan));
        }
    }
}

/* Groups g0 .. g1-1, two at a time, each pair over every 16 rows. */
static AMX void unit_amx(const job_t *j, int64_t g0, int64_t g1, float *cbuf, float *ybuf) {
    for (int64_t g = g0; g < g1; g += 2)
        for (int64_t m = 0; m < j->M; m += 16) tile_amx(j, m, g, g1 - g > 1 ? 2 : 1, cbuf, ybuf);
}
#endif

/* ---------------------------------------------------------------- workers */
static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    /* MXCSR 0x9FC0 (FTZ|DAZ) for the vector and tile paths; the plain C path does both in
     * software and needs IEEE subnormals from the hardware for its exact double fma */
    const unsigned csr = lmtail_mxcsr_pin(j->isa == ISA_C ? LMTAIL_MXCSR_IEEE : LMTAIL_MXCSR_FTZ_DAZ);
    float *buf = NULL;
    const int ok = j->isa != ISA_AMX || !posix_memalign((void **)&buf, 64, sizeof(float) * 2 * 16 * 32);
#if defined(__x86_64__)
    if (ok && j->isa == ISA_AMX) amx_config();
#endif
    while (ok) { /* a worker without its buffer takes no unit; the others take them all */
        const int64_t u = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (u >= j->units) break;
        const int64_t g0 = u * j->chunk, g1 = j->ng - g0 < j->chunk ? j->ng : g0 + j->chunk;
#if defined(__x86_64__)
        if (j->isa == ISA_AMX) unit_amx(j, g0, g1, buf, buf + 16 * 32);
        else if (j->isa == ISA_AVX512) unit_512(j, g0, g1);
        else if (j->isa == ISA_AVX2) unit_avx2(j, g0, g1);
        else
#endif
            unit_c(j, g0, g1);
        __atomic_fetch_add(&j->done, 1, __ATOMIC_RELAXED);
    }
#if defined(__x86_64__)
    if (ok && j->isa == ISA_AMX) amx_release();
#endif
    lmtail_mxcsr_restore(csr);
    free(buf);
    return NULL;
}

/* ---------------------------------------------------------------- the packed weight */
static inline uint16_t ld16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* fp16 bits -> fp32, exact (subnormal halves become normal floats; inf/NaN kept). */
static inline float half_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (e == 0x1F) return u2f(sign | 0x7F800000u | (mant << 13));
    if (e == 0) return u2f(f2u((float)mant * 0x1p-24f) | sign); /* mant * 2^-24: exact */
    return u2f(sign | ((e + 112) << 23) | (mant << 13));
}

/* pack_bq's layout (kernels/quant/gemm_bq.py's BqPacked) from the file's blocks w [N, NB, BS]:
 * q [Ng, NB, 16, 32] bf16 (VNNI pairs of the block's integers, exact), d, m [Ng, NB, 16] fp32
 * (m only for Q4_1), columns past N zero. Returns 0, or -3 on a bad format or shape. */
int lmtail_bq_pack(const uint8_t *w, int fmt, int64_t N, int64_t K, uint16_t *q, float *d, float *mn) {
    if ((fmt != FMT_Q8_0 && fmt != FMT_Q4_1) || K <= 0 || K % QK || N < 0) return -3;
    const int64_t nb = K / QK, ng = (N + GW - 1) / GW, bs = fmt == FMT_Q8_0 ? 34 : 20;
    memset(q, 0, sizeof(uint16_t) * ng * nb * TILE_Q);
    memset(d, 0, sizeof(float) * ng * nb * GW);
    if (fmt == FMT_Q4_1) memset(mn, 0, sizeof(float) * ng * nb * GW);
    for (int64_t n = 0; n < N; ++n) {
        const int64_t g = n / GW, c = n % GW;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = w + (n * nb + b) * bs;
            const int64_t x = (g * nb + b) * GW + c;
            uint16_t *qt = q + (g * nb + b) * TILE_Q + 2 * c;
            d[x] = half_to_f32(ld16(blk));
            if (fmt == FMT_Q4_1) mn[x] = half_to_f32(ld16(blk + 2));
            for (int k = 0; k < QK; ++k) {
                const int v = fmt == FMT_Q8_0 ? (int8_t)blk[2 + k] : k < 16 ? blk[4 + k] & 15 : blk[4 + k - 16] >> 4;
                qt[(k / 2) * 2 * GW + (k & 1)] = (uint16_t)(f2u((float)v) >> 16); /* <= 8 bits: exact */
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- exported */
/* 1 if this CPU (and OS, for AMX) runs `isa` (0 c, 1 avx2: AVX2+FMA, 2 avx512: F/BW/VL/DQ,
 * 3 amx: AMX-TILE + AMX-BF16 with the OS's tile permission, and AVX-512). */
int lmtail_bq_has(int isa) {
    if (isa == ISA_C) return 1;
#if defined(__x86_64__)
    if (isa == ISA_AVX2) return lmtail_cpu_has(LMTAIL_ISA_AVX2);
    if (isa == ISA_AVX512) return lmtail_cpu_has(LMTAIL_ISA_AVX512);
    if (isa == ISA_AMX) return lmtail_cpu_has(LMTAIL_ISA_AVX512 | LMTAIL_CPU_AMX_BF16);
#endif
    return 0;
}

/* Step 1 and s for rows 0..M-1 as path `isa` computes them (its MXCSR pinned): parts
 * [M, 3, K] fp32 (the bf16 values widened) and s [M, NB]; pb [3, Mp, K] bf16 when not NULL.
 * Every path gives the same bytes (tests read them through lmtail_bq_split). */
static void prologue(const float *a, int64_t lda, int64_t M, int64_t Mp, int64_t K, int isa, float *pf,
                     uint16_t *pb, float *s) {
    const unsigned csr = lmtail_mxcsr_pin(isa == ISA_C ? LMTAIL_MXCSR_IEEE : LMTAIL_MXCSR_FTZ_DAZ);
    for (int64_t m = 0; m < M; ++m) {
        float *pr = pf + m * 3 * K;
        uint16_t *br = pb ? pb + m * K : NULL;
#if defined(__x86_64__)
        if (isa >= ISA_AVX512) split_512(a + m * lda, K, pr, br, Mp * K);
        else
#endif
            split_c(a + m * lda, K, pr, br, Mp * K);
        if (s && isa == ISA_C) s_row(pr, K, s + m * (K / QK));
        else if (s) s_row_ftz(pr, K, s + m * (K / QK)); /* MXCSR 0x9FC0 pinned above */
    }
    lmtail_mxcsr_restore(csr);
}

int lmtail_bq_split(const float *a, int64_t lda, int64_t M, int64_t K, int isa, float *pf, float *s) {
    if (!lmtail_bq_has(isa)) return -1;
    if (K <= 0 || K % QK || M < 0) return -3;
    prologue(a, lda, M, M, K, isa, pf, NULL, s);
    return 0;
}

/* out = a @ W^T in the bq32 order, W packed as q, d (, m) (pack_bq), on up to nthreads threads
 * with `isa`. fmt: 0 Q8_0, 1 Q4_1. Returns 0 on success, -1 on an unavailable isa, -2 when a
 * buffer cannot be allocated, -3 on a bad shape or format. */
int lmtail_bq_gemm(const float *a, int64_t lda, const uint16_t *q, const float *d, const float *mn, int fmt,
                   int64_t N, int64_t K, float *out, int64_t ldc, int64_t M, int nthreads, int isa) {
    if (!lmtail_bq_has(isa)) return -1;
    if ((fmt != FMT_Q8_0 && fmt != FMT_Q4_1) || K <= 0 || K % QK || M < 0 || N < 0) return -3;
    if (M == 0 || N == 0) return 0;
    job_t j;
    memset(&j, 0, sizeof j);
    j.q = q; j.d = d; j.mn = fmt == FMT_Q4_1 ? mn : NULL; j.fmt = fmt; j.isa = isa;
    j.out = out; j.ldc = ldc; j.M = M; j.N = N; j.K = K; j.nb = K / QK; j.ng = (N + GW - 1) / GW;
    j.Mp = isa == ISA_AMX ? (M + 15) / 16 * 16 : M;
    float *pf = NULL, *s = NULL;
    uint16_t *pb = NULL;
    if (posix_memalign((void **)&pf, 64, sizeof(float) * 3 * M * K + 64) ||
        (fmt == FMT_Q4_1 && posix_memalign((void **)&s, 64, sizeof(float) * M * j.nb + 64)) ||
        (isa == ISA_AMX && posix_memalign((void **)&pb, 64, sizeof(uint16_t) * 3 * j.Mp * K + 64))) {
        free(pf); free(s); free(pb);
        return -2;
    }
    if (pb) memset(pb, 0, sizeof(uint16_t) * 3 * j.Mp * K); /* rows past M: +0 parts */
    prologue(a, lda, M, j.Mp, K, isa, pf, pb, s);
    j.pf = pf; j.pb = pb; j.s = s;
    if (nthreads < 1) nthreads = 1;
    const int64_t by_weight = N * K / MIN_WEIGHT, by_work = 3 * M * N * K / MIN_WORK;
    const int64_t work = by_weight > by_work ? by_weight : by_work;
    if (nthreads > work) nthreads = work < 1 ? 1 : (int)work;
    /* about UNITS units per thread, whole groups (AMX: pairs of groups) */
    const int64_t step = isa == ISA_AMX ? 2 : 1;
    j.chunk = (j.ng + UNITS * nthreads - 1) / (UNITS * nthreads);
    j.chunk = (j.chunk + step - 1) / step * step;
    if (j.chunk < step) j.chunk = step;
    j.units = (j.ng + j.chunk - 1) / j.chunk;
    if (nthreads > j.units) nthreads = (int)j.units;
    lmtail_parallel(worker, &j, nthreads);
    free(pf); free(s); free(pb);
    return j.done == j.units ? 0 : -2;
}
