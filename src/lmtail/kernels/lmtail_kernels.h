/* lmtail_kernels.h: what every lmtail C kernel shares, in one place (#included by every .c
 * under kernels/; _cc.py hashes this file into each library's cache key, so a change here
 * rebuilds them all).
 *
 *   targets  LMTAIL_TARGET_<ISA>: each vector path's target attribute (empty in the
 *            emulated build, -DLMTAIL_EMULATE: then lmtail_emulate.h's SIMDe and exact
 *            models stand in for <immintrin.h>; docs/emulated.md)
 *   bits     f2u / u2f, bf16 widening, daz16 (DAZ on a bf16), canon_nan
 *   fma      fma_rn / fma_ftz / add_ftz: exact fp32 fma (round-to-odd double) without libm
 *   MXCSR    lmtail_mxcsr_pin(LMTAIL_MXCSR_IEEE | LMTAIL_MXCSR_FTZ_DAZ) / _restore: every
 *            worker pins the rounding mode (to nearest, exceptions masked) and FTZ/DAZ state
 *            its declared order needs, and restores the caller's on the way out
 *   exp64    numerics.exp64's float64 ops for the shifted term exp64(z == m ? 0 : z - m),
 *            z <= m, scalar (shifted_exp1), 8 lanes (AVX-512: shifted_exp8) and 4 lanes
 *            (AVX2: sexp4); K[17] = INV_LN2, LN2_HI, LN2_LO, C[0..13] comes from Python
 *            (numerics.exp64_constants()): no constant here
 *   sampler  lmtail_sampling (one row's parameters, kernels/tail/sampling.py's record) and the
 *            sampler's candidate steps (top-k threshold, filtered softmax, top-p, min-p, the
 *            draw, the truncation flag), shared by rows_tail.c and shard_partials.c
 *   top-k    select_top / sort_desc on uint64_t keys (rows_tail.c's and shard_partials.c's
 *            exact top-k; shard_partials.c's int64 keys go through key ^ 2**63, order kept)
 *   cpu      lmtail_cpu_features(): LMTAIL_CPU_* bits from cpuid (via the compiler's
 *            probe) and, for AMX, the OS permission (arch_prctl); every bit in the
 *            emulated build
 *   threads  lmtail_parallel(fn, job, n): fn(job) on the caller and n-1 helpers of a
 *            per-library pool (helpers live for the process, spin SPIN_NS for the next
 *            call, then sleep); a busy pool or a failed helper start falls back to threads
 *            made for the call. Which thread runs a unit never changes a bit: each kernel
 *            hands out whole rows / tiles through its own atomic counter.
 * Everything is static: each library compiled from a .c holds its own copy (one pool per
 * library, one source).
 */
#ifndef LMTAIL_KERNELS_H
#define LMTAIL_KERNELS_H

#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#if defined(LMTAIL_EMULATE)
#include "lmtail_emulate.h" /* SIMDe for every intrinsic, exact models where it differs */
#else
#include <immintrin.h>
#endif
#include <cpuid.h>
#include <sys/syscall.h>
#endif

#define LMTAIL_UNUSED __attribute__((unused))

/* ================================================================ ISA targets
 * The target sets of the vector paths: each kernel names its own (`#define AVX512
 * LMTAIL_TARGET_AVX512`). A native build compiles each path for its ISA and dispatches at
 * run time; the emulated build (-DLMTAIL_EMULATE, _cc.py) drops every target, so the same
 * source runs on any x86-64 CPU with AVX2 + FMA + F16C through SIMDe and lmtail_emulate.h. */
#if defined(LMTAIL_EMULATE)
#define LMTAIL_TARGET(isa)
#else
#define LMTAIL_TARGET(isa) __attribute__((target(isa)))
#endif
#define LMTAIL_TARGET_AVX2 LMTAIL_TARGET("avx2")
#define LMTAIL_TARGET_AVX2_FMA LMTAIL_TARGET("avx2,fma")
#define LMTAIL_TARGET_AVX2_F16C LMTAIL_TARGET("avx2,fma,f16c")
#define LMTAIL_TARGET_AVX512F LMTAIL_TARGET("avx512f")
#define LMTAIL_TARGET_AVX512BW LMTAIL_TARGET("avx512f,avx512bw")
#define LMTAIL_TARGET_AVX512VL LMTAIL_TARGET("avx512f,avx512bw,avx512vl")
#define LMTAIL_TARGET_AVX512 LMTAIL_TARGET("avx512f,avx512bw,avx512vl,avx512dq")
#define LMTAIL_TARGET_AVX512_F16C LMTAIL_TARGET("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define LMTAIL_TARGET_AVX512_BF16 LMTAIL_TARGET("avx512bf16,avx512f,avx512bw,avx512vl,avx512dq")
#define LMTAIL_TARGET_AMX LMTAIL_TARGET("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")
/* LDTILECFG's 64-byte operand (Intel SDM): palette, start row, 14 reserved bytes, then each
 * tile's bytes per row (16 x 16 bits) and rows (16 x 8 bits). Each AMX kernel keeps its one
 * configuration as a static const of this type (never a local: gemm_amx32.c says why). */
