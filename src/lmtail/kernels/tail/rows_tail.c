/* lmtail: the decode tail after the exchange, fused: exact top-k, the full-row mass terms
 * and the draw, reading each bf16 row once from memory (then twice more from cache).
 *
 * Bit-equal to the declared reference (lmtail.tail.topk.exact_topk, then lmtail.tail.sampler
 * .sample_rows); rows_tail.py documents the contract, this comment the implementation.
 *
 * Shape legend: R rows, V vocab (the full row), k candidates, L = 256 sum lanes.
 *   rows     [R, ld]  uint16   bf16 bit patterns; row i at rows[i*ld + v], v < V
 *   sp       [R]      lmtail_sampling  each row's parameters (lmtail_kernels.h; built by
 *                              kernels/tail/sampling.py's sampling_records)
 *   K        [17]     float64  exp64's INV_LN2, LN2_HI, LN2_LO, C[0..13] (numerics.py's
 *                              constants, passed in so this file cannot drift from them)
 *   vals     [R, k]   uint16   top-k values (bf16 bits), descending
 *   ids      [R, k]   int64    their vocab ids
 *   tokens   [R]      int64;  logprobs [R] fp32;  trunc [R] uint8
 *   flag     [R]      int32    1: the sampler outputs of this row are left to the reference
 *
 * Top-k. Every lane has the unique key (mono16(value) << 32) | (2**32 - 1 - id), mono16
 * the order-preserving map of lmtail.tail.topk.mono_keys (-0 -> +0, a folded NaN -> 1, below
 * -inf). The answer is the k largest keys, sorted: unique, so any exact method gives the
 * same bytes. Method: the first `cap` lanes go to a buffer; whenever the buffer is full, a
 * quickselect (lmtail_kernels.h's select_top; its sort_desc sorts the k at the end) keeps
 * its k largest keys and the k-th one's mono16 becomes the threshold; later lanes (higher
 * ids) enter only if their raw 16-bit order key is strictly greater (an equal value with
 * a higher id can never beat the k-th key). The raw key
 * b ^ ((b >> 15) & 0x7FFF) orders every bf16 pattern like mono16 except -0.0 (one below
 * +0.0) and folded NaNs; neither can be rejected wrongly (a -0.0 or a positive NaN that
 * should enter passes the compare; a folded NaN never beats a filled threshold), so the
 * filter only ever drops lanes outside the top k. One vector compare per 32 lanes
 * (AVX-512BW), 16 (AVX2) or one per lane (plain C); the set of lanes that pass differs
 * by path, the answer cannot.
 *
 * Mass. Per lane d = double(bf16) (exact; NaN -> -inf with nan_fold), z = d / scale (a
 * product by 1/scale when scale is a power of two: the same bits), the term
 * shifted_exp(z, m) = exp64(z == m ? 0 : z - m) with exp64's float64 ops in their order
 * (clamp at -746, n = round-half-even(xc * INV_LN2), r = (xc - n*HI) - n*LO, the
 * degree-13 Horner, times 2**n, split as (p * 2**n1) * 2**n2 when n < -1022, 0 below
 * -745), summed as sum64: lane t = v mod 256 holds the chain ((+0 + y[t]) + y[t+256]) + ...
 * in pass order, then lane t += lane t + w for w = 128, 64, ..., 1. m is the row's max
 * z, which is fl(vmax / scale) with vmax the first candidate (division is monotone), so
 * the max needs no pass of its own. nz counts the terms > 0. Every path runs the same IEEE
 * float64 ops per lane (separate mul/add, -ffp-contract=off, MXCSR pinned to
 * round-to-nearest with FTZ/DAZ off); only the number of lanes per instruction differs.
 * A term is a function of the lane's 16 bits, so when the row's value range holds few bf16
 * patterns compared with V (an estimate picks the pass; either gives the same bits), the
 * terms of all patterns in the range are computed once into tab[bits] and the pass adds
 * tab[x[v]] (a gather) to the same lane chains in the same order. In that fill, a block of
 * patterns whose d = z - m all equal d0 = 0 - m (|z| far below ulp(m): most of the tiny
 * patterns near zero) takes the term of d0 without evaluating exp64 again.
 *
 * The draw: per row, scalar float64 over the k candidates: lmtail_kernels.h's sampler steps
 * (the ones shard_partials.c's candidates sampler runs), the reference's formulas
 * (rows_tail.py lists them). log64 is numerics.log64's ops.
 *
 * Rows the reference decides (flag = 1; top-k still written here): with sampling, a NaN
 * lane without nan_fold (NaN propagation through torch's max is not declared), or a zero
 * max (vmax == 0 or vmax / T == 0: the sign torch's max returns between +0 and -0 is not
 * declared). A row is owned by one thread from first op to last: no bit depends on R or
 * the thread count.
 */
#include "lmtail_kernels.h"

