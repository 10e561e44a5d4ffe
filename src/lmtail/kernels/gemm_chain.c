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
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <pthread.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

enum { ISA_GENERIC = 0, ISA_AVX512 = 2 };
#ifndef KC_
#define KC_ 128
#endif
#ifndef NC_
#define NC_ 256
#endif
enum { KC = KC_, NC = NC_, NR = 64, MR = 6, GEN_NC = 64 };

typedef struct {
    const float *aT;
    const uint16_t *w;
    float *out;
    int64_t M, H, V, ldc, ntiles;
    int isa;
    int64_t next; /* next column tile to take (atomic) */
} job_t;

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16; /* widening bf16 -> fp32 is exact: a 16-bit shift */
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float canon_nan(float x) {
    return x != x ? NAN : x;
}

/* ---------------------------------------------------------------- generic (any CPU) */
/* One column tile [c0, c0+nc), nc <= GEN_NC: for each row, the whole h chain in a
 * register/stack row of accumulators. */
static void tile_generic(const job_t *j, int64_t c0, int64_t nc) {
    float acc[GEN_NC];
    for (int64_t m = 0; m < j->M; ++m) {
        for (int64_t c = 0; c < nc; ++c) acc[c] = 0.0f;
        for (int64_t h = 0; h < j->H; ++h) {
            const float a = j->aT[h * j->M + m];
            const uint16_t *wr = j->w + h * j->V + c0;
            for (int64_t c = 0; c < nc; ++c) acc[c] = fmaf(a, bf16_to_f32(wr[c]), acc[c]);
        }
        float *o = j->out + m * j->ldc + c0;
        for (int64_t c = 0; c < nc; ++c) o[c] = canon_nan(acc[c]);
    }
}

/* ---------------------------------------------------------------- AVX-512 */
#if defined(__x86_64__)
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

/* Widen w[h0:h0+kc, c0:c0+nc] (bf16) into panel[kc][NC] fp32; columns >= nc become 0.
 * Also prefetch the next h block of the same columns (it is read one block later). */
static AVX512 void widen_panel(const job_t *j, int64_t h0, int64_t kc, int64_t c0,
                               int64_t nc, float *panel) {
    const int64_t hn = h0 + kc < j->H ? h0 + kc : j->H; /* first row of the next block */
    const int64_t kn = j->H - hn < KC ? j->H - hn : KC;
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

/* Few rows (M <= 6, one register tile): no panel, since nothing would reuse it. The
 * register tile runs the whole chain, h = 0..H-1, widening each 64-column bf16 row
 * segment as it goes, prefetching PF rows ahead. mk as in micro. */
enum { PF = 16 };
static inline __attribute__((always_inline)) AVX512 void
micro_direct(const int ROWS, const float *a, int64_t lda, const uint16_t *w, int64_t ldw,
             int64_t H, float *c, int64_t ldc, const __mmask16 *mk) {
    __m512 acc[MR][4];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_setzero_ps();
    for (int64_t h = 0; h < H; ++h) {
        const uint16_t *wh = w + h * ldw;
        if (h + PF < H) {
            _mm_prefetch((const char *)(wh + PF * ldw), _MM_HINT_T0);
            _mm_prefetch((const char *)(wh + PF * ldw) + 64, _MM_HINT_T0);
        }
        __m512 wv[4];
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q)
            wv[q] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk[q], wh + 16 * q)), 16));
        const float *ah = a + h * lda;
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r) {
            const __m512 b = _mm512_set1_ps(ah[r]);
#pragma GCC unroll 4
            for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_fmadd_ps(b, wv[q], acc[r][q]);
        }
    }
    const __m512 qnan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000));
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
            __m512 x = acc[r][q];
            x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), qnan);
            _mm512_mask_storeu_ps(c + r * ldc + 16 * q, mk[q], x);
        }
}

#define DIRECT_N(R)                                                                       \
    static AVX512 __attribute__((noinline)) void direct_##R(                              \
        const float *a, int64_t lda, const uint16_t *w, int64_t ldw, int64_t H, float *c, \
        int64_t ldc, const __mmask16 *mk) {                                               \
        micro_direct(R, a, lda, w, ldw, H, c, ldc, mk);                                   \
    }
DIRECT_N(1) DIRECT_N(2) DIRECT_N(3) DIRECT_N(4) DIRECT_N(5) DIRECT_N(6)

typedef void (*direct_fn)(const float *, int64_t, const uint16_t *, int64_t, int64_t, float *,
                          int64_t, const __mmask16 *);
static const direct_fn DIRECTS[MR + 1] = {0, direct_1, direct_2, direct_3,
                                          direct_4, direct_5, direct_6};

static inline void tail_masks(int64_t left, __mmask16 mk[4]) {
    for (int q = 0; q < 4; ++q, left -= 16)
        mk[q] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

/* One column tile [c0, c0+nc), nc <= NC: h blocks of KC in order; within a block every
 * 64-column sub-panel and every group of <= 6 rows continues its elements' chains. */
static AVX512 void tile_avx512(const job_t *j, int64_t c0, int64_t nc, float *panel) {
    if (j->M <= MR) {
        for (int64_t s = 0; s < nc; s += NR) {
            __mmask16 mk[4];
            tail_masks(nc - s, mk);
            DIRECTS[j->M](j->aT, j->M, j->w + c0 + s, j->V, j->H, j->out + c0 + s, j->ldc, mk);
        }
        return;
    }
    for (int64_t h0 = 0; h0 < j->H; h0 += KC) {
        const int64_t kc = j->H - h0 < KC ? j->H - h0 : KC;
        const int first = h0 == 0, last = h0 + kc == j->H;
        widen_panel(j, h0, kc, c0, nc, panel);
        for (int64_t s = 0; s < nc; s += NR) {
            __mmask16 mk[4];
            tail_masks(nc - s, mk);
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
#if defined(__x86_64__)
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(0x1F80); /* round to nearest, exceptions masked, FTZ and DAZ off */
    float *panel = NULL;
    if (j->isa == ISA_AVX512 && posix_memalign((void **)&panel, 64, sizeof(float) * KC * NC))
        panel = NULL;
#endif
    const int64_t width = j->isa == ISA_AVX512 ? NC : GEN_NC;
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
    _mm_setcsr(csr);
#endif
    return NULL;
}

/* The best kernel this CPU runs: 2 = AVX-512 (F, BW, VL), 0 = generic C. */
int lmtail_gemm_best_isa(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return ISA_AVX512;
#endif
    return ISA_GENERIC;
}

/* out[m, v] = chain over h (see top). Returns the ISA used, or -1 if threads failed. */
int lmtail_gemm_bf16_chain(const float *aT, const uint16_t *w, float *out, int64_t M,
                           int64_t H, int64_t V, int64_t ldc, int nthreads, int isa) {
    if (isa != ISA_GENERIC && isa != lmtail_gemm_best_isa()) isa = ISA_GENERIC;
    const int64_t width = isa == ISA_AVX512 ? NC : GEN_NC;
    job_t j = {aT, w, out, M, H, V, ldc, (V + width - 1) / width, isa, 0};
    if (nthreads > j.ntiles) nthreads = (int)j.ntiles;
    if (nthreads < 1) nthreads = 1;
    pthread_t tid[64];
    if (nthreads > 64) nthreads = 64;
    int started = 0;
    for (int t = 1; t < nthreads; ++t, ++started)
        if (pthread_create(&tid[t], NULL, worker, &j)) break;
    worker(&j); /* the calling thread works too; any tiles left by failed starts included */
    for (int t = 1; t <= started; ++t) pthread_join(tid[t], NULL);
    return isa;
}
