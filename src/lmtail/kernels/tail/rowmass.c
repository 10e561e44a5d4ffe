/* lmtail: the sampler's full-vocab pass `row_mass` as a CPU kernel, bit-equal to the
 * "torch" backend of `lmtail.kernels.tail.rowmass.row_mass` (numerics.exp64 and
 * kernels.tail.rowmass.sum64 as torch ops).
 *
 * Shape legend: R rows, V vocab (the full row), L = 256 sum lanes.
 *   row    [R, ld]  float64   row i in row[i*ld + v] for v < V (ld >= V)
 *   scale  [R]      float64   divisor per row (1.0, or the temperature)
 *   k      [17]     float64   INV_LN2, LN2_HI, LN2_LO, C[0..13] (numerics' constants,
 *                             passed in so the kernel cannot drift from numerics.py)
 *   m, S   [R]      float64   results
 *   nz     [R]      int64     the number of lanes whose term y is > 0 (carry mass)
 *   flag   [R]      int32     1: the row is left to the torch reference (see below)
 *
 * Numerics, per row i, every op one IEEE float64 operation rounded to nearest-even:
 *   z[v] = row[i, v] / scale[i]        (one division; a product by the exact 1/scale
 *                                         when scale is a power of two: the same bits,
 *                                         see exact_inverse)
 *   m    = max_v z[v]
 *   d    = (z == m) ? +0.0 : z - m                           (shifted_exp)
 *   xc   = max(d, -746)            (exp64 from here on; its clamp at 710, its d > 709.78
 *                                   -> inf and its NaN pass-through never act: d <= 0)
 *   n    = round_even(xc * INV_LN2)      (MXCSR pinned to round-to-nearest: half-even,
 *                                         like torch.round; the AVX-512 path uses
 *                                         roundscale with _MM_FROUND_TO_NEAREST_INT)
 *   r    = (xc - n * LN2_HI) - n * LN2_LO
 *   p    = r * C13;  p = (p + Cj) * r  for j = 12, 11, ..., 1;  p = p + C0
 *   y    = (p * 2**n1) * 2**n2,  n1 = (n >= -1022) ? 0 : floor(n / 2),  n2 = n - n1
 *          (these ops are shifted_exp1 / shifted_exp8 of lmtail_kernels.h, shared with
 *          rows_tail.c)
 *          (n1, n2 clamped to [-1022, 1023] like numerics.exp64; no clamp bites here)
 *   y    = 0 where d < -745
 *   S    = sum64(y): lane t = v mod 256 holds the chain ((+0 + y[t]) + y[t+256]) + ...
 *          in pass order, then a halving tree: lane t += lane t + w, w = 128, 64, ..., 1;
 *          S = lane 0. (sum64 pads the row with +0.0 to a multiple of 256; adding +0.0 to
 *          a chain that is never -0.0 changes nothing, so the pad is skipped.)
 *   nz   = #{v : y[v] > 0}                                   (an exact integer count)
 *
 * The 2**n product. numerics.exp64 picks ONE path for the whole tensor: a single product
 * p * 2**n when every n >= -1022, else the split (p * 2**n1) * 2**n2 for every element.
 * Here the path is picked per element, and both give the same bits: d is in [-inf, 0] (m
 * is the max), so xc in [-746, 0], n in [-1076, 0], and p = exp(r) with |r| <= ln2/2 + tiny
 * is in [0.70, 1.42]. (a) n >= -1022: n1 = 0, so p * 2**0 = p exactly and the second
 * product IS the single product p * 2**n, one rounding. Had torch taken the split path,
 * n1 = floor(n/2) >= -511 makes p * 2**n1 >= 0.70 * 2**-511 a normal number, hence exact,
 * and the second product rounds the exact value p * 2**n once: the same correctly rounded
 * number as the single product. (b) n < -1022: the split with n1, n2 >= -538, as torch.
 *
 * Rows left to the reference (flag = 1, m, S and nz not written): a NaN among z (a NaN lane
 * without nan_fold, inf/inf, 0/0): torch's NaN payload propagation through max and adds is
 * not declared; a max that is zero with both +0.0 and -0.0 among z: the sign torch's max
 * returns is not declared. Every other row depends only on the ops above.
 *
 * A row is owned by one thread from first op to last, so neither R nor the thread count
 * can reach the bits. Each worker sets MXCSR to round-to-nearest, FTZ/DAZ off (restoring
 * the caller's value). Compiled with -ffp-contract=off and no fast-math: no op is fused,
 * reassociated or flushed; the AVX-512 path uses only separate mul/add/sub/div/min/max.
 */
