/* lmtail: one vocab shard's exact fp32 top-(k+1) keys, NaN count and chunk mass partials
 * (the per-rank half of the candidates exchange), bit-equal to the "torch" backend of
 * lmtail.kernels.tail.shard_partials (shard_partials.py documents the contract; this comment
 * the implementation).
 *
 * Shape legend: n rows, V = V_s shard columns, k1 keys per row, c chunks, L = 256 lanes.
 *   x        [n, ld]    float    row i at x[i*ld + j], j < V; column j = vocab id col0 + j
 *   bounds   [c + 1]    int64    local chunk offsets, 0 = bounds[0] <= ... <= bounds[c] = V
 *   scale    [n]        float64  the T pass's divisor (0.0: no T pass for the row)
 *   K        [17]       float64  exp64's INV_LN2, LN2_HI, LN2_LO, C[0..13] (numerics.py's)
 *   keys     [n, k1]    int64    descending; PAD_KEY = INT64_MIN past V
 *   mass     [n, c, 4]  float64  (m1, S1, mT, ST) per chunk (with_mass)
 *   nans     [n]        int64    NaN lanes per row (with_mass)
 *   flag     [n]        int32    1: the row's outputs are left to the torch backend
 *
 * Keys. key = mono32(b) * 2**32 + (2**32 - 1 - id), b the fp32 bits as int32: -0 -> +0,
 * negative b -> b ^ 0x7FFFFFFF, with nan_fold every NaN -> NAN_MONO. Keys are unique, so
 * any exact method gives the k1 largest. They are held as key ^ 2**63 (KEY_BIAS: the
 * uint64 order is the int64 order), so the select and sort are lmtail_kernels.h's
 * select_top / sort_desc, shared with rows_tail.c; the output undoes the bias. Method (as
 * rows_tail.c's): the first `cap` lanes go to a buffer; whenever it is full a quickselect
 * (select_top) keeps its k1 largest and the k1-th key's mono32 becomes the threshold;
 * later lanes (higher ids) enter only if their raw order key
 * raw32(b) = b ^ ((b >> 31) & 0x7FFFFFFF) is strictly greater (an equal mono with a higher
 * id cannot beat the k1-th key). raw32 equals mono32 except at -0 (raw -1,
 * mono 0; mono -1 is no lane's, so a -0 that belongs passes) and, with nan_fold, at NaNs
 * (a positive NaN passes and is keyed NAN_MONO, then loses in the select; a negative NaN's
 * raw is below NAN_MONO, the lowest mono a folded row has, so it never belongs). The filter
 * only drops lanes outside the top k1; one vector compare per 8 lanes (AVX2) or per lane.
 *
 * Mass (with_mass). Per chunk [b_j, b_{j+1}) of width w: lanes widened to float64 exactly
 * (NaN -> -inf with nan_fold); max m1 = the chunk's max lane (computed on the fp32 values:
 * widening is exact and monotone; an empty chunk's is -inf); at scale s (1.0, and
 * scale[i] when != 0) z = fl64(v / s) per lane (a product by the exact 1/s when s is a power
 * of two: the same bits, exact_inverse) and m = fl64(m1 / s) (division by s > 0 is
 * monotone, so this is max z: the same value, up to the sign of a zero max, which no output
 * sees: m is stored as m + 0.0 and z - (+-0) is z for every z != m). S = sum64 of
 * shifted_exp1(z, m) over the chunk: lane t of the CHUNK (its position in the chunk) adds to
 * chain t mod 256, chains from +0.0 in pass order, then lane t += lane t + h for
 * h = 128, ..., 1; S = lane 0. Chains at positions >= w stay +0.0 and adding +0.0 changes
 * no chain (a chain is never -0.0: +0.0 plus terms >= +0.0), so the tree skips them, and
 * the vector paths may add the term of a -inf pad lane (+0.0) past the chunk's end.
 * m == -inf (empty, or -inf lanes only): S = w. Outputs (m + 0.0, S); rows with scale 0
 * get mT = ST = 0.0. The exp terms are lmtail_kernels.h's shifted_exp1 (scalar) and sexp4
 * (AVX2, 4 x 4 lanes): the same float64 ops in the same order (rowmass.c spells them out).
 *
 * Rows left to the torch backend (flag = 1, mass and nans not written; keys written): with
 * mass, a NaN lane without nan_fold (torch's NaN propagation through max and adds is not
 * declared) and a T pass at a scale that is not finite and > 0 (NaN z from inf/inf, and
 * the max shortcut needs s > 0). A row is owned by one thread from first op to last; each
 * worker pins MXCSR to round-to-nearest with FTZ/DAZ off; -ffp-contract=off, no fast-math.
 *
 * Also here, single-threaded scalar C for the tail's host work at small batch (each commented
 * where it is defined, op for op with the torch spelling it stands for): lmtail_owner_stats
 * (candidates.merge), lmtail_sample_candidates (sampler.plan_on + decide on merged
 * candidates), lmtail_tail_norm (tail.normed_rows, deferred rms).
 */
#include "lmtail_kernels.h"

