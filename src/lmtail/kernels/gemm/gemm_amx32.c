/* lmtail: the bf16 GEMM in the declared "amx32" order (CPU kernels, all bit-equal).
 *
 * Shape legend: M rows of activations, H hidden (the summed axis), V columns,
 * NB = ceil(H/32) blocks of 32 K-lanes, Kp = 32*NB (H zero-padded), Vp = V rounded up to 32.
 *   a    [M, H]      bf16 bits, rows lda apart          activations
 *   w    [H, V]      bf16 bits, rows ldw apart          weight (plain layout), or
 *   wp   [Kp/2, Vp, 2] bf16 bits                        weight packed by lmtail_amx32_pack:
 *        wp[(k/2)*2*Vp + 2*v + k%2] = w[k, v] (0 past H or V; subnormals stored as signed 0)
 *   out  [M, ldc]    fp32                               out[m*ldc + v] for v < V
 *
 * Numerics (the declaration; docs/gemm.md): for every (m, v) on its own
 *   acc = +0
 *   for block b = 0, 1, ..., NB-1 (lanes k = 32b + i, i = 0..31; k >= H is a +0*+0 lane):
 *       e = +0; o = +0
 *       for i = 0, 1, ..., 15:  e = fma(a[m,32b+2i], w[32b+2i,v], e)
 *                               o = fma(a[m,32b+2i+1], w[32b+2i+1,v], o)
 *       acc = acc + (e + o)
 *   out = acc, a NaN stored as 0x7FC00000.
 * Every fma and add rounds once to nearest-even in fp32, then flushes a tiny result to the
 * zero of its sign (FTZ, tininess after rounding, as x86); subnormal inputs are read as the
 * zero of their sign (DAZ). This is what AMX TDPBF16PS computes per tile instruction.
 * Paths: "amx" (tile instructions), "avx512" and "avx2" (vector fmas under MXCSR FTZ|DAZ),
 * "c" (plain C: the fma emulated exactly in double, FTZ/DAZ in software). Blocking over k
 * only parks `acc` in `out` between whole 32-lane blocks; blocking over rows and columns
 * only picks which elements share registers; every element is owned by one thread.
 */
#include "lmtail_kernels.h"

enum { ISA_C = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AMX = 3 };
/* Blocking: column tiles of NC (for at most MR512 rows: on one thread 4096 down to 1024, the
 * widest that leaves 4 tiles, so rows of w are read in long runs; on n threads q*n equal
 * tiles of a multiple of 32 columns, at most 1024; AMX: NCA) taken by threads,
 * split in row chunks when there are few tiles; per tile, k blocks of KC lanes (KC_SMALL for
 * few rows) widened once into an fp32 panel (rows >= H and columns >= the tile's width are
 * 0): strip-major for the vector paths, row-major [kc, ldp] for plain C. AVX-512 and AVX2
 * with at most MR512 rows read w directly (no panel; a plain w: stream_512 for at most
 * STREAM_MR rows, stream_avx2).
 * Register tiles: AVX-512 6 rows x 32 columns (24 zmm: e and o), AVX2 2 x 16 (8 ymm: 16
 * registers leave no room for 3 rows). */
enum { NC = 256, KC = 128, WMAX = 4096, KC_SMALL = 32, MR512 = 6, MR2 = 2, NCA = 32, MAXT = LMTAIL_MAXT };
enum { STREAM_MR = 4 }; /* the most rows stream_512 takes; 5 and 6 are faster on direct_512 */
/* Threads per call: a pool thread costs a handoff (about a microsecond while it spins, tens
 * when it sleeps), so each thread gets at least MIN_WORK multiply-adds, or, with at most
 * MR512 rows (where reading w is the cost), MIN_WEIGHT weight elements (256 KiB). */
enum { MIN_WORK = 1 << 20, MIN_WEIGHT = 1 << 17 };


typedef struct {
    const uint16_t *w;  /* plain [H, ldw] or packed [Kp/2, 2*Vp] */
    int packed;
    int64_t ldw, Vp;
    const float *aw;     /* [M, Kp] fp32, DAZ applied, zero past H (emulations) */
    const uint16_t *ab;  /* [Mp, Kp] bf16, DAZ applied, zero past H and M (AMX) */
    float *out;
    int64_t M, H, Kp, V, ldc;
    int64_t rows, nrc, ntiles, width; /* row chunk, number of row chunks, column tiles */
    int small;                        /* M <= MR512: wide tiles, KC_SMALL lanes per panel */
    int isa;
    int64_t next, done; /* next unit to take, units finished (atomic) */
} job_t;


/* w[k, v] of the tile source, in either layout (0 past H and V). */
static inline uint16_t w_at(const job_t *j, int64_t k, int64_t v) {
    if (k >= j->H || v >= j->V) return 0;
    if (j->packed) return j->w[(k >> 1) * 2 * j->Vp + 2 * v + (k & 1)];
    return j->w[k * j->ldw + v];
}

/* ---------------------------------------------------------------- plain C */
/* Widen w[k0:k0+kc, c0:c0+nc] into panel[kc][ldp] (software DAZ; zeros past H, nc). */
static void panel_c(const job_t *j, int64_t k0, int64_t kc, int64_t c0, int64_t nc, int64_t ldp, float *p) {
    for (int64_t k = 0; k < kc; ++k)
        for (int64_t c = 0; c < ldp; ++c)
            p[k * ldp + c] = c < nc ? bf16_daz(w_at(j, k0 + k, c0 + c)) : 0.0f;
}

/* Rows [m0, m0+rows) x columns [c0, c0+nc) over lanes [k0, k0+kc): the declared blocks. */
static void micro_c(const job_t *j, int64_t m0, int64_t rows, const float *p, int64_t k0,
                    int64_t kc, int64_t c0, int64_t nc, int64_t ldp) {
    float e[WMAX], o[WMAX];
    for (int64_t m = m0; m < m0 + rows; ++m) {
        float *acc = j->out + m * j->ldc + c0;
        const float *am = j->aw + m * j->Kp + k0;
        for (int64_t b = 0; b < kc; b += 32) {
            for (int64_t c = 0; c < nc; ++c) e[c] = o[c] = 0.0f;
            for (int64_t i = 0; i < 32; i += 2) {
                const float ae = am[b + i], ao = am[b + i + 1];
                const float *pe = p + (b + i) * ldp, *po = pe + ldp;
                for (int64_t c = 0; c < nc; ++c) {
                    e[c] = fma_ftz(ae, pe[c], e[c]);
                    o[c] = fma_ftz(ao, po[c], o[c]);
                }
            }
            const int first = k0 + b == 0;
            for (int64_t c = 0; c < nc; ++c)
                acc[c] = add_ftz(first ? 0.0f : acc[c], add_ftz(e[c], o[c]));
        }
    }
}

/* ---------------------------------------------------------------- AVX-512 */
#if defined(__x86_64__)
#define AVX512 LMTAIL_TARGET_AVX512

/* The vector panels are strip-major: the [kc, 32] fp32 block of columns [32q, 32q+32) is
 * contiguous (AVX2: [kc, 16] blocks), so the strip one register tile reads stays in L1. */
#define STRIP512(p, kc, k, c) ((p) + ((c) >> 5) * (kc) * 32 + (k) * 32 + ((c) & 31))
#define STRIP2(p, kc, k, c) ((p) + ((c) >> 4) * (kc) * 16 + (k) * 16 + ((c) & 15))