enum { ISA_C = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
enum { LANES = 256 };
#define NEG_INF (-__builtin_inf())
#define KEY_PINF 0x7F80    /* raw16 key of +inf; larger keys are positive NaNs */
#define KEY_NINF (-32641)  /* raw16 key of -inf (0xFF80); smaller keys are negative NaNs */

typedef struct {
    const uint16_t *rows;
    int64_t R, V, ld, k;
    int nan_fold, sampling, isa;
    const lmtail_sampling *sp;
    const double *K;
    uint16_t *vals;
    int64_t *ids, *tokens;
    float *logprobs;
    uint8_t *trunc;
    int32_t *flag;
    double *dbg;  /* [R, 3] or NULL: S1, lse1, nz1 of each sampled row (debug export) */
    int64_t next; /* next row to take (atomic) */
    int failed;   /* a worker could not allocate its scratch */
} job_t;

typedef struct {
    uint64_t *buf; /* [cap] candidate keys */
    double *v, *vf, *e, *p, *c; /* [k] each */
    double *acc; /* [L] */
    double *tab; /* [65536] terms by bit pattern (pooled, see table_take) */
    uint16_t *iota; /* [65536] iota[b] = b (in the same pooled block) */
    int64_t cap;
} scratch_t;

/* ================================================================ keys */
static inline uint32_t mono_of(uint16_t bits, int fold) { /* topk.mono_keys */
    int32_t b = (int16_t)bits;
    if (b == -32768) b = 0; /* -0 -> +0 */
    uint32_t m = (uint32_t)((b ^ ((b >> 15) & 0x7FFF)) + 32769);
    if (fold && (b & 0x7FFF) > 0x7F80) m = 1;
    return m;
}

static inline int32_t raw16(uint16_t bits) { /* the filter's order key, int16 range */
    const int32_t b = (int16_t)bits;
    return (int16_t)(b ^ ((b >> 15) & 0x7FFF));
}

static inline uint16_t mono_to_bits(uint32_t mono) { /* topk.mono_to_bf16 */
    if (mono == 0) return 0xFF80;
    const uint32_t m = mono - 1;
    if (m == 0) return 0x7FC0;
    return (m & 0x8000) ? (uint16_t)(m & 0x7FFF) : (uint16_t)(~m & 0xFFFF);
}

static inline uint64_t make_key(uint16_t bits, int64_t v, int fold) {
    return ((uint64_t)mono_of(bits, fold) << 32) | (uint64_t)(0xFFFFFFFFu - (uint32_t)v);
}

typedef struct {
    uint64_t *buf;
    int64_t n, cap, k;
    int32_t thr; /* lanes enter iff raw16 > thr */
    int fold;
} pool_t;

/* Keep the pool's k largest keys; the k-th one's mono16 becomes the threshold (raw16
 * space, in [-32768, 32767]). */
static inline void pool_reduce(pool_t *P) {
    select_top(P->buf, P->n, P->k);
    P->n = P->k;
    P->thr = (int32_t)(P->buf[P->k - 1] >> 32) - 32769;
}

static inline void pool_push(pool_t *P, uint16_t bits, int64_t v) {
    P->buf[P->n++] = make_key(bits, v, P->fold);
    if (P->n == P->cap) pool_reduce(P);
}

static void scan_c(pool_t *P, const uint16_t *x, int64_t v, int64_t V) {
    for (; v < V; ++v)
        if (raw16(x[v]) > P->thr) pool_push(P, x[v], v);
}

#if defined(__x86_64__)
#define AVX512 LMTAIL_TARGET_AVX512BW
#define AVX2 LMTAIL_TARGET_AVX2
enum { PREFETCH = 2048 }; /* lanes ahead (4 KB) the top-k scan asks the cache for */

static AVX512 void scan_avx512(pool_t *P, const uint16_t *x, int64_t v, int64_t V) {
    const __m512i t7 = _mm512_set1_epi16(0x7FFF);
    __m512i thr = _mm512_set1_epi16((int16_t)P->thr);
    for (; v + 64 <= V; v += 64) {
        _mm_prefetch((const char *)(x + v + PREFETCH), _MM_HINT_T0); /* past the end: harmless */
        _mm_prefetch((const char *)(x + v + PREFETCH + 32), _MM_HINT_T0);
        const __m512i b0 = _mm512_loadu_si512((const void *)(x + v));
        const __m512i b1 = _mm512_loadu_si512((const void *)(x + v + 32));
        const __m512i k0 = _mm512_xor_si512(b0, _mm512_and_si512(_mm512_srai_epi16(b0, 15), t7));
        const __m512i k1 = _mm512_xor_si512(b1, _mm512_and_si512(_mm512_srai_epi16(b1, 15), t7));
        const uint64_t m = (uint64_t)_mm512_cmpgt_epi16_mask(k0, thr) |
                           ((uint64_t)_mm512_cmpgt_epi16_mask(k1, thr) << 32);
        if (!m) continue;
        for (uint64_t mm = m; mm; mm &= mm - 1) {
            const int64_t j = v + __builtin_ctzll(mm);
            if (raw16(x[j]) > P->thr) pool_push(P, x[j], j); /* thr may have risen */
        }
        thr = _mm512_set1_epi16((int16_t)P->thr);
    }
    scan_c(P, x, v, V);
}

static AVX2 void scan_avx2(pool_t *P, const uint16_t *x, int64_t v, int64_t V) {
    const __m256i t7 = _mm256_set1_epi16(0x7FFF);
    __m256i thr = _mm256_set1_epi16((int16_t)P->thr);
    for (; v + 32 <= V; v += 32) {
        _mm_prefetch((const char *)(x + v + PREFETCH), _MM_HINT_T0);
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)(x + v));
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(x + v + 16));
        const __m256i k0 = _mm256_xor_si256(b0, _mm256_and_si256(_mm256_srai_epi16(b0, 15), t7));
        const __m256i k1 = _mm256_xor_si256(b1, _mm256_and_si256(_mm256_srai_epi16(b1, 15), t7));
        /* movemask_epi8: two bits per 16-bit lane */
        const uint64_t m = (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpgt_epi16(k0, thr)) |
                           ((uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpgt_epi16(k1, thr)) << 32);
        if (!m) continue;
        for (uint64_t mm = m & 0x5555555555555555ULL; mm; mm &= mm - 1) {
            const int64_t j = v + (__builtin_ctzll(mm) >> 1);
            if (raw16(x[j]) > P->thr) pool_push(P, x[j], j);
        }
        thr = _mm256_set1_epi16((int16_t)P->thr);
    }
    scan_c(P, x, v, V);
}
#endif