enum { ISA_C = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
enum { LANES = 256, BLK = 16 /* lanes per sexp4 call: 16 | 256 */ };
#define NEG_INF (-__builtin_inf())
#define NAN_MONO (INT32_MIN + 1)
#define PAD_KEY INT64_MIN
#define KEY_BIAS 0x8000000000000000ull /* int64 key <-> held uint64 key */

typedef struct {
    const float *x;
    int64_t n, V, ld, col0, k1;
    int fold, with_mass, isa;
    const int64_t *bounds;
    int64_t c;
    const double *scale, *K;
    int64_t *keys;
    double *mass;
    int64_t *nans;
    int32_t *flag;
    int64_t next; /* next row to take (atomic) */
    int failed;   /* a worker could not allocate its scratch */
} job_t;

/* ================================================================ keys */
static inline int32_t mono32(uint32_t u, int fold) {
    int32_t b = (int32_t)u;
    if (b == INT32_MIN) b = 0; /* -0 -> +0 */
    int32_t m = b < 0 ? (b ^ 0x7FFFFFFF) : b;
    if (fold && (b & 0x7FFFFFFF) > 0x7F800000) m = NAN_MONO;
    return m;
}

static inline int32_t raw32(uint32_t u) { /* the filter's order key */
    const int32_t b = (int32_t)u;
    return b ^ ((b >> 31) & 0x7FFFFFFF);
}

/* The lane's key held as key ^ KEY_BIAS: a uint64 in the int64 key's order, for
 * lmtail_kernels.h's select_top / sort_desc; its high half is mono32 ^ 0x80000000. */
static inline uint64_t make_key(uint32_t u, int64_t id, int fold) {
    return ((uint64_t)((uint32_t)mono32(u, fold) ^ 0x80000000u) << 32) |
           (uint64_t)(0xFFFFFFFFu - (uint32_t)id);
}

typedef struct {
    uint64_t *buf; /* held keys (key ^ KEY_BIAS) */
    int64_t n, cap, k, col0;
    int32_t thr; /* lanes enter iff raw32 > thr */
    int fold;
} pool_t;

static inline void pool_reduce(pool_t *P) {
    select_top(P->buf, P->n, P->k);
    P->n = P->k;
    P->thr = (int32_t)((uint32_t)(P->buf[P->k - 1] >> 32) ^ 0x80000000u); /* mono32 */
}

static inline void pool_push(pool_t *P, uint32_t u, int64_t j) {
    P->buf[P->n++] = make_key(u, P->col0 + j, P->fold);
    if (P->n == P->cap) pool_reduce(P);
}

static void scan_c(pool_t *P, const uint32_t *x, int64_t j, int64_t V) {
    for (; j < V; ++j)
        if (raw32(x[j]) > P->thr) pool_push(P, x[j], j);
}

#if defined(__x86_64__)
#define AVX2 LMTAIL_AVX2
#define AVX512 LMTAIL_TARGET_AVX512F

static AVX2 void scan_avx2(pool_t *P, const uint32_t *x, int64_t j, int64_t V) {
    const __m256i t7 = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i thr = _mm256_set1_epi32(P->thr);
    for (; j + 16 <= V; j += 16) {
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)(x + j));
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(x + j + 8));
        const __m256i k0 = _mm256_xor_si256(b0, _mm256_and_si256(_mm256_srai_epi32(b0, 31), t7));
        const __m256i k1 = _mm256_xor_si256(b1, _mm256_and_si256(_mm256_srai_epi32(b1, 31), t7));
        const unsigned m = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k0, thr))) |
                           ((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k1, thr))) << 8);
        if (!m) continue;
        for (unsigned mm = m; mm; mm &= mm - 1) {
            const int64_t jj = j + __builtin_ctz(mm);
            if (raw32(x[jj]) > P->thr) pool_push(P, x[jj], jj); /* thr may have risen */
        }
        thr = _mm256_set1_epi32(P->thr);
    }
    scan_c(P, x, j, V);
}

static AVX512 void scan_avx512(pool_t *P, const uint32_t *x, int64_t j, int64_t V) {
    const __m512i t7 = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i thr = _mm512_set1_epi32(P->thr);
    for (; j + 32 <= V; j += 32) {
        const __m512i b0 = _mm512_loadu_si512((const void *)(x + j));
        const __m512i b1 = _mm512_loadu_si512((const void *)(x + j + 16));
        const __m512i k0 = _mm512_xor_si512(b0, _mm512_and_si512(_mm512_srai_epi32(b0, 31), t7));
        const __m512i k1 = _mm512_xor_si512(b1, _mm512_and_si512(_mm512_srai_epi32(b1, 31), t7));
        const uint32_t m = (uint32_t)_mm512_cmpgt_epi32_mask(k0, thr) |
                           ((uint32_t)_mm512_cmpgt_epi32_mask(k1, thr) << 16);
        if (!m) continue;
        for (uint32_t mm = m; mm; mm &= mm - 1) {
            const int64_t jj = j + __builtin_ctz(mm);
            if (raw32(x[jj]) > P->thr) pool_push(P, x[jj], jj);
        }
        thr = _mm512_set1_epi32(P->thr);
    }
    scan_c(P, x, j, V);
}
#endif