static AVX512 void panel_512(const job_t *j, int64_t k0, int64_t kc, int64_t c0, int64_t nc,
                             int64_t ldp, float *p) {
    for (int64_t k = 0; k < kc; ++k) {
        const int64_t kk = k0 + k;
        if (kk >= j->H) {
            for (int64_t c = 0; c < ldp; c += 16)
                _mm512_store_ps(STRIP512(p, kc, k, c), _mm512_setzero_ps());
            continue;
        }
        if (j->packed) { /* one dword = the (even, odd) pair; this row is one half of it */
            if (kk & 1) continue; /* written with its even row */
            const uint16_t *src = j->w + (kk >> 1) * 2 * j->Vp + 2 * c0;
            const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
            if (kk + 8 < j->H)
                for (int64_t c = 0; c < nc; c += 16)
                    _mm_prefetch((const char *)(src + 4 * 2 * j->Vp + 2 * c), _MM_HINT_T0);
            for (int64_t c = 0; c < ldp; c += 16) {
                __m512i x = c < nc ? _mm512_loadu_si512(src + 2 * c) : _mm512_setzero_si512();
                _mm512_store_ps(STRIP512(p, kc, k, c), _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
                _mm512_store_ps(STRIP512(p, kc, k + 1, c), _mm512_castsi512_ps(_mm512_and_si512(x, hi)));
            }
            continue;
        }
        const uint16_t *src = j->w + kk * j->ldw + c0;
        if (kk + 8 < j->H)
            for (int64_t c = 0; c < nc; c += 32) _mm_prefetch((const char *)(src + 8 * j->ldw + c), _MM_HINT_T0);
        for (int64_t c = 0; c < ldp; c += 16) {
            const int64_t left = nc - c;
            const __mmask16 m = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
            const __m256i x = _mm256_maskz_loadu_epi16(m, src + c);
            _mm512_store_ps(STRIP512(p, kc, k, c),
                            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)));
        }
    }
}

/* ROWS x 32 columns over the lanes of one panel (kc/32 whole blocks). MXCSR has FTZ|DAZ. */
static inline __attribute__((always_inline)) AVX512 void
micro_512(const int ROWS, const float *a, int64_t lda, const float *p, int64_t ldp, int64_t nblk,
          float *c, int64_t ldc, __mmask16 mk0, __mmask16 mk1, int first, int last) {
    for (int64_t b = 0; b < nblk; ++b) {
        __m512 e[MR512][2], o[MR512][2];
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r)
            e[r][0] = e[r][1] = o[r][0] = o[r][1] = _mm512_setzero_ps();
        const float *pb = p + b * 32 * ldp, *ab = a + b * 32;
#pragma GCC unroll 2
        for (int i = 0; i < 32; i += 2) {
            const float *pe = pb + i * ldp;
            const __m512 we0 = _mm512_load_ps(pe), we1 = _mm512_load_ps(pe + 16);
            const __m512 wo0 = _mm512_load_ps(pe + ldp), wo1 = _mm512_load_ps(pe + ldp + 16);
#pragma GCC unroll 8
            for (int r = 0; r < ROWS; ++r) {
                const __m512 be = _mm512_set1_ps(ab[r * lda + i]);
                const __m512 bo = _mm512_set1_ps(ab[r * lda + i + 1]);
                e[r][0] = _mm512_fmadd_ps(be, we0, e[r][0]);
                e[r][1] = _mm512_fmadd_ps(be, we1, e[r][1]);
                o[r][0] = _mm512_fmadd_ps(bo, wo0, o[r][0]);
                o[r][1] = _mm512_fmadd_ps(bo, wo1, o[r][1]);
            }
        }
        const int f = first && b == 0, l = last && b == nblk - 1;
        const __m512 qnan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000));
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 2
            for (int q = 0; q < 2; ++q) {
                const __mmask16 mk = q ? mk1 : mk0;
                float *cq = c + r * ldc + 16 * q;
                const __m512 acc = f ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mk, cq);
                __m512 x = _mm512_add_ps(acc, _mm512_add_ps(e[r][q], o[r][q]));
                if (l) x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), qnan);
                _mm512_mask_storeu_ps(cq, mk, x);
            }
    }
}

#define MICRO512_N(R)                                                                     \
    static AVX512 __attribute__((noinline)) void micro512_##R(                            \
        const float *a, int64_t lda, const float *p, int64_t ldp, int64_t nblk, float *c, \
        int64_t ldc, __mmask16 mk0, __mmask16 mk1, int first, int last) {                 \
        micro_512(R, a, lda, p, ldp, nblk, c, ldc, mk0, mk1, first, last);                \
    }
MICRO512_N(1) MICRO512_N(2) MICRO512_N(3) MICRO512_N(4) MICRO512_N(5) MICRO512_N(6)
typedef void (*micro512_fn)(const float *, int64_t, const float *, int64_t, int64_t, float *, int64_t,
                            __mmask16, __mmask16, int, int);
static const micro512_fn MICRO512[MR512 + 1] = {0, micro512_1, micro512_2, micro512_3,
                                                micro512_4, micro512_5, micro512_6};

/* Few rows (M <= MR512): no panel. ROWS x 32 columns from column c0 over nblk blocks from
 * lane k0, each lane pair read straight from w (plain: two bf16 rows, widened by a shift;
 * packed: one 64-byte load per 16 columns holds both lanes) and prefetched a block ahead. */
static inline __attribute__((always_inline)) AVX512 void
direct_512(const int ROWS, const int PACKED, const job_t *j, const float *a, int64_t lda,
           int64_t k0, int64_t nblk, int64_t c0, float *c, int64_t ldc, __mmask16 mk0,
           __mmask16 mk1, int first, int last) {
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t b = 0; b < nblk; ++b) {
        __m512 e[MR512][2], o[MR512][2];
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r)
            e[r][0] = e[r][1] = o[r][0] = o[r][1] = _mm512_setzero_ps();
        const int64_t kb = k0 + 32 * b;
        const float *ab = a + 32 * b;
