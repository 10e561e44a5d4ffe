/* lmtail: the lm_head GEMM with a declared fp32 fma chain (CPU kernel).
 *
 * Shape legend: M rows of activations, H hidden (the summed axis), V vocab columns.
 *   aT   [H, M]   fp32   activations, transposed (widened from bf16 by the caller: exact)
 *   w    [H, V]   bf16   weight shard, C-contiguous, passed as raw uint16 bit patterns
 *   out  [M, ldc] fp32   result in out[m*ldc + v] for v < V (ldc >= V)
 *
 * Numerics (the contract; see docs/gemm.md):
 *   for every (m, v) on its own: acc = +0.0; for h = 0, 1, ..., H-1 in order:
 *       acc = fmaf(a[m,h], w[h,v], acc)          (one rounding per step, fp32, RNE)
 *   then a NaN acc is stored as the canonical quiet NaN 0x7FC00000.
 * Every code path below runs exactly this chain for every element it owns: blocking over
 * h only parks the accumulator in `out` between blocks (a store/load does not change a
 * value); blocking over rows/columns only picks which elements share a register tile.
 * Each element is owned by one thread, so neither M nor the thread count can reach the bits.
 * Arithmetic is IEEE: every worker sets MXCSR to round-to-nearest with FTZ/DAZ off (and
 * restores the caller's value), so a caller that flushes denormals cannot change the bits.
 * Contraction is irrelevant: the only multiply-adds are explicit fmaf / _mm512_fmadd_ps
 * calls; the library is compiled with -ffp-contract=off anyway.
 */
#include <math.h>
#include "lmtail_kernels.h"

enum { ISA_GENERIC = 0, ISA_AVX512 = 2 };
/* Blocking (none of it can change a bit, see above):
 *   M > MR:  column tiles of NC; per tile, h blocks of KC: the bf16 block [KC, NC] is
 *            widened once into an fp32 panel, then every MR x NR register tile (6 rows x
 *            64 columns, 24 zmm accumulators) runs its KC fmas per element from registers.
 *   M <= MR: column tiles of SC; accumulators in `out` (L1), w rows streamed, SPF ahead.
 *   generic: column tiles of GEN_NC, blocks of GEN_ROWS rows (edges one row at a time). */
enum { KC = 128, NC = 256, NR = 64, MR = 6, SC = 512, SPF = 8, GEN_NC = 64 };

typedef struct {
    const float *aT;
    const uint16_t *w;
    float *out;
    int64_t M, H, V, ldc, width, ntiles; /* width: columns per tile (a unit of work) */
    int isa;
    int64_t next; /* next column tile to take (atomic) */
} job_t;

/* ---------------------------------------------------------------- generic (any CPU) */
/* Rows [m0, m0+ROWS) x GEN_NC columns from c0: the whole h chain per element, in a
 * block of accumulators small enough for the compiler to keep in vector registers. */