/* The k largest keys of row x, sorted descending, into buf[0..k). */
static void topk_row(const uint16_t *x, int64_t V, int64_t k, int fold, int isa,
                     uint64_t *buf, int64_t cap) {
    pool_t P = {buf, 0, cap, k, 0, fold};
    int64_t v = 0;
    for (; v < V && P.n < cap; ++v) P.buf[P.n++] = make_key(x[v], v, fold); /* fill */
    if (v < V) { /* cap > k lanes seen: the filtered scan takes the rest */
        pool_reduce(&P);
#if defined(__x86_64__)
        if (isa == ISA_AVX512) scan_avx512(&P, x, v, V);
        else if (isa == ISA_AVX2) scan_avx2(&P, x, v, V);
        else
#endif
            scan_c(&P, x, v, V);
    }
    if (P.n > k) select_top(P.buf, P.n, k);
    sort_desc(P.buf, k);
}

/* ================================================================ float64 exp and log */
/* log64's constants (lmtail_kernels.h's lmtail_log64): LOG_L[0] = SQRT2 (the mantissa
 * split), LOG_L[1 + i] = 1/(2i+1), i = 0..14 (the atanh series; numerics.log64's 1.0 / k).
 * lmtail_rows_tail_constants exports them. Used for x >= 1 finite (the sums it is taken of). */
static const double LOG_L[16] = {1.4142135623730951, 1.0 / 1, 1.0 / 3, 1.0 / 5, 1.0 / 7, 1.0 / 9, 1.0 / 11,
                                 1.0 / 13, 1.0 / 15, 1.0 / 17, 1.0 / 19, 1.0 / 21, 1.0 / 23, 1.0 / 25,
                                 1.0 / 27, 1.0 / 29};

/* ================================================================ the full-row mass */
typedef struct {
    double S;
    int64_t nz;
    int nan;
} mass_t;

static inline double lane_z(uint16_t bits, int fold, double s, double inv, int *nan) {
    double d = bf16_to_double(bits);
    if (d != d) {
        *nan = 1;
        if (fold) d = NEG_INF;
    }
    return inv != 0.0 ? d * inv : d / s;
}

/* The terms of lanes [v0, V), generic C: added to the lane chains acc (y NULL) or stored
 * to y[v] (acc NULL; a table fill). */
static void mass_c(const uint16_t *x, int64_t v0, int64_t V, int fold, double s, double inv,
                   double m, const double *K, double *acc, double *y, mass_t *out) {
    const double d0 = 0.0 - m, t0 = shifted_exp1(0.0, m, K); /* the term of z = +-0 */
    for (int64_t v = v0; v < V; ++v) {
        const double z = lane_z(x[v], fold, s, inv, &out->nan);
        /* a term is a function of d alone: where d == d0 (|z| far below ulp(m)) it is t0 */
        const double t = (z != m && z - m == d0) ? t0 : shifted_exp1(z, m, K);
        out->nz += t > 0.0;
        if (y) y[v] = t;
        else acc[v % LANES] += t;
    }
}

static double tree256(double *acc) {
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int t = 0; t < w; ++t) acc[t] = acc[t] + acc[t + w];
    return acc[0];
}

#if defined(__x86_64__)
enum { U = EXP8_U };

static inline __attribute__((always_inline)) AVX512 __m512d load8_bf16(const uint16_t *x) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)x));
    return _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
}