/* The k1 largest keys of row x, descending, into out[0..k1) (PAD_KEY past V). */
static void keys_row(const job_t *J, const uint32_t *x, uint64_t *buf, int64_t cap, int64_t *out) {
    const int64_t V = J->V, k = J->k1;
    pool_t P = {buf, 0, cap, k, J->col0, 0, J->fold};
    int64_t j = 0;
    for (; j < V && P.n < cap; ++j) P.buf[P.n++] = make_key(x[j], J->col0 + j, J->fold); /* fill */
    if (j < V) { /* cap > k1 lanes seen: the filtered scan takes the rest */
        pool_reduce(&P);
#if defined(__x86_64__)
        if (J->isa == ISA_AVX512) scan_avx512(&P, x, j, V);
        else if (J->isa == ISA_AVX2) scan_avx2(&P, x, j, V);
        else
#endif
            scan_c(&P, x, j, V);
    }
    if (P.n > k) select_top(P.buf, P.n, k);
    const int64_t have = P.n < k ? P.n : k;
    sort_desc(P.buf, have);
    for (int64_t t = 0; t < have; ++t) out[t] = (int64_t)(P.buf[t] ^ KEY_BIAS);
    for (int64_t t = have; t < k; ++t) out[t] = PAD_KEY;
}

/* ================================================================ chunk max and NaN count */
/* The max lane of x[0..w) with NaN read as -inf (-inf when w == 0), and the NaN count. */
static float chunk_max_c(const float *x, int64_t w, int64_t *nan) {
    float mx = NEG_INF;
    int64_t cnt = 0;
    for (int64_t t = 0; t < w; ++t) {
        const float v = x[t];
        if (v != v) ++cnt;
        else if (v > mx) mx = v;
    }
    *nan += cnt;
    return mx;
}

#if defined(__x86_64__)
static AVX2 float chunk_max_avx2(const float *x, int64_t w, int64_t *nan) {
    const __m256 ninf = _mm256_set1_ps(NEG_INF);
    __m256 mx = ninf;
    int64_t cnt = 0, t = 0;
    for (; t + 8 <= w; t += 8) {
        const __m256 v = _mm256_loadu_ps(x + t);
        const __m256 isn = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
        cnt += __builtin_popcount((unsigned)_mm256_movemask_ps(isn));
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(v, ninf, isn));
    }
    float l[8], best = chunk_max_c(x + t, w - t, &cnt);
    _mm256_storeu_ps(l, mx);
    for (int u = 0; u < 8; ++u)
        if (l[u] > best) best = l[u];
    *nan += cnt;
    return best; /* a zero max's sign is whichever: no output sees it (see top) */
}

static AVX512 float chunk_max_avx512(const float *x, int64_t w, int64_t *nan) {
    const __m512 ninf = _mm512_set1_ps(NEG_INF);
    __m512 mx = ninf;
    int64_t cnt = 0, t = 0;
    for (; t + 16 <= w; t += 16) {
        const __m512 v = _mm512_loadu_ps(x + t);
        const __mmask16 isn = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        cnt += __builtin_popcount((unsigned)isn);
        mx = _mm512_max_ps(mx, _mm512_mask_mov_ps(v, isn, ninf));
    }
    float l[16], best = chunk_max_c(x + t, w - t, &cnt);
    _mm512_storeu_ps(l, mx);
    for (int u = 0; u < 16; ++u)
        if (l[u] > best) best = l[u];
    *nan += cnt;
    return best;
}
#endif

/* ================================================================ chunk mass */
/* The halving tree over the chains acc[0..256) when acc[t] == +0.0 for t >= act (those
 * are not read): lane t += lane t + h only where t + h < act (adding +0.0 is exact). */
static double tree_active(double *acc, int64_t act) {
    for (int h = LANES / 2; h >= 1; h /= 2) {
        for (int t = 0; t < h && t + h < act; ++t) acc[t] = acc[t] + acc[t + h];
        if (act > h) act = h;
    }
    return acc[0];
}

static inline double lane_z(float v, int fold, double s, double inv) {
    double d = (double)v;
    if (fold && d != d) d = NEG_INF;
    return inv != 0.0 ? d * inv : d / s;
}

/* S of the chunk x[lo..lo+w) at scale s (inv = exact_inverse(s)) with max z m > -inf. */
static double chunk_sum_c(const float *x, int64_t lo, int64_t w, int fold, double s, double inv,
                          double m, const double *K, double *acc) {
    const int64_t act = w < LANES ? w : LANES;
    for (int64_t t = 0; t < act; ++t) acc[t] = 0.0;
    for (int64_t v = lo; v < lo + w; ++v) /* chain: the lane's position in the chunk */
        acc[(v - lo) % LANES] += shifted_exp1(lane_z(x[v], fold, s, inv), m, K);
    return tree_active(acc, act);
}

#if defined(__x86_64__)
static inline __attribute__((always_inline)) AVX2 __m256d z4(const float *x, int fold, __m256d sv,
                                                              __m256d iv, int use_inv) {
    __m256d d = _mm256_cvtps_pd(_mm_loadu_ps(x)); /* exact */
    if (fold) d = _mm256_blendv_pd(d, _mm256_set1_pd(NEG_INF), _mm256_cmp_pd(d, d, _CMP_UNORD_Q));
    return use_inv ? _mm256_mul_pd(d, iv) : _mm256_div_pd(d, sv);
}