#define GEN_ROWS 4
static inline __attribute__((always_inline)) void
generic_block(const job_t *j, int64_t m0, int64_t c0) {
    float acc[GEN_ROWS][GEN_NC];
    for (int r = 0; r < GEN_ROWS; ++r)
        for (int c = 0; c < GEN_NC; ++c) acc[r][c] = 0.0f;
    for (int64_t h = 0; h < j->H; ++h) {
        const uint16_t *wr = j->w + h * j->V + c0;
        float wv[GEN_NC];
        for (int c = 0; c < GEN_NC; ++c) wv[c] = bf16_to_f32(wr[c]);
        for (int r = 0; r < GEN_ROWS; ++r) {
            const float a = j->aT[h * j->M + m0 + r];
            for (int c = 0; c < GEN_NC; ++c) acc[r][c] = fmaf(a, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < GEN_ROWS; ++r)
        for (int c = 0; c < GEN_NC; ++c)
            j->out[(m0 + r) * j->ldc + c0 + c] = canon_nan(acc[r][c]);
}

/* One row m, columns [c0, c0+nc), nc <= GEN_NC (the edges of the above). */
static inline __attribute__((always_inline)) void
generic_row(const job_t *j, int64_t m, int64_t c0, int64_t nc) {
    float acc[GEN_NC];
    for (int64_t c = 0; c < nc; ++c) acc[c] = 0.0f;
    for (int64_t h = 0; h < j->H; ++h) {
        const float a = j->aT[h * j->M + m];
        const uint16_t *wr = j->w + h * j->V + c0;
        for (int64_t c = 0; c < nc; ++c) acc[c] = fmaf(a, bf16_to_f32(wr[c]), acc[c]);
    }
    for (int64_t c = 0; c < nc; ++c) j->out[m * j->ldc + c0 + c] = canon_nan(acc[c]);
}

/* One column tile [c0, c0+nc), nc <= GEN_NC, all rows. On x86-64 an FMA clone (fmaf as
 * a vector fma: same bits) is picked at load time where the CPU has FMA. */
#if defined(__x86_64__)
__attribute__((target_clones("fma", "default")))
#endif
static void tile_generic(const job_t *j, int64_t c0, int64_t nc) {
    int64_t m = 0;
    if (nc == GEN_NC)
        for (; m + GEN_ROWS <= j->M; m += GEN_ROWS) generic_block(j, m, c0);
    for (; m < j->M; ++m) generic_row(j, m, c0, nc);
}

/* ---------------------------------------------------------------- AVX-512 */
#if defined(__x86_64__)
#define AVX512 LMTAIL_TARGET_AVX512VL

/* Widen w[h0:h0+kc, c0:c0+nc] (bf16) into panel[kc][NC] fp32; columns >= nc become 0.
 * Also prefetch the next h block of the same columns (it is read one block later). */
static AVX512 void widen_panel(const job_t *j, int64_t h0, int64_t kc, int64_t c0,
                               int64_t nc, float *panel) {
    const int64_t hn = h0 + kc;                          /* first row of the next block */
    const int64_t kn = j->H - hn < KC ? j->H - hn : KC;  /* its row count (0: none) */
    for (int64_t h = 0; h < kc; ++h) {
        const uint16_t *wr = j->w + (h0 + h) * j->V + c0;
        if (h < kn) {
            const char *pf = (const char *)(j->w + (hn + h) * j->V + c0);
            for (int64_t b = 0; b < nc * 2; b += 64) _mm_prefetch(pf + b, _MM_HINT_T1);
        }
        for (int64_t c = 0; c < NC; c += 16) {
            int64_t left = nc - c;
            __mmask16 k = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
            __m256i b = _mm256_maskz_loadu_epi16(k, wr + c);
            __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16);
            _mm512_store_ps(panel + h * NC + c, _mm512_castsi512_ps(u));
        }
    }
}

/* The register tile: ROWS rows x 64 columns (4 zmm per row) of accumulators, kept in
 * registers across the kc steps of one h block. a points at aT[h0, m0] (row stride lda),
 * p at panel[0][s*64], c at out[m0, c0 + s*64]. first: start from +0.0; last: canonical
 * NaN on the final store. mk[q]: valid-lane mask of the q-th 16-column vector. */
static inline __attribute__((always_inline)) AVX512 void
micro(const int ROWS, const float *a, int64_t lda, const float *p, int64_t kc, float *c,
      int64_t ldc, const __mmask16 *mk, int first, int last) {
    __m512 acc[MR][4];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q)
            acc[r][q] = first ? _mm512_setzero_ps()
                              : _mm512_maskz_loadu_ps(mk[q], c + r * ldc + 16 * q);
    for (int64_t h = 0; h < kc; ++h) {
        const float *ph = p + h * NC;
        const __m512 w0 = _mm512_load_ps(ph), w1 = _mm512_load_ps(ph + 16);
        const __m512 w2 = _mm512_load_ps(ph + 32), w3 = _mm512_load_ps(ph + 48);
        const float *ah = a + h * lda;
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r) {
            const __m512 b = _mm512_set1_ps(ah[r]);
            acc[r][0] = _mm512_fmadd_ps(b, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(b, w1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(b, w2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(b, w3, acc[r][3]);
        }
    }
    const __m512 qnan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000));
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
            __m512 x = acc[r][q];
            if (last) x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), qnan);
            _mm512_mask_storeu_ps(c + r * ldc + 16 * q, mk[q], x);
        }
}