typedef struct {
    uint8_t palette_id, start_row, rsv[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} lmtail_tilecfg;

/* ================================================================ bits */
static inline LMTAIL_UNUSED uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline LMTAIL_UNUSED float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
/* bf16 -> fp32 is exact: the 16 bits shifted left */
static inline LMTAIL_UNUSED float bf16_to_f32(uint16_t b) { return u2f((uint32_t)b << 16); }
static inline LMTAIL_UNUSED double bf16_to_double(uint16_t b) { return (double)bf16_to_f32(b); }
/* DAZ on a bf16 pattern: a subnormal (exponent 0, mantissa != 0) reads as the zero of its sign */
static inline LMTAIL_UNUSED uint16_t daz16(uint16_t b) { return (b & 0x7F80u) ? b : (uint16_t)(b & 0x8000u); }
static inline LMTAIL_UNUSED float bf16_daz(uint16_t b) { return u2f((uint32_t)daz16(b) << 16); }
/* every NaN stored as the canonical quiet NaN 0x7FC00000 */
static inline LMTAIL_UNUSED float canon_nan(float x) { return x != x ? u2f(0x7FC00000u) : x; }

/* orders.lane_totals (the strided(T) sum's fold) on acc[T], T a multiple of 32, overwritten:
 * per group of 32 lanes the halving tree (x[i] = x[i] + x[i + h], h = 16, 8, 4, 2, 1), the
 * groups' results added in order. Shared by fmachain.c, body.c's norms, shard_partials.c. */
static inline LMTAIL_UNUSED float lmtail_lane_totals(float *acc, int64_t T) {
    float total = 0.0f;
    for (int64_t g = 0; g < T / 32; ++g) {
        float *x = acc + 32 * g;
        for (int half = 16; half >= 1; half /= 2)
            for (int i = 0; i < half; ++i) x[i] = x[i] + x[i + half];
        total = g == 0 ? x[0] : total + x[0];
    }
    return total;
}

/* ---------------------------------------------------------------- exact fp32 fma, no libm */
#define F32_MIN_BITS 0x00800000u /* the bits of 2^-126, the smallest normal float */

/* a*b + c rounded to odd in double: a*b is exact in double (24 + 24 <= 53 bits); s + err =
 * a*b + c exactly (TwoSum); setting the last bit when err != 0 makes the one double -> float
 * conversion round the exact value correctly (53 >= 24 + 2 bits). Non-finite s as it is. */
static inline LMTAIL_UNUSED double fma_odd64(float a, float b, float c) {
    const double p = (double)a * (double)b, cd = c, s = p + cd;
    double so = s;
    uint64_t sb;
    memcpy(&sb, &s, 8);
    if ((sb & 0x7FF0000000000000ull) != 0x7FF0000000000000ull) { /* finite */
        const double bb = s - p, err = (p - (s - bb)) + (cd - bb);
        if (err != 0 && !(sb & 1)) {
            sb += ((err > 0) == (s > 0)) ? 1 : (uint64_t)-1;
            memcpy(&so, &sb, 8);
        }
    }
    return so;
}

/* fma(a, b, c) rounded once to fp32 (IEEE, gradual underflow). */
static inline LMTAIL_UNUSED float fma_rn(float a, float b, float c) { return (float)fma_odd64(a, b, c); }

/* fma(a, b, c) rounded once to fp32, then FTZ (tininess after rounding): the exact value is
 * tiny iff, rounded to 24 bits with an unbounded exponent, it is below 2^-126: iff
 * |x| < 2^-126 - 2^-151 (the tie goes up), i.e. the float result is below 2^-126, or equal
 * to it with |so| < 2^-126 - 2^-151 (an even double: so equals it only when exact). */
static inline LMTAIL_UNUSED float fma_ftz(float a, float b, float c) {
    const double so = fma_odd64(a, b, c);
    const float r = (float)so;
    const uint32_t u = f2u(r), mag = u & 0x7FFFFFFFu;
    const double B = 0x1.ffffffp-127; /* 2^-126 - 2^-151 */
    if (mag < F32_MIN_BITS || (mag == F32_MIN_BITS && so < B && so > -B))
        return u2f(u & 0x80000000u);
    return r;
}

/* x + y rounded once, then FTZ. For x, y never subnormal (FTZ results, DAZ inputs) the exact
 * sum is a multiple of 2^-149 and is tiny iff the rounded sum is below 2^-126. */
static inline LMTAIL_UNUSED float add_ftz(float x, float y) {
    const float r = x + y;
    const uint32_t u = f2u(r);
    return (u & 0x7FFFFFFFu) < F32_MIN_BITS ? u2f(u & 0x80000000u) : r;
}

/* ================================================================ MXCSR */
#define LMTAIL_MXCSR_IEEE 0x1F80u                     /* to nearest, masked, FTZ/DAZ off */
#define LMTAIL_MXCSR_FTZ_DAZ (0x1F80u | 0x8000u | 0x0040u) /* ... with FTZ and DAZ on */
static inline LMTAIL_UNUSED unsigned lmtail_mxcsr_pin(unsigned csr) {
#if defined(__x86_64__)
    const unsigned old = _mm_getcsr();
    _mm_setcsr(csr);
    return old;
#else
    (void)csr;
    return 0;
#endif
}
static inline LMTAIL_UNUSED void lmtail_mxcsr_restore(unsigned old) {
#if defined(__x86_64__)
    _mm_setcsr(old);
#else
    (void)old;
#endif
}

/* ================================================================ exp64 */
enum { K_INV = 0, K_HI = 1, K_LO = 2, K_C0 = 3, LMTAIL_NK = 17 };

/* 2**n for integer n in [-1022, 1023]: the exponent bits */
static inline LMTAIL_UNUSED double pow2(int64_t n) {
    const uint64_t u = (uint64_t)(n + 1023) << 52;
    double f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline LMTAIL_UNUSED int64_t clampi(int64_t x, int64_t lo, int64_t hi) {
    return x < lo ? lo : (x > hi ? hi : x);
}

/* round half to even for |x| < 2**51 (MXCSR round-to-nearest): the sign of a zero result
 * may differ from torch.round's, which no later op can see (n only enters as n*HI, n*LO
 * subtracted from a nonzero xc or from +0, and through its integer value). */
static inline LMTAIL_UNUSED double round_even(double x) {
    const double big = 6755399441055744.0; /* 1.5 * 2**52 */
    const double t = x + big;              /* no fast-math: the compiler keeps both roundings */
    return t - big;
}

/* 1/s when s is a power of two 2**e, e in [-1022, 1023] (so 2**-e is a float64, normal or
 * subnormal, and exact), else 0. Then x * (1/s) and x / s are both the exact real x * 2**-e
 * rounded once, the same bits for every x: the common s = 1 and power-of-two divisors skip
 * the division. */
static inline LMTAIL_UNUSED double exact_inverse(double s) {
    uint64_t u;
    memcpy(&u, &s, sizeof u);
    const uint64_t ex = (u >> 52) & 0x7FF;
    if ((u & ((1ULL << 52) - 1)) != 0 || ex == 0 || ex == 0x7FF) return 0.0;
    return 1.0 / s;
}

/* numerics.log64 for a normal, positive, finite x: e, m from the bits (m in [1, 2), halved
 * with e + 1 when m > L[0]), s = (m - 1) / (m + 1), p = the atanh series Horner in s*s over
 * L[1 + i] = 1/(2i+1), i = 14..0, then 2*s*p + e*LN2_LO + e*LN2_HI (K: exp64's constants).
 * L[0] = sqrt 2 (the mantissa split). Shared by rows_tail.c and shard_partials.c. */
static inline LMTAIL_UNUSED double lmtail_log64(double x, const double *L, const double *K) {
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    int64_t e = (int64_t)((bits >> 52) & 0x7FF) - 1023;
    const uint64_t mb = (bits & ((1ULL << 52) - 1)) | (1023ULL << 52);
    double m;
    memcpy(&m, &mb, sizeof m);
    if (m > L[0]) {
        m = m * 0.5;
        e = e + 1;
    }
    const double ed = (double)e;
    const double s = (m - 1.0) / (m + 1.0);
    const double s2 = s * s;
    double p = L[1 + 14];
    for (int j = 13; j >= 0; --j) p = p * s2 + L[1 + j];
    return 2.0 * s * p + ed * K[K_LO] + ed * K[K_HI];
}

/* exp64(z == m ? 0 : z - m) for z <= m, z not NaN: numerics.exp64's ops in its order (clamp
 * at -746 (d <= 0: the clamp at 710 never bites), n = round-half-even(xc * INV_LN2),
 * r = (xc - n*HI) - n*LO, the degree-13 Horner, times 2**n, split as (p * 2**n1) * 2**n2
 * when n < -1022, 0 below -745). */
static inline LMTAIL_UNUSED double shifted_exp1(double z, double m, const double *K) {
    const double d = z == m ? 0.0 : z - m;
    const double xc = d < -746.0 ? -746.0 : d;
    const double n = round_even(xc * K[K_INV]);
    const double r = (xc - n * K[K_HI]) - n * K[K_LO];
    double p = r * K[K_C0 + 13];
    for (int j = 12; j >= 1; --j) p = (p + K[K_C0 + j]) * r;
    p = p + K[K_C0];
    const int64_t ni = (int64_t)n;
    const int64_t n1 = ni >= -1022 ? 0 : (ni >> 1); /* floor(n / 2) */
    const int64_t n2 = ni - n1;
    double y = (p * pow2(clampi(n1, -1022, 1023))) * pow2(clampi(n2, -1022, 1023));
    if (d < -745.0) y = 0.0;
    return y;
}

/* ================================================================ the sampler's candidate steps */
/* One row's sampling parameters: the C side of lmtail.kernels.tail.sampling.SAMPLING_RECORD (the
 * same field names, order and offsets; kernels.tail.sampling.sampling_records builds the array
 * once from the public [R, 3|4|5] fp32 tensor, whose columns kernels.tail.sampling.COL names):
 *   top_k                          int64: clamp(fp32 top_k, -1, 2**62) truncated (<= 0: off;
 *                                  > k caps at k, however large)
 *   top_p, temperature, u, min_p   float64: exact widenings of the fp32 columns (u = 0.5 =
 *                                  numerics.DEFAULT_U without a u column, min_p = 0 without
 *                                  a min_p column) */
typedef struct {
    int64_t top_k;
    double top_p, temperature, u, min_p;
} lmtail_sampling;

#define LMTAIL_GREEDY_T 1e-5 /* sampler.GREEDY_TEMPERATURE: T below it (float64) is greedy */

/* The steps of lmtail.tail.sampler (its docstring's 1-6) on one row's k candidates v[0..k)
 * (float64, descending, NaN folded to -inf by the caller), written once for every C pass
 * (rows_tail.c's fused draw, shard_partials.c's candidates sampler). The caller answers the
 * questions about the row outside the candidates (a lane tied with the threshold, the
 * normalizer of a top-k-off row, mass past slot k-1) and computes the terms
 * e_j = shifted_exp1(v_j / T, m) at the normalizer's max m. */

/* 2. greedy: T < GREEDY_T. */
static inline LMTAIL_UNUSED int lmtail_greedy(const lmtail_sampling *s) {
    return s->temperature < LMTAIL_GREEDY_T;
}

/* 1. top-k's threshold v[kk - 1], kk = min(top_k, k) when top_k > 0, else k: the filtered
 * set is {j : v_j >= thr} (ties at the threshold survive). */
static inline LMTAIL_UNUSED double lmtail_topk_threshold(const double *v, int64_t k, const lmtail_sampling *s) {
    const int64_t kk = s->top_k > 0 ? (s->top_k < k ? s->top_k : k) : k;
    return v[kk - 1];
}

/* 3. the filtered set's normalizer when top-k is on: sum64 of (v_j >= thr ? e_j : +0.0)
 * over j < k (256 lane chains: lane j mod 256 from +0.0 in candidate order, then the
 * halving tree 128, ..., 1). acc: [256] scratch. */
static inline LMTAIL_UNUSED double lmtail_kept_sum64(const double *v, const double *e, int64_t k, double thr,
                                                     double *acc) {
    for (int t = 0; t < 256; ++t) acc[t] = 0.0;
    for (int64_t j = 0; j < k; ++j) acc[j % 256] = acc[j % 256] + (v[j] >= thr ? e[j] : 0.0);
    for (int h = 128; h >= 1; h /= 2)
        for (int t = 0; t < h; ++t) acc[t] = acc[t] + acc[t + h];
    return acc[0];
}

/* 3. p_j = v_j >= thr ? fl64(e_j / S) : 0, then torch's nan_to_num(nan=0) (NaN -> 0,
 * +-inf -> +-DBL_MAX), and c_j = the sequential running sum ((+0 + p_0) + p_1) + ... */
static inline LMTAIL_UNUSED void lmtail_filtered_probs(const double *v, const double *e, int64_t k, double thr,
                                                       double S, double *p, double *c) {
    double run = 0.0;
    for (int64_t j = 0; j < k; ++j) {
        double q = v[j] >= thr ? e[j] / S : 0.0;
        if (q != q) q = 0.0;
        else if (q == __builtin_inf()) q = __DBL_MAX__;
        else if (q == -__builtin_inf()) q = -__DBL_MAX__;
        p[j] = q;
        run = run + q;
        c[j] = run;
    }
}

/* 4-6. keep_j = j == 0 or (v_j >= thr (top-k), c_j - p_j < top_p or top_p >= 1 (top-p: the
 * crossing token kept), p_j >= min_p * p_0 (min-p)); the kept set is a prefix of n_keep
 * slots; the slot drawn is #{kept j : fl64(c_j / c[n_keep - 1]) <= u}, clamped to
 * n_keep - 1. keep: [k] flags out. */
static inline LMTAIL_UNUSED int64_t lmtail_draw_slot(const double *v, const double *p, const double *c, int64_t k,
                                                     double thr, const lmtail_sampling *s, uint8_t *keep) {
    const double floor_p = s->min_p * p[0];
    int64_t n_keep = 0, pos = 0;
    for (int64_t j = 0; j < k; ++j) {
        const int kj = (j == 0) || ((v[j] >= thr) && ((c[j] - p[j] < s->top_p) || s->top_p >= 1.0) &&
                                    (p[j] >= floor_p));
        keep[j] = (uint8_t)kj;
        n_keep += kj;
    }
    const double total = c[n_keep - 1];
    for (int64_t j = 0; j < k; ++j) pos += keep[j] && (c[j] / total <= s->u);
    return pos > n_keep - 1 ? n_keep - 1 : pos;
}

/* 1 and 4's flag: top-k on: top_k > k, or ties_past_k (a lane outside the candidates is >= the
 * threshold); top-k off: the k candidates' mass c[k-1] < top_p, or (top_p >= 1) past_k (a lane
 * outside them carries mass). Greedy rows are never truncated (the caller's). */
static inline LMTAIL_UNUSED int lmtail_truncated(const lmtail_sampling *s, int64_t k, int ties_past_k,
                                                 const double *c, int past_k) {
    if (s->top_k > 0) return s->top_k > k || ties_past_k;
    return s->top_p < 1.0 ? c[k - 1] < s->top_p : past_k;
}

#if defined(__x86_64__)
#define LMTAIL_AVX512F LMTAIL_TARGET_AVX512F
enum { EXP8_U = 4 }; /* vectors per shifted_exp8 call */

/* An empty asm that "updates" the 4 vectors x[0..3] in registers: gcc 12 otherwise schedules
 * shifted_exp8's 4 Horner chains one after the other (fewer live registers), and the 26-op
 * chain of one vector is then latency-bound. Measured on Zen 4 (shard_partials' mass pass,
 * [128, 25136], 1 thread, CPU time): 9.3 -> 6.8 ms per pass. It changes no value (no
 * instruction), so no byte; the emulated build (SIMDe types) skips it. */
#if defined(LMTAIL_EMULATE)
#define LMTAIL_STEP_BARRIER4(x) ((void)0)
#else
#define LMTAIL_STEP_BARRIER4(x) __asm__("" : "+v"((x)[0]), "+v"((x)[1]), "+v"((x)[2]), "+v"((x)[3]))
#endif
_Static_assert(EXP8_U == 4, "LMTAIL_STEP_BARRIER4 names EXP8_U vectors");

/* 2**n for 8 integer-valued n in [-1022, 1023]: the exponent bits. */
static inline __attribute__((always_inline)) LMTAIL_AVX512F __m512d pow2_8(__m512d n) {
    const __m512i e = _mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(n));
    return _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_add_epi64(e, _mm512_set1_epi64(1023)), 52));
}