static AVX2 double chunk_sum_avx2(const float *x, int64_t lo, int64_t w, int fold, double s,
                                  double inv, double m, const __m256d *KV, double *acc) {
    x += lo; /* t below: the position in the chunk */
    const int64_t act = w < LANES ? w : LANES;
    const int64_t nz = w < LANES ? (w + BLK - 1) / BLK * BLK : LANES; /* chains a block may touch */
    for (int64_t t = 0; t < nz; t += 4) _mm256_store_pd(acc + t, _mm256_setzero_pd());
    const __m256d mv = _mm256_set1_pd(m), sv = _mm256_set1_pd(s), iv = _mm256_set1_pd(inv);
    const int use_inv = inv != 0.0;
    int64_t t = 0;
    __m256d z[EXP8_U], y[EXP8_U];
    for (; t + BLK <= w; t += BLK) { /* a block never wraps the chain index */
        for (int u = 0; u < EXP8_U; ++u) z[u] = z4(x + t + 4 * u, fold, sv, iv, use_inv);
        sexp4(y, z, mv, KV);
        double *a = acc + (t % LANES);
        for (int u = 0; u < EXP8_U; ++u)
            _mm256_store_pd(a + 4 * u, _mm256_add_pd(_mm256_load_pd(a + 4 * u), y[u]));
    }
    if (t < w) { /* the last partial block: pad lanes are -inf, whose term is +0.0 */
        double zt[BLK] __attribute__((aligned(32)));
        for (int64_t u = 0; u < BLK; ++u) zt[u] = t + u < w ? lane_z(x[t + u], fold, s, inv) : NEG_INF;
        for (int u = 0; u < EXP8_U; ++u) z[u] = _mm256_load_pd(zt + 4 * u);
        sexp4(y, z, mv, KV);
        double *a = acc + (t % LANES);
        for (int u = 0; u < EXP8_U; ++u)
            _mm256_store_pd(a + 4 * u, _mm256_add_pd(_mm256_load_pd(a + 4 * u), y[u]));
    }
    return tree_active(acc, act);
}

enum { BLK8 = 8 * EXP8_U /* lanes per shifted_exp8 call: 32 | 256 */ };

/* tree_active in vectors: the same adds (lane t += lane t + h, h = 128, ..., 1), where the
 * chains [act, p2) are +0.0 (p2 >= 8 a power of two >= act, 64-byte aligned acc): a step
 * h >= act is skipped (tree_active adds nothing there), every other adds all t < h, and
 * where t + h >= act that adds +0.0 to a chain >= +0.0, which leaves its bits as they are
 * (chains are +0.0 plus terms >= +0.0: never -0.0 or NaN). */
static AVX512 double tree_512(double *acc, int64_t act) {
    for (int64_t h = LANES / 2; h >= 8; h /= 2)
        if (h < act)
            for (int64_t t = 0; t < h; t += 8)
                _mm512_store_pd(acc + t, _mm512_add_pd(_mm512_load_pd(acc + t), _mm512_load_pd(acc + t + h)));
    const __m512d x = _mm512_load_pd(acc);
    const __m256d x4 = _mm256_add_pd(_mm512_castpd512_pd256(x), _mm512_extractf64x4_pd(x, 1)); /* h = 4 */
    const __m128d x2 = _mm_add_pd(_mm256_castpd256_pd128(x4), _mm256_extractf128_pd(x4, 1));   /* h = 2 */
    return _mm_cvtsd_f64(_mm_add_sd(x2, _mm_unpackhi_pd(x2, x2)));                            /* h = 1 */
}

static AVX512 double chunk_sum_avx512(const float *x, int64_t lo, int64_t w, int fold, double s,
                                      double inv, double m, const __m512d *KV, double *acc) {
    x += lo; /* t below: the position in the chunk */
    const int64_t act = w < LANES ? w : LANES;
    /* chains [0, nz) take their first term by a store (+0.0 + y is y: y >= +0.0); the tree
     * reads up to p2, the power of two >= act (at least 8): [nz, p2) set to +0.0 */
    const int64_t nz = w < LANES ? (w + BLK8 - 1) / BLK8 * BLK8 : LANES;
    int64_t p2 = 8;
    while (p2 < act) p2 *= 2;
    for (int64_t t = nz; t < p2; t += 8) _mm512_store_pd(acc + t, _mm512_setzero_pd());
    const __m512d mv = _mm512_set1_pd(m), sv = _mm512_set1_pd(s), iv = _mm512_set1_pd(inv);
    const __m512d ninf = _mm512_set1_pd(NEG_INF);
    const int use_inv = inv != 0.0;
    __m512d z[EXP8_U], y[EXP8_U];
    for (int64_t t = 0; t < w; t += BLK8) { /* the last block's pad lanes: -inf, term +0.0 */
        for (int u = 0; u < EXP8_U; ++u) {
            const int64_t left = w - t - 8 * u;
            const __mmask8 mk = left >= 8 ? 0xFF : left <= 0 ? 0 : (__mmask8)((1u << left) - 1);
            __m512d d = _mm512_mask_cvtps_pd(
                ninf, mk, _mm512_castps512_ps256(_mm512_maskz_loadu_ps((__mmask16)mk, x + t + 8 * u)));
            if (fold) d = _mm512_mask_mov_pd(d, _mm512_cmp_pd_mask(d, d, _CMP_UNORD_Q), ninf);
            z[u] = use_inv ? _mm512_mul_pd(d, iv) : _mm512_div_pd(d, sv);
        }
        shifted_exp8(y, z, mv, KV);
        double *a = acc + (t % LANES);
        if (t < LANES)
            for (int u = 0; u < EXP8_U; ++u) _mm512_store_pd(a + 8 * u, y[u]);
        else
            for (int u = 0; u < EXP8_U; ++u)
                _mm512_store_pd(a + 8 * u, _mm512_add_pd(_mm512_load_pd(a + 8 * u), y[u]));
    }
    return tree_512(acc, act);
}
#endif