#include <math.h>
#include "lmtail_kernels.h"

enum { ISA_GENERIC = 0, ISA_AVX512 = 2 };
enum { LANES = 256 };

typedef struct {
    const double *row, *scale, *k;
    double *m, *S;
    int64_t *nz;
    int32_t *flag;
    int64_t R, V, ld;
    int isa;
    int64_t next; /* next row to take (atomic) */
} job_t;

/* ---------------------------------------------------------------- generic (any CPU) */
/* Pass 1: z = row / s into buf, the max, and whether the row must go to the reference. */
static int row_max_generic(const double *x, int64_t V, double s, double *buf, double *m) {
    const double inv = exact_inverse(s);
    double mx = -INFINITY;
    int nan = 0, pz = 0, nz = 0;
    for (int64_t v = 0; v < V; ++v) {
        const double z = inv != 0.0 ? x[v] * inv : x[v] / s;
        buf[v] = z;
        if (z != z) nan = 1;
        else if (z > mx) mx = z;
        if (z == 0.0) {
            if (signbit(z)) nz = 1;
            else pz = 1;
        }
    }
    *m = mx;
    return nan || (mx == 0.0 && pz && nz);
}

static double row_sum_generic(const double *buf, int64_t V, double m, const double *k,
                              double *acc, int64_t *nz) {
    int64_t cnt = 0;
    for (int t = 0; t < LANES; ++t) acc[t] = 0.0;
    for (int64_t v = 0; v < V; ++v) {
        const double y = shifted_exp1(buf[v], m, k);
        cnt += y > 0.0;
        acc[v % LANES] += y;
    }
    *nz = cnt;
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int t = 0; t < w; ++t) acc[t] = acc[t] + acc[t + w];
    return acc[0];
}

/* ---------------------------------------------------------------- AVX-512 */
#if defined(__x86_64__)
#define AVX512 LMTAIL_TARGET_AVX512F

enum { U = EXP8_U };

static inline __mmask8 tail_mask(int64_t left) {
    return left >= 8 ? 0xFF : left <= 0 ? 0 : (__mmask8)((1u << left) - 1);
}

static AVX512 int row_max_avx512(const double *x, int64_t V, double s, double *buf,
                                 double *m) {
    const double inv = exact_inverse(s);
    const __m512d sv = _mm512_set1_pd(s), iv = _mm512_set1_pd(inv), zero = _mm512_setzero_pd();
    const __m512i sign = _mm512_set1_epi64((long long)0x8000000000000000ULL);
    __m512d mx = _mm512_set1_pd(-INFINITY);
    __mmask8 nan = 0, pz = 0, nz = 0;
    for (int64_t v = 0; v < V; v += 8) {
        const __mmask8 mk = tail_mask(V - v);
        const __m512d xv = _mm512_maskz_loadu_pd(mk, x + v);
        const __m512d z = inv != 0.0 ? _mm512_mul_pd(xv, iv) : _mm512_div_pd(xv, sv);
        _mm512_mask_storeu_pd(buf + v, mk, z);
        nan |= _mm512_mask_cmp_pd_mask(mk, z, z, _CMP_UNORD_Q);
        mx = _mm512_mask_max_pd(mx, mk, mx, z); /* max of non-NaN lanes; NaN rows flagged */
        const __mmask8 isz = _mm512_mask_cmp_pd_mask(mk, z, zero, _CMP_EQ_OQ);
        const __mmask8 neg = _mm512_test_epi64_mask(_mm512_castpd_si512(z), sign);
        nz |= isz & neg;
        pz |= isz & (__mmask8)~neg;
    }
    double lanes[8], best = -INFINITY;
    _mm512_storeu_pd(lanes, mx);
    for (int t = 0; t < 8; ++t)
        if (lanes[t] > best) best = lanes[t];
    *m = best; /* a zero max of one sign only is that zero; mixed signs are flagged */
    return nan != 0 || (best == 0.0 && pz && nz);
}