static AVX512 void mass_avx512(const uint16_t *x, int64_t V, int fold, double s, double inv,
                               double m, const double *K, double *acc, double *y, mass_t *out) {
    __m512d KV[17];
    for (int c = 0; c < 17; ++c) KV[c] = _mm512_set1_pd(K[c]);
    const __m512d mv = _mm512_set1_pd(m), sv = _mm512_set1_pd(s), iv = _mm512_set1_pd(inv);
    const __m512d ninf = _mm512_set1_pd(NEG_INF), zero = _mm512_setzero_pd();
    const __m512d d0v = _mm512_set1_pd(0.0 - m), t0v = _mm512_set1_pd(shifted_exp1(0.0, m, K));
    __mmask8 nan = 0;
    int64_t cnt = 0, v = 0;
    for (; v + 8 * U <= V; v += 8 * U) { /* 32 | 256: a block never wraps the lane index */
        __m512d z[U], t[U];
        for (int u = 0; u < U; ++u) {
            __m512d d = load8_bf16(x + v + 8 * u);
            const __mmask8 isn = _mm512_cmp_pd_mask(d, d, _CMP_UNORD_Q);
            nan |= isn;
            if (fold) d = _mm512_mask_mov_pd(d, isn, ninf);
            z[u] = inv != 0.0 ? _mm512_mul_pd(d, iv) : _mm512_div_pd(d, sv);
        }
        if (y) { /* a table fill: a block whose every d equals d0 (tiny |z|) is all t0 */
            int same = 1;
            for (int u = 0; u < U; ++u) {
                const __m512d d = _mm512_mask_mov_pd(_mm512_sub_pd(z[u], mv),
                                                     _mm512_cmp_pd_mask(z[u], mv, _CMP_EQ_OQ), zero);
                same &= _mm512_cmp_pd_mask(d, d0v, _CMP_EQ_OQ) == 0xFF;
            }
            if (same) {
                for (int u = 0; u < U; ++u) _mm512_storeu_pd(y + v + 8 * u, t0v);
                continue;
            }
        }
        shifted_exp8(t, z, mv, KV);
        for (int u = 0; u < U; ++u)
            cnt += __builtin_popcount(_mm512_cmp_pd_mask(t[u], zero, _CMP_GT_OQ));
        if (y) {
            for (int u = 0; u < U; ++u) _mm512_storeu_pd(y + v + 8 * u, t[u]);
        } else {
            double *a = acc + (v % LANES);
            for (int u = 0; u < U; ++u)
                _mm512_storeu_pd(a + 8 * u, _mm512_add_pd(_mm512_loadu_pd(a + 8 * u), t[u]));
        }
    }
    out->nan |= nan != 0;
    out->nz += cnt;
    mass_c(x, v, V, fold, s, inv, m, K, acc, y, out);
}

static inline __attribute__((always_inline)) AVX2 __m256d load4_bf16(const uint16_t *x) {
    const __m128i w = _mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)x));
    return _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(w, 16)));
}

static AVX2 void mass_avx2(const uint16_t *x, int64_t V, int fold, double s, double inv,
                           double m, const double *K, double *acc, double *y, mass_t *out) {
    __m256d KV[17];
    for (int c = 0; c < 17; ++c) KV[c] = _mm256_set1_pd(K[c]);
    const __m256d mv = _mm256_set1_pd(m), sv = _mm256_set1_pd(s), iv = _mm256_set1_pd(inv);
    const __m256d ninf = _mm256_set1_pd(NEG_INF), zero = _mm256_setzero_pd();
    const __m256d d0v = _mm256_set1_pd(0.0 - m), t0v = _mm256_set1_pd(shifted_exp1(0.0, m, K));
    int nan = 0;
    int64_t cnt = 0, v = 0;
    for (; v + 4 * U <= V; v += 4 * U) { /* 16 | 256 */
        __m256d z[U], t[U];
        for (int u = 0; u < U; ++u) {
            __m256d d = load4_bf16(x + v + 4 * u);
            const __m256d isn = _mm256_cmp_pd(d, d, _CMP_UNORD_Q);
            nan |= _mm256_movemask_pd(isn);
            if (fold) d = _mm256_blendv_pd(d, ninf, isn);
            z[u] = inv != 0.0 ? _mm256_mul_pd(d, iv) : _mm256_div_pd(d, sv);
        }
        if (y) { /* a table fill: a block whose every d equals d0 (tiny |z|) is all t0 */
            int same = 1;
            for (int u = 0; u < U; ++u) {
                const __m256d d = _mm256_blendv_pd(_mm256_sub_pd(z[u], mv), zero,
                                                   _mm256_cmp_pd(z[u], mv, _CMP_EQ_OQ));
                same &= _mm256_movemask_pd(_mm256_cmp_pd(d, d0v, _CMP_EQ_OQ)) == 0xF;
            }
            if (same) {
                for (int u = 0; u < U; ++u) _mm256_storeu_pd(y + v + 4 * u, t0v);
                continue;
            }
        }
        sexp4(t, z, mv, KV);
        for (int u = 0; u < U; ++u)
            cnt += __builtin_popcount(_mm256_movemask_pd(_mm256_cmp_pd(t[u], zero, _CMP_GT_OQ)));
        if (y) {
            for (int u = 0; u < U; ++u) _mm256_storeu_pd(y + v + 4 * u, t[u]);
        } else {
            double *a = acc + (v % LANES);
            for (int u = 0; u < U; ++u)
                _mm256_storeu_pd(a + 4 * u, _mm256_add_pd(_mm256_loadu_pd(a + 4 * u), t[u]));
        }
    }
    out->nan |= nan != 0;
    out->nz += cnt;
    mass_c(x, v, V, fold, s, inv, m, K, acc, y, out);
}
#endif

