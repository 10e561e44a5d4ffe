/* lmtail model body kernels: exp32 and silu_mul rows (CPU), and the model loop's fused glue:
 * add + RMSNorm rows (lmtail.glue.norms.add_rms's numerics, strided order), q|k|v split + rope
 * + KV-cache write, silu_mul with its bf16 round (end of file). The attention is attend.c; the
 * declared exp32 and silu_mul1 (their numerics) are in exp32.h, shared by both.
 *
 * Each exported entry pins MXCSR to round-to-nearest with FTZ/DAZ off and restores it.
 * Compiled with -ffp-contract=off: the only fused ops are the explicit fma calls (fmaf and
 * the fmadd / fnmadd intrinsics).
 */
#include <math.h>
#include "lmtail_kernels.h"
#include "exp32.h"
#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

enum { HD = 64 }; /* the head dim rope_qkv is built for */

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

#if defined(__x86_64__)
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

/* exp_rows on 16 lanes (exp32_512), the last n % 16 as masked lanes (lanes past n read +0.0
 * and are not stored): every lane runs exp32's operations, so the same bits.
 * Estimate (llvm-mca-14, not a measurement: gcc 12 -O3 loop body, in-range lanes, 200
 * iterations): -mcpu=sapphirerapids and icelake-server alike, 25 instructions, 10.3 cycles per
 * 16 floats (block reciprocal throughput 7.5) against exp_rows256's 10.2 per 8: ~2.0x per
 * float. Measured on Zen 4 (256-bit FP datapaths, zmm split in two): 0.87-0.89x the AVX2
 * row's time at [16, 1024] (bench_body_ops). */
static AVX512 void exp_rows512(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(y + i, k, exp32_512(_mm512_maskz_loadu_ps(k, x + i)));
    }
}

/* silu_rows on 16 lanes: silu_mul_512 (exp32.h: silu_mul1's operations one for one), the
 * last F % 16 of a row as masked lanes (read as +0.0, not stored): the same bits.
 * Estimate (llvm-mca-14, as exp_rows512's): sapphirerapids and icelake-server alike, 32
 * instructions, 16.5 cycles per 16 outputs (block reciprocal throughput 10.0: the divider)
 * against silu_rows256's 14.8 per 8: ~1.8x per output. Measured on Zen 4: 0.78-0.91x the
 * AVX2 row's time at F = 1536 (bench_body_ops). */
static AVX512 void silu_rows512(const float *gu, float *out, int64_t M, int64_t F, int64_t ld) {
    for (int64_t m = 0; m < M; ++m) {
        const float *g = gu + m * ld, *u = g + F;
        float *o = out + m * F;
        for (int64_t c = 0; c < F; c += 16) {
            const __mmask16 k = F - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (F - c)) - 1u);
            _mm512_mask_storeu_ps(o + c, k, silu_mul_512(_mm512_maskz_loadu_ps(k, g + c), _mm512_maskz_loadu_ps(k, u + c)));
        }
    }
}
#endif

/* The rows body.c's capped entries pick (every one gives the same bytes): cap 0 takes the
 * 16-lane rows where the CPU has AVX-512F, cap <= 1 the 8-lane rows where it has AVX2 + FMA,
 * else (cap 2) the portable C. */
static LMTAIL_UNUSED int avx512_rows(int cap) { return cap <= 0 && lmtail_cpu_has(LMTAIL_CPU_AVX512F); }
static LMTAIL_UNUSED int avx2_rows(int cap) { return cap <= 1 && lmtail_cpu_has(LMTAIL_ISA_AVX2); }

/* exp32 elementwise, x, y [n]; cap as avx512_rows / avx2_rows. */
void lmtail_exp32_isa(const float *x, float *y, int64_t n, int cap) {
    unsigned old = pin_mxcsr();
#if defined(__x86_64__)
    if (avx512_rows(cap)) {
        exp_rows512(x, y, n);
        restore_mxcsr(old);
        return;
    }
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
    if (avx512_rows(cap)) {
        silu_rows512(gu, out, M, F, ld);
        restore_mxcsr(old);
        return;
    }
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

#if defined(__x86_64__)
/* lmtail_lane_totals on acc[T] (T a multiple of 32) in zmm registers: per group of 32 lanes
 * lo = x[0..15] + x[16..31] (h = 16), then lane i adds lane i + h for h = 8, 4, 2, 1 (the
 * lanes past h carry values no result reads), the groups' lane-0 results added in order:
 * the same additions of the same values, so the same bits. */
static inline __attribute__((always_inline)) AVX512 float lane_totals512(const float *acc, int64_t T) {
    const __m512i i2 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 3, 2);
    const __m512i i1 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 1);
    float total = 0.0f;
    for (int64_t g = 0; g < T / 32; ++g) {
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc + 32 * g), _mm512_loadu_ps(acc + 32 * g + 16));
        v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(3, 2, 3, 2))); /* lanes 0..7 += 8..15 */
        v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 1, 1, 1))); /* lanes 0..3 += 4..7 */
        v = _mm512_add_ps(v, _mm512_permutexvar_ps(i2, v));                          /* lanes 0, 1 += 2, 3 */
        v = _mm512_add_ps(v, _mm512_permutexvar_ps(i1, v));                          /* lane 0 += 1 */
        const float x0 = _mm_cvtss_f32(_mm512_castps512_ps128(v));
        total = g == 0 ? x0 : total + x0;
    }
    return total;
}