/* shifted_exp1 on EXP8_U x 8 lanes: the same ops in the same order; KV[c] = K[c] broadcast.
 * The EXP8_U independent vectors go through each step together, so the 26-op Horner
 * dependency chain of one vector hides behind the others'. */
static inline __attribute__((always_inline)) LMTAIL_AVX512F void
shifted_exp8(__m512d *y, const __m512d *z, __m512d mv, const __m512d *KV) {
    const __m512d zero = _mm512_setzero_pd();
    const __m512d lo = _mm512_set1_pd(-1022.0), hi = _mm512_set1_pd(1023.0);
    __m512d d[EXP8_U], n[EXP8_U], r[EXP8_U], p[EXP8_U];
#pragma GCC unroll 4
    for (int u = 0; u < EXP8_U; ++u) {
        const __mmask8 eq = _mm512_cmp_pd_mask(z[u], mv, _CMP_EQ_OQ);
        d[u] = _mm512_mask_mov_pd(_mm512_sub_pd(z[u], mv), eq, zero);
        const __m512d xc = _mm512_max_pd(d[u], _mm512_set1_pd(-746.0)); /* d <= 0, never NaN */
        n[u] = _mm512_roundscale_pd(_mm512_mul_pd(xc, KV[K_INV]),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r[u] = _mm512_sub_pd(_mm512_sub_pd(xc, _mm512_mul_pd(n[u], KV[K_HI])),
                             _mm512_mul_pd(n[u], KV[K_LO]));
        p[u] = _mm512_mul_pd(r[u], KV[K_C0 + 13]);
    }
#pragma GCC unroll 12
    for (int j = 12; j >= 1; --j) {
#pragma GCC unroll 4
        for (int u = 0; u < EXP8_U; ++u) p[u] = _mm512_mul_pd(_mm512_add_pd(p[u], KV[K_C0 + j]), r[u]);
        LMTAIL_STEP_BARRIER4(p); /* keep the EXP8_U chains interleaved step by step */
    }
#pragma GCC unroll 4
    for (int u = 0; u < EXP8_U; ++u) {
        p[u] = _mm512_add_pd(p[u], KV[K_C0]);
        const __mmask8 sub = _mm512_cmp_pd_mask(n[u], lo, _CMP_LT_OQ);
        __m512d e;
        if (!sub) { /* every lane n1 = 0: (p * 2**0) * 2**n, and p * 1.0 = p exactly */
            e = _mm512_mul_pd(p[u], pow2_8(n[u]));
        } else {
            const __m512d half = _mm512_roundscale_pd(_mm512_mul_pd(n[u], _mm512_set1_pd(0.5)),
                                                      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
            const __m512d n1 = _mm512_mask_mov_pd(zero, sub, half);
            const __m512d n2 = _mm512_sub_pd(n[u], n1);
            e = _mm512_mul_pd(_mm512_mul_pd(p[u], pow2_8(_mm512_min_pd(_mm512_max_pd(n1, lo), hi))),
                              pow2_8(_mm512_min_pd(_mm512_max_pd(n2, lo), hi)));
        }
        y[u] = _mm512_mask_mov_pd(e, _mm512_cmp_pd_mask(d[u], _mm512_set1_pd(-745.0), _CMP_LT_OQ), zero);
    }
}

#define LMTAIL_AVX2 LMTAIL_TARGET_AVX2

/* r[k] <- lane k of r[0..7]: an 8 x 8 fp32 transpose in registers (AVX). Shared by
 * body.c (attention's den) and gemm_q.c (the lanes path's panel). */
static inline __attribute__((always_inline)) LMTAIL_AVX2 void lmtail_transpose8(__m256 *r) {
    __m256 t[8], u[8];
    for (int k = 0; k < 8; k += 2) {
        t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
        t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
    }
    for (int k = 0; k < 8; k += 4) {
        u[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44);
        u[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
        u[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44);
        u[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
    }
    for (int k = 0; k < 4; ++k) {
        r[k] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x20);
        r[k + 4] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x31);
    }
}

/* 2**n for 4 integer-valued n in [-1022, 1023]: the exponent bits (AVX2). */
static inline __attribute__((always_inline)) LMTAIL_AVX2 __m256d pow2_4(__m256d n) {
    const __m256i e = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n));
    return _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(e, _mm256_set1_epi64x(1023)), 52));
}