#pragma GCC unroll 2
        for (int i = 0; i < 32; i += 2) {
            const int64_t k = kb + i;
            __m512 we0, we1, wo0, wo1;
            if (PACKED) {
                const uint16_t *src = j->w + (k >> 1) * 2 * j->Vp + 2 * c0;
                if (k + 32 < j->Kp) _mm_prefetch((const char *)(src + 32 * j->Vp), _MM_HINT_T0);
                if (k + 32 < j->Kp) _mm_prefetch((const char *)(src + 32 * j->Vp + 32), _MM_HINT_T0);
                const __m512i x0 = _mm512_loadu_si512(src), x1 = _mm512_loadu_si512(src + 32);
                we0 = _mm512_castsi512_ps(_mm512_slli_epi32(x0, 16));
                wo0 = _mm512_castsi512_ps(_mm512_and_si512(x0, hi));
                we1 = _mm512_castsi512_ps(_mm512_slli_epi32(x1, 16));
                wo1 = _mm512_castsi512_ps(_mm512_and_si512(x1, hi));
            } else {
                const uint16_t *src = j->w + k * j->ldw + c0;
                const __mmask16 me0 = k < j->H ? mk0 : 0, me1 = k < j->H ? mk1 : 0;
                const __mmask16 mo0 = k + 1 < j->H ? mk0 : 0, mo1 = k + 1 < j->H ? mk1 : 0;
                if (k + 33 < j->H) {
                    _mm_prefetch((const char *)(src + 32 * j->ldw), _MM_HINT_T0);
                    _mm_prefetch((const char *)(src + 33 * j->ldw), _MM_HINT_T0);
                }
#define WIDEN(m, p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16))
                we0 = WIDEN(me0, src);
                we1 = WIDEN(me1, src + 16);
                wo0 = WIDEN(mo0, src + j->ldw);
                wo1 = WIDEN(mo1, src + j->ldw + 16);
#undef WIDEN
            }
#pragma GCC unroll 8
            for (int r = 0; r < ROWS; ++r) {
                const __m512 be = _mm512_set1_ps(ab[r * lda + i]);
                const __m512 bo = _mm512_set1_ps(ab[r * lda + i + 1]);
                e[r][0] = _mm512_fmadd_ps(be, we0, e[r][0]);
                e[r][1] = _mm512_fmadd_ps(be, we1, e[r][1]);
                o[r][0] = _mm512_fmadd_ps(bo, wo0, o[r][0]);
                o[r][1] = _mm512_fmadd_ps(bo, wo1, o[r][1]);
            }
        }
        const int f = first && b == 0, l = last && b == nblk - 1;
        const __m512 qnan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000));
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 2
            for (int q = 0; q < 2; ++q) {
                const __mmask16 mk = q ? mk1 : mk0;
                float *cq = c + r * ldc + 16 * q;
                const __m512 acc = f ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mk, cq);
                __m512 x = _mm512_add_ps(acc, _mm512_add_ps(e[r][q], o[r][q]));
                if (l) x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), qnan);
                _mm512_mask_storeu_ps(cq, mk, x);
            }
    }
}

#define DIRECT512_N(R, P)                                                                 \
    static AVX512 __attribute__((noinline)) void direct512_##R##_##P(                     \
        const job_t *j, const float *a, int64_t lda, int64_t k0, int64_t nblk, int64_t c0, \
        float *c, int64_t ldc, __mmask16 mk0, __mmask16 mk1, int first, int last) {       \
        direct_512(R, P, j, a, lda, k0, nblk, c0, c, ldc, mk0, mk1, first, last);         \
    }
DIRECT512_N(1, 0) DIRECT512_N(2, 0) DIRECT512_N(3, 0) DIRECT512_N(4, 0) DIRECT512_N(5, 0)
DIRECT512_N(6, 0) DIRECT512_N(1, 1) DIRECT512_N(2, 1) DIRECT512_N(3, 1) DIRECT512_N(4, 1)
DIRECT512_N(5, 1) DIRECT512_N(6, 1)
typedef void (*direct512_fn)(const job_t *, const float *, int64_t, int64_t, int64_t, int64_t,
                             float *, int64_t, __mmask16, __mmask16, int, int);
static const direct512_fn DIRECT512[2][MR512 + 1] = {
    {0, direct512_1_0, direct512_2_0, direct512_3_0, direct512_4_0, direct512_5_0, direct512_6_0},
    {0, direct512_1_1, direct512_2_1, direct512_3_1, direct512_4_1, direct512_5_1, direct512_6_1}};

static inline AVX512 __mmask16 mask16(int64_t left) {
    return left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

/* Few rows, plain w: one strip of ROWS x 32*CW columns over one whole 32-lane block (all
 * lanes below H), wb = its first weight row, ab = its lanes of a. One 64-byte load
 * holds 32 columns of one lane; a shift and a mask split it into its even and its odd
 * columns (16 fp32 each), so e and o live per column parity; a permute puts e + o back in
 * column order before the block add into c; the strip of the next block is prefetched
 * (from DRAM this is 10-20% of the time of a decode step's GEMMs). Each element's operations
 * are the declared ones: only which elements share a register changes. */
static inline __attribute__((always_inline)) AVX512 void
strip_512(const int ROWS, const int CW, const uint16_t *wb, int64_t ldw, const float *ab,
          int64_t lda, float *c, int64_t ldc, int f, int l, int pf) {
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const __m512 qnan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000));
    __m512 e[ROWS][CW][2], o[ROWS][CW][2]; /* [.][.][0]: even columns, [1]: odd */
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
        for (int q = 0; q < CW; ++q)
            e[r][q][0] = e[r][q][1] = o[r][q][0] = o[r][q][1] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int i = 0; i < 32; i += 2) {
        const uint16_t *re = wb + i * ldw, *ro = re + ldw;
#pragma GCC unroll 4
        for (int q = 0; q < CW; ++q) {
            if (pf) { /* this strip of the next block: memory latency hidden */
                _mm_prefetch((const char *)(re + 32 * ldw + 32 * q), _MM_HINT_T0);
                _mm_prefetch((const char *)(ro + 32 * ldw + 32 * q), _MM_HINT_T0);
            }
            const __m512i x = _mm512_loadu_si512(re + 32 * q), y = _mm512_loadu_si512(ro + 32 * q);
            const __m512 xe = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
            const __m512 xo = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
            const __m512 ye = _mm512_castsi512_ps(_mm512_slli_epi32(y, 16));
            const __m512 yo = _mm512_castsi512_ps(_mm512_and_si512(y, hi));
#pragma GCC unroll 8
            for (int r = 0; r < ROWS; ++r) {
                const __m512 be = _mm512_set1_ps(ab[r * lda + i]);
                const __m512 bo = _mm512_set1_ps(ab[r * lda + i + 1]);
                e[r][q][0] = _mm512_fmadd_ps(be, xe, e[r][q][0]);
                e[r][q][1] = _mm512_fmadd_ps(be, xo, e[r][q][1]);
                o[r][q][0] = _mm512_fmadd_ps(bo, ye, o[r][q][0]);
                o[r][q][1] = _mm512_fmadd_ps(bo, yo, o[r][q][1]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
        for (int q = 0; q < CW; ++q) {
            const __m512 se = _mm512_add_ps(e[r][q][0], o[r][q][0]);
            const __m512 so = _mm512_add_ps(e[r][q][1], o[r][q][1]);
            float *cq = c + r * ldc + 32 * q;
            const __m512 s0 = _mm512_permutex2var_ps(se, lo_idx, so);
            const __m512 s1 = _mm512_permutex2var_ps(se, hi_idx, so);
            __m512 x0 = _mm512_add_ps(f ? _mm512_setzero_ps() : _mm512_loadu_ps(cq), s0);
            __m512 x1 = _mm512_add_ps(f ? _mm512_setzero_ps() : _mm512_loadu_ps(cq + 16), s1);
            if (l) {
                x0 = _mm512_mask_mov_ps(x0, _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q), qnan);
                x1 = _mm512_mask_mov_ps(x1, _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q), qnan);
            }
            _mm512_storeu_ps(cq, x0);
            _mm512_storeu_ps(cq + 16, x1);
        }
}

/* RA + RB rows (RB may be 0) x whole strips of 32*CW columns: per block and strip, rows
 * [0, RA) then rows [RA, RA+RB) on the same strip of w (then in L1), so 4-6 rows still read
 * 64-column runs of each lane row with at most 24 accumulators live. */
static inline __attribute__((always_inline)) AVX512 void
stream_512(const int RA, const int RB, const int CW, const job_t *j, const float *a, int64_t lda,
           int64_t k0, int64_t nblk, int64_t c0, int64_t ns, float *c, int64_t ldc, int first,
           int last) {
    const int64_t ldw = j->ldw;
    for (int64_t b = 0; b < nblk; ++b) {
        const float *ab = a + 32 * b;
        const int f = first && b == 0, l = last && b == nblk - 1, pf = b + 1 < nblk;
        for (int64_t s = 0; s < ns; ++s) {
            const uint16_t *wb = j->w + (k0 + 32 * b) * ldw + c0 + 32 * CW * s;
            strip_512(RA, CW, wb, ldw, ab, lda, c + 32 * CW * s, ldc, f, l, pf);
            if (RB) strip_512(RB, CW, wb, ldw, ab + RA * lda, lda, c + RA * ldc + 32 * CW * s, ldc, f, l, 0);
        }
    }
}

#define STREAM512_N(R, RA, RB, CW)                                                        \
    static AVX512 __attribute__((noinline)) void stream512_##R(                           \
        const job_t *j, const float *a, int64_t lda, int64_t k0, int64_t nblk, int64_t c0, \
        int64_t ns, float *c, int64_t ldc, int first, int last) {                         \
        stream_512(RA, RB, CW, j, a, lda, k0, nblk, c0, ns, c, ldc, first, last);         \
    }