/* add_rms_row32 on 16 lanes (its order exactly): h = x + r (r NULL: + 0.0) per 16-lane block
 * (each block's r read before its h is written: h may alias r or x); the strided(lanes) lane
 * chains acc_t = fma(h_i, h_i, acc_t) as 16-lane fmas over acc[t..t+15] (a chunk's last
 * lanes masked: the lanes past H are not updated); lane_totals512; inv by the scalar IEEE
 * sqrt and division; y = (h * inv) * gamma. The tail of H as masked lanes (not stored).
 * Estimate (llvm-mca-14; the ssq loop body: masked load of h, fma with acc from memory,
 * masked store): sapphirerapids and icelake-server alike, 4 instructions, 1.4 cycles per 16
 * lanes (block reciprocal throughput 1.2). Measured on Zen 4: 0.86-0.98x the compiler's
 * x86-64-v4 clone of add_rms_row32 (scalar butterfly) at H = 576 (bench_body_ops). */
static AVX512 void add_rms_row32_512(const float *x, const float *r, const float *gamma, int64_t H,
                                     float eps, int64_t lanes, float *h, float *y) {
    float acc[NORM32_MAX_LANES];
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < H; i += 16) {
        const __mmask16 k = H - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (H - i)) - 1u);
        const __m512 rv = r ? _mm512_maskz_loadu_ps(k, r + i) : zero;
        _mm512_mask_storeu_ps(h + i, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, x + i), rv));
    }
    for (int64_t t = 0; t < lanes; t += 16) _mm512_storeu_ps(acc + t, zero);
    for (int64_t i0 = 0; i0 < H; i0 += lanes) {
        const int64_t n = H - i0 < lanes ? H - i0 : lanes;
        for (int64_t t = 0; t < n; t += 16) {
            const __mmask16 k = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1u);
            const __m512 hv = _mm512_maskz_loadu_ps(k, h + i0 + t);
            _mm512_mask_storeu_ps(acc + t, k, _mm512_fmadd_ps(hv, hv, _mm512_loadu_ps(acc + t)));
        }
    }
    const float ssq = lane_totals512(acc, lanes);
    const float m = ssq / (float)H;
    const float d = m + eps;
    const __m512 inv = _mm512_set1_ps(1.0f / __builtin_sqrtf(d));
    for (int64_t i = 0; i < H; i += 16) {
        const __mmask16 k = H - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (H - i)) - 1u);
        const __m512 t = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, h + i), inv);
        _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(t, _mm512_maskz_loadu_ps(k, gamma + i)));
    }
}
#endif

/* x [N, ldx] fp32, r [N, H] fp32 or NULL, gamma [H] fp32 -> h, y [N, H] fp32 (h may alias r
 * or x: each h_i is written after x_i and r_i are read); cap: 0 the 16-lane rows where the CPU
 * has AVX-512F, else the portable C (its AVX-512 / AVX2 / default clones): the same bytes.
 * Returns 0, or -3 for lanes outside (0, NORM32_MAX_LANES] or not a multiple of 32 (nothing
 * written then). */