#define MICRO_N(R)                                                                        \
    static AVX512 __attribute__((noinline)) void micro_##R(                               \
        const float *a, int64_t lda, const float *p, int64_t kc, float *c, int64_t ldc,   \
        const __mmask16 *mk, int first, int last) {                                       \
        micro(R, a, lda, p, kc, c, ldc, mk, first, last);                                \
    }
MICRO_N(1) MICRO_N(2) MICRO_N(3) MICRO_N(4) MICRO_N(5) MICRO_N(6)

typedef void (*micro_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t,
                         const __mmask16 *, int, int);
static const micro_fn MICROS[MR + 1] = {0, micro_1, micro_2, micro_3, micro_4, micro_5, micro_6};

/* mk[q] for q < n: the lanes of columns [16q, 16q+16) that are below `left`. */
static inline void tail_masks(int64_t left, __mmask16 *mk, int n) {
    for (int q = 0; q < n; ++q, left -= 16)
        mk[q] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

/* Few rows, streamed: the accumulators of ROWS rows x nc (<= SC) columns live in `out`
 * (L1-resident) and each h step streams one contiguous bf16 row segment of w, prefetched
 * SPF rows ahead. Per element the same chain: +0.0, then fma for h = 0, 1, ... in order. */
static inline __attribute__((always_inline)) AVX512 void
stream_step(const int ROWS, const __m512 *av, const uint16_t *wq, float *oq, int64_t ldc,
            __mmask16 m) {
    const __m512 wv = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, wq)), 16));
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
        const __m512 x = _mm512_maskz_loadu_ps(m, oq + r * ldc);
        _mm512_mask_storeu_ps(oq + r * ldc, m, _mm512_fmadd_ps(av[r], wv, x));
    }
}

static inline __attribute__((always_inline)) AVX512 void
stream_rows(const int ROWS, const job_t *j, int64_t c0, int64_t nc) {
    float *o = j->out + c0;
    const int64_t nfull = nc / 16, rem = nc % 16;
    const __mmask16 mrem = (__mmask16)((1u << rem) - 1);
    for (int r = 0; r < ROWS; ++r) memset(o + r * j->ldc, 0, sizeof(float) * nc); /* +0.0 */
    for (int64_t h = 0; h < j->H; ++h) {
        const uint16_t *wh = j->w + h * j->V + c0;
        if (h + SPF < j->H)
            for (int64_t b = 0; b < nc; b += 32)
                _mm_prefetch((const char *)(wh + SPF * j->V + b), _MM_HINT_T0);
        __m512 av[MR];
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r) av[r] = _mm512_set1_ps(j->aT[h * j->M + r]);
        for (int64_t q = 0; q < nfull; ++q)
            stream_step(ROWS, av, wh + 16 * q, o + 16 * q, j->ldc, 0xFFFF);
        if (rem) stream_step(ROWS, av, wh + 16 * nfull, o + 16 * nfull, j->ldc, mrem);
    }
    for (int r = 0; r < ROWS; ++r)
        for (int64_t c = 0; c < nc; ++c) o[r * j->ldc + c] = canon_nan(o[r * j->ldc + c]);
}

#define STREAM_N(R)                                                                       \
    static AVX512 __attribute__((noinline)) void stream_##R(const job_t *j, int64_t c0,   \
                                                           int64_t nc) {                  \
        stream_rows(R, j, c0, nc);                                                        \
    }