STREAM512_N(1, 1, 0, 4) STREAM512_N(2, 2, 0, 2) STREAM512_N(3, 3, 0, 2) STREAM512_N(4, 2, 2, 2)
typedef void (*stream512_fn)(const job_t *, const float *, int64_t, int64_t, int64_t, int64_t,
                             int64_t, float *, int64_t, int, int);
static const stream512_fn STREAM512[STREAM_MR + 1] = {0, stream512_1, stream512_2, stream512_3,
                                                     stream512_4};
static const int STREAM_CW[STREAM_MR + 1] = {0, 4, 2, 2, 2};

/* Rows [m0, m1) (at most STREAM_MR) x columns [c0, c0+nc) of a plain w, every block: the whole
 * strips and blocks by stream_512, the partial last block and the columns past the whole
 * strips by direct_512 (masked loads), each element's blocks still in order. */
static AVX512 void small_plain_512(const job_t *j, int64_t m0, int64_t m1, int64_t c0, int64_t nc) {
    const int rows = (int)(m1 - m0);
    const int64_t sw = 32 * STREAM_CW[rows], ns = nc / sw, nfull = j->H / 32, nb = j->Kp / 32;
    const float *a = j->aw + m0 * j->Kp;
    float *c = j->out + m0 * j->ldc + c0;
    if (ns > 0 && nfull > 0) STREAM512[rows](j, a, j->Kp, 0, nfull, c0, ns, c, j->ldc, 1, nfull == nb);
    if (nfull < nb)
        for (int64_t s = 0; s < ns * sw; s += 32)
            DIRECT512[0][rows](j, a + 32 * nfull, j->Kp, 32 * nfull, 1, c0 + s, c + s, j->ldc,
                               0xFFFF, 0xFFFF, nfull == 0, 1);
    for (int64_t s = ns * sw; s < nc; s += 32)
        DIRECT512[0][rows](j, a, j->Kp, 0, nb, c0 + s, c + s, j->ldc, mask16(nc - s),
                           mask16(nc - s - 16), 1, 1);
}

/* ---------------------------------------------------------------- AVX2 */
#define AVX2 LMTAIL_TARGET_AVX2_FMA

static AVX2 void panel_avx2(const job_t *j, int64_t k0, int64_t kc, int64_t c0, int64_t nc,
                            int64_t ldp, float *p) {
    for (int64_t k = 0; k < kc; ++k) {
        const int64_t kk = k0 + k;
        if (kk >= j->H) {
            for (int64_t c = 0; c < ldp; ++c) *STRIP2(p, kc, k, c) = 0.0f;
            continue;
        }
        if (j->packed) { /* one dword = the (even, odd) pair; written with the even row */
            if (kk & 1) continue;
            const uint16_t *src = j->w + (kk >> 1) * 2 * j->Vp + 2 * c0;
            const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
            for (int64_t c = 0; c < ldp; c += 8) {
                const __m256i x = c < nc ? _mm256_loadu_si256((const __m256i *)(src + 2 * c))
                                         : _mm256_setzero_si256();
                _mm256_store_ps(STRIP2(p, kc, k, c), _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
                _mm256_store_ps(STRIP2(p, kc, k + 1, c), _mm256_castsi256_ps(_mm256_and_si256(x, hi)));
            }
            continue;
        }
        const uint16_t *src = j->w + kk * j->ldw + c0;
        int64_t c = 0;
        for (; c + 8 <= nc; c += 8) {
            const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + c)));
            _mm256_store_ps(STRIP2(p, kc, k, c), _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
        }
        for (; c < ldp; ++c) *STRIP2(p, kc, k, c) = c < nc ? u2f((uint32_t)src[c] << 16) : 0.0f;
    }
}

static inline AVX2 __m256i mask8(int64_t left) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left > 8 ? 8 : left < 0 ? 0 : left)), idx);
}

static inline __attribute__((always_inline)) AVX2 void
micro_avx2(const int ROWS, const float *a, int64_t lda, const float *p, int64_t ldp, int64_t nblk,
           float *c, int64_t ldc, int64_t left, int first, int last) {
    const __m256i m0 = mask8(left), m1 = mask8(left - 8);
    for (int64_t b = 0; b < nblk; ++b) {
        __m256 e[MR2][2], o[MR2][2];
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r)
            e[r][0] = e[r][1] = o[r][0] = o[r][1] = _mm256_setzero_ps();
        const float *pb = p + b * 32 * ldp, *ab = a + b * 32;
#pragma GCC unroll 2
        for (int i = 0; i < 32; i += 2) {
            const float *pe = pb + i * ldp;
            const __m256 we0 = _mm256_load_ps(pe), we1 = _mm256_load_ps(pe + 8);
            const __m256 wo0 = _mm256_load_ps(pe + ldp), wo1 = _mm256_load_ps(pe + ldp + 8);
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; ++r) {
                const __m256 be = _mm256_broadcast_ss(ab + r * lda + i);
                const __m256 bo = _mm256_broadcast_ss(ab + r * lda + i + 1);
                e[r][0] = _mm256_fmadd_ps(be, we0, e[r][0]);
                e[r][1] = _mm256_fmadd_ps(be, we1, e[r][1]);
                o[r][0] = _mm256_fmadd_ps(bo, wo0, o[r][0]);
                o[r][1] = _mm256_fmadd_ps(bo, wo1, o[r][1]);
            }
        }
        const int f = first && b == 0, l = last && b == nblk - 1;
        const __m256 qnan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 2
            for (int q = 0; q < 2; ++q) {
                const __m256i mk = q ? m1 : m0;
                float *cq = c + r * ldc + 8 * q;
                const __m256 acc = f ? _mm256_setzero_ps() : _mm256_maskload_ps(cq, mk);
                __m256 x = _mm256_add_ps(acc, _mm256_add_ps(e[r][q], o[r][q]));
                if (l) x = _mm256_blendv_ps(x, qnan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
                _mm256_maskstore_ps(cq, mk, x);
            }
    }
}

/* Few rows: ROWS x 16 columns from column c0 over nblk blocks, each lane pair read straight
 * from w (plain: two bf16 rows; an edge strip goes through a zero-filled copy; packed: one
 * 32-byte load per 8 columns holds both lanes), prefetched one block ahead. */