/* ================================================================ one row */
typedef struct {
    uint64_t *buf; /* [cap] candidate keys, held (key ^ KEY_BIAS) */
    int64_t cap;
    double *acc;  /* [LANES], 64-byte aligned */
    float *mx;    /* [c] chunk maxima */
} scratch_t;

/* (m, S) of every chunk at scale s into out[4*j + 0..1] (out: the row's [c, 4] block, the
 * pair's offset applied); mx: the chunks' max lanes. One loop per ISA (the vector constants
 * live in that ISA's registers). m = max z: division by s > 0 is monotone (see top). */
#define MASS_PASS(SUM, KARG)                                                               \
    const double inv = exact_inverse(s);                                                   \
    const int64_t *b = J->bounds;                                                          \
    for (int64_t j = 0; j < J->c; ++j) {                                                   \
        const int64_t w = b[j + 1] - b[j];                                                 \
        const double m1 = (double)mx[j];                                                   \
        const double m = inv != 0.0 ? m1 * inv : m1 / s;                                   \
        out[4 * j] = m + 0.0;                                                              \
        out[4 * j + 1] = m == NEG_INF ? (double)w /* empty, or -inf lanes only */          \
                                      : SUM(x, b[j], w, J->fold, s, inv, m, KARG, acc);    \
    }

static void mass_pass_c(const job_t *J, const float *x, const float *mx, double s, double *out,
                        double *acc) {
    MASS_PASS(chunk_sum_c, J->K)
}

#if defined(__x86_64__)
static AVX2 void mass_pass_avx2(const job_t *J, const float *x, const float *mx, double s,
                                double *out, double *acc) {
    __m256d KV[LMTAIL_NK];
    for (int q = 0; q < LMTAIL_NK; ++q) KV[q] = _mm256_set1_pd(J->K[q]);
    MASS_PASS(chunk_sum_avx2, KV)
}

static AVX512 void mass_pass_avx512(const job_t *J, const float *x, const float *mx, double s,
                                    double *out, double *acc) {
    __m512d KV[LMTAIL_NK];
    for (int q = 0; q < LMTAIL_NK; ++q) KV[q] = _mm512_set1_pd(J->K[q]);
    MASS_PASS(chunk_sum_avx512, KV)
}
#endif

static void mass_pass(const job_t *J, const float *x, const float *mx, double s, double *out,
                      double *acc) {
#if defined(__x86_64__)
    if (J->isa == ISA_AVX512) mass_pass_avx512(J, x, mx, s, out, acc);
    else if (J->isa == ISA_AVX2) mass_pass_avx2(J, x, mx, s, out, acc);
    else
#endif
        mass_pass_c(J, x, mx, s, out, acc);
}

static void do_row(job_t *J, int64_t i, scratch_t *sc) {
    const float *x = J->x + i * J->ld;
    keys_row(J, (const uint32_t *)x, sc->buf, sc->cap, J->keys + i * J->k1);
    if (!J->with_mass) return;
    int64_t nan = 0;
    for (int64_t j = 0; j < J->c; ++j) {
        const float *xc = x + J->bounds[j];
        const int64_t w = J->bounds[j + 1] - J->bounds[j];
#if defined(__x86_64__)
        if (J->isa == ISA_AVX512) sc->mx[j] = chunk_max_avx512(xc, w, &nan);
        else if (J->isa == ISA_AVX2) sc->mx[j] = chunk_max_avx2(xc, w, &nan);
        else
#endif
            sc->mx[j] = chunk_max_c(xc, w, &nan);
    }
    const double s = J->scale[i];
    const int tpass = s != 0.0;
    if ((nan && !J->fold) || (tpass && !(s > 0.0 && s < __builtin_inf()))) {
        J->flag[i] = 1; /* the torch backend decides this row */
        return;
    }
    J->nans[i] = nan;
    double *out = J->mass + i * J->c * 4;
    mass_pass(J, x, sc->mx, 1.0, out, sc->acc);
    if (tpass) {
        mass_pass(J, x, sc->mx, s, out + 2, sc->acc);
    } else {
        for (int64_t j = 0; j < J->c; ++j) out[4 * j + 2] = out[4 * j + 3] = 0.0;
    }
}