int lmtail_add_rms_rows32(const float *x, int64_t ldx, const float *r, const float *gamma,
                          int64_t N, int64_t H, float eps, int64_t lanes, float *h, float *y, int cap) {
    if (lanes <= 0 || lanes > NORM32_MAX_LANES || lanes % 32) return -3;
    unsigned old = pin_mxcsr();
#if defined(__x86_64__)
    if (avx512_rows(cap)) {
        for (int64_t m = 0; m < N; ++m)
            add_rms_row32_512(x + m * ldx, r ? r + m * H : NULL, gamma, H, eps, lanes, h + m * H, y + m * H);
        restore_mxcsr(old);
        return 0;
    }
#endif
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

#if defined(__x86_64__)
/* rope_head on 16 lanes: 32 floats of x split into e = x[2i], o = x[2i+1] (vpermt2ps), the
 * same four products, one subtraction and one addition per pair, re-interleaved; stride 1
 * stores the 32 outputs, another stride writes them one by one (lmtail_rope_qkv uses it for
 * the queries only).
 * Estimate (llvm-mca-14; one 16-pair step, stride 1): sapphirerapids and icelake-server
 * alike, 19 instructions, 6.7 cycles (block reciprocal throughput 6.0: port 5's four
 * vpermt2ps). Measured on Zen 4: 0.92-1.06x the compiler's x86-64-v4 clone (which
 * vectorizes rope_head itself) for a whole rope_qkv call: the cache writes bound it. */
static AVX512 void rope_head512(const float *x, const float *c, const float *s, float *out, int64_t stride) {
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i io = _mm512_add_epi32(ie, _mm512_set1_epi32(1));
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int64_t i = 0; i < HD / 2; i += 16) {
        const __m512 a = _mm512_loadu_ps(x + 2 * i), b = _mm512_loadu_ps(x + 2 * i + 16);
        const __m512 e = _mm512_permutex2var_ps(a, ie, b), o = _mm512_permutex2var_ps(a, io, b);
        const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
        const __m512 ne = _mm512_sub_ps(_mm512_mul_ps(e, cv), _mm512_mul_ps(o, sv));
        const __m512 no = _mm512_add_ps(_mm512_mul_ps(e, sv), _mm512_mul_ps(o, cv));
        const __m512 r0 = _mm512_permutex2var_ps(ne, lo, no), r1 = _mm512_permutex2var_ps(ne, hi, no);
        if (stride == 1) {
            _mm512_storeu_ps(out + 2 * i, r0);
            _mm512_storeu_ps(out + 2 * i + 16, r1);
        } else {
            float tmp[32];
            _mm512_storeu_ps(tmp, r0);
            _mm512_storeu_ps(tmp + 16, r1);
            for (int j = 0; j < 32; ++j) out[(2 * i + j) * stride] = tmp[j];
        }
    }
}
#endif

/* cap: 0 the 16-lane rope where the CPU has AVX-512F, else the portable C: the same bytes. */
void lmtail_rope_qkv(const float *qkv, int64_t ld, const float *cs, const float *sn,
                     const int64_t *pos, float *q_out, float *kt, float *v, int64_t B, int64_t T,
                     int64_t nh, int64_t nkv, int64_t S_cap, int64_t s0, int cap) {
    unsigned old = pin_mxcsr();
    void (*rope)(const float *, const float *, const float *, float *, int64_t) = rope_head;
#if defined(__x86_64__)
    if (avx512_rows(cap)) rope = rope_head512;
#else
    (void)cap;
#endif
    /* the keys' transposed writes (one cache line per element) bound their rope: the portable
     * rope_head stores from registers there (measured faster than rope_head512's stride path). */
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) {
            const float *row = qkv + (b * T + t) * ld;
            const float *c = cs + pos[b * T + t] * (HD / 2), *s = sn + pos[b * T + t] * (HD / 2);
            for (int64_t h = 0; h < nh; ++h)
                rope(row + h * HD, c, s, q_out + ((b * T + t) * nh + h) * HD, 1);
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
/* silu_rows_bf16 on 16 lanes: silu_mul_512 (silu_mul1's operations one for one), then
 * to_bf16's integer rounding (NaN -> 0x7FC0): the same bits. */
static LMTAIL_TARGET_AVX512VL void silu_rows_bf16_512(const float *gu, uint16_t *out, int64_t M, int64_t F, int64_t ld) {
    const __m512i bias = _mm512_set1_epi32(0x7FFF), lsb = _mm512_set1_epi32(1);
    const __m512i qnan = _mm512_set1_epi32(0x7FC0);
    for (int64_t m = 0; m < M; ++m) {
        const float *g = gu + m * ld, *u = g + F;
        uint16_t *o = out + m * F;
        for (int64_t c = 0; c < F; c += 16) {
            const __mmask16 k = F - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (F - c)) - 1u);
            const __m512 y = silu_mul_512(_mm512_maskz_loadu_ps(k, g + c), _mm512_maskz_loadu_ps(k, u + c));
            const __m512i yi = _mm512_castps_si512(y);
            __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(yi, bias),
                                                           _mm512_and_si512(_mm512_srli_epi32(yi, 16), lsb)), 16);
            r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), r, qnan);
            _mm256_mask_storeu_epi16(o + c, k, _mm512_cvtepi32_epi16(r));
        }
    }
}
#endif

/* cap: 0 lets the AVX-512 rows run where the CPU has them, else portable. */
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