/* ---------------------------------------------------------------- lookup-table pass
 * A lane's term depends on its 16 bits alone (for a given row, scale and m), so when the
 * row's bit patterns span few distinct values compared with V, the terms of every pattern
 * between the row's smallest and largest value are computed once (the same ops, any
 * path) into tab[bits], and the pass adds tab[x[v]] to lane chain v mod 256 in pass
 * order: the same terms in the same order, hence the same bits. */
typedef struct {
    int32_t kmin, kmax; /* raw16 keys of the row's smallest and largest lanes */
} krange_t;

static krange_t keyrange_c(const uint16_t *x, int64_t v, int64_t V, krange_t r) {
    for (; v < V; ++v) {
        const int32_t key = raw16(x[v]);
        if (key < r.kmin) r.kmin = key;
        if (key > r.kmax) r.kmax = key;
    }
    return r;
}

#if defined(__x86_64__)
static AVX512 krange_t keyrange_avx512(const uint16_t *x, int64_t V) {
    const __m512i t7 = _mm512_set1_epi16(0x7FFF);
    __m512i lo = _mm512_set1_epi16(32767), hi = _mm512_set1_epi16(-32768);
    int64_t v = 0;
    for (; v + 32 <= V; v += 32) {
        const __m512i b = _mm512_loadu_si512((const void *)(x + v));
        const __m512i key = _mm512_xor_si512(b, _mm512_and_si512(_mm512_srai_epi16(b, 15), t7));
        lo = _mm512_min_epi16(lo, key);
        hi = _mm512_max_epi16(hi, key);
    }
    int16_t l[32], h[32];
    _mm512_storeu_si512((void *)l, lo);
    _mm512_storeu_si512((void *)h, hi);
    krange_t r = {32767, -32768};
    for (int t = 0; t < 32; ++t) {
        if (l[t] < r.kmin) r.kmin = l[t];
        if (h[t] > r.kmax) r.kmax = h[t];
    }
    return keyrange_c(x, v, V, r);
}

static AVX2 krange_t keyrange_avx2(const uint16_t *x, int64_t V) {
    const __m256i t7 = _mm256_set1_epi16(0x7FFF);
    __m256i lo = _mm256_set1_epi16(32767), hi = _mm256_set1_epi16(-32768);
    int64_t v = 0;
    for (; v + 16 <= V; v += 16) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(x + v));
        const __m256i key = _mm256_xor_si256(b, _mm256_and_si256(_mm256_srai_epi16(b, 15), t7));
        lo = _mm256_min_epi16(lo, key);
        hi = _mm256_max_epi16(hi, key);
    }
    int16_t l[16], h[16];
    _mm256_storeu_si256((__m256i *)l, lo);
    _mm256_storeu_si256((__m256i *)h, hi);
    krange_t r = {32767, -32768};
    for (int t = 0; t < 16; ++t) {
        if (l[t] < r.kmin) r.kmin = l[t];
        if (h[t] > r.kmax) r.kmax = h[t];
    }
    return keyrange_c(x, v, V, r);
}

static AVX512 void accum_avx512(const uint16_t *x, int64_t V, const double *tab, double *acc,
                                int64_t *nz) {
    const __m512d zero = _mm512_setzero_pd();
    int64_t cnt = 0, v = 0;
    for (; v + 32 <= V; v += 32) { /* 32 | 256 */
        double *a = acc + (v % LANES);
        for (int u = 0; u < 4; ++u) {
            const __m256i idx = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + v + 8 * u)));
            const __m512d t = _mm512_i32gather_pd(idx, tab, 8);
            cnt += __builtin_popcount(_mm512_cmp_pd_mask(t, zero, _CMP_GT_OQ));
            _mm512_storeu_pd(a + 8 * u, _mm512_add_pd(_mm512_loadu_pd(a + 8 * u), t));
        }
    }
    for (; v < V; ++v) {
        const double t = tab[x[v]];
        cnt += t > 0.0;
        acc[v % LANES] += t;
    }
    *nz += cnt;
}

static AVX2 void accum_avx2(const uint16_t *x, int64_t V, const double *tab, double *acc,
                            int64_t *nz) {
    const __m256d zero = _mm256_setzero_pd();
    int64_t cnt = 0, v = 0;
    for (; v + 16 <= V; v += 16) { /* 16 | 256 */
        double *a = acc + (v % LANES);
        for (int u = 0; u < 4; ++u) {
            const __m128i idx = _mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(x + v + 4 * u)));
            const __m256d t = _mm256_i32gather_pd(tab, idx, 8);
            cnt += __builtin_popcount(_mm256_movemask_pd(_mm256_cmp_pd(t, zero, _CMP_GT_OQ)));
            _mm256_storeu_pd(a + 4 * u, _mm256_add_pd(_mm256_loadu_pd(a + 4 * u), t));
        }
    }
    for (; v < V; ++v) {
        const double t = tab[x[v]];
        cnt += t > 0.0;
        acc[v % LANES] += t;
    }
    *nz += cnt;
}
#endif