static inline AVX2 __m256 widen8(const uint16_t *p) {
    const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}

static inline __attribute__((always_inline)) AVX2 void
direct_avx2(const int ROWS, const int PACKED, const job_t *j, const float *a, int64_t lda,
            int64_t k0, int64_t nblk, int64_t c0, float *c, int64_t ldc, int64_t left,
            int first, int last) {
    const __m256i m0 = mask8(left), m1 = mask8(left - 8);
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    uint16_t edge[2][16];
    for (int64_t b = 0; b < nblk; ++b) {
        __m256 e[MR2][2], o[MR2][2];
        for (int r = 0; r < ROWS; ++r)
            e[r][0] = e[r][1] = o[r][0] = o[r][1] = _mm256_setzero_ps();
        const int64_t kb = k0 + 32 * b;
        const float *ab = a + 32 * b;
        for (int i = 0; i < 32; i += 2) {
            const int64_t k = kb + i;
            __m256 we0, we1, wo0, wo1;
            if (PACKED) {
                const uint16_t *src = j->w + (k >> 1) * 2 * j->Vp + 2 * c0;
                if (k + 32 < j->Kp) _mm_prefetch((const char *)(src + 32 * j->Vp), _MM_HINT_T0);
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)src);
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(src + 16));
                we0 = _mm256_castsi256_ps(_mm256_slli_epi32(x0, 16));
                wo0 = _mm256_castsi256_ps(_mm256_and_si256(x0, hi));
                we1 = _mm256_castsi256_ps(_mm256_slli_epi32(x1, 16));
                wo1 = _mm256_castsi256_ps(_mm256_and_si256(x1, hi));
            } else {
                const uint16_t *re = j->w + k * j->ldw + c0, *ro = re + j->ldw;
                if (k + 33 < j->H) {
                    _mm_prefetch((const char *)(re + 32 * j->ldw), _MM_HINT_T0);
                    _mm_prefetch((const char *)(ro + 32 * j->ldw), _MM_HINT_T0);
                }
                if (left < 16 || k + 1 >= j->H) { /* edge strip or the last rows */
                    for (int h = 0; h < 2; ++h)
                        for (int q = 0; q < 16; ++q)
                            edge[h][q] = (q < left && k + h < j->H) ? (h ? ro : re)[q] : 0;
                    re = edge[0];
                    ro = edge[1];
                }
                we0 = widen8(re);
                we1 = widen8(re + 8);
                wo0 = widen8(ro);
                wo1 = widen8(ro + 8);
            }
            for (int r = 0; r < ROWS; ++r) {
                const __m256 be = _mm256_broadcast_ss(ab + r * lda + i);
                const __m256 bo = _mm256_broadcast_ss(ab + r * lda + i + 1);
                e[r][0] = _mm256_fmadd_ps(be, we0, e[r][0]);
                e[r][1] = _mm256_fmadd_ps(be, we1, e[r][1]);
                o[r][0] = _mm256_fmadd_ps(bo, wo0, o[r][0]);
                o[r][1] = _mm256_fmadd_ps(bo, wo1, o[r][1]);
            }
        }
        const int f = first && b == 0, l = last && b == nblk - 1;
        const __m256 qnan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
        for (int r = 0; r < ROWS; ++r)
            for (int q = 0; q < 2; ++q) {
                const __m256i mk = q ? m1 : m0;
                float *cq = c + r * ldc + 8 * q;
                const __m256 acc = f ? _mm256_setzero_ps() : _mm256_maskload_ps(cq, mk);
                __m256 x = _mm256_add_ps(acc, _mm256_add_ps(e[r][q], o[r][q]));
                if (l) x = _mm256_blendv_ps(x, qnan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
                _mm256_maskstore_ps(cq, mk, x);
            }
    }
}

#define DIRECT2_N(R, P)                                                                   \
    static AVX2 __attribute__((noinline)) void direct2_##R##_##P(                         \
        const job_t *j, const float *a, int64_t lda, int64_t k0, int64_t nblk, int64_t c0, \
        float *c, int64_t ldc, int64_t left, int first, int last) {                       \
        direct_avx2(R, P, j, a, lda, k0, nblk, c0, c, ldc, left, first, last);            \
    }
DIRECT2_N(1, 0) DIRECT2_N(2, 0) DIRECT2_N(1, 1) DIRECT2_N(2, 1)
typedef void (*direct2_fn)(const job_t *, const float *, int64_t, int64_t, int64_t, int64_t,
                           float *, int64_t, int64_t, int, int);
static const direct2_fn DIRECT2[2][MR2 + 1] = {{0, direct2_1_0, direct2_2_0},
                                               {0, direct2_1_1, direct2_2_1}};

#define MICRO2_N(R)                                                                       \
    static AVX2 __attribute__((noinline)) void micro2_##R(                                \
        const float *a, int64_t lda, const float *p, int64_t ldp, int64_t nblk, float *c, \
        int64_t ldc, int64_t left, int first, int last) {                                 \
        micro_avx2(R, a, lda, p, ldp, nblk, c, ldc, left, first, last);                   \
    }
MICRO2_N(1) MICRO2_N(2)
typedef void (*micro2_fn)(const float *, int64_t, const float *, int64_t, int64_t, float *, int64_t,
                          int64_t, int, int);
static const micro2_fn MICRO2[MR2 + 1] = {0, micro2_1, micro2_2};

/* stream_512 on AVX2: ROWS x (16*CW) columns per strip; one 32-byte load holds 16 columns
 * of one lane, split by a shift and a mask into its 8 even and 8 odd columns; an unpack
 * and a lane permute restore column order before the block add. Whole strips and blocks. */
