/* lmtail model body kernels: declared-order attention, exp32 and silu_mul (CPU), and the
 * model loop's fused glue: add + RMSNorm rows (lmtail.glue.norms.add_rms's numerics, strided
 * order), q|k|v split + rope + KV-cache write, silu_mul with its bf16 round (end of file).
 *
 * Shape legend: B rows, T new tokens, nh / nkv query / KV heads, g = nh / nkv, HD = 64
 * head dim, S_cap cache slots (the key cache's row stride, capacity + 64), F FFN width.
 *   q    [B, T, nh, HD]     fp32  queries after rope
 *   kt   [B, nkv, HD, S_cap] fp32 keys after rope, TRANSPOSED (slot contiguous)
 *   v    [B, nkv, S_cap, HD] fp32 values
 *   out  [B, T, nh, HD]     fp32
 *   pad  [B] int64           left pad slots of each row; key j of row b is slot pad[b] + j
 *
 * Numerics (the declaration; model/body.py states it as a Decl, docs/model.md explains it).
 * For one query (row b, head h, position p = s0 + t - pad[b]; n = p + 1 keys):
 *   s_j  = fl32(dot_j * scale), dot_j = fma chain over d = 0..HD-1 from +0.0 of q[d]*k_j[d]
 *   m    = max_j s_j                            (exact; order-free)
 *   e_j  = exp32(fl32(s_j - m))                 (declared exp below)
 *   den  = sequential fp32 sum over j = 0..n-1 from +0.0 of e_j
 *   acc  = fma chain over j = 0..n-1 from +0.0 of e_j * v_j[d]   (per d)
 *   out  = fl32(acc / den)
 * A pad query (p < 0) gets out = +0.0. Every element's chain is run in that order by one
 * thread; blocking only decides which independent chains share registers, so the bytes do
 * not depend on B, T, the slot a key sits in, the thread count, the ISA clone or the
 * micro-kernel set (portable C, AVX2 + FMA 8 lanes, AVX-512 16 lanes: pick_isa under the
 * caller's cap). Keys beyond a query's position are never read into its sums (no masking
 * terms).
 *
 * exp32(x) (fp32, basic operations only):
 *   x NaN -> NaN; x > 88 -> +inf; x < -86 -> +0;
 *   t = fl32(x * LOG2E); n = fl32(fl32(t + 1.5*2^23) - 1.5*2^23)  (round to nearest even)
 *   r = fma(-n, LN2_HI, x); r = fma(-n, LN2_LO, r)
 *   p = Horner with fma over fp32(1/k!), k = 7..0, in r;  exp32 = fl32(p * 2^n)
 * silu_mul(g, u) = fl32(fl32(g / fl32(1 + exp32(-g))) * u); silu(-inf) = -0.
 * Each worker pins MXCSR to round-to-nearest with FTZ/DAZ off and restores it.
 * Compiled with -ffp-contract=off: the only fused ops are the explicit fma calls (fmaf and
 * the fmadd / fnmadd intrinsics).
 */
#include <math.h>
#include "lmtail_kernels.h"
#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* Positions per work unit: UP2 on the AVX2 kernels (one multi-position call), UP512 on the
 * AVX-512 ones (one call) and the portable ones; UP, the most of them, sizes the scratch. */
enum { HD = 64, JB = 64, QB = 3, UP512 = 2, UP2 = 8, UP = UP2 > UP512 ? UP2 : UP512 };

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
static int pick_isa(int cap) {
    if (cap <= 0 && lmtail_cpu_has(LMTAIL_CPU_AVX512F)) return 2;
    if (cap <= 1 && lmtail_cpu_has(LMTAIL_ISA_AVX2)) return 1;
    return 0;
}

/* out[0..13] = LOG2E, RND, LN2_HI, LN2_LO, X_HI, X_LO, C[0..7]: exp32's constants as this
 * file holds them. Returns the count written (14). */
int lmtail_body_constants(float *out) {
    out[0] = LOG2E, out[1] = RND, out[2] = LN2_HI, out[3] = LN2_LO, out[4] = X_HI, out[5] = X_LO;
    for (int i = 0; i < 8; ++i) out[6 + i] = C[i];
    return 14;
}

CLONES static void exp_rows(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = exp32(x[i]);
}

/* gu [M, ld] fp32: gate in columns [0, F), up in [F, 2F); out [M, F]. */
CLONES static void silu_rows(const float *gu, float *out, int64_t M, int64_t F, int64_t ld) {
    for (int64_t m = 0; m < M; ++m) {
        const float *g = gu + m * ld, *u = g + F;
        float *o = out + m * F;
        for (int64_t c = 0; c < F; ++c) o[c] = silu_mul1(g[c], u[c]);
    }
}

/* ------------------------------------------------------------------ attention */
typedef struct {
    const float *q, *kt, *v;
    float *out;
    const int64_t *pad;
    int64_t B, T, nh, nkv, S_cap, s0;
    float scale;
    float *scratch; /* per thread: up QB * (S_cap + JB) floats */
    size_t per;     /* floats of scratch per thread */
    int64_t nunits, next;
    int slots;      /* scratch slots handed out so far (atomic) */
    int isa; /* micro-kernels: 2 AVX-512, 1 AVX2 + FMA, 0 portable (same chains, same bits) */
    int64_t up; /* positions per unit */
} attn_job;

#if defined(__x86_64__)
/* AVX-512 versions of scores() and pv() below: the same fma chains per element, with the
 * accumulators held in zmm registers (3 queries x 64 keys, or 3 queries x 64 dims). */