/* ================================================================ threads */
static void *worker(void *arg) {
    job_t *J = (job_t *)arg;
    const unsigned csr = lmtail_mxcsr_pin(LMTAIL_MXCSR_IEEE);
    scratch_t sc;
    sc.cap = 4 * J->k1 + 64;
    if (sc.cap > J->V + 1) sc.cap = J->V + 1; /* the fill then holds the whole row */
    sc.buf = malloc(sizeof(uint64_t) * (size_t)sc.cap);
    sc.mx = malloc(sizeof(float) * (size_t)(J->c + 1));
    if (posix_memalign((void **)&sc.acc, 64, sizeof(double) * LANES)) sc.acc = NULL;
    if (!sc.buf || !sc.mx || !sc.acc) {
        __atomic_store_n(&J->failed, 1, __ATOMIC_RELAXED);
    } else {
        for (;;) {
            const int64_t i = __atomic_fetch_add(&J->next, 1, __ATOMIC_RELAXED);
            if (i >= J->n) break;
            do_row(J, i, &sc);
        }
    }
    free(sc.buf);
    free(sc.mx);
    free(sc.acc);
    lmtail_mxcsr_restore(csr);
    return NULL;
}

/* 1 when this CPU runs `isa`: 2 = AVX-512F, 1 = AVX2, 0 = plain C. */
static int isa_ok(int isa) {
    if (isa == ISA_AVX512) return lmtail_cpu_has(LMTAIL_CPU_AVX512F);
    if (isa == ISA_AVX2) return lmtail_cpu_has(LMTAIL_CPU_AVX2);
    return isa == ISA_C;
}

/* keys (and with with_mass: mass, nans, flag) for every row, on up to nthreads threads (the
 * caller's included). flag must come in zeroed. Returns the ISA used, -1 if the ISA is not
 * available here, -2 if scratch memory could not be allocated (outputs incomplete). */
int lmtail_shard_partials(const float *x, int64_t n, int64_t V, int64_t ld, int64_t col0,
                          int64_t k1, int nan_fold, const int64_t *bounds, int64_t c,
                          const double *scale, int with_mass, const double *K, int64_t *keys,
                          double *mass, int64_t *nans, int32_t *flag, int nthreads, int isa) {
    if (!isa_ok(isa)) return -1;
    job_t J = {x, n, V, ld, col0, k1, nan_fold, with_mass, isa, bounds, c, scale, K,
               keys, mass, nans, flag, 0, 0};
    if (nthreads > n) nthreads = (int)n;
    if (nthreads < 1) nthreads = 1;
    lmtail_parallel(worker, &J, nthreads);
    return (J.failed && J.next < n) ? -2 : isa;
}

/* ================================================================ the one-call owner stats */
/* numerics.log64 (lmtail_kernels.h's lmtail_log64; L: SQRT2, then the atanh series
 * 1/(2i+1), i = 0..14, handed in by the caller from numerics.log64_constants(); K: exp64's
 * constants), with its special values: 0 -> -inf, +inf -> +inf, anything else outside [2**-1022, inf)
 * (negatives, subnormals, NaN) -> the canonical quiet NaN. */
static double log64_full(double x, const double *L, const double *K) {
    if (x == 0.0) return NEG_INF;
    if (x == __builtin_inf()) return __builtin_inf();
    if (!(x >= 2.2250738585072014e-308)) return __builtin_nan("");
    return lmtail_log64(x, L, K);
}

/* candidates.combine of one row's pair: (m, S) from the chunks' (m_j, S_j) at mass[4*j + q]
 * and mass[4*j + q + 1], j < c: top = max_j m_j + 0.0, t_j = S_j * shifted_exp(m_j, top),
 * S = sum64(t) (lane j mod 256 chains from +0.0, then the halving tree). 1 if a m_j is NaN
 * (then nothing is written). */
static int combine_row(const double *mass, int64_t c, int q, const double *K, double *acc,
                       double *m_out, double *s_out) {
    double top = NEG_INF;
    for (int64_t j = 0; j < c; ++j) {
        const double m = mass[4 * j + q];
        if (m != m) return 1;
        if (m > top) top = m;
    }
    top = top + 0.0;
    for (int t = 0; t < LANES; ++t) acc[t] = 0.0;
    for (int64_t j = 0; j < c; ++j)
        acc[j % LANES] += mass[4 * j + q + 1] * shifted_exp1(mass[4 * j + q], top, K);
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int t = 0; t < w; ++t) acc[t] = acc[t] + acc[t + w];
    *m_out = top;
    *s_out = acc[0];
    return 0;
}

/* The owner's view of R rows from their merged keys [R, k1] (descending) and, when mass is
 * not NULL, the chunk partials [R, c, 4] in global chunk order (candidates.merge):
 *   vals [R, k1] fp32, ids [R, k1] int64   candidates.split_fp32_keys, op for op
 *   stats [5, R] float64                   m1, S1, mT, ST (combine of each pair), lse1 =
 *                                          m1 + log64(S1)
 *   lp0 [R] fp32                           fp32(double(vals[r, 0]) - lse1): slot 0's logprob
 * flag[r] = 1: a chunk max of the row is NaN; its stats and lp0 are not written (the caller
 * takes candidates.combine's torch path). Single-threaded (a few microseconds a row);
 * MXCSR pinned to round-to-nearest, FTZ/DAZ off. Returns the number of flagged rows. */
