/* exp32 and silu_mul1, the model body's declared exp and silu (scalar, and on 8 / 16 lanes with
 * the same operations one for one): shared by body.c and attend.c (each includes this file; its
 * bytes are part of both libraries' cache keys).
 *
 * exp32(x) (fp32, basic operations only):
 *   x NaN -> NaN; x > 88 -> +inf; x < -86 -> +0;
 *   t = fl32(x * LOG2E); n = fl32(fl32(t + 1.5*2^23) - 1.5*2^23)  (round to nearest even)
 *   r = fma(-n, LN2_HI, x); r = fma(-n, LN2_LO, r)
 *   p = Horner with fma over fp32(1/k!), k = 7..0, in r;  exp32 = fl32(p * 2^n)
 * silu_mul(g, u) = fl32(fl32(g / fl32(1 + exp32(-g))) * u); silu(-inf) = -0.
 * Compiled with -ffp-contract=off: the only fused ops are the explicit fma calls (fmaf and
 * the fmadd / fnmadd intrinsics).
 */
#ifndef LMTAIL_EXP32_H
#define LMTAIL_EXP32_H
#include <math.h>
#include "lmtail_kernels.h"

/* Constants as exact hex floats (model/body.py spells the same bits; lmtail_body_constants
 * exports them so a test compares the two): */
static const float LOG2E = 0x1.715476p+0f;    /* fp32(log2 e) */
static const float RND = 0x1.8p+23f;          /* 1.5 * 2^23 */
static const float LN2_HI = 0x1.63p-1f;       /* 355/512 */
static const float LN2_LO = -0x1.bd0106p-13f; /* fp32(ln 2 - LN2_HI) */
static const float X_HI = 88.0f, X_LO = -86.0f;
static const float C[8] = {0x1p+0f, 0x1p+0f, 0x1p-1f, 0x1.555556p-3f, 0x1.555556p-5f,
                           0x1.111112p-7f, 0x1.6c16c2p-10f, 0x1.a01a02p-13f}; /* fp32(1/k!) */

static inline float exp32(float x) {
    float xc = x > X_HI ? X_HI : x;
    xc = xc < X_LO ? X_LO : xc;
    xc = xc != xc ? 0.0f : xc;
    float t = xc * LOG2E;
    float n = (t + RND) - RND;
    float r = fmaf(-n, LN2_HI, xc);
    r = fmaf(-n, LN2_LO, r);
    float p = C[7];
    p = fmaf(p, r, C[6]);
    p = fmaf(p, r, C[5]);
    p = fmaf(p, r, C[4]);
    p = fmaf(p, r, C[3]);
    p = fmaf(p, r, C[2]);
    p = fmaf(p, r, C[1]);
    p = fmaf(p, r, C[0]);
    uint32_t sb = (uint32_t)((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &sb, sizeof s);
    float y = p * s;
    y = x < X_LO ? 0.0f : y;
    y = x > X_HI ? INFINITY : y;
    return x != x ? NAN : y;
}

static inline float silu_mul1(float g, float u) {
    float s = g / (1.0f + exp32(-g));
    s = g == -INFINITY ? -0.0f : s;
    return s * u;
}

static unsigned pin_mxcsr(void) { return lmtail_mxcsr_pin(LMTAIL_MXCSR_IEEE); } /* RN, no FTZ/DAZ, masked */
static void restore_mxcsr(unsigned old) { lmtail_mxcsr_restore(old); }

/* The micro-kernels under the ISA cap `cap` (0: the best this CPU has, 1: no AVX-512,
 * 2: portable C only): 2 AVX-512, 1 AVX2 + FMA, 0 portable. */

#if defined(__x86_64__)
#define AVX512 LMTAIL_TARGET_AVX512F
#define AVX2 LMTAIL_TARGET_AVX2_FMA

/* exp32 on 16 lanes all in [X_LO, X_HI] (so not NaN): the scalar exp32's arithmetic with
 * its selects dropped, as they pass x through unchanged there. */
static inline __attribute__((always_inline)) AVX512 __m512 exp32_512_in(__m512 xc) {
    const __m512 rnd = _mm512_set1_ps(RND);
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)), rnd), rnd);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(C[7]);
    for (int k = 6; k >= 0; --k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C[k]));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* exp32 on 16 lanes: the scalar exp32's operations one for one (compare + blend for its
 * selects, fnmadd(n, c, x) = fma(-n, c, x)), so the same bits lane by lane. */
static inline __attribute__((always_inline)) AVX512 __m512 exp32_512(__m512 x) {
    const __m512 hi = _mm512_set1_ps(X_HI), lo = _mm512_set1_ps(X_LO);
    const __mmask16 in = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(x, hi, _CMP_LE_OQ);
    if (in == (__mmask16)0xFFFF) return exp32_512_in(x); /* every lane in range: no selects */
    __m512 xc = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), x, hi);
    xc = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(xc, lo, _CMP_LT_OQ), xc, lo);
    xc = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(xc, xc, _CMP_UNORD_Q), xc, _mm512_setzero_ps());
    __m512 y = exp32_512_in(xc); /* the clamped lanes are in range */
    y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), y, _mm512_setzero_ps());
    y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), y, _mm512_set1_ps(INFINITY));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), y, _mm512_set1_ps(NAN));
}

/* silu_mul1 on 16 lanes: its operations one for one (-g by flipping the sign bit, exp32_512,
 * IEEE division, the -inf select, the product): the same bits lane by lane. */
static inline __attribute__((always_inline)) AVX512 __m512 silu_mul_512(__m512 gv, __m512 uv) {
    const __m512 ng = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), _mm512_set1_epi32((int)0x80000000u)));
    __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp32_512(ng)));
    sv = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(gv, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), sv, _mm512_set1_ps(-0.0f));
    return _mm512_mul_ps(sv, uv);
}

/* exp32_512_in on 8 lanes all in [X_LO, X_HI]. */
static inline __attribute__((always_inline)) AVX2 __m256 exp32_256_in(__m256 xc) {
    const __m256 rnd = _mm256_set1_ps(RND);
    const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(LOG2E)), rnd), rnd);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(C[7]);
    for (int k = 6; k >= 0; --k) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C[k]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* exp32 on 8 lanes: the scalar exp32's operations one for one (compare + blendv for its
 * selects), so the same bits lane by lane. */
static inline __attribute__((always_inline)) AVX2 __m256 exp32_256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(X_HI), lo = _mm256_set1_ps(X_LO);
    const __m256 in = _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_GE_OQ), _mm256_cmp_ps(x, hi, _CMP_LE_OQ));
    if (_mm256_movemask_ps(in) == 0xFF) return exp32_256_in(x); /* every lane in range: no selects */
    __m256 xc = _mm256_blendv_ps(x, hi, _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
    xc = _mm256_blendv_ps(xc, lo, _mm256_cmp_ps(xc, lo, _CMP_LT_OQ));
    xc = _mm256_blendv_ps(xc, _mm256_setzero_ps(), _mm256_cmp_ps(xc, xc, _CMP_UNORD_Q));
    __m256 y = exp32_256_in(xc); /* the clamped lanes are in range */
    y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
    y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
    return _mm256_blendv_ps(y, _mm256_set1_ps(NAN), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#endif
#endif