static void accum_c(const uint16_t *x, int64_t V, const double *tab, double *acc, int64_t *nz) {
    int64_t cnt = 0;
    for (int64_t v = 0; v < V; ++v) {
        const double t = tab[x[v]];
        cnt += t > 0.0;
        acc[v % LANES] += t;
    }
    *nz += cnt;
}

static krange_t keyrange(const uint16_t *x, int64_t V, int isa) {
#if defined(__x86_64__)
    if (isa == ISA_AVX512) return keyrange_avx512(x, V);
    if (isa == ISA_AVX2) return keyrange_avx2(x, V);
#endif
    const krange_t r = {32767, -32768};
    return keyrange_c(x, 0, V, r);
}

/* The terms of the n patterns x[0..n) into y (a table fill), by `isa`. */
static void terms(const uint16_t *x, int64_t n, int fold, double s, double inv, double m,
                  const double *K, double *y, int isa) {
    mass_t out = {0.0, 0, 0};
#if defined(__x86_64__)
    if (isa == ISA_AVX512) mass_avx512(x, n, fold, s, inv, m, K, NULL, y, &out);
    else if (isa == ISA_AVX2) mass_avx2(x, n, fold, s, inv, m, K, NULL, y, &out);
    else
#endif
        mass_c(x, 0, n, fold, s, inv, m, K, NULL, y, &out);
}

/* An estimate (it only picks the faster pass) of how many patterns of the key ranges
 * [p0, p1] and [n1, n0] have |z| below ulp(m)/2, where d == -m and the table fill is cheap. */
static int64_t tiny_patterns(double m, double s, int64_t p0, int64_t p1, int64_t n0, int64_t n1) {
    uint64_t mb;
    memcpy(&mb, &m, sizeof mb);
    const int64_t em = (int64_t)((mb >> 52) & 0x7FF) - 1023;
    if (em == 1024) return (p1 >= p0 ? p1 - p0 + 1 : 0) + (n0 >= n1 ? n0 - n1 + 1 : 0); /* inf */
    if (em - 54 < -1022 || em == -1023) return 0;
    const double lim = pow2(em - 54) * s; /* |v| below this: |z| < ulp(m)/4 */
    if (!(lim < 3.0e38)) return (p1 >= p0 ? p1 - p0 + 1 : 0) + (n0 >= n1 ? n0 - n1 + 1 : 0);
    const float lf = (float)lim;
    uint32_t fb;
    memcpy(&fb, &lf, sizeof fb);
    const int64_t mag = (int64_t)(fb >> 16); /* bf16 magnitudes below mag are tiny */
    int64_t n = 0;
    const int64_t a = p0, b = p1 < mag - 1 ? p1 : mag - 1; /* positive keys [0, mag) */
    if (b >= a) n += b - a + 1;
    const int64_t c = n1 > -mag ? n1 : -mag, d = n0; /* negative keys [-mag, -1] */
    if (d >= c) n += d - c + 1;
    return n;
}

/* sum64 over the row of shifted_exp(row / s, m) and the count of terms > 0. kr: the row's
 * key range; tab [65536] scratch, iota[b] = b. The caller has ruled out NaN lanes without
 * the fold. */
static mass_t row_mass(const uint16_t *x, int64_t V, int fold, double s, double m,
                       const double *K, double *acc, int isa, krange_t kr, double *tab,
                       const uint16_t *iota) {
    mass_t out = {0.0, 0, 0};
    const double inv = exact_inverse(s);
    for (int t = 0; t < LANES; ++t) acc[t] = 0.0;
    /* the patterns between the extremes: keys [max(kmin, 0), kmax] are bits of the same
     * value; keys [kmin, min(kmax, -1)] are bits 0x8000 + (-1 - key) */
    const int64_t p0 = kr.kmin > 0 ? kr.kmin : 0, p1 = kr.kmax;
    const int64_t n0 = kr.kmax < -1 ? kr.kmax : -1, n1 = kr.kmin;
    const int64_t npos = p1 >= p0 ? p1 - p0 + 1 : 0, nneg = n0 >= n1 ? n0 - n1 + 1 : 0;
    const int64_t ntiny = tiny_patterns(m, s, p0, p1, n0, n1);
    /* cost in exp-lanes: a pattern's exp 1, a tiny pattern ~1/8, a gathered lane ~1/4 */
    if (8 * (npos + nneg - ntiny) + ntiny + 2 * V < 8 * V) {
        if (npos) terms(iota + p0, npos, fold, s, inv, m, K, tab + p0, isa);
        if (nneg) terms(iota + 0x8000 + (-1 - n0), nneg, fold, s, inv, m, K, tab + 0x8000 + (-1 - n0), isa);
#if defined(__x86_64__)
        if (isa == ISA_AVX512) accum_avx512(x, V, tab, acc, &out.nz);
        else if (isa == ISA_AVX2) accum_avx2(x, V, tab, acc, &out.nz);
        else
#endif
            accum_c(x, V, tab, acc, &out.nz);
    } else {
#if defined(__x86_64__)
        if (isa == ISA_AVX512) mass_avx512(x, V, fold, s, inv, m, K, acc, NULL, &out);
        else if (isa == ISA_AVX2) mass_avx2(x, V, fold, s, inv, m, K, acc, NULL, &out);
        else
#endif
            mass_c(x, 0, V, fold, s, inv, m, K, acc, NULL, &out);
    }
    out.S = tree256(acc);
    return out;
}