int lmtail_owner_stats(const int64_t *keys, int64_t R, int64_t k1, const double *mass, int64_t c,
                       const double *K, const double *L, float *vals, int64_t *ids,
                       double *stats, float *lp0, int32_t *flag) {
    const unsigned csr = lmtail_mxcsr_pin(LMTAIL_MXCSR_IEEE);
    double acc[LANES];
    int bad = 0;
    for (int64_t r = 0; r < R; ++r) {
        for (int64_t t = 0; t < k1; ++t) {
            const int64_t key = keys[r * k1 + t];
            const int32_t mono = (int32_t)(key >> 32);
            int32_t b = mono < 0 ? (mono ^ 0x7FFFFFFF) : mono;
            if (mono == NAN_MONO) b = 0x7FC00000;
            const int pad = key == PAD_KEY;
            if (pad) b = (int32_t)0xFF800000u;
            vals[r * k1 + t] = u2f((uint32_t)b);
            ids[r * k1 + t] = pad ? -1 : (int64_t)0xFFFFFFFF - (key & 0xFFFFFFFF);
        }
        if (!mass) continue;
        const double *mr = mass + r * c * 4;
        double m1, s1, mt, st;
        if (combine_row(mr, c, 0, K, acc, &m1, &s1) || combine_row(mr, c, 2, K, acc, &mt, &st)) {
            flag[r] = 1;
            ++bad;
            continue;
        }
        const double lse1 = m1 + log64_full(s1, L, K);
        stats[0 * R + r] = m1;
        stats[1 * R + r] = s1;
        stats[2 * R + r] = mt;
        stats[3 * R + r] = st;
        stats[4 * R + r] = lse1;
        lp0[r] = (float)((double)vals[r * k1] - lse1);
    }
    lmtail_mxcsr_restore(csr);
    return bad;
}

/* ================================================================ the tail's norm */
/* decode_tail's normed_rows (deferred rms) for rows x [n, H] fp32, gamma g [H] fp32 and the
 * real-lane mask real [H] (NULL: every lane real):
 *   xr    = real ? x : +0.0
 *   ssq   = orders.sum_squares(xr, strided(256)): lane t's fp32 fma chain over t, t + 256, ...
 *           from +0.0 (exact fma, fma_rn; past H: + 0.0), then per 32-lane group the halving
 *           fold 16, 8, 4, 2, 1 and the groups added in order (kernels/glue/fmachain.c's)
 *   m     = ssq / hu;  rms = 1 / sqrt(m + eps)          (fp32 each, IEEE, sqrt correctly
 *                                                        rounded: sqrtss)
 *   a     = real ? fp32(x * g) : +0.0                    [n, H] fp32
 * Writes m [n] (the caller's eps = 0 check), rms [n], a. Returns 1 (outputs not to be used)
 * when a real lane of x or g is NaN: the caller then takes the torch path, whose NaN payloads
 * this kernel does not promise. MXCSR pinned to round-to-nearest, FTZ/DAZ off. */
int lmtail_tail_norm(const float *x, int64_t n, int64_t H, const float *g, const uint8_t *real,
                     float hu, float eps, float *a, float *m_out, float *rms) {
    for (int64_t i = 0; i < H; ++i)
        if ((!real || real[i]) && g[i] != g[i]) return 1;
    const unsigned csr = lmtail_mxcsr_pin(LMTAIL_MXCSR_IEEE);
    float acc[LANES];
    int bad = 0;
    for (int64_t r = 0; r < n && !bad; ++r) {
        const float *xr = x + r * H;
        float *ar = a + r * H;
        for (int t = 0; t < LANES; ++t) acc[t] = 0.0f;
        for (int64_t base = 0; base < H; base += LANES)
            for (int t = 0; t < LANES; ++t) {
                const int64_t i = base + t;
                if (i >= H) {
                    acc[t] = acc[t] + 0.0f;
                    continue;
                }
                const float v = (!real || real[i]) ? xr[i] : 0.0f;
                if (v != v) bad = 1;
                acc[t] = fma_rn(v, v, acc[t]);
                ar[i] = (!real || real[i]) ? v * g[i] : 0.0f;
            }
        const float m = lmtail_lane_totals(acc, LANES) / hu;
        m_out[r] = m;
#if defined(__x86_64__)
        const float s = _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(m + eps)));
#else
        const float s = __builtin_sqrtf(m + eps);
#endif
        rms[r] = 1.0f / s;
    }
    lmtail_mxcsr_restore(csr);
    return bad;
}

/* ================================================================ the sampler on merged candidates */
/* sampler.plan_on + draw + decide for the candidates exchange (candidates.sample_merged with
 * MergedStats), one row at a time in float64, through lmtail_kernels.h's sampler steps (the
 * ones rows_tail.c's fused draw runs; plan_on's docstring and the sampler module's numerics):
 *   row r: v [k] = double(vals[r*ldv ..]) (NaN -> -inf with nan_fold), sp[r] its
 *   lmtail_sampling, stats [5, R] (m1, S1, mT, ST, lse1), out = double(outside[r]) (NaN ->
 *   -inf with nan_fold), has_outside[r].
 * What this file answers itself is MergedStats': a lane outside the candidates tied with
 * the threshold (has_out and out >= thr), a top-k-off row's normalizer (m, S) = (mT, ST) on
 * the rows with a T pass (candidates.needs_t), else (m1, S1), and mass past slot k-1
 * (has_out and shifted_exp(out / T, m) > 0).
 * Writes tokens, logprobs, truncated. Returns 1 (nothing to be used) when a row meets a
 * NaN, or a shifted_exp argument above its max (the torch ops decide those). scratch: [4k]. */