#define AVX512 LMTAIL_TARGET_AVX512F
static inline __attribute__((always_inline)) AVX512 void
scores512(const int NQ, const float *const *qs, const float *kt, int64_t S_cap, int64_t nmax,
          float scale, float *const *sc) {
    enum { W = JB / 16 }; /* zmm per query per key block */
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < nmax; j0 += JB) {
        __m512 acc[UP512 * QB][4];
#pragma GCC unroll 12
        for (int i = 0; i < NQ; ++i)
#pragma GCC unroll 4
            for (int c = 0; c < W; ++c) acc[i][c] = _mm512_setzero_ps();
        for (int d = 0; d < HD; ++d) {
            const float *kr = kt + (int64_t)d * S_cap + j0;
#pragma GCC unroll 4
            for (int c = 0; c < W; ++c) _mm_prefetch((const char *)(kr + JB + 16 * c), _MM_HINT_T0); /* next block */
            __m512 kv[4];
#pragma GCC unroll 4
            for (int c = 0; c < W; ++c) kv[c] = _mm512_loadu_ps(kr + 16 * c);
#pragma GCC unroll 12
            for (int i = 0; i < NQ; ++i) {
                const __m512 qd = _mm512_set1_ps(qs[i][d]);
#pragma GCC unroll 4
                for (int c = 0; c < W; ++c) acc[i][c] = _mm512_fmadd_ps(qd, kv[c], acc[i][c]);
            }
        }
#pragma GCC unroll 12
        for (int i = 0; i < NQ; ++i)
#pragma GCC unroll 4
            for (int c = 0; c < W; ++c) _mm512_storeu_ps(sc[i] + j0 + 16 * c, _mm512_mul_ps(acc[i][c], vs));
    }
}

static inline __attribute__((always_inline)) AVX512 void
pv512(const int NQ, float *const *e, const float *v, int64_t n, float *const *outs) {
    __m512 acc[QB][4];
    float den[QB];
#pragma GCC unroll 3
    for (int i = 0; i < NQ; ++i) {
        den[i] = 0.0f;
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < n; ++j) {
        const float *vr = v + j * HD;
        const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
        const __m512 v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
#pragma GCC unroll 3
        for (int i = 0; i < NQ; ++i) {
            const float ej = e[i][j];
            den[i] = den[i] + ej;
            const __m512 eb = _mm512_set1_ps(ej);
            acc[i][0] = _mm512_fmadd_ps(eb, v0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(eb, v1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(eb, v2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(eb, v3, acc[i][3]);
        }
    }
#pragma GCC unroll 3
    for (int i = 0; i < NQ; ++i) {
        const __m512 dv = _mm512_set1_ps(den[i]);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(outs[i] + 16 * c, _mm512_div_ps(acc[i][c], dv));
    }
}

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

/* softmax_num on 16 lanes: m by the scalar rule (x > m ? x : m, every lane started at sc[0],
 * lanes folded by the same rule: the same m, as max is order-free for the values that
 * reach exp), then sc[j] = exp32(sc[j] - m). The same bits as softmax_num. */
static AVX512 void softmax512(float *sc, int64_t n) {
    __m512 m = _mm512_set1_ps(sc[0]);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
        const __m512 x = _mm512_maskz_loadu_ps(k, sc + j);
        m = _mm512_mask_max_ps(m, k, x, m); /* vmaxps(x, m) = x > m ? x : m, exactly */
    }
    float lanes[16], mx = sc[0];
    _mm512_storeu_ps(lanes, m);
    for (int i = 0; i < 16; ++i) mx = lanes[i] > mx ? lanes[i] : mx;
    const __m512 vm = _mm512_set1_ps(mx);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
        _mm512_mask_storeu_ps(sc + j, k, exp32_512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + j), vm)));
    }
}

static AVX512 void attend512(int nq, const float *const *qs, const float *kt, const float *v,
                             int64_t S_cap, int64_t n, float scale, float *const *sc,
                             float *const *outs, void (*num)(float *, int64_t)) {
    if (nq == 3) scores512(3, qs, kt, S_cap, n, scale, sc);
    else if (nq == 2) scores512(2, qs, kt, S_cap, n, scale, sc);
    else scores512(1, qs, kt, S_cap, n, scale, sc);
    for (int i = 0; i < nq; ++i) num(sc[i], n);
    if (nq == 3) pv512(3, sc, v, n, outs);
    else if (nq == 2) pv512(2, sc, v, n, outs);
    else pv512(1, sc, v, n, outs);
}

/* pv512 for NQ = P nq queries of P adjacent positions (query i is position i / nq, with
 * n + i / nq keys), sharing each value row's loads; dims in two halves of 32 (each
 * element's chain and each den are the same sequential chains over j as in pv512; the
 * dens run first, in a pass of their own). */
static inline __attribute__((always_inline)) AVX512 void
pv512_multi(const int NQ, const int P, float *const *e, const float *v, int64_t n,
            float *const *outs) {
    const int nq = NQ / P;
    float den[UP512 * QB];
#pragma GCC unroll 12
    for (int i = 0; i < NQ; ++i) den[i] = 0.0f;
    for (int64_t j = 0; j < n + P - 1; ++j) { /* the dens, in their own pass (registers) */
        const int64_t first = j < n ? 0 : (j - n + 1) * nq;
#pragma GCC unroll 12
        for (int i = 0; i < NQ; ++i)
            if (i >= first) den[i] = den[i] + e[i][j];
    }
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
        __m512 acc[UP512 * QB][2];
#pragma GCC unroll 12
        for (int i = 0; i < NQ; ++i) {
            acc[i][0] = _mm512_setzero_ps();
            acc[i][1] = _mm512_setzero_ps();
        }
        for (int64_t j = 0; j < n + P - 1; ++j) {
            const float *vr = v + j * HD + 32 * half;
            _mm_prefetch((const char *)(vr + 8 * HD), _MM_HINT_T0); /* 8 rows ahead */
            _mm_prefetch((const char *)(vr + 8 * HD + 16), _MM_HINT_T0);
            const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
            const int64_t first = j < n ? 0 : (j - n + 1) * nq; /* queries with key j */
#pragma GCC unroll 12
            for (int i = 0; i < NQ; ++i) {
                if (i < first) continue;
                const __m512 eb = _mm512_set1_ps(e[i][j]);
                acc[i][0] = _mm512_fmadd_ps(eb, v0, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(eb, v1, acc[i][1]);
            }
        }
#pragma GCC unroll 12
        for (int i = 0; i < NQ; ++i) {
            const __m512 dv = _mm512_set1_ps(den[i]);
            _mm512_storeu_ps(outs[i] + 32 * half, _mm512_div_ps(acc[i][0], dv));
            _mm512_storeu_ps(outs[i] + 32 * half + 16, _mm512_div_ps(acc[i][1], dv));
        }
    }
}