/* #{v : row64[v] >= thr} (NaN lanes count as -inf with the fold, else never). */
static int64_t count_ge(const uint16_t *x, int64_t V, double thr, int fold) {
    int64_t c = 0;
    for (int64_t v = 0; v < V; ++v) {
        double d = bf16_to_double(x[v]);
        if (d != d && fold) d = NEG_INF;
        c += d >= thr;
    }
    return c;
}

/* ================================================================ one row */
typedef struct {
    const uint16_t *x; /* the row */
    double m, safe_t;  /* max(row / T), T (1 on greedy rows) */
    mass_t m1;         /* the full-row mass at T = 1 */
    krange_t kr;       /* the row's key range */
} rowctx_t;

/* Steps 1, 3-6 for a non-greedy row: the slot drawn and the truncation flag. */
static int64_t filtered_draw(const job_t *J, int64_t i, const rowctx_t *R, scratch_t *s,
                             int *truncated) {
    const int64_t k = J->k;
    const lmtail_sampling *sp = J->sp + i;
    const double *vf = s->vf;
    double *e = s->e, *p = s->p, *c = s->c;
    const int enabled = sp->top_k > 0;
    const double thr = lmtail_topk_threshold(vf, k, sp);
    int64_t n_in = 0;
    for (int64_t j = 0; j < k; ++j) n_in += vf[j] >= thr;
    /* lanes outside the candidates are <= vf[k-1]: they reach thr only if every candidate does */
    const int ties_past_k = enabled && n_in == k && count_ge(R->x, J->V, thr, J->nan_fold) > n_in;
    for (int64_t j = 0; j < k; ++j) e[j] = shifted_exp1(vf[j] / R->safe_t, R->m, J->K);
    mass_t S = {lmtail_kept_sum64(vf, e, k, thr, s->acc), 0, 0};
    if (!enabled) /* normalized over the whole row: at T = 1 that is the first pass's sum */
        S = R->safe_t == 1.0 ? R->m1 : row_mass(R->x, J->V, J->nan_fold, R->safe_t, R->m, J->K,
                                                 s->acc, J->isa, R->kr, s->tab, s->iota);
    lmtail_filtered_probs(vf, e, k, thr, S.S, p, c);
    *truncated = lmtail_truncated(sp, k, ties_past_k, c, S.nz > k);
    return lmtail_draw_slot(vf, p, c, k, thr, sp, (uint8_t *)e); /* e reused as flags */
}

/* The sampler on row i's candidates (already in vals/ids); flag = 1 leaves it to the
 * reference (see the top comment). */
static void sample_row(const job_t *J, int64_t i, const uint16_t *x, scratch_t *s) {
    const int64_t k = J->k;
    const int fold = J->nan_fold;
    const uint16_t *cv = J->vals + i * k;
    double *v = s->v, *vf = s->vf;
    for (int64_t j = 0; j < k; ++j) {
        v[j] = bf16_to_double(cv[j]);
        vf[j] = (fold && v[j] != v[j]) ? NEG_INF : v[j];
    }
    const double temp = J->sp[i].temperature;
    const int greedy = lmtail_greedy(J->sp + i);
    rowctx_t R = {x, 0.0, greedy ? 1.0 : temp, {0.0, 0, 0}, {0, 0}};
    const double vmax = vf[0], inv = exact_inverse(R.safe_t);
    R.m = inv != 0.0 ? vmax * inv : vmax / R.safe_t; /* = z[0] = max(row / T) */
    R.kr = keyrange(x, J->V, J->isa);
    if (vmax != vmax || vmax == 0.0 || R.m == 0.0 ||
        (!fold && (R.kr.kmax > KEY_PINF || R.kr.kmin < KEY_NINF))) { /* NaN lane, zero max */
        J->flag[i] = 1;
        return;
    }
    R.m1 = row_mass(x, J->V, fold, 1.0, vmax, J->K, s->acc, J->isa, R.kr, s->tab, s->iota);
    const double lse1 = vmax + lmtail_log64(R.m1.S, LOG_L, J->K);
    if (J->dbg) {
        J->dbg[3 * i] = R.m1.S;
        J->dbg[3 * i + 1] = lse1;
        J->dbg[3 * i + 2] = (double)R.m1.nz;
    }
    int truncated = 0;
    const int64_t pos = greedy ? 0 : filtered_draw(J, i, &R, s, &truncated);
    J->tokens[i] = J->ids[i * k + pos];
    J->logprobs[i] = (float)(v[pos] - lse1);
    J->trunc[i] = (uint8_t)truncated;
}