static AVX512 double row_sum_avx512(const double *buf, int64_t V, double m,
                                    const __m512d *K, double *acc, int64_t *nz) {
    const __m512d mv = _mm512_set1_pd(m);
    int64_t cnt = 0;
    for (int t = 0; t < LANES; t += 8) _mm512_store_pd(acc + t, _mm512_setzero_pd());
    for (int64_t b = 0; b < V; b += LANES) /* pass b / 256: lanes t = 0..255 in order */
        for (int t = 0; t < LANES && b + t < V; t += 8 * U) {
            __m512d z[U], e[U];
            __mmask8 mk[U];
#pragma GCC unroll 4
            for (int u = 0; u < U; ++u) {
                mk[u] = tail_mask(V - b - t - 8 * u);
                z[u] = _mm512_maskz_loadu_pd(mk[u], buf + b + t + 8 * u);
            }
            shifted_exp8(e, z, mv, K);
#pragma GCC unroll 4
            for (int u = 0; u < U; ++u) { /* masked-off lanes (past V) add nothing */
                cnt += __builtin_popcount(
                    _mm512_mask_cmp_pd_mask(mk[u], e[u], _mm512_setzero_pd(), _CMP_GT_OQ));
                const __m512d a = _mm512_load_pd(acc + t + 8 * u);
                _mm512_store_pd(acc + t + 8 * u, _mm512_mask_add_pd(a, mk[u], a, e[u]));
            }
        }
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int t = 0; t < w; ++t) acc[t] = acc[t] + acc[t + w];
    *nz = cnt;
    return acc[0];
}

static AVX512 void load_k(const double *k, __m512d *K) {
    for (int c = 0; c < LMTAIL_NK; ++c) K[c] = _mm512_set1_pd(k[c]);
}

/* y[v] = shifted_exp(z[v], m) for v < n (z <= m): the terms row_sum_avx512 adds. */
static AVX512 void terms_avx512(const double *z, double m, const double *k, double *y,
                                int64_t n) {
    __m512d K[LMTAIL_NK];
    load_k(k, K);
    const __m512d mv = _mm512_set1_pd(m);
    for (int64_t t = 0; t < n; t += 8 * U) {
        __m512d zz[U], e[U];
        __mmask8 mk[U];
        for (int u = 0; u < U; ++u) {
            mk[u] = tail_mask(n - t - 8 * u);
            zz[u] = _mm512_maskz_loadu_pd(mk[u], z + t + 8 * u);
        }
        shifted_exp8(e, zz, mv, K);
        for (int u = 0; u < U; ++u) _mm512_mask_storeu_pd(y + t + 8 * u, mk[u], e[u]);
    }
}

static AVX512 void do_row_avx512(const job_t *j, int64_t i, double *buf, double *acc) {
    __m512d K[LMTAIL_NK];
    load_k(j->k, K);
    double m;
    if ((j->flag[i] = row_max_avx512(j->row + i * j->ld, j->V, j->scale[i], buf, &m)))
        return;
    j->m[i] = m;
    j->S[i] = row_sum_avx512(buf, j->V, m, K, acc, j->nz + i);
}
#endif

static void do_row_generic(const job_t *j, int64_t i, double *buf, double *acc) {
    double m;
    if ((j->flag[i] = row_max_generic(j->row + i * j->ld, j->V, j->scale[i], buf, &m)))
        return;
    j->m[i] = m;
    j->S[i] = row_sum_generic(buf, j->V, m, j->k, acc, j->nz + i);
}

/* ---------------------------------------------------------------- threads */
static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    const unsigned csr = lmtail_mxcsr_pin(LMTAIL_MXCSR_IEEE);
    double *buf = NULL, *acc = NULL;
    const size_t nbuf = (size_t)((j->V + 7) / 8 * 8);
    if (posix_memalign((void **)&buf, 64, sizeof(double) * nbuf)) buf = NULL;
    if (posix_memalign((void **)&acc, 64, sizeof(double) * LANES)) acc = NULL;
    for (;;) {
        if (!buf || !acc) break; /* the other threads (or the caller's) take the rows */
        const int64_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (i >= j->R) break;
#if defined(__x86_64__)
        if (j->isa == ISA_AVX512) {
            do_row_avx512(j, i, buf, acc);
            continue;
        }
#endif
        do_row_generic(j, i, buf, acc);
    }
    free(buf);
    free(acc);
    lmtail_mxcsr_restore(csr);
    return NULL;
}