/* P adjacent positions (n, n + 1, ... keys) of the same nq heads: one pass over the keys
 * for all P nq scores (qs, sc, outs: position-major, nq heads each), then each query's own
 * softmax and value chain over its own keys. The same chains as attend512. */
static AVX512 void attend512_multi(int nq, int P, const float *const *qs, const float *kt,
                                   const float *v, int64_t S_cap, int64_t n, float scale,
                                   float *const *sc, float *const *outs) {
    if (nq == 3) scores512(3 * P, qs, kt, S_cap, n + P - 1, scale, sc);
    else if (nq == 2) scores512(2 * P, qs, kt, S_cap, n + P - 1, scale, sc);
    else scores512(P, qs, kt, S_cap, n + P - 1, scale, sc);
    for (int i = 0; i < nq * P; ++i) softmax512(sc[i], n + i / nq);
    if (nq == 3) pv512_multi(3 * P, P, sc, v, n, outs);
    else if (nq == 2) pv512_multi(2 * P, P, sc, v, n, outs);
    else pv512_multi(P, P, sc, v, n, outs);
}

/* AVX2 (+FMA) versions of the same kernels, 8 lanes: the same fma chains element by element
 * (dot_j vectorized across keys, acc_d across dims, den sequential per query). NQ = P nq
 * queries of P adjacent positions share each key and value block, loaded once into L1;
 * register tiles of G = 3 queries x 4 vectors (12 of the 16 ymm) run over it. */
#define AVX2 LMTAIL_TARGET_AVX2_FMA
enum { G2 = 3, KB2 = 32, EB = 64, NQ2 = UP2 * QB }; /* tile rows; keys per score / value block */

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

/* One score tile: queries qb[0..G) (rows of HD) x keys j0 .. j0 + KB2 - 1: acc = fma chain
 * over d from +0, sc[i][j] = fl32(acc * scale). pf: prefetch the next block's keys. */
static inline __attribute__((always_inline)) AVX2 void
score_tile(const int G, const int pf, const float (*qb)[HD], const float *kt, int64_t S_cap,
           int64_t j0, __m256 vs, float *const *sc) {
    __m256 acc[G2][KB2 / 8];
#pragma GCC unroll 3
    for (int i = 0; i < G; ++i)
#pragma GCC unroll 4
        for (int c = 0; c < KB2 / 8; ++c) acc[i][c] = _mm256_setzero_ps();
    for (int d = 0; d < HD; ++d) {
        const float *kr = kt + (int64_t)d * S_cap + j0;
        if (pf) {
            _mm_prefetch((const char *)(kr + KB2), _MM_HINT_T0); /* the next block */
            _mm_prefetch((const char *)(kr + KB2 + 16), _MM_HINT_T0);
        }
        __m256 kv[KB2 / 8];
#pragma GCC unroll 4
        for (int c = 0; c < KB2 / 8; ++c) kv[c] = _mm256_loadu_ps(kr + 8 * c);
#pragma GCC unroll 3
        for (int i = 0; i < G; ++i) {
            const __m256 qd = _mm256_broadcast_ss(&qb[i][d]);
#pragma GCC unroll 4
            for (int c = 0; c < KB2 / 8; ++c) acc[i][c] = _mm256_fmadd_ps(qd, kv[c], acc[i][c]);
        }
    }
#pragma GCC unroll 3
    for (int i = 0; i < G; ++i)
#pragma GCC unroll 4
        for (int c = 0; c < KB2 / 8; ++c) _mm256_storeu_ps(sc[i] + j0 + 8 * c, _mm256_mul_ps(acc[i][c], vs));
}

/* scores() on 8 lanes for NQ <= NQ2 queries: sc[i][j] for j < nmax rounded up to KB2 (lanes
 * past a query's own n: in-bounds slots, never used). Each key block is used by every tile
 * of G2 queries before the next (L1); the queries are copied to one local block first. */
static AVX2 void scores256(int NQ, const float *const *qs, const float *kt, int64_t S_cap,
                           int64_t nmax, float scale, float *const *sc) {
    float qb[NQ2][HD] __attribute__((aligned(32)));
    for (int i = 0; i < NQ; ++i) memcpy(qb[i], qs[i], HD * sizeof(float));
    const __m256 vs = _mm256_set1_ps(scale);
    for (int64_t j0 = 0; j0 < nmax; j0 += KB2) {
        int i = NQ < G2 ? NQ : G2; /* the first tile also prefetches */
        if (i == G2) score_tile(G2, 1, qb, kt, S_cap, j0, vs, sc);
        else if (i == 2) score_tile(2, 1, qb, kt, S_cap, j0, vs, sc);
        else score_tile(1, 1, qb, kt, S_cap, j0, vs, sc);
        for (; i + G2 <= NQ; i += G2) score_tile(G2, 0, qb + i, kt, S_cap, j0, vs, sc + i);
        if (NQ - i == 2) score_tile(2, 0, qb + i, kt, S_cap, j0, vs, sc + i);
        else if (NQ - i == 1) score_tile(1, 0, qb + i, kt, S_cap, j0, vs, sc + i);
    }
}

/* softmax512 on 8 lanes (the same m, the same e_j); writes sc up to n rounded up to 8
 * (lanes past n: scratch never read). */
static AVX2 void softmax256(float *sc, int64_t n) {
    __m256 m = _mm256_set1_ps(sc[0]);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) m = _mm256_max_ps(_mm256_loadu_ps(sc + j), m); /* x > m ? x : m */
    float lanes[8], mx = sc[0];
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; ++i) mx = lanes[i] > mx ? lanes[i] : mx;
    for (; j < n; ++j) mx = sc[j] > mx ? sc[j] : mx;
    const __m256 vm = _mm256_set1_ps(mx);
    for (j = 0; j < n; j += 8) _mm256_storeu_ps(sc + j, exp32_256(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vm)));
}