/* shifted_exp1 on EXP8_U x 4 lanes (AVX2): the same ops in the same order as shifted_exp1 /
 * shifted_exp8; KV[c] = K[c] broadcast. Shared by rows_tail.c and shard_partials.c. The
 * d < -745 test is kept as a 4-bit mask in a general register, so only n, r and p stay in
 * vector registers through the Horner chain (16 ymm: d as well spilled; 6-7% faster passes
 * on Zen 3; EXP8_U = 8 spills r and ran 15-40% slower). */
static inline __attribute__((always_inline)) LMTAIL_AVX2 void
sexp4(__m256d *y, const __m256d *z, __m256d mv, const __m256d *KV) {
    const __m256d zero = _mm256_setzero_pd();
    const __m256d lo = _mm256_set1_pd(-1022.0), hi = _mm256_set1_pd(1023.0);
    __m256d n[EXP8_U], r[EXP8_U], p[EXP8_U];
    int tiny[EXP8_U]; /* lanes with d < -745 (term 0) */
    for (int u = 0; u < EXP8_U; ++u) {
        const __m256d eq = _mm256_cmp_pd(z[u], mv, _CMP_EQ_OQ);
        const __m256d d = _mm256_blendv_pd(_mm256_sub_pd(z[u], mv), zero, eq);
        tiny[u] = _mm256_movemask_pd(_mm256_cmp_pd(d, _mm256_set1_pd(-745.0), _CMP_LT_OQ));
        const __m256d xc = _mm256_max_pd(d, _mm256_set1_pd(-746.0));
        n[u] = _mm256_round_pd(_mm256_mul_pd(xc, KV[K_INV]),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r[u] = _mm256_sub_pd(_mm256_sub_pd(xc, _mm256_mul_pd(n[u], KV[K_HI])),
                             _mm256_mul_pd(n[u], KV[K_LO]));
        p[u] = _mm256_mul_pd(r[u], KV[K_C0 + 13]);
    }
    for (int j = 12; j >= 1; --j)
        for (int u = 0; u < EXP8_U; ++u)
            p[u] = _mm256_mul_pd(_mm256_add_pd(p[u], KV[K_C0 + j]), r[u]);
    for (int u = 0; u < EXP8_U; ++u) {
        p[u] = _mm256_add_pd(p[u], KV[K_C0]);
        const __m256d sub = _mm256_cmp_pd(n[u], lo, _CMP_LT_OQ);
        __m256d e;
        if (!_mm256_movemask_pd(sub)) {
            e = _mm256_mul_pd(p[u], pow2_4(n[u]));
        } else {
            const __m256d half = _mm256_round_pd(_mm256_mul_pd(n[u], _mm256_set1_pd(0.5)),
                                                 _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
            const __m256d n1 = _mm256_blendv_pd(zero, half, sub);
            const __m256d n2 = _mm256_sub_pd(n[u], n1);
            e = _mm256_mul_pd(_mm256_mul_pd(p[u], pow2_4(_mm256_min_pd(_mm256_max_pd(n1, lo), hi))),
                              pow2_4(_mm256_min_pd(_mm256_max_pd(n2, lo), hi)));
        }
        if (tiny[u]) { /* lanes with d < -745: +0.0 */
            const __m256i bit = _mm256_set_epi64x(8, 4, 2, 1);
            const __m256i hit = _mm256_cmpeq_epi64(_mm256_and_si256(_mm256_set1_epi64x(tiny[u]), bit), bit);
            e = _mm256_blendv_pd(e, zero, _mm256_castsi256_pd(hit));
        }
        y[u] = e;
    }
}
#endif

/* ================================================================ top-k keys */
static inline LMTAIL_UNUSED void swap64(uint64_t *a, uint64_t *b) {
    const uint64_t t = *a;
    *a = *b;
    *b = t;
}

/* One Hoare partition of a[lo..hi] into descending order around the median of a[lo],
 * a[mid], a[hi] (those three swapped into order first): afterwards a[lo..j] >= x >=
 * a[i..hi] and i > j. select_top and sort_desc share it. */
static inline void partition_desc(uint64_t *a, int64_t lo, int64_t hi, int64_t mid, int64_t *pi, int64_t *pj) {
    if (a[mid] > a[lo]) swap64(&a[mid], &a[lo]);
    if (a[hi] > a[lo]) swap64(&a[hi], &a[lo]);
    if (a[hi] > a[mid]) swap64(&a[hi], &a[mid]);
    const uint64_t x = a[mid]; /* a[lo] >= x >= a[hi] */
    int64_t i = lo, j = hi;
    while (i <= j) {
        while (a[i] > x) ++i;
        while (a[j] < x) --j;
        if (i <= j) {
            swap64(&a[i], &a[j]);
            ++i;
            --j;
        }
    }
    *pi = i;
    *pj = j;
}

/* Afterwards a[0..k) hold the k largest of a[0..n) and a[k-1] is the k-th largest (keys
 * distinct). Hoare quickselect, median-of-three pivot. */
static LMTAIL_UNUSED void select_top(uint64_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    const int64_t t = k - 1;
    while (hi > lo) {
        int64_t i, j;
        partition_desc(a, lo, hi, lo + (hi - lo) / 2, &i, &j);
        if (t <= j) hi = j;
        else if (t >= i) lo = i;
        else break;
    }
}

/* Sort a[0..n) descending: quicksort to small parts, then insertion sort. */
static LMTAIL_UNUSED void sort_desc(uint64_t *a, int64_t n) {
    while (n > 24) {
        int64_t i, j;
        partition_desc(a, 0, n - 1, n / 2, &i, &j);
        if (j + 1 < n - i) { /* recurse on the smaller part */
            sort_desc(a, j + 1);
            a += i;
            n -= i;
        } else {
            sort_desc(a + i, n - i);
            n = j + 1;
        }
    }
    for (int64_t i = 1; i < n; ++i) {
        const uint64_t x = a[i];
        int64_t j = i;
        while (j > 0 && a[j - 1] < x) {
            a[j] = a[j - 1];
            --j;
        }
        a[j] = x;
    }
}

/* ================================================================ cpu */
enum {
    LMTAIL_CPU_AVX2 = 1 << 0, LMTAIL_CPU_FMA = 1 << 1, LMTAIL_CPU_AVX512F = 1 << 2,
    LMTAIL_CPU_AVX512BW = 1 << 3, LMTAIL_CPU_AVX512VL = 1 << 4, LMTAIL_CPU_AVX512DQ = 1 << 5,
    LMTAIL_CPU_AMX_BF16 = 1 << 6, /* AMX-BF16 and AMX-TILE, and the OS lets this process use tiles */
    LMTAIL_CPU_AVX512_BF16 = 1 << 7, LMTAIL_CPU_F16C = 1 << 8,
    LMTAIL_CPU_ALL = (1 << 9) - 1,
};
/* the ISA sets the kernels dispatch on */
#define LMTAIL_ISA_AVX512 (LMTAIL_CPU_AVX512F | LMTAIL_CPU_AVX512BW | LMTAIL_CPU_AVX512VL | LMTAIL_CPU_AVX512DQ)
#define LMTAIL_ISA_AVX2 (LMTAIL_CPU_AVX2 | LMTAIL_CPU_FMA)

#if defined(LMTAIL_EMULATE)
/* The emulated build runs every path (SIMDe, lmtail_emulate.h's AMX and VDPBF16PS models)
 * on any CPU that runs the build itself (AVX2, FMA, F16C): every bit, no OS request. */
static inline LMTAIL_UNUSED unsigned lmtail_cpu_features(void) { return LMTAIL_CPU_ALL; }
#elif defined(__x86_64__)
#define LMTAIL_ARCH_GET_XCOMP_PERM 0x1022
#define LMTAIL_ARCH_REQ_XCOMP_PERM 0x1023
#define LMTAIL_XFEATURE_XTILEDATA 18
static unsigned lmtail_cpu_bits = 0;
static pthread_once_t lmtail_cpu_once = PTHREAD_ONCE_INIT;

static void lmtail_cpu_probe(void) {
    unsigned bits = 0;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) bits |= LMTAIL_CPU_AVX2;
    if (__builtin_cpu_supports("fma")) bits |= LMTAIL_CPU_FMA;
    if (__builtin_cpu_supports("avx512f")) bits |= LMTAIL_CPU_AVX512F;
    if (__builtin_cpu_supports("avx512bw")) bits |= LMTAIL_CPU_AVX512BW;
    if (__builtin_cpu_supports("avx512vl")) bits |= LMTAIL_CPU_AVX512VL;
    if (__builtin_cpu_supports("avx512dq")) bits |= LMTAIL_CPU_AVX512DQ;
    if (__builtin_cpu_supports("f16c")) bits |= LMTAIL_CPU_F16C;
    unsigned int eax, ebx, ecx, edx;
    if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 5)))
        bits |= LMTAIL_CPU_AVX512_BF16;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx & (1u << 22)) && (edx & (1u << 24)) &&
        !syscall(SYS_arch_prctl, LMTAIL_ARCH_REQ_XCOMP_PERM, LMTAIL_XFEATURE_XTILEDATA)) {
        unsigned long perm = 0;
        if (!syscall(SYS_arch_prctl, LMTAIL_ARCH_GET_XCOMP_PERM, &perm) &&
            (perm & (1ul << LMTAIL_XFEATURE_XTILEDATA)))
            bits |= LMTAIL_CPU_AMX_BF16;
    }
    lmtail_cpu_bits = bits;
}