static inline __attribute__((always_inline)) AVX2 void
stream_avx2(const int ROWS, const int CW, const job_t *j, const float *a, int64_t lda,
            int64_t k0, int64_t nblk, int64_t c0, int64_t ns, float *c, int64_t ldc, int first,
            int last) {
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    const __m256 qnan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
    const int64_t ldw = j->ldw;
    for (int64_t b = 0; b < nblk; ++b) {
        const float *ab = a + 32 * b;
        const int f = first && b == 0, l = last && b == nblk - 1, pf = b + 1 < nblk;
        for (int64_t s = 0; s < ns; ++s) {
            const uint16_t *wb = j->w + (k0 + 32 * b) * ldw + c0 + 16 * CW * s;
            __m256 e[ROWS][CW][2], o[ROWS][CW][2]; /* [.][.][0]: even columns, [1]: odd */
            for (int r = 0; r < ROWS; ++r)
                for (int q = 0; q < CW; ++q)
                    e[r][q][0] = e[r][q][1] = o[r][q][0] = o[r][q][1] = _mm256_setzero_ps();
#pragma GCC unroll 2
            for (int i = 0; i < 32; i += 2) {
                const uint16_t *re = wb + i * ldw, *ro = re + ldw;
                for (int q = 0; q < CW; ++q) {
                    if (pf) {
                        _mm_prefetch((const char *)(re + 32 * ldw + 16 * q), _MM_HINT_T0);
                        _mm_prefetch((const char *)(ro + 32 * ldw + 16 * q), _MM_HINT_T0);
                    }
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(re + 16 * q));
                    const __m256i y = _mm256_loadu_si256((const __m256i *)(ro + 16 * q));
                    const __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
                    const __m256 xo = _mm256_castsi256_ps(_mm256_and_si256(x, hi));
                    const __m256 ye = _mm256_castsi256_ps(_mm256_slli_epi32(y, 16));
                    const __m256 yo = _mm256_castsi256_ps(_mm256_and_si256(y, hi));
                    for (int r = 0; r < ROWS; ++r) {
                        const __m256 be = _mm256_broadcast_ss(ab + r * lda + i);
                        const __m256 bo = _mm256_broadcast_ss(ab + r * lda + i + 1);
                        e[r][q][0] = _mm256_fmadd_ps(be, xe, e[r][q][0]);
                        e[r][q][1] = _mm256_fmadd_ps(be, xo, e[r][q][1]);
                        o[r][q][0] = _mm256_fmadd_ps(bo, ye, o[r][q][0]);
                        o[r][q][1] = _mm256_fmadd_ps(bo, yo, o[r][q][1]);
                    }
                }
            }
            for (int r = 0; r < ROWS; ++r)
                for (int q = 0; q < CW; ++q) {
                    const __m256 se = _mm256_add_ps(e[r][q][0], o[r][q][0]);
                    const __m256 so = _mm256_add_ps(e[r][q][1], o[r][q][1]);
                    const __m256 ul = _mm256_unpacklo_ps(se, so), uh = _mm256_unpackhi_ps(se, so);
                    const __m256 s0 = _mm256_permute2f128_ps(ul, uh, 0x20);
                    const __m256 s1 = _mm256_permute2f128_ps(ul, uh, 0x31);
                    float *cq = c + r * ldc + 16 * (CW * s + q);
                    __m256 x0 = _mm256_add_ps(f ? _mm256_setzero_ps() : _mm256_loadu_ps(cq), s0);
                    __m256 x1 = _mm256_add_ps(f ? _mm256_setzero_ps() : _mm256_loadu_ps(cq + 8), s1);
                    if (l) {
                        x0 = _mm256_blendv_ps(x0, qnan, _mm256_cmp_ps(x0, x0, _CMP_UNORD_Q));
                        x1 = _mm256_blendv_ps(x1, qnan, _mm256_cmp_ps(x1, x1, _CMP_UNORD_Q));
                    }
                    _mm256_storeu_ps(cq, x0);
                    _mm256_storeu_ps(cq + 8, x1);
                }
        }
    }
}

#define STREAM2_N(R, CW)                                                                  \
    static AVX2 __attribute__((noinline)) void stream2_##R(                               \
        const job_t *j, const float *a, int64_t lda, int64_t k0, int64_t nblk, int64_t c0, \
        int64_t ns, float *c, int64_t ldc, int first, int last) {                         \
        stream_avx2(R, CW, j, a, lda, k0, nblk, c0, ns, c, ldc, first, last);             \
    }
STREAM2_N(1, 2) STREAM2_N(2, 1)
static const stream512_fn STREAM2[MR2 + 1] = {0, stream2_1, stream2_2};
static const int STREAM2_CW[MR2 + 1] = {0, 2, 1};

/* small_plain_512 on AVX2, in groups of at most MR2 rows. */
static AVX2 void small_plain_avx2(const job_t *j, int64_t m0, int64_t m1, int64_t c0, int64_t nc) {
    const int64_t nfull = j->H / 32, nb = j->Kp / 32;
    for (int64_t m = m0; m < m1; m += MR2) {
        const int rows = m1 - m < MR2 ? (int)(m1 - m) : MR2;
        const int64_t sw = 16 * STREAM2_CW[rows], ns = nc / sw;
        const float *a = j->aw + m * j->Kp;
        float *c = j->out + m * j->ldc + c0;
        if (ns > 0 && nfull > 0) STREAM2[rows](j, a, j->Kp, 0, nfull, c0, ns, c, j->ldc, 1, nfull == nb);
        if (nfull < nb)
            for (int64_t s = 0; s < ns * sw; s += 16)
                DIRECT2[0][rows](j, a + 32 * nfull, j->Kp, 32 * nfull, 1, c0 + s, c + s, j->ldc,
                                 16, nfull == 0, 1);
        for (int64_t s = ns * sw; s < nc; s += 16)
            DIRECT2[0][rows](j, a, j->Kp, 0, nb, c0 + s, c + s, j->ldc, nc - s, 1, 1);
    }
}

/* ---------------------------------------------------------------- AMX */
#define AMX LMTAIL_TARGET_AMX

static AMX void amx_release(void) { _tile_release(); }

/* The one tile configuration: palette 1, tiles 0-7 all 16 rows x 64 bytes, 8-15 unused.
 * A static const object in .rodata, never a local: GCC's _tile_loadconfig names only an
 * 8-byte memory operand, so the stores filling a local config are dead to the compiler and
 * get dropped, and LDTILECFG faults (#GP) on the half-written bytes. A constant has no
 * stores to drop (tests/test_backends.py reads the assembly: every ldtilecfg operand is a
 * 64-byte constant holding this configuration). */
static const lmtail_tilecfg AMX_CFG = {
    .palette_id = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

static AMX void amx_config(void) { _tile_loadconfig(&AMX_CFG); }

/* The VNNI copy of a plain weight's column tile: out[p][c][h] = daz16(w[2p + h, c0 + c])
 * for p < Kp/2, c < NCA, h < 2 (zero for c >= nc or 2p + h >= H): the bytes of
 * lmtail_amx32_pack's layout for these columns. Two rows of 32 bf16 per step, masked loads
 * past nc, interleaved by two vpermt2w, DAZ by a lane mask made from the exponent bits.
 * ESTIMATE (llvm-mca-14 -mcpu=sapphirerapids, and icelake-server alike; not measured: no AMX
 * CPU here) of the loop body as gcc 12 -O3 compiles it: 16 instructions, 24 uops, ~6.4 cycles
 * per pair of rows (128 output bytes; block reciprocal throughput 4.0). The scalar loop it
 * replaces made 64 element copies with a bounds test and a DAZ branch each. */
static AVX512 void
vnni_tile_512(const uint16_t *w, int64_t ldw, int64_t H, int64_t Kp, int64_t c0, int64_t nc, uint16_t *out) {
    const __mmask32 cols = nc >= 32 ? 0xFFFFFFFFu : (((__mmask32)1 << nc) - 1);
    __m512i lo_idx, hi_idx;
    {
        uint16_t lo[32], hi[32];
        for (int i = 0; i < 16; ++i) {
            lo[2 * i] = (uint16_t)i; lo[2 * i + 1] = (uint16_t)(32 + i);
            hi[2 * i] = (uint16_t)(16 + i); hi[2 * i + 1] = (uint16_t)(48 + i);
        }
        lo_idx = _mm512_loadu_si512(lo);
        hi_idx = _mm512_loadu_si512(hi);
    }
    const __m512i expo = _mm512_set1_epi16(0x7F80), sign = _mm512_set1_epi16((short)0x8000);
    const __m512i one = _mm512_set1_epi16(1);
    for (int64_t p = 0; p < Kp / 2; ++p) {
        const int64_t k = 2 * p;
        const __m512i r0 = k < H ? _mm512_maskz_loadu_epi16(cols, w + k * ldw + c0) : _mm512_setzero_si512();
        const __m512i r1 = k + 1 < H ? _mm512_maskz_loadu_epi16(cols, w + (k + 1) * ldw + c0)
                                     : _mm512_setzero_si512();
        __m512i a = _mm512_permutex2var_epi16(r0, lo_idx, r1);
        __m512i b = _mm512_permutex2var_epi16(r0, hi_idx, r1);
        /* DAZ: keep = 0xFFFF where the exponent is nonzero, else only the sign bit */
        const __m512i ka = _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_min_epu16(_mm512_and_si512(a, expo), one));
        const __m512i kb = _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_min_epu16(_mm512_and_si512(b, expo), one));
        a = _mm512_and_si512(a, _mm512_or_si512(ka, sign));
        b = _mm512_and_si512(b, _mm512_or_si512(kb, sign));
        _mm512_storeu_si512(out + p * 2 * NCA, a);
        _mm512_storeu_si512(out + p * 2 * NCA + 32, b);
    }
}