/* One value tile: queries eb[0..G) (rows of EB e's) x dims c0 .. c0 + 31 over keys
 * 0 .. jn - 1 of the block at v: acc[i] = fma(e_ij, v_j, acc[i]) in j order, the
 * accumulators parked in park[i] between blocks. */
static inline __attribute__((always_inline)) AVX2 void
pv_tile(const int G, const float (*eb)[EB], const float *v, int jn, int c0, __m256 (*park)[HD / 8]) {
    __m256 acc[G2][4];
#pragma GCC unroll 3
    for (int i = 0; i < G; ++i)
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) acc[i][c] = park[i][c0 / 8 + c];
    for (int jj = 0; jj < jn; ++jj) {
        const float *vr = v + (int64_t)jj * HD + c0;
        __m256 vv[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) vv[c] = _mm256_loadu_ps(vr + 8 * c);
#pragma GCC unroll 3
        for (int i = 0; i < G; ++i) {
            const __m256 b = _mm256_broadcast_ss(&eb[i][jj]);
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) acc[i][c] = _mm256_fmadd_ps(b, vv[c], acc[i][c]);
        }
    }
#pragma GCC unroll 3
    for (int i = 0; i < G; ++i)
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) park[i][c0 / 8 + c] = acc[i][c];
}

/* den[i] = den[i] + eb[i][jj] for jj = 0 .. jn - 1 in order, i < NQ: 8 queries to a vector
 * (lane i - 8 g; each lane's chain is one den's; lanes past NQ add zeros), their e's turned
 * to columns by transposes. den has room for NQ rounded up to 8. */
static inline __attribute__((always_inline)) AVX2 void den_block(int NQ, const float (*eb)[EB], int jn,
                                                                 float *den) {
    const int ng = (NQ + 7) / 8;
    __m256 D[(NQ2 + 7) / 8];
    for (int g = 0; g < ng; ++g) D[g] = _mm256_loadu_ps(den + 8 * g);
    for (int jj = 0; jj < jn; jj += 8) {
        const int m = jn - jj < 8 ? jn - jj : 8; /* keys in this column block */
        for (int g = 0; g < ng; ++g) {
            __m256 r[8];
            for (int k = 0; k < 8; ++k)
                r[k] = 8 * g + k < NQ ? _mm256_load_ps(eb[8 * g + k] + jj) : _mm256_setzero_ps();
            lmtail_transpose8(r);
            if (m == 8)
                for (int k = 0; k < 8; ++k) D[g] = _mm256_add_ps(D[g], r[k]);
            else
                for (int k = 0; k < m; ++k) D[g] = _mm256_add_ps(D[g], r[k]);
        }
    }
    for (int g = 0; g < ng; ++g) _mm256_storeu_ps(den + 8 * g, D[g]);
}

/* pv512_multi on 8 lanes: NQ = P nq queries of P adjacent positions (query i has n + i / nq
 * keys). The keys all of them have (j < n) go in blocks of EB: the block's e copied to one
 * local block, its dens added (each den's chain in j order), then every tile of G2 queries
 * x 32 dims over the block's values (in L1); then the later positions' last keys (j = n ..
 * n + P - 2), each query's chains continued in j order, and the divisions. */
static AVX2 void pv256(int NQ, int P, float *const *e, const float *v, int64_t n, float *const *outs) {
    const int nq = NQ / P;
    float eb[NQ2][EB] __attribute__((aligned(32)));
    __m256 park[NQ2][HD / 8];
    float den[NQ2 + 8];
    for (int i = 0; i < NQ2 + 8; ++i) den[i] = 0.0f;
    for (int i = 0; i < NQ; ++i)
        for (int c = 0; c < HD / 8; ++c) park[i][c] = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < n; j0 += EB) {
        const int jn = (int)(n - j0 < EB ? n - j0 : EB);
        for (int i = 0; i < NQ; ++i) /* whole vectors: lanes past jn are never read */
            for (int jj = 0; jj < jn; jj += 8) _mm256_store_ps(eb[i] + jj, _mm256_loadu_ps(e[i] + j0 + jj));
        den_block(NQ, eb, jn, den);
        const float *vb = v + j0 * HD;
        int i = 0;
        for (; i + G2 <= NQ; i += G2)
            for (int c0 = 0; c0 < HD; c0 += 32) pv_tile(G2, eb + i, vb, jn, c0, park + i);
        for (int c0 = 0; c0 < HD; c0 += 32) {
            if (NQ - i == 2) pv_tile(2, eb + i, vb, jn, c0, park + i);
            else if (NQ - i == 1) pv_tile(1, eb + i, vb, jn, c0, park + i);
        }
    }
    for (int64_t j = n; j < n + P - 1; ++j) /* the later positions' last keys */
        for (int i = (int)(j - n + 1) * nq; i < NQ; ++i) {
            den[i] = den[i] + e[i][j];
            const __m256 b = _mm256_set1_ps(e[i][j]);
            for (int c = 0; c < HD / 8; ++c)
                park[i][c] = _mm256_fmadd_ps(b, _mm256_loadu_ps(v + j * HD + 8 * c), park[i][c]);
        }
    for (int i = 0; i < NQ; ++i) {
        const __m256 dv = _mm256_set1_ps(den[i]);
        for (int c = 0; c < HD / 8; ++c) _mm256_storeu_ps(outs[i] + 8 * c, _mm256_div_ps(park[i][c], dv));
    }
}

/* attend512_multi on the AVX2 kernels: P adjacent positions (n, n + 1, ... keys) of the
 * same nq heads, NQ = P nq <= NQ2 queries (position-major) sharing one pass over the keys
 * and one over the values; P = 1 is one position. The same chains as attend512. */
static AVX2 void attend256_multi(int nq, int P, const float *const *qs, const float *kt,
                                 const float *v, int64_t S_cap, int64_t n, float scale,
                                 float *const *sc, float *const *outs) {
    const int NQ = nq * P;
    scores256(NQ, qs, kt, S_cap, n + P - 1, scale, sc);
    for (int i = 0; i < NQ; ++i) softmax256(sc[i], n + i / nq);
    pv256(NQ, P, sc, v, n, outs);
}