/* The LMTAIL_CPU_* bits of this CPU (and OS, for AMX); probed once. */
static inline LMTAIL_UNUSED unsigned lmtail_cpu_features(void) {
    pthread_once(&lmtail_cpu_once, lmtail_cpu_probe);
    return lmtail_cpu_bits;
}
#else
static inline LMTAIL_UNUSED unsigned lmtail_cpu_features(void) { return 0; }
#endif

/* 1 when every bit of `isa` (LMTAIL_ISA_* or LMTAIL_CPU_*) is present; 0 always passes. */
static inline LMTAIL_UNUSED int lmtail_cpu_has(unsigned isa) { return (lmtail_cpu_features() & isa) == isa; }

/* ================================================================ the thread pool */
enum { LMTAIL_MAXT = 64, LMTAIL_SPIN_NS = 200000 };
typedef void *(*lmtail_worker_fn)(void *);

typedef struct {
    pthread_mutex_t mu, call;
    pthread_cond_t go, done;
    pid_t pid;
    int nhelpers, sleepers, main_sleeps;
    uint64_t gen;         /* written under mu, read by spinning helpers (atomic) */
    lmtail_worker_fn fn;  /* this generation's job while open (NULL once closed) */
    void *job;
    int want;             /* helpers 1..want-1 may join it */
    int active;           /* helpers that joined and are still running (atomic) */
    uint64_t born[LMTAIL_MAXT]; /* helper i was created at generation born[i] */
} lmtail_pool_t;