/* Rows [m0, m1) (a multiple of 32 in ab's padding) x columns [c0, c0+nc), nc <= NCA = 32:
 * tiles 0-3 C (2 x 2 of 16 x 16 fp32), 4-5 A (16 rows x 32 lanes), 6-7 B (16 pairs x 16
 * columns, VNNI). One TDPBF16PS per (C tile, 32-lane block), blocks in k order. */
static AMX void tile_amx(const job_t *j, int64_t m0, int64_t m1, int64_t c0, int64_t nc,
                         uint16_t *bbuf, float *cbuf) {
    const uint16_t *B;
    int64_t bstride; /* bytes between pair rows */
    if (j->packed) {
        B = j->w + 2 * c0;
        bstride = 4 * j->Vp;
    } else { /* VNNI copy of this column tile: bbuf[Kp/2][32][2] */
        vnni_tile_512(j->w, j->ldw, j->H, j->Kp, c0, nc, bbuf);
        B = bbuf;
        bstride = 4 * NCA;
    }
    for (int64_t m = m0; m < m1; m += 32) {
        const uint16_t *A0 = j->ab + m * j->Kp, *A1 = A0 + 16 * j->Kp;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t k = 0; k < j->Kp; k += 32) {
            const uint16_t *Bk = (const uint16_t *)((const char *)B + (k / 2) * bstride);
            _tile_loadd(4, A0 + k, 2 * j->Kp);
            _tile_loadd(5, A1 + k, 2 * j->Kp);
            _tile_loadd(6, Bk, bstride);
            _tile_loadd(7, Bk + 32, bstride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, cbuf, 128);
        _tile_stored(1, cbuf + 16, 128);
        _tile_stored(2, cbuf + 16 * 32, 128);
        _tile_stored(3, cbuf + 16 * 32 + 16, 128);
        for (int64_t r = 0; r < 32 && m + r < j->M && m + r < m1; ++r)
            for (int64_t c = 0; c < nc; ++c)
                j->out[(m + r) * j->ldc + c0 + c] = canon_nan(cbuf[r * 32 + c]);
    }
}
#endif

/* ---------------------------------------------------------------- one work unit */
static int isa_kc(const job_t *j) { return j->small ? KC_SMALL : KC; } /* the panel fits */

/* Rows [m0, m1) x column tile [c0, c0+nc): emulation paths, k blocks in order. */
static void unit_emulated(const job_t *j, int64_t m0, int64_t m1, int64_t c0, int64_t nc,
                          float *panel) {
    const int64_t kcmax = isa_kc(j), ldp = (nc + 31) / 32 * 32; /* panel row stride */
#if defined(__x86_64__)
    if (j->isa == ISA_AVX512 && !j->packed && m1 - m0 <= STREAM_MR) {
        small_plain_512(j, m0, m1, c0, nc);
        return;
    }
    if (j->isa == ISA_AVX2 && !j->packed && m1 - m0 <= MR512) {
        small_plain_avx2(j, m0, m1, c0, nc);
        return;
    }
#endif
    for (int64_t k0 = 0; k0 < j->Kp; k0 += kcmax) {
        const int64_t kc = j->Kp - k0 < kcmax ? j->Kp - k0 : kcmax;
        const int first = k0 == 0, last = k0 + kc == j->Kp;
#if defined(__x86_64__)
        if (j->isa == ISA_AVX512 && m1 - m0 <= MR512) {
            for (int64_t s = 0; s < nc; s += 32)
                DIRECT512[j->packed][m1 - m0](j, j->aw + m0 * j->Kp + k0, j->Kp, k0, kc / 32,
                                              c0 + s, j->out + m0 * j->ldc + c0 + s, j->ldc,
                                              mask16(nc - s), mask16(nc - s - 16), first, last);
            continue;
        }
        if (j->isa == ISA_AVX512) {
            panel_512(j, k0, kc, c0, nc, ldp, panel);
            for (int64_t s = 0; s < nc; s += 32)
                for (int64_t m = m0; m < m1; m += MR512) {
                    const int rows = m1 - m < MR512 ? (int)(m1 - m) : MR512;
                    MICRO512[rows](j->aw + m * j->Kp + k0, j->Kp, STRIP512(panel, kc, 0, s), 32, kc / 32,
                                   j->out + m * j->ldc + c0 + s, j->ldc, mask16(nc - s),
                                   mask16(nc - s - 16), first, last);
                }
            continue;
        }
        if (j->isa == ISA_AVX2 && m1 - m0 <= MR512) {
            for (int64_t s = 0; s < nc; s += 16)
                for (int64_t m = m0; m < m1; m += MR2) {
                    const int rows = m1 - m < MR2 ? (int)(m1 - m) : MR2;
                    DIRECT2[j->packed][rows](j, j->aw + m * j->Kp + k0, j->Kp, k0, kc / 32,
                                             c0 + s, j->out + m * j->ldc + c0 + s, j->ldc,
                                             nc - s, first, last);
                }
            continue;
        }
        if (j->isa == ISA_AVX2) {
            panel_avx2(j, k0, kc, c0, nc, ldp, panel);
            for (int64_t s = 0; s < nc; s += 16)
                for (int64_t m = m0; m < m1; m += MR2) {
                    const int rows = m1 - m < MR2 ? (int)(m1 - m) : MR2;
                    MICRO2[rows](j->aw + m * j->Kp + k0, j->Kp, STRIP2(panel, kc, 0, s), 16, kc / 32,
                                 j->out + m * j->ldc + c0 + s, j->ldc, nc - s, first, last);
                }
            continue;
        }
#endif
        panel_c(j, k0, kc, c0, nc, ldp, panel);
        micro_c(j, m0, m1 - m0, panel, k0, kc, c0, nc, ldp);
        if (last)
            for (int64_t m = m0; m < m1; ++m)
                for (int64_t c = 0; c < nc; ++c)
                    j->out[m * j->ldc + c0 + c] = canon_nan(j->out[m * j->ldc + c0 + c]);
    }
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    /* round to nearest, exceptions masked; FTZ|DAZ for the vector emulations (the plain C
     * path does both in software and needs IEEE subnormals from the hardware) */
    const unsigned csr = lmtail_mxcsr_pin(j->isa == ISA_C ? LMTAIL_MXCSR_IEEE : LMTAIL_MXCSR_FTZ_DAZ);
#if defined(__x86_64__)
    if (j->isa == ISA_AMX) amx_config();
#endif
    float *panel = NULL;
    uint16_t *bbuf = NULL;
    float *cbuf = NULL;
    /* the panel: the plain C path, and the vector paths with more than MR512 rows */
    const int need_panel = j->isa == ISA_C || (j->isa != ISA_AMX && !j->small);
    int ok = !need_panel ||
             !posix_memalign((void **)&panel, 64, sizeof(float) * (j->small ? KC_SMALL * WMAX : KC * NC));
    if (j->isa == ISA_AMX)
        ok = ok && !posix_memalign((void **)&bbuf, 64, sizeof(uint16_t) * j->Kp * NCA) &&
             !posix_memalign((void **)&cbuf, 64, sizeof(float) * 32 * 32);
    const int64_t units = j->nrc * j->ntiles;
    while (ok) { /* a worker without buffers takes no unit; the others take them all */
        const int64_t u = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (u >= units) break;
        const int64_t t = u % j->ntiles, rc = u / j->ntiles;
        const int64_t c0 = t * j->width, nc = j->V - c0 < j->width ? j->V - c0 : j->width;
        const int64_t m0 = rc * j->rows, m1 = j->M - m0 < j->rows ? j->M : m0 + j->rows;
#if defined(__x86_64__)
        if (j->isa == ISA_AMX)
            tile_amx(j, m0, m1, c0, nc, bbuf, cbuf);
        else
#endif
            unit_emulated(j, m0, m1, c0, nc, panel);
        __atomic_fetch_add(&j->done, 1, __ATOMIC_RELAXED);
    }
#if defined(__x86_64__)
    if (j->isa == ISA_AMX) amx_release();
#endif
    lmtail_mxcsr_restore(csr);
    free(panel);
    free(bbuf);
    free(cbuf);
    return NULL;
}