STREAM_N(1) STREAM_N(2) STREAM_N(3) STREAM_N(4) STREAM_N(5) STREAM_N(6)
typedef void (*stream_fn)(const job_t *, int64_t, int64_t);
static const stream_fn STREAMS[MR + 1] = {0, stream_1, stream_2, stream_3,
                                          stream_4, stream_5, stream_6};

/* One column tile [c0, c0+nc). Few rows: streamed (nc <= SC). Otherwise (nc <= NC): h
 * blocks of KC in order; within a block every 64-column sub-panel and every group of <= 6
 * rows continues its elements' chains from where the previous block parked them. */
static AVX512 void tile_avx512(const job_t *j, int64_t c0, int64_t nc, float *panel) {
    if (j->M <= MR) {
        STREAMS[j->M](j, c0, nc);
        return;
    }
    for (int64_t h0 = 0; h0 < j->H; h0 += KC) {
        const int64_t kc = j->H - h0 < KC ? j->H - h0 : KC;
        const int first = h0 == 0, last = h0 + kc == j->H;
        widen_panel(j, h0, kc, c0, nc, panel);
        for (int64_t s = 0; s < nc; s += NR) {
            __mmask16 mk[4];
            tail_masks(nc - s, mk, 4);
            for (int64_t m0 = 0; m0 < j->M; m0 += MR) {
                const int rows = j->M - m0 < MR ? (int)(j->M - m0) : MR;
                MICROS[rows](j->aT + h0 * j->M + m0, j->M, panel + s, kc,
                             j->out + m0 * j->ldc + c0 + s, j->ldc, mk, first, last);
            }
        }
    }
}
#endif

/* ---------------------------------------------------------------- threads */
static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    const unsigned csr = lmtail_mxcsr_pin(LMTAIL_MXCSR_IEEE);
#if defined(__x86_64__)
    float *panel = NULL;
    if (j->isa == ISA_AVX512 && posix_memalign((void **)&panel, 64, sizeof(float) * KC * NC))
        panel = NULL;
#endif
    const int64_t width = j->width;
    for (;;) {
        const int64_t t = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (t >= j->ntiles) break;
        const int64_t c0 = t * width, nc = j->V - c0 < width ? j->V - c0 : width;
#if defined(__x86_64__)
        if (j->isa == ISA_AVX512 && panel) {
            tile_avx512(j, c0, nc, panel);
            continue;
        }
#endif
        for (int64_t c = c0; c < c0 + nc; c += GEN_NC)
            tile_generic(j, c, c0 + nc - c < GEN_NC ? c0 + nc - c : GEN_NC);
    }
#if defined(__x86_64__)
    free(panel);
#endif
    lmtail_mxcsr_restore(csr);
    return NULL;
}

/* out[m, v] = chain over h (see top), on up to nthreads threads (the caller's included;
 * if a thread cannot start, the others take its tiles). isa: the kernel wanted; one this
 * CPU lacks falls back to generic. Returns the ISA used. */
int lmtail_gemm_bf16_chain(const float *aT, const uint16_t *w, float *out, int64_t M,
                           int64_t H, int64_t V, int64_t ldc, int nthreads, int isa) {
    const unsigned need = LMTAIL_CPU_AVX512F | LMTAIL_CPU_AVX512BW | LMTAIL_CPU_AVX512VL;
    if (isa != ISA_AVX512 || !lmtail_cpu_has(need)) isa = ISA_GENERIC;
    if (H == 0) { /* the empty chain: +0.0 */
        for (int64_t m = 0; m < M; ++m) memset(out + m * ldc, 0, sizeof(float) * V);
        return isa;
    }
    const int64_t width = isa != ISA_AVX512 ? GEN_NC : M <= MR ? SC : NC;
    job_t j = {aT, w, out, M, H, V, ldc, width, (V + width - 1) / width, isa, 0};
    if (nthreads > j.ntiles) nthreads = (int)j.ntiles;
    if (nthreads < 1) nthreads = 1;
    lmtail_parallel(worker, &j, nthreads); /* the calling thread works too */
    return isa;
}