static lmtail_pool_t lmtail_pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .call = PTHREAD_MUTEX_INITIALIZER,
                                    .go = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};
static pthread_once_t lmtail_pool_once = PTHREAD_ONCE_INIT;

static void lmtail_pool_reset(void) { /* a fresh process: no helpers, nothing locked */
    lmtail_pool_t *P = &lmtail_pool;
    pthread_mutex_init(&P->mu, NULL);
    pthread_mutex_init(&P->call, NULL);
    pthread_cond_init(&P->go, NULL);
    pthread_cond_init(&P->done, NULL);
    P->pid = getpid();
    P->nhelpers = P->sleepers = P->main_sleeps = P->want = P->active = 0;
    P->gen = 0;
    P->fn = NULL;
    P->job = NULL;
}

static void lmtail_pool_init(void) {
    lmtail_pool.pid = getpid();
    pthread_atfork(NULL, NULL, lmtail_pool_reset);
}

static inline int64_t lmtail_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void lmtail_cpu_relax(void) {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

static void *lmtail_pool_helper(void *arg) {
    lmtail_pool_t *P = &lmtail_pool;
    const int idx = (int)(intptr_t)arg;
    uint64_t seen = P->born[idx]; /* the generation before the first one it may run */
    for (;;) {
        const int64_t until = lmtail_now_ns() + LMTAIL_SPIN_NS;
        for (int n = 0; __atomic_load_n(&P->gen, __ATOMIC_ACQUIRE) == seen; ++n) {
            lmtail_cpu_relax();
            if ((n & 63) == 63 && lmtail_now_ns() > until) break;
        }
        pthread_mutex_lock(&P->mu);
        while (P->gen == seen) {
            ++P->sleepers;
            pthread_cond_wait(&P->go, &P->mu);
            --P->sleepers;
        }
        seen = P->gen;
        const lmtail_worker_fn fn = P->fn;
        void *job = P->job;
        const int mine = fn != NULL && idx < P->want;
        if (mine) __atomic_add_fetch(&P->active, 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&P->mu);
        if (!mine) continue;
        fn(job);
        if (__atomic_sub_fetch(&P->active, 1, __ATOMIC_ACQ_REL) == 0) {
            pthread_mutex_lock(&P->mu);
            if (P->main_sleeps) pthread_cond_signal(&P->done);
            pthread_mutex_unlock(&P->mu);
        }
    }
    return NULL;
}

/* fn(job) on the caller and nthreads-1 pool helpers. Returns 0, or -1 when the pool is busy
 * or cannot grow to nthreads-1 helpers (nothing run then). Helper i (1-based) joins the job
 * when i < want and the caller has not closed it yet (the caller closes it when fn returns
 * on its thread, i.e. no unit is left to take), so a helper that wakes late costs nothing;
 * the caller then waits only for the helpers that joined. */
static int lmtail_pool_run(lmtail_worker_fn fn, void *job, int nthreads) {
    lmtail_pool_t *P = &lmtail_pool;
    pthread_once(&lmtail_pool_once, lmtail_pool_init);
    if (P->pid != getpid()) lmtail_pool_reset();
    if (pthread_mutex_trylock(&P->call)) return -1;
    while (P->nhelpers < nthreads - 1) {
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        P->born[P->nhelpers + 1] = P->gen; /* gen changes only under `call` */
        const int bad = pthread_create(&t, &at, lmtail_pool_helper, (void *)(intptr_t)(P->nhelpers + 1));
        pthread_attr_destroy(&at);
        if (bad) break;
        ++P->nhelpers;
    }
    if (P->nhelpers < nthreads - 1) {
        pthread_mutex_unlock(&P->call);
        return -1;
    }
    pthread_mutex_lock(&P->mu);
    P->fn = fn;
    P->job = job;
    P->want = nthreads;
    __atomic_store_n(&P->active, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&P->gen, P->gen + 1, __ATOMIC_RELEASE);
    if (P->sleepers) pthread_cond_broadcast(&P->go);
    pthread_mutex_unlock(&P->mu);
    fn(job); /* returns when no unit is left to take */
    pthread_mutex_lock(&P->mu);
    P->fn = NULL; /* closed: later helpers skip it; `active` counts the ones inside */
    P->job = NULL;
    pthread_mutex_unlock(&P->mu);
    const int64_t until = lmtail_now_ns() + LMTAIL_SPIN_NS;
    for (int n = 0; __atomic_load_n(&P->active, __ATOMIC_ACQUIRE) != 0; ++n) {
        lmtail_cpu_relax();
        if ((n & 63) == 63 && lmtail_now_ns() > until) break;
    }
    pthread_mutex_lock(&P->mu);
    while (__atomic_load_n(&P->active, __ATOMIC_ACQUIRE) != 0) {
        P->main_sleeps = 1;
        pthread_cond_wait(&P->done, &P->mu);
    }
    P->main_sleeps = 0;
    pthread_mutex_unlock(&P->mu);
    pthread_mutex_unlock(&P->call);
    return 0;
}

/* fn(job) on up to nthreads threads, the caller's included (clamped to [1, LMTAIL_MAXT]):
 * one thread runs it inline; more use the pool, or, when the pool is busy (a concurrent
 * call) or cannot grow, threads made for this call (if one cannot start, the others take
 * its units). fn must take its units from an atomic counter in job until none is left. */
static LMTAIL_UNUSED void lmtail_parallel(lmtail_worker_fn fn, void *job, int nthreads) {
    if (nthreads > LMTAIL_MAXT) nthreads = LMTAIL_MAXT;
    if (nthreads <= 1) {
        fn(job);
        return;
    }
    if (!lmtail_pool_run(fn, job, nthreads)) return;
    pthread_t tid[LMTAIL_MAXT];
    int started = 0;
    for (int t = 1; t < nthreads; ++t, ++started)
        if (pthread_create(&tid[t], NULL, fn, job)) break;
    fn(job);
    for (int t = 1; t <= started; ++t) pthread_join(tid[t], NULL);
}

/* The pool helpers this library has started in this process (a forked child starts with none). */
static inline LMTAIL_UNUSED int lmtail_pool_helpers(void) {
    pthread_once(&lmtail_pool_once, lmtail_pool_init);
    return lmtail_pool.pid == getpid() ? __atomic_load_n(&lmtail_pool.nhelpers, __ATOMIC_RELAXED) : 0;
}

#endif /* LMTAIL_KERNELS_H */