/* ---------------------------------------------------------------- exported */
/* 1 if this CPU (and OS) runs `isa`. */
int lmtail_amx32_has(int isa) {
    if (isa == ISA_C) return 1;
    if (isa == ISA_AVX512) return lmtail_cpu_has(LMTAIL_ISA_AVX512);
    if (isa == ISA_AVX2) return lmtail_cpu_has(LMTAIL_ISA_AVX2);
    if (isa == ISA_AMX) return lmtail_cpu_has(LMTAIL_ISA_AVX512 | LMTAIL_CPU_AMX_BF16);
    return 0;
}

/* The AMX path's VNNI copy of a plain weight's column tile (tests: equal to
 * lmtail_amx32_pack's columns c0..c0+31 on every CPU with AVX-512BW or the emulated build).
 * Returns -1 where the CPU cannot run it. */
int lmtail_amx32_vnni_tile(const uint16_t *w, int64_t ldw, int64_t H, int64_t c0, int64_t nc, uint16_t *out) {
#if defined(__x86_64__)
    if (!lmtail_amx32_has(ISA_AVX512)) return -1;
    vnni_tile_512(w, ldw, H, (H + 31) / 32 * 32, c0, nc, out);
    return 0;
#else
    (void)w; (void)ldw; (void)H; (void)c0; (void)nc; (void)out;
    return -1;
#endif
}

/* The pool helpers this process has started (a forked child starts with none). */
int lmtail_amx32_pool_helpers(void) { return lmtail_pool_helpers(); }

/* wp[Kp/2, Vp, 2] from w[H, V] (rows ldw apart): VNNI pairs, DAZ applied, zero padded. */
void lmtail_amx32_pack(const uint16_t *w, int64_t ldw, int64_t H, int64_t V, uint16_t *wp) {
    const int64_t Kp = (H + 31) / 32 * 32, Vp = (V + 31) / 32 * 32;
    for (int64_t p = 0; p < Kp / 2; ++p)
        for (int64_t v = 0; v < Vp; ++v)
            for (int64_t h = 0; h < 2; ++h) {
                const int64_t k = 2 * p + h;
                wp[p * 2 * Vp + 2 * v + h] = (k < H && v < V) ? daz16(w[k * ldw + v]) : 0;
            }
}

/* out = a @ w in the amx32 order on up to nthreads threads with `isa` (which must be one
 * lmtail_amx32_has accepts). Returns 0 on success, -1 on an unavailable isa, -2 when a
 * buffer cannot be allocated. */
int lmtail_amx32_gemm(const uint16_t *a, int64_t lda, const uint16_t *w, int64_t ldw,
                      int packed, float *out, int64_t M, int64_t H, int64_t V, int64_t ldc,
                      int nthreads, int isa) {
    if (!lmtail_amx32_has(isa)) return -1;
    const int64_t Kp = (H + 31) / 32 * 32, Mp = (M + 31) / 32 * 32;
    job_t j;
    memset(&j, 0, sizeof j);
    j.w = w; j.packed = packed; j.ldw = ldw; j.Vp = (V + 31) / 32 * 32;
    j.out = out; j.M = M; j.H = H; j.Kp = Kp; j.V = V; j.ldc = ldc; j.isa = isa;
    float *aw = NULL;
    uint16_t *ab = NULL;
    if (isa == ISA_AMX) {
        if (posix_memalign((void **)&ab, 64, sizeof(uint16_t) * (Mp * Kp + 1))) return -2;
        for (int64_t m = 0; m < Mp; ++m)
            for (int64_t k = 0; k < Kp; ++k)
                ab[m * Kp + k] = (m < M && k < H) ? daz16(a[m * lda + k]) : 0;
        j.ab = ab;
    } else {
        if (posix_memalign((void **)&aw, 64, sizeof(float) * (M * Kp + 1))) return -2;
        for (int64_t m = 0; m < M; ++m)
            for (int64_t k = 0; k < Kp; ++k) aw[m * Kp + k] = k < H ? bf16_daz(a[m * lda + k]) : 0.0f;
        j.aw = aw;
    }
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAXT) nthreads = MAXT;
    j.small = isa != ISA_AMX && M <= MR512;
    /* each thread gets at least MIN_WORK multiply-adds (few rows: MIN_WEIGHT of w) */
    const int64_t work = j.small ? Kp * V / MIN_WEIGHT : M * Kp * V / MIN_WORK;
    if (nthreads > work) nthreads = work < 1 ? 1 : (int)work;
    j.width = isa == ISA_AMX ? NCA : NC;
    if (j.small && nthreads == 1)
        for (j.width = WMAX; j.width > 1024 && (V + j.width - 1) / j.width < 4;) j.width /= 2;
    if (j.small && nthreads > 1) /* q tiles per thread of equal 32-column (64 B) multiples */
        for (int64_t q = 1;; ++q) {
            j.width = ((V + nthreads * q - 1) / (nthreads * q) + 31) / 32 * 32;
            if (j.width <= 1024) break;
        }
    j.ntiles = (V + j.width - 1) / j.width;
    /* few column tiles: split rows too (a multiple of the register tile, AMX: 32) */
    const int64_t quantum = isa == ISA_AMX ? 32 : isa == ISA_AVX2 ? MR2 : MR512;
    int64_t want = (2 * nthreads + j.ntiles - 1) / j.ntiles;
    if (want < 1) want = 1;
    int64_t rows = (M + want - 1) / want;
    rows = (rows + quantum - 1) / quantum * quantum;
    if (rows < 4 * quantum && M > rows) rows = 4 * quantum; /* keep panels reused */
    j.rows = rows < 1 ? 1 : rows;
    j.nrc = (M + j.rows - 1) / j.rows;
    const int64_t units = j.nrc * j.ntiles;
    if (nthreads > units) nthreads = (int)units;
    lmtail_parallel(worker, &j, nthreads);
    free(aw);
    free(ab);
    return j.done == units ? 0 : -2;
}