/* exp_rows on 8 lanes (exp32_256), the last n % 8 by the scalar exp32: the same bits. */
static AVX2 void exp_rows256(const float *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp32_256(_mm256_loadu_ps(x + i)));
    for (; i < n; ++i) y[i] = exp32(x[i]);
}

/* silu_rows on 8 lanes: silu_mul1's operations one for one (-g by flipping the sign bit,
 * exp32_256, IEEE division, the -inf select), the last F % 8 of a row by silu_mul1. */
static AVX2 void silu_rows256(const float *gu, float *out, int64_t M, int64_t F, int64_t ld) {
    const __m256 one = _mm256_set1_ps(1.0f), ninf = _mm256_set1_ps(-INFINITY);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t m = 0; m < M; ++m) {
        const float *g = gu + m * ld, *u = g + F;
        float *o = out + m * F;
        int64_t c = 0;
        for (; c + 8 <= F; c += 8) {
            const __m256 gv = _mm256_loadu_ps(g + c);
            const __m256 e = exp32_256(_mm256_xor_ps(gv, sign));
            __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            sv = _mm256_blendv_ps(sv, sign, _mm256_cmp_ps(gv, ninf, _CMP_EQ_OQ));
            _mm256_storeu_ps(o + c, _mm256_mul_ps(sv, _mm256_loadu_ps(u + c)));
        }
        for (; c < F; ++c) o[c] = silu_mul1(g[c], u[c]);
    }
}
#endif

/* exp32 and silu_mul have AVX2 rows only: cap <= 1 takes them where the CPU has AVX2 + FMA. */
static LMTAIL_UNUSED int avx2_rows(int cap) { return cap <= 1 && lmtail_cpu_has(LMTAIL_ISA_AVX2); }

/* exp32 elementwise, x, y [n]; cap: pick_isa's (0 or 1: the AVX2 rows, 2: portable). */
void lmtail_exp32_isa(const float *x, float *y, int64_t n, int cap) {
    unsigned old = pin_mxcsr();
#if defined(__x86_64__)
    if (avx2_rows(cap)) {
        exp_rows256(x, y, n);
        restore_mxcsr(old);
        return;
    }
#endif
    exp_rows(x, y, n);
    restore_mxcsr(old);
}

void lmtail_exp32(const float *x, float *y, int64_t n) { lmtail_exp32_isa(x, y, n, 0); }

/* silu_mul of gu [M, ld] (gate columns [0, F), up [F, 2F)) -> out [M, F]; cap as exp32. */
void lmtail_silu_mul_isa(const float *gu, float *out, int64_t M, int64_t F, int64_t ld, int cap) {
    unsigned old = pin_mxcsr();
#if defined(__x86_64__)
    if (avx2_rows(cap)) {
        silu_rows256(gu, out, M, F, ld);
        restore_mxcsr(old);
        return;
    }
#endif
    silu_rows(gu, out, M, F, ld);
    restore_mxcsr(old);
}

void lmtail_silu_mul(const float *gu, float *out, int64_t M, int64_t F, int64_t ld) {
    lmtail_silu_mul_isa(gu, out, M, F, ld, 0);
}

/* Scores of NQ queries (NQ <= QB) sharing one KV head: sc[i][j] = fl32(dot * scale) for
 * j < nmax (lanes past a query's own n are computed from in-bounds slots and never used). */
static inline __attribute__((always_inline)) void
scores(const int NQ, const float *const *qs, const float *kt, int64_t S_cap, int64_t nmax,
       float scale, float *const *sc) {
    for (int64_t j0 = 0; j0 < nmax; j0 += JB) {
        float acc[QB][JB];
        for (int i = 0; i < NQ; ++i)
            for (int jj = 0; jj < JB; ++jj) acc[i][jj] = 0.0f;
        for (int d = 0; d < HD; ++d) {
            const float *kr = kt + (int64_t)d * S_cap + j0;
            for (int i = 0; i < NQ; ++i) {
                const float qd = qs[i][d];
                for (int jj = 0; jj < JB; ++jj) acc[i][jj] = fmaf(qd, kr[jj], acc[i][jj]);
            }
        }
        for (int i = 0; i < NQ; ++i)
            for (int jj = 0; jj < JB; ++jj) sc[i][j0 + jj] = acc[i][jj] * scale;
    }
}

/* In place: sc[j] = exp32(sc[j] - max) for j < n. */
CLONES static void softmax_num(float *sc, int64_t n) {
    float m = sc[0];
    for (int64_t j = 1; j < n; ++j) m = sc[j] > m ? sc[j] : m;
    for (int64_t j = 0; j < n; ++j) sc[j] = exp32(sc[j] - m);
}

/* acc[i][d] = fma chain over j in [j0, j1) of e[i][j] * v_j[d]; den[i] += e[i][j] in order. */
static inline __attribute__((always_inline)) void
pv(const int NQ, float *const *e, const float *v, int64_t j0, int64_t j1, float acc[][HD],
   float *den) {
    for (int64_t j = j0; j < j1; ++j) {
        const float *vr = v + j * HD;
        for (int i = 0; i < NQ; ++i) {
            const float ej = e[i][j];
            den[i] = den[i] + ej;
            for (int d = 0; d < HD; ++d) acc[i][d] = fmaf(ej, vr[d], acc[i][d]);
        }
    }
}