static void do_row(const job_t *J, int64_t i, scratch_t *s) {
    const uint16_t *x = J->rows + i * J->ld;
    topk_row(x, J->V, J->k, J->nan_fold, J->isa, s->buf, s->cap);
    uint16_t *ov = J->vals + i * J->k;
    int64_t *oi = J->ids + i * J->k;
    for (int64_t j = 0; j < J->k; ++j) {
        const uint64_t key = s->buf[j];
        ov[j] = mono_to_bits((uint32_t)(key >> 32));
        oi[j] = (int64_t)(0xFFFFFFFFu - (uint32_t)(key & 0xFFFFFFFFu));
    }
    if (J->sampling) sample_row(J, i, x, s);
}

/* ================================================================ threads */
/* The 640 KB term table + pattern list of a worker, kept across calls in a small pool (so
 * a call does not pay page faults and the iota fill again); a mutex guards the pool. */
enum { POOL = 64 };
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static void *pool[POOL];
static int pool_n = 0;

static void *table_take(void) {
    void *t = NULL;
    pthread_mutex_lock(&pool_mu);
    if (pool_n > 0) t = pool[--pool_n];
    pthread_mutex_unlock(&pool_mu);
    if (t) return t;
    t = malloc(sizeof(double) * 65536 + sizeof(uint16_t) * 65536);
    if (t) {
        uint16_t *iota = (uint16_t *)((double *)t + 65536);
        for (int b = 0; b < 65536; ++b) iota[b] = (uint16_t)b;
    }
    return t;
}

static void table_give(void *t) {
    if (!t) return;
    pthread_mutex_lock(&pool_mu);
    if (pool_n < POOL) {
        pool[pool_n++] = t;
        t = NULL;
    }
    pthread_mutex_unlock(&pool_mu);
    free(t);
}

static void *worker(void *arg) {
    job_t *J = (job_t *)arg;
    const unsigned csr = lmtail_mxcsr_pin(LMTAIL_MXCSR_IEEE);
    scratch_t s;
    s.cap = 4 * J->k + 64;
    if (s.cap > J->V + 1) s.cap = J->V + 1; /* the fill then holds the whole row */
    const size_t kk = (size_t)J->k + 8;
    s.buf = malloc(sizeof(uint64_t) * (size_t)s.cap);
    double *blk = malloc(sizeof(double) * (5 * kk + LANES));
    void *table = J->sampling ? table_take() : NULL;
    s.tab = (double *)table;
    s.iota = table ? (uint16_t *)((double *)table + 65536) : NULL;
    if (!s.buf || !blk || (J->sampling && !table)) {
        __atomic_store_n(&J->failed, 1, __ATOMIC_RELAXED);
    } else {
        s.v = blk; s.vf = blk + kk; s.e = blk + 2 * kk; s.p = blk + 3 * kk; s.c = blk + 4 * kk;
        s.acc = blk + 5 * kk;
        for (;;) {
            const int64_t i = __atomic_fetch_add(&J->next, 1, __ATOMIC_RELAXED);
            if (i >= J->R) break;
            do_row(J, i, &s);
        }
    }
    free(s.buf);
    free(blk);
    table_give(table);
    lmtail_mxcsr_restore(csr);
    return NULL;
}

/* 1 when this CPU runs `isa`: 2 = AVX-512 (F + BW), 1 = AVX2, 0 = plain C. */
static int isa_ok(int isa) {
    if (isa == ISA_AVX512) return lmtail_cpu_has(LMTAIL_CPU_AVX512F | LMTAIL_CPU_AVX512BW);
    if (isa == ISA_AVX2) return lmtail_cpu_has(LMTAIL_CPU_AVX2);
    return isa == ISA_C;
}

/* The constants this file holds (the rest come in K from numerics): out[0] = LMTAIL_GREEDY_T,
 * out[1 + i] = LOG_L[i] for i < 16 (SQRT2, then the series). Returns the count written (17). */
int lmtail_rows_tail_constants(double *out) {
    out[0] = LMTAIL_GREEDY_T;
    for (int i = 0; i < 16; ++i) out[1 + i] = LOG_L[i];
    return 17;
}

/* Top-k (and, when sp is not NULL, the sampler) for every row on up to nthreads threads
 * (the caller's included). dbg: NULL, or [R, 3] float64 that receives each sampled row's
 * full-row S at T = 1, lse1 and nz (rows flagged for the reference are not written). Returns the ISA used, -1 if the ISA is not available here,
 * -2 if scratch memory could not be allocated (then outputs are incomplete). */
int lmtail_rows_tail(const uint16_t *rows, int64_t R, int64_t V, int64_t ld, int64_t k,
                     int nan_fold, const lmtail_sampling *sp, const double *K,
                     uint16_t *vals, int64_t *ids, int64_t *tokens, float *logprobs,
                     uint8_t *trunc, int32_t *flag, double *dbg, int nthreads, int isa) {
    if (!isa_ok(isa)) return -1;
    job_t J = {rows, R, V, ld, k, nan_fold, sp != NULL, isa, sp, K,
               vals, ids, tokens, logprobs, trunc, flag, dbg, 0, 0};
    if (nthreads > R) nthreads = (int)R;
    if (nthreads < 1) nthreads = 1;
    lmtail_parallel(worker, &J, nthreads);
    return (J.failed && J.next < R) ? -2 : isa;
}