/* isa: the kernel wanted; 2 = AVX-512 (F) on a CPU without it falls back to 0 = generic C. */
static int pick_isa(int isa) {
    return isa == ISA_AVX512 && lmtail_cpu_has(LMTAIL_CPU_AVX512F) ? ISA_AVX512 : ISA_GENERIC;
}

/* (m, S, nz, flag) for every row (see top), on up to nthreads threads (the caller's
 * included). isa: the kernel wanted; one this CPU lacks falls back to generic. Returns
 * the ISA used, or -1 if no row could be done (out of memory). */
int lmtail_row_mass(const double *row, const double *scale, const double *k, double *m,
                    double *S, int64_t *nz, int32_t *flag, int64_t R, int64_t V, int64_t ld,
                    int nthreads, int isa) {
    isa = pick_isa(isa);
    job_t j = {row, scale, k, m, S, nz, flag, R, V, ld, isa, 0};
    if (nthreads > R) nthreads = (int)R;
    if (nthreads < 1) nthreads = 1;
    lmtail_parallel(worker, &j, nthreads);
    return j.next >= R ? isa : -1;
}

/* Test hook: y[v] = shifted_exp(z[v], m) for v < n, z <= m (no NaN): the per-lane terms
 * the kernel sums, by the kernel `isa` would use. S >= 1 absorbs every term below 2**-53,
 * so only this per-lane view can show the bits of tiny and subnormal terms. */
int lmtail_rowmass_terms(const double *z, double m, const double *k, double *y, int64_t n,
                         int isa) {
    isa = pick_isa(isa);
    const unsigned csr = lmtail_mxcsr_pin(LMTAIL_MXCSR_IEEE);
#if defined(__x86_64__)
    if (isa == ISA_AVX512)
        terms_avx512(z, m, k, y, n);
    else
#endif
        for (int64_t v = 0; v < n; ++v) y[v] = shifted_exp1(z[v], m, k);
    lmtail_mxcsr_restore(csr);
    return isa;
}

/* shifted_exp and sum64 on small row blocks (the sampler's [R, k] candidate terms), so the
 * caller need not spell exp64's ~30 float64 ops as torch ops on a tiny tensor:
 *   lmtail_shifted_exp_rows: y[i, v] = shifted_exp(z[i, v], m[i]) (z, y [R, n], m [R]),
 *     shifted_exp1's ops (the same as the row pass's terms); returns 1 (y not to be used)
 *     when a z or m is NaN or some z > m (the torch ops decide those: exp64's upper clamp
 *     and NaN payloads are not spelled here).
 *   lmtail_sum64_rows: out[i] = sum64(x[i, :]) (x [R, n]): lane t = v mod 256 chains from
 *     +0.0 in pass order, then the halving tree (rowmass.sum64; its +0.0 pad lanes change no
 *     chain, which is never -0.0); returns 1 (out not to be used) when an x is NaN.
 * Single-threaded, generic C (a few microseconds a row); MXCSR pinned as above. */
int lmtail_shifted_exp_rows(const double *z, const double *m, const double *k, double *y,
                            int64_t R, int64_t n) {
    for (int64_t i = 0; i < R; ++i) {
        if (m[i] != m[i]) return 1;
        for (int64_t v = 0; v < n; ++v)
            if (!(z[i * n + v] <= m[i])) return 1;
    }
    const unsigned csr = lmtail_mxcsr_pin(LMTAIL_MXCSR_IEEE);
    for (int64_t i = 0; i < R; ++i)
        for (int64_t v = 0; v < n; ++v) y[i * n + v] = shifted_exp1(z[i * n + v], m[i], k);
    lmtail_mxcsr_restore(csr);
    return 0;
}

int lmtail_sum64_rows(const double *x, double *out, int64_t R, int64_t n) {
    for (int64_t i = 0; i < R * n; ++i)
        if (x[i] != x[i]) return 1;
    const unsigned csr = lmtail_mxcsr_pin(LMTAIL_MXCSR_IEEE);
    double acc[LANES];
    for (int64_t i = 0; i < R; ++i) {
        for (int t = 0; t < LANES; ++t) acc[t] = 0.0;
        for (int64_t v = 0; v < n; ++v) acc[v % LANES] += x[i * n + v];
        for (int w = LANES / 2; w >= 1; w /= 2)
            for (int t = 0; t < w; ++t) acc[t] = acc[t] + acc[t + w];
        out[i] = acc[0];
    }
    lmtail_mxcsr_restore(csr);
    return 0;
}