/* One position t of row b, KV head kh: its g query heads (in groups of QB). */
CLONES static void attn_pos(const attn_job *jb, int64_t b, int64_t kh, int64_t t, float *scratch) {
    const int64_t T = jb->T, g = jb->nh / jb->nkv;
    const int64_t p = jb->s0 + t - jb->pad[b];
    const float *kt = jb->kt + ((b * jb->nkv + kh) * HD) * jb->S_cap + jb->pad[b];
    const float *v = jb->v + ((b * jb->nkv + kh) * jb->S_cap + jb->pad[b]) * HD;
    for (int64_t h0 = 0; h0 < g; h0 += QB) {
        const int nq = (int)(g - h0 < QB ? g - h0 : QB);
        const float *qs[QB];
        float *outs[QB], *sc[QB];
        for (int i = 0; i < nq; ++i) {
            const int64_t h = kh * g + h0 + i;
            qs[i] = jb->q + ((b * T + t) * jb->nh + h) * HD;
            outs[i] = jb->out + ((b * T + t) * jb->nh + h) * HD;
            sc[i] = scratch + (int64_t)i * (jb->S_cap + JB);
        }
        if (p < 0) {
            for (int i = 0; i < nq; ++i) memset(outs[i], 0, HD * sizeof(float));
            continue;
        }
        const int64_t n = p + 1;
#if defined(__x86_64__)
        if (jb->isa == 2) {
            attend512(nq, qs, kt, v, jb->S_cap, n, jb->scale, sc, outs, softmax512);
            continue;
        }
        if (jb->isa == 1) {
            attend256_multi(nq, 1, qs, kt, v, jb->S_cap, n, jb->scale, sc, outs);
            continue;
        }
#endif
        if (nq == 3) scores(3, qs, kt, jb->S_cap, n, jb->scale, sc);
        else if (nq == 2) scores(2, qs, kt, jb->S_cap, n, jb->scale, sc);
        else scores(1, qs, kt, jb->S_cap, n, jb->scale, sc);
        for (int i = 0; i < nq; ++i) softmax_num(sc[i], n);
        float acc[QB][HD], den[QB];
        for (int i = 0; i < nq; ++i) {
            den[i] = 0.0f;
            for (int d = 0; d < HD; ++d) acc[i][d] = 0.0f;
        }
        if (nq == 3) pv(3, sc, v, 0, n, acc, den);
        else if (nq == 2) pv(2, sc, v, 0, n, acc, den);
        else pv(1, sc, v, 0, n, acc, den);
        for (int i = 0; i < nq; ++i)
            for (int d = 0; d < HD; ++d) outs[i][d] = acc[i][d] / den[i];
    }
}

#if defined(__x86_64__)
/* Positions t .. t + P - 1 (all real queries; P = the unit's up) of row b, KV head kh on
 * the AVX-512 (isa 2, P = UP512: attend512_multi) or AVX2 (isa 1, P = UP2: attend256_multi)
 * kernels: each group of nq heads shares one pass over the keys. */
static void attn_multi(const attn_job *jb, int64_t b, int64_t kh, int64_t t, int P, float *scratch) {
    const int64_t T = jb->T, g = jb->nh / jb->nkv;
    const int64_t n = jb->s0 + t - jb->pad[b] + 1;
    const float *kt = jb->kt + ((b * jb->nkv + kh) * HD) * jb->S_cap + jb->pad[b];
    const float *v = jb->v + ((b * jb->nkv + kh) * jb->S_cap + jb->pad[b]) * HD;
    for (int64_t h0 = 0; h0 < g; h0 += QB) {
        const int nq = (int)(g - h0 < QB ? g - h0 : QB);
        const float *qs[UP * QB];
        float *outs[UP * QB], *sc[UP * QB];
        for (int k = 0; k < P * nq; ++k) {
            const int64_t tt = t + k / nq, h = kh * g + h0 + k % nq;
            qs[k] = jb->q + ((b * T + tt) * jb->nh + h) * HD;
            outs[k] = jb->out + ((b * T + tt) * jb->nh + h) * HD;
            sc[k] = scratch + (int64_t)k * (jb->S_cap + JB);
        }
        if (jb->isa == 2) attend512_multi(nq, UP512, qs, kt, v, jb->S_cap, n, jb->scale, sc, outs);
        else attend256_multi(nq, UP2, qs, kt, v, jb->S_cap, n, jb->scale, sc, outs);
    }
}
#endif

/* One unit: row b, KV head kh, positions up u .. up u + up - 1 (fewer in the last unit). */
static void attn_unit(const attn_job *jb, int64_t unit, float *scratch) {
    const int64_t T = jb->T, up = jb->up, tp = (T + up - 1) / up;
    const int64_t b = unit / (jb->nkv * tp), kh = (unit / tp) % jb->nkv, t0 = up * (unit % tp);
    const int64_t t1 = t0 + up < T ? t0 + up : T;
    for (int64_t t = t0; t < t1;) {
#if defined(__x86_64__)
        if (jb->isa && jb->s0 + t - jb->pad[b] >= 0 && t + up <= t1) {
            attn_multi(jb, b, kh, t, (int)up, scratch);
            t += up;
            continue;
        }
#endif
        attn_pos(jb, b, kh, t, scratch);
        t += 1;
    }
}

static void *attn_worker(void *arg) {
    attn_job *job = (attn_job *)arg;
    const int slot = __atomic_fetch_add(&job->slots, 1, __ATOMIC_RELAXED); /* < the thread count */
    float *scratch = job->scratch + job->per * (size_t)slot;
    unsigned old = pin_mxcsr();
    for (;;) {
        int64_t u = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (u >= job->nunits) break;
        attn_unit(job, u, scratch);
    }
    restore_mxcsr(old);
    return NULL;
}

/* Returns 0 on success, -1 if scratch memory could not be had (nothing written then).
 * cap: the ISA cap of pick_isa (the tests compare every path; the bytes are the same). */
int lmtail_attend(const float *q, const float *kt, const float *v, float *out, const int64_t *pad,
                  int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t S_cap, int64_t s0,
                  float scale, int threads, int cap) {
    attn_job job;
    memset(&job, 0, sizeof job);
    job.q = q, job.kt = kt, job.v = v, job.out = out, job.pad = pad;
    job.B = B, job.T = T, job.nh = nh, job.nkv = nkv, job.S_cap = S_cap, job.s0 = s0, job.scale = scale;
    job.isa = pick_isa(cap);
    job.up = job.isa == 1 ? UP2 : UP512;
    job.nunits = B * nkv * ((T + job.up - 1) / job.up);
    if (threads < 1) threads = 1;
    if (threads > job.nunits) threads = (int)(job.nunits > 0 ? job.nunits : 1);
    if (threads > LMTAIL_MAXT) threads = LMTAIL_MAXT;
    job.per = (size_t)(job.up * QB) * (size_t)(S_cap + JB);
    job.scratch = (float *)malloc(job.per * sizeof(float) * (size_t)threads);
    if (!job.scratch) return -1;
    lmtail_parallel(attn_worker, &job, threads); /* at most `threads` workers take a slot */
    free(job.scratch);
    return 0;
}