static inline double shexp(double z, double m, const double *K, int *bad) {
    if (!(z <= m) || m != m) *bad = 1; /* also catches NaN z */
    return *bad ? 0.0 : shifted_exp1(z, m, K);
}

static int sample_row(const float *vr, const int64_t *ir, int64_t k, const lmtail_sampling *sp,
                      const double *st, int64_t R, int64_t r, double out, int has_out, int fold,
                      const double *K, double *acc, double *v, double *e, double *p, double *c,
                      int64_t *token, float *lp, uint8_t *trunc) {
    int bad = 0;
    const int greedy = lmtail_greedy(sp);
    const double safe_t = greedy ? 1.0 : sp->temperature;
    const double lse1 = st[4 * R + r];
    if (fold && out != out) out = NEG_INF;
    if (lse1 != lse1 || out != out) return 1;
    for (int64_t j = 0; j < k; ++j) {
        v[j] = (double)vr[j];
        if (fold && v[j] != v[j]) v[j] = NEG_INF;
        if (v[j] != v[j]) return 1;
    }
    /* 1. top-k: in_k = v >= thr (a prefix: v descends) */
    const int enabled = sp->top_k > 0;
    const double thr = lmtail_topk_threshold(v, k, sp);
    const int ties_past_k = has_out && out >= thr;
    /* 3. z = v / safe_t; the filtered set's (m, S) = (z[0], sum64 of its shifted_exp(z, z[0])) */
    const double m_k = v[0] / safe_t;
    for (int64_t j = 0; j < k; ++j) e[j] = shexp(v[j] / safe_t, m_k, K, &bad);
    double m = m_k, s = lmtail_kept_sum64(v, e, k, thr, acc);
    int past = 0;
    if (!enabled && !greedy) { /* off_mass: the whole row's mass at T (needs_t) or at 1 */
        const int at_t = sp->temperature != 1.0; /* top-k off and sampled here */
        m = at_t ? st[2 * R + r] : st[0 * R + r];
        s = at_t ? st[3 * R + r] : st[1 * R + r];
        past = has_out && shexp(out / safe_t, m, K, &bad) > 0;
        for (int64_t j = 0; j < k; ++j) e[j] = shexp(v[j] / safe_t, m, K, &bad);
    }
    if (bad || m != m || s != s) return 1;
    lmtail_filtered_probs(v, e, k, thr, s, p, c);
    /* 4-6. top-p, min-p, the draw; greedy: slot 0 */
    const int64_t pos = greedy ? 0 : lmtail_draw_slot(v, p, c, k, thr, sp, (uint8_t *)e); /* e reused */
    *token = ir[pos];
    *lp = (float)((double)vr[pos] - lse1);
    *trunc = (uint8_t)(!greedy && lmtail_truncated(sp, k, ties_past_k, c, past));
    return 0;
}

int lmtail_sample_candidates(const float *vals, const int64_t *ids, int64_t ld, int64_t R, int64_t k,
                             const lmtail_sampling *sp, const double *stats, const float *outside,
                             const uint8_t *has_outside, int nan_fold, const double *K,
                             int64_t *tokens, float *logprobs, uint8_t *truncated, double *scratch) {
    const unsigned csr = lmtail_mxcsr_pin(LMTAIL_MXCSR_IEEE);
    double acc[LANES];
    int bad = 0;
    for (int64_t r = 0; r < R && !bad; ++r)
        bad = sample_row(vals + r * ld, ids + r * ld, k, sp + r, stats, R, r, (double)outside[r],
                         has_outside[r], nan_fold, K, acc, scratch, scratch + k, scratch + 2 * k, scratch + 3 * k,
                         tokens + r, logprobs + r, truncated + r);
    lmtail_mxcsr_restore(csr);
    return bad;
}

/* decode_tail's deferred scale, in place: x[r*V + i] = fl32(x[r*V + i] * s[r]) for r < n,
 * i < V (IEEE fp32 products, MXCSR pinned to round-to-nearest, FTZ/DAZ off): the bytes of
 * torch's `acc * rms[:, None]`, a NaN x kept as its own NaN, quieted (with one NaN operand
 * the product is that NaN whatever the operand order). Returns 1 (nothing written) when
 * some s[r] is NaN: the caller then runs the torch op, whose choice between two NaN
 * payloads this kernel does not promise.
 * One thread: the decode tail calls it between the body's kernels, where a torch op of
 * >= 32,768 elements would wake torch's OpenMP team, whose spinning then takes a core
 * from the body's next GEMM. */
int lmtail_scale_rows(float *x, int64_t n, int64_t V, const float *s) {
    for (int64_t r = 0; r < n; ++r)
        if (s[r] != s[r]) return 1;
    const unsigned csr = lmtail_mxcsr_pin(LMTAIL_MXCSR_IEEE);
    for (int64_t r = 0; r < n; ++r) {
        float *xr = x + r * V;
        const float sr = s[r];
        for (int64_t i = 0; i < V; ++i) xr[i] = xr[i] * sr;
    }
    lmtail_mxcsr_restore(csr);
    return 0;
}