/* ------------------------------------------------------------------ bf16 helpers */
/* fp32 -> bf16, round to nearest even (overflow -> inf); a NaN -> 0x7FC0 (payload not declared). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)0x7FC0u;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#define from_bf16 bf16_to_f32

/* ------------------------------------------------------------------ add + RMSNorm */
/* inv = fl32(1 / sqrt(fl32(fl32(ssq / H) + eps))) of one row h [H] fp32, ssq in the order
 * strided(lanes): lane chains acc_t = fma(h_i, h_i, acc_t) over i = t, t + lanes, ... from
 * +0.0, an xor butterfly (halves folded 16, 8, 4, 2, 1) per 32 lanes, groups added in order
 * (lmtail.glue.norms.inv_rms). acc: lanes floats of scratch. */
static inline __attribute__((always_inline)) float strided_inv(const float *h, int64_t H, float eps,
                                                               int64_t lanes, float *acc) {
    for (int64_t t = 0; t < lanes; ++t) acc[t] = 0.0f;
    for (int64_t i0 = 0; i0 < H; i0 += lanes) {
        const int64_t n = H - i0 < lanes ? H - i0 : lanes;
        for (int64_t t = 0; t < n; ++t) acc[t] = fmaf(h[i0 + t], h[i0 + t], acc[t]);
    }
    const float ssq = lmtail_lane_totals(acc, lanes);
    const float m = ssq / (float)H;
    const float d = m + eps;
    return 1.0f / __builtin_sqrtf(d);
}

/* lmtail.glue.norms.add_rms in the order strided(lanes), for one row of H (see body.py add_rms_rows):
 *   h_i = bf16(fl32(bf16(x_i) + r_i))  (x fp32; x_bf16 != 0: x is bf16, widened exactly)
 *   ssq = lane chains acc_t = fma(h_i, h_i, acc_t) over i = t, t + lanes, ... from +0.0,
 *         xor butterfly (halves folded: 16, 8, 4, 2, 1) per 32 lanes, groups added in order
 *   inv = fl32(1 / sqrt(fl32(fl32(ssq / H) + eps)))   (IEEE sqrt and division)
 *   y_i = bf16(fl32(fl32(h_i * inv) * gamma_i))
 * scratch: H + lanes floats. */
CLONES static void add_rms_row(const void *x, int x_bf16, const uint16_t *r, const float *gamma,
                               int64_t H, float eps, int64_t lanes, uint16_t *h, uint16_t *y,
                               float *scratch) {
    float *h32 = scratch, *acc = scratch + H;
    for (int64_t i = 0; i < H; ++i) {
        const float xi = x_bf16 ? from_bf16(((const uint16_t *)x)[i])
                                : from_bf16(to_bf16(((const float *)x)[i]));
        const uint16_t hb = to_bf16(xi + from_bf16(r[i]));
        h[i] = hb;
        h32[i] = from_bf16(hb);
    }
    const float inv = strided_inv(h32, H, eps, lanes, acc);
    for (int64_t i = 0; i < H; ++i) y[i] = to_bf16((h32[i] * inv) * gamma[i]);
}

/* x [N, ldx] fp32 or bf16, r [N, H] bf16, gamma [H] fp32 -> h, y [N, H] bf16.
 * Returns 0, or -1 when scratch memory could not be had (nothing written then). */
int lmtail_add_rms_rows(const void *x, int64_t ldx, int x_bf16, const uint16_t *r,
                        const float *gamma, int64_t N, int64_t H, float eps, int64_t lanes,
                        uint16_t *h, uint16_t *y) {
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(H + lanes));
    if (!scratch) return -1;
    unsigned old = pin_mxcsr();
    const size_t esz = x_bf16 ? 2 : 4;
    for (int64_t m = 0; m < N; ++m)
        add_rms_row((const char *)x + (size_t)(m * ldx) * esz, x_bf16, r + m * H, gamma, H, eps,
                    lanes, h + m * H, y + m * H, scratch);
    restore_mxcsr(old);
    free(scratch);
    return 0;
}

/* The fp32 stream's add + RMSNorm (the q32 body), one row of H, the order of add_rms_row
 * without its bf16 roundings:
 *   h_i = fl32(x_i + r_i)            (r == NULL: r_i = +0.0)
 *   ssq = lane chains acc_t = fma(h_i, h_i, acc_t) over i = t, t + lanes, ... from +0.0,
 *         xor butterfly (halves folded: 16, 8, 4, 2, 1) per 32 lanes, groups added in order
 *   inv = fl32(1 / sqrt(fl32(fl32(ssq / H) + eps)))   (IEEE sqrt and division)
 *   y_i = fl32(fl32(h_i * inv) * gamma_i)
 * lanes % 32 == 0 and lanes <= NORM32_MAX_LANES (the caller checks): no allocation. */
enum { NORM32_MAX_LANES = 1024 };
CLONES static void add_rms_row32(const float *x, const float *r, const float *gamma, int64_t H,
                                 float eps, int64_t lanes, float *h, float *y) {
    float acc[NORM32_MAX_LANES];
    for (int64_t i = 0; i < H; ++i) h[i] = x[i] + (r ? r[i] : 0.0f);
    const float inv = strided_inv(h, H, eps, lanes, acc);
    for (int64_t i = 0; i < H; ++i) y[i] = (h[i] * inv) * gamma[i];
}

/* x [N, ldx] fp32, r [N, H] fp32 or NULL, gamma [H] fp32 -> h, y [N, H] fp32 (h may alias r:
 * each h_i is written after r_i is read). Returns 0, or -3 for lanes outside
 * (0, NORM32_MAX_LANES] or not a multiple of 32 (nothing written then). */
int lmtail_add_rms_rows32(const float *x, int64_t ldx, const float *r, const float *gamma,
                          int64_t N, int64_t H, float eps, int64_t lanes, float *h, float *y) {
    if (lanes <= 0 || lanes > NORM32_MAX_LANES || lanes % 32) return -3;
    unsigned old = pin_mxcsr();
    for (int64_t m = 0; m < N; ++m)
        add_rms_row32(x + m * ldx, r ? r + m * H : NULL, gamma, H, eps, lanes, h + m * H, y + m * H);
    restore_mxcsr(old);
    return 0;
}

/* ------------------------------------------------------------------ rope + cache write */
/* qkv [B*T, ld] fp32 rows = [q (nh*HD) | k (nkv*HD) | v (nkv*HD)] of the fused GEMM;
 * cs, sn [P, HD/2] fp32 rope tables; pos [B*T] int64 positions (>= 0, < P).
 * Writes q_out [B, T, nh, HD] (roped), kt[b, kh, :, s0 + t] (roped, transposed) and
 * v[b, kh, s0 + t, :]. Rope of pair i (angle row pos): e = x[2i], o = x[2i+1],
 *   x'[2i] = fl32(fl32(e c) - fl32(o s)),  x'[2i+1] = fl32(fl32(e s) + fl32(o c)). */
CLONES static void rope_head(const float *x, const float *c, const float *s, float *out,
                             int64_t stride) {
    for (int64_t i = 0; i < HD / 2; ++i) {
        const float e = x[2 * i], o = x[2 * i + 1];
        out[(2 * i) * stride] = e * c[i] - o * s[i];
        out[(2 * i + 1) * stride] = e * s[i] + o * c[i];
    }
}

void lmtail_rope_qkv(const float *qkv, int64_t ld, const float *cs, const float *sn,
                     const int64_t *pos, float *q_out, float *kt, float *v, int64_t B, int64_t T,
                     int64_t nh, int64_t nkv, int64_t S_cap, int64_t s0) {
    unsigned old = pin_mxcsr();
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) {
            const float *row = qkv + (b * T + t) * ld;
            const float *c = cs + pos[b * T + t] * (HD / 2), *s = sn + pos[b * T + t] * (HD / 2);
            for (int64_t h = 0; h < nh; ++h)
                rope_head(row + h * HD, c, s, q_out + ((b * T + t) * nh + h) * HD, 1);
            for (int64_t h = 0; h < nkv; ++h) {
                rope_head(row + (nh + h) * HD, c, s, kt + ((b * nkv + h) * HD) * S_cap + s0 + t, S_cap);
                memcpy(v + ((b * nkv + h) * S_cap + s0 + t) * HD, row + (nh + nkv + h) * HD,
                       HD * sizeof(float));
            }
        }
    restore_mxcsr(old);
}

/* silu_mul with a bf16 result: out[m, c] = bf16(silu_mul1(g, u)) (the GEMM input it feeds). */
CLONES static void silu_rows_bf16(const float *gu, uint16_t *out, int64_t M, int64_t F, int64_t ld) {
    for (int64_t m = 0; m < M; ++m) {
        const float *g = gu + m * ld, *u = g + F;
        uint16_t *o = out + m * F;
        for (int64_t c = 0; c < F; ++c) o[c] = to_bf16(silu_mul1(g[c], u[c]));
    }
}

#if defined(__x86_64__)
/* silu_rows_bf16 on 16 lanes: silu_mul1's operations one for one (exp32_512, IEEE division),
 * then to_bf16's integer rounding (NaN -> 0x7FC0): the same bits. */
static LMTAIL_TARGET_AVX512VL void silu_rows_bf16_512(const float *gu, uint16_t *out, int64_t M, int64_t F, int64_t ld) {
    const __m512 one = _mm512_set1_ps(1.0f), ninf = _mm512_set1_ps(-INFINITY);
    const __m512i bias = _mm512_set1_epi32(0x7FFF), lsb = _mm512_set1_epi32(1);
    const __m512i qnan = _mm512_set1_epi32(0x7FC0);
    for (int64_t m = 0; m < M; ++m) {
        const float *g = gu + m * ld, *u = g + F;
        uint16_t *o = out + m * F;
        for (int64_t c = 0; c < F; c += 16) {
            const __mmask16 k = F - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (F - c)) - 1u);
            const __m512 gv = _mm512_maskz_loadu_ps(k, g + c), uv = _mm512_maskz_loadu_ps(k, u + c);
            const __m512 e = exp32_512(_mm512_castsi512_ps(  /* -g: the sign bit flipped */
                _mm512_xor_si512(_mm512_castps_si512(gv), _mm512_set1_epi32((int)0x80000000u))));
            __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(one, e));
            sv = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(gv, ninf, _CMP_EQ_OQ), sv, _mm512_set1_ps(-0.0f));
            const __m512 y = _mm512_mul_ps(sv, uv);
            const __m512i yi = _mm512_castps_si512(y);
            __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(yi, bias),
                                                           _mm512_and_si512(_mm512_srli_epi32(yi, 16), lsb)), 16);
            r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), r, qnan);
            _mm256_mask_storeu_epi16(o + c, k, _mm512_cvtepi32_epi16(r));
        }
    }
}
#endif

/* cap as pick_isa's: 0 lets the AVX-512 rows run where the CPU has them, else portable. */
void lmtail_silu_mul_bf16(const float *gu, uint16_t *out, int64_t M, int64_t F, int64_t ld, int cap) {
    unsigned old = pin_mxcsr();
#if defined(__x86_64__)
    if (cap <= 0 && lmtail_cpu_has(LMTAIL_CPU_AVX512F | LMTAIL_CPU_AVX512BW | LMTAIL_CPU_AVX512VL)) {
        silu_rows_bf16_512(gu, out, M, F, ld);
        restore_mxcsr(old);
        return;
    }
#endif
    silu_rows_bf16(gu, out, M, F, ld);
    restore_mxcsr(old);
}
