/* lmtail_emulate.h: the emulated build of every vector path (included by lmtail_kernels.h
 * when a kernel is compiled with -DLMTAIL_EMULATE; _cc.py's emulated variant adds
 * -mavx2 -mfma -mf16c and SIMDe's include dir).
 *
 * What it is for: running the AVX-512, AVX512-BF16 and AMX paths, slowly, on any x86-64 CPU
 * with AVX2 + FMA + F16C, so their indexing, tails and declared order are tested bit for bit
 * against the plain-C path on machines (CI) that lack the ISA. The target attributes of the
 * paths are empty in this build (LMTAIL_TARGET) and lmtail_cpu_features() reports every bit.
 *
 *   SIMDe     every _mm512_* / AVX-512VL / F16C intrinsic, with native aliases. Under -mavx2
 *             -mfma its 512-bit ops are two native 256-bit ops (vfmadd, vaddps, vcvtph2ps,
 *             ...), so they round as the hardware does and honour the MXCSR the kernels pin
 *             (FTZ/DAZ or IEEE). Its fallbacks that would not (an fma spelled a*b + c when
 *             FMA is not native) are ruled out below at compile time. Replaced here: the
 *             intrinsics SIMDe 0.8.2 lacks, its masked loads / stores (they touch the
 *             masked-off lanes: a read past a buffer, zeros written over a neighbour's data),
 *             and its _mm512_roundscale_pd (it ignores the rounding mode with NO_EXC).
 *   VDPBF16PS _mm512_dpbf16_ps (and the 256 / 128 forms): SIMDe sums both products before
 *             adding; the instruction computes per fp32 lane t = fma(a[2i+1], b[2i+1], src),
 *             then t = fma(a[2i], b[2i], t): odd pair first, DAZ on every input (the
 *             accumulator too), FTZ after each fma (../shared/probes/dpbf16_order_probe.c:
 *             2,000,000 of 2,000,000 lanes on Zen 4). Modelled exactly with fma_ftz.
 *   AMX       a software model of the tile instructions gemm_amx32.c uses: _tile_loadconfig
 *             (palette 1, start_row 0, reserved bytes 0, tiles 0-7: rows <= 16, colsb <= 64
 *             and a multiple of 4, both 0 or both set; tiles 8-15 unused; anything else
 *             aborts naming the field, where the hardware raises #GP), _tile_loadd,
 *             _tile_stored, _tile_zero, _tile_release, and _tile_dpbf16ps with the
 *             instruction's shape checks (#UD on hardware: abort here), computing per C
 *             element per K block of colsb(A)/4 pairs: even and odd fp32 fma chains from +0
 *             over the pairs, then c = c + (e + o) (the "amx32" order, measured by
 *             ../shared/probes/amx_order_probe.c), DAZ on every input, FTZ after every op.
 *             The tile state is per thread, as the hardware's is.
 * No libm anywhere: the models call lmtail_kernels.h's fma_ftz / add_ftz.
 */
#ifndef LMTAIL_EMULATE_H
#define LMTAIL_EMULATE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* vectors cross only static functions inside one library: the 512-bit ABI note is moot */
#pragma GCC diagnostic ignored "-Wpsabi"
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>

#if !defined(SIMDE_X86_AVX2_NATIVE) || !defined(SIMDE_X86_FMA_NATIVE) || !defined(SIMDE_X86_F16C_NATIVE)
#error "the emulated build needs -mavx2 -mfma -mf16c (without native FMA SIMDe spells an fma as a*b + c)"
#endif
#if defined(SIMDE_X86_AVX512F_NATIVE)
#error "the emulated build must not be compiled with -mavx512f (it would not emulate anything)"
#endif

/* ---------------------------------------------------------------- what SIMDe 0.8 lacks */
/* The AVX-512 intrinsics the kernels use that SIMDe 0.8.2 does not define (GCC's own would
 * need AVX-512): each on native 256-bit halves or lane by lane, with the instruction's
 * semantics (conversions round by MXCSR as the instruction does; integer narrowing truncates). */
static inline simde__m512i lmtail_emu_cvtepi8_epi32(simde__m128i a) {
    simde__m512i_private r;
    r.m256i[0] = _mm256_cvtepi8_epi32(a);
    r.m256i[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8));
    return simde__m512i_from_private(r);
}
static inline simde__m512i lmtail_emu_cvtepu8_epi32(simde__m128i a) {
    simde__m512i_private r;
    r.m256i[0] = _mm256_cvtepu8_epi32(a);
    r.m256i[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8));
    return simde__m512i_from_private(r);
}
static inline simde__m512i lmtail_emu_cvtepi32_epi64(simde__m256i a) {
    simde__m512i_private r;
    r.m256i[0] = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(a));
    r.m256i[1] = _mm256_cvtepi32_epi64(_mm256_extracti128_si256(a, 1));
    return simde__m512i_from_private(r);
}
static inline simde__m256i lmtail_emu_cvtepi32_epi16(simde__m512i a) { /* VPMOVDW: truncate */
    const simde__m512i_private x = simde__m512i_to_private(a);
    int16_t r[16];
    for (int i = 0; i < 16; ++i) r[i] = (int16_t)x.i32[i];
    simde__m256i v;
    memcpy(&v, r, sizeof r);
    return v;
}
static inline simde__m256i lmtail_emu_cvtpd_epi32(simde__m512d a) { /* by MXCSR, as VCVTPD2DQ */
    const simde__m512d_private x = simde__m512d_to_private(a);
    return _mm256_set_m128i(_mm256_cvtpd_epi32(x.m256d[1]), _mm256_cvtpd_epi32(x.m256d[0]));
}
static inline simde__mmask16 lmtail_emu_cmplt_epi32_mask(simde__m512i a, simde__m512i b) {
    return simde_mm512_cmpgt_epi32_mask(b, a);
}
static inline simde__m512 lmtail_emu_mask_i32gather_ps(simde__m512 src, simde__mmask16 k, simde__m512i idx,
                                                       const void *base, int scale) {
    simde__m512_private r = simde__m512_to_private(src);
    const simde__m512i_private x = simde__m512i_to_private(idx);
    for (int i = 0; i < 16; ++i)
        if (k >> i & 1) memcpy(&r.f32[i], (const char *)base + (int64_t)x.i32[i] * scale, 4);
    return simde__m512_from_private(r);
}
static inline simde__m512d lmtail_emu_i32gather_pd(simde__m256i idx, const void *base, int scale) {
    simde__m512d_private r;
    int32_t x[8];
    memcpy(x, &idx, sizeof x);
    for (int i = 0; i < 8; ++i) memcpy(&r.f64[i], (const char *)base + (int64_t)x[i] * scale, 8);
    return simde__m512d_from_private(r);
}
static inline simde__m512d lmtail_emu_cvtps_pd(simde__m256 a) { /* exact (DAZ by MXCSR) */
    simde__m512d_private r;
    r.m256d[0] = _mm256_cvtps_pd(_mm256_castps256_ps128(a));
    r.m256d[1] = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
    return simde__m512d_from_private(r);
}
static inline simde__m512d lmtail_emu_mask_cvtps_pd(simde__m512d src, simde__mmask8 k, simde__m256 a) {
    return simde_mm512_mask_mov_pd(src, k, lmtail_emu_cvtps_pd(a));
}
/* VRNDSCALEPD with scale M = 0 (imm8[7:4] = 0, the only one the kernels use): imm8[3:0] are
 * ROUNDPD's (rounding mode, MXCSR.RC, suppress), so two native VROUNDPDs. SIMDe 0.8.2's own
 * ignores the rounding mode when _MM_FROUND_NO_EXC is set (-537.5 "rounded" to -inf stays
 * -537.5). The switch makes each immediate a constant. */
#define LMTAIL_EMU_ROUND_CASE(I) \
    case I: r.m256d[0] = _mm256_round_pd(x.m256d[0], I); r.m256d[1] = _mm256_round_pd(x.m256d[1], I); break;
static inline simde__m512d lmtail_emu_roundscale_pd(simde__m512d a, int imm) {
    const simde__m512d_private x = simde__m512d_to_private(a);
    simde__m512d_private r;
    switch (imm) {
        LMTAIL_EMU_ROUND_CASE(0) LMTAIL_EMU_ROUND_CASE(1) LMTAIL_EMU_ROUND_CASE(2) LMTAIL_EMU_ROUND_CASE(3)
        LMTAIL_EMU_ROUND_CASE(4) LMTAIL_EMU_ROUND_CASE(8) LMTAIL_EMU_ROUND_CASE(9) LMTAIL_EMU_ROUND_CASE(10)
        LMTAIL_EMU_ROUND_CASE(11) LMTAIL_EMU_ROUND_CASE(12)
    default:
        fprintf(stderr, "lmtail emulated _mm512_roundscale_pd: imm8 = %d is not modelled (scale 0 only)\n", imm);
        abort();
    }
    return simde__m512d_from_private(r);
}
#undef _mm512_roundscale_pd
#define _mm512_roundscale_pd(a, imm) lmtail_emu_roundscale_pd((a), (imm))
#undef _mm512_cvtps_pd
#undef _mm512_mask_cvtps_pd
#undef _mm512_mask_cmp_pd_mask
#define _mm512_cvtps_pd(a) lmtail_emu_cvtps_pd(a)
#define _mm512_mask_cvtps_pd(src, k, a) lmtail_emu_mask_cvtps_pd((src), (k), (a))
#define _mm512_mask_cmp_pd_mask(k, a, b, imm) ((simde__mmask8)((k) & simde_mm512_cmp_pd_mask((a), (b), (imm))))
#undef _mm512_cvtepi8_epi32
#undef _mm512_cvtepu8_epi32
#undef _mm512_cvtepi32_epi64
#undef _mm512_cvtepi32_epi16
#undef _mm512_cvtpd_epi32
#undef _mm512_cmplt_epi32_mask
#undef _mm512_mask_i32gather_ps
#undef _mm512_i32gather_pd
#define _mm512_cvtepi8_epi32(a) lmtail_emu_cvtepi8_epi32(a)
#define _mm512_cvtepu8_epi32(a) lmtail_emu_cvtepu8_epi32(a)
#define _mm512_cvtepi32_epi64(a) lmtail_emu_cvtepi32_epi64(a)
#define _mm512_cvtepi32_epi16(a) lmtail_emu_cvtepi32_epi16(a)
#define _mm512_cvtpd_epi32(a) lmtail_emu_cvtpd_epi32(a)
#define _mm512_cmplt_epi32_mask(a, b) lmtail_emu_cmplt_epi32_mask((a), (b))
#define _mm512_mask_i32gather_ps(src, k, idx, base, scale) \
    lmtail_emu_mask_i32gather_ps((src), (k), (idx), (base), (scale))
#define _mm512_i32gather_pd(idx, base, scale) lmtail_emu_i32gather_pd((idx), (base), (scale))

/* ---------------------------------------------------------------- masked memory */
/* SIMDe 0.8.2's masked loads read the whole vector and its masked stores write zeros to the
 * masked-off lanes; the instructions touch only the masked lanes (a tail past the end of a
 * buffer, or a neighbour's columns). These touch exactly the lanes of k. */
#define LMTAIL_EMU_MASKZ_LOAD(NAME, VT, K, N, W)                                              \
    static inline VT NAME(K k, const void *p) {                                              \
        uint8_t b[N * W] = {0};                                                              \
        for (int i = 0; i < N; ++i)                                                          \
            if (k >> i & 1) memcpy(b + W * i, (const char *)p + W * i, W);                   \
        VT r;                                                                                \
        memcpy(&r, b, sizeof r);                                                             \
        return r;                                                                            \
    }
#define LMTAIL_EMU_MASK_STORE(NAME, VT, K, N, W)                                              \
    static inline void NAME(void *p, K k, VT v) {                                            \
        uint8_t b[N * W];                                                                    \
        memcpy(b, &v, sizeof b);                                                             \
        for (int i = 0; i < N; ++i)                                                          \
            if (k >> i & 1) memcpy((char *)p + W * i, b + W * i, W);                         \
    }
LMTAIL_EMU_MASKZ_LOAD(lmtail_emu_maskz_loadu_ps, simde__m512, simde__mmask16, 16, 4)
LMTAIL_EMU_MASKZ_LOAD(lmtail_emu_maskz_loadu_pd, simde__m512d, simde__mmask8, 8, 8)
LMTAIL_EMU_MASKZ_LOAD(lmtail_emu_maskz_loadu_epi16_256, simde__m256i, simde__mmask16, 16, 2)
LMTAIL_EMU_MASKZ_LOAD(lmtail_emu_maskz_loadu_epi16, simde__m512i, simde__mmask32, 32, 2)
LMTAIL_EMU_MASK_STORE(lmtail_emu_mask_storeu_ps, simde__m512, simde__mmask16, 16, 4)
LMTAIL_EMU_MASK_STORE(lmtail_emu_mask_storeu_pd, simde__m512d, simde__mmask8, 8, 8)
LMTAIL_EMU_MASK_STORE(lmtail_emu_mask_storeu_epi16_256, simde__m256i, simde__mmask16, 16, 2)
#undef _mm512_maskz_loadu_ps
#undef _mm512_maskz_loadu_pd
#undef _mm256_maskz_loadu_epi16
#undef _mm512_maskz_loadu_epi16
#undef _mm512_mask_storeu_ps
#undef _mm512_mask_storeu_pd
#undef _mm256_mask_storeu_epi16
#define _mm512_maskz_loadu_ps(k, p) lmtail_emu_maskz_loadu_ps((k), (p))
#define _mm512_maskz_loadu_pd(k, p) lmtail_emu_maskz_loadu_pd((k), (p))
#define _mm256_maskz_loadu_epi16(k, p) lmtail_emu_maskz_loadu_epi16_256((k), (p))
#define _mm512_maskz_loadu_epi16(k, p) lmtail_emu_maskz_loadu_epi16((k), (p))
#define _mm512_mask_storeu_ps(p, k, v) lmtail_emu_mask_storeu_ps((p), (k), (v))
#define _mm512_mask_storeu_pd(p, k, v) lmtail_emu_mask_storeu_pd((p), (k), (v))
#define _mm256_mask_storeu_epi16(p, k, v) lmtail_emu_mask_storeu_epi16_256((p), (k), (v))

/* lmtail_kernels.h's exact helpers, defined after this header is included */
static inline float fma_ftz(float a, float b, float c);
static inline float add_ftz(float x, float y);

/* a bf16 pattern read with DAZ, as fp32 */
static inline float lmtail_emu_bf16(uint16_t b) {
    const uint32_t u = (b & 0x7F80u) ? (uint32_t)b << 16 : (uint32_t)(b & 0x8000u) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* an fp32 read with DAZ */
static inline float lmtail_emu_daz(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if (!(u & 0x7F800000u)) u &= 0x80000000u;
    memcpy(&x, &u, 4);
    return x;
}

/* ---------------------------------------------------------------- VDPBF16PS */
/* n fp32 lanes: dst[i] = fma(a[2i], b[2i], fma(a[2i+1], b[2i+1], src[i])), DAZ, FTZ. */
static inline void lmtail_emu_dpbf16(int n, float *dst, const float *src, const uint16_t *a,
                                     const uint16_t *b) {
    for (int i = 0; i < n; ++i) {
        const float t = fma_ftz(lmtail_emu_bf16(a[2 * i + 1]), lmtail_emu_bf16(b[2 * i + 1]),
                                lmtail_emu_daz(src[i]));
        dst[i] = fma_ftz(lmtail_emu_bf16(a[2 * i]), lmtail_emu_bf16(b[2 * i]), t);
    }
}

#define LMTAIL_EMU_DPBF16(N, VF, VH)                                                         \
    static inline VF lmtail_emu_dpbf16_##N(VF src, VH a, VH b) {                              \
        float s[N], d[N];                                                                     \
        uint16_t x[2 * N], y[2 * N];                                                          \
        memcpy(s, &src, sizeof s);                                                            \
        memcpy(x, &a, sizeof x);                                                              \
        memcpy(y, &b, sizeof y);                                                              \
        lmtail_emu_dpbf16(N, d, s, x, y);                                                     \
        VF r;                                                                                 \
        memcpy(&r, d, sizeof d);                                                              \
        return r;                                                                             \
    }
LMTAIL_EMU_DPBF16(16, simde__m512, simde__m512bh)
LMTAIL_EMU_DPBF16(8, simde__m256, simde__m256bh)
LMTAIL_EMU_DPBF16(4, simde__m128, simde__m128bh)
#undef _mm512_dpbf16_ps
#undef _mm256_dpbf16_ps
#undef _mm_dpbf16_ps
#define _mm512_dpbf16_ps(src, a, b) lmtail_emu_dpbf16_16((src), (a), (b))
#define _mm256_dpbf16_ps(src, a, b) lmtail_emu_dpbf16_8((src), (a), (b))
#define _mm_dpbf16_ps(src, a, b) lmtail_emu_dpbf16_4((src), (a), (b))

/* ---------------------------------------------------------------- AMX */
enum { LMTAIL_EMU_TILES = 8, LMTAIL_EMU_ROWS = 16, LMTAIL_EMU_COLSB = 64 };
typedef struct {
    int configured;
    uint16_t colsb[LMTAIL_EMU_TILES];
    uint8_t rows[LMTAIL_EMU_TILES];
    uint8_t t[LMTAIL_EMU_TILES][LMTAIL_EMU_ROWS][LMTAIL_EMU_COLSB];
} lmtail_emu_amx_t;
static __thread lmtail_emu_amx_t lmtail_emu_amx; /* per thread, as the tile registers */

/* Where the hardware raises #GP (LDTILECFG) or #UD (a tile instruction): one line on stderr
 * naming the instruction and the field, then abort(). */
static __attribute__((noreturn, cold)) void lmtail_emu_amx_fault(const char *insn, const char *field,
                                                                long got, const char *want) {
    fprintf(stderr, "lmtail emulated AMX: %s: %s = %ld, must be %s (the CPU faults here)\n", insn, field,
            got, want);
    fflush(stderr);
    abort();
}

static inline void lmtail_emu_tile_loadconfig(const void *config) {
    const uint8_t *c = (const uint8_t *)config;
    char field[32];
    if (c[0] != 1) lmtail_emu_amx_fault("ldtilecfg", "palette_id", c[0], "1");
    if (c[1] != 0) lmtail_emu_amx_fault("ldtilecfg", "start_row", c[1], "0");
    for (int i = 2; i < 16; ++i)
        if (c[i]) {
            snprintf(field, sizeof field, "reserved byte %d", i);
            lmtail_emu_amx_fault("ldtilecfg", field, c[i], "0");
        }
    for (int i = 0; i < 16; ++i) {
        const long colsb = c[16 + 2 * i] | (long)c[17 + 2 * i] << 8, rows = c[48 + i];
        if (i >= LMTAIL_EMU_TILES && (colsb || rows)) {
            snprintf(field, sizeof field, colsb ? "colsb[%d]" : "rows[%d]", i);
            lmtail_emu_amx_fault("ldtilecfg", field, colsb ? colsb : rows, "0 (palette 1 has 8 tiles)");
        }
        snprintf(field, sizeof field, "rows[%d]", i);
        if (rows > LMTAIL_EMU_ROWS) lmtail_emu_amx_fault("ldtilecfg", field, rows, "<= 16");
        snprintf(field, sizeof field, "colsb[%d]", i);
        if (colsb > LMTAIL_EMU_COLSB) lmtail_emu_amx_fault("ldtilecfg", field, colsb, "<= 64");
        if (colsb % 4) lmtail_emu_amx_fault("ldtilecfg", field, colsb, "a multiple of 4");
        if (!colsb != !rows)
            lmtail_emu_amx_fault("ldtilecfg", field, colsb, "0 exactly when rows is 0");
    }
    lmtail_emu_amx_t *s = &lmtail_emu_amx;
    memset(s, 0, sizeof *s);
    for (int i = 0; i < LMTAIL_EMU_TILES; ++i) {
        s->colsb[i] = (uint16_t)(c[16 + 2 * i] | c[17 + 2 * i] << 8);
        s->rows[i] = c[48 + i];
    }
    s->configured = 1;
}

/* The state of a configured tile `t` (faults on an unconfigured state or tile). */
static inline lmtail_emu_amx_t *lmtail_emu_tile(const char *insn, int t) {
    lmtail_emu_amx_t *s = &lmtail_emu_amx;
    if (!s->configured) lmtail_emu_amx_fault(insn, "tiles configured", 0, "1 (ldtilecfg first)");
    if (t < 0 || t >= LMTAIL_EMU_TILES) lmtail_emu_amx_fault(insn, "tile", t, "0..7");
    if (!s->rows[t]) lmtail_emu_amx_fault(insn, "rows of the tile", 0, "> 0 (a configured tile)");
    return s;
}

static inline void lmtail_emu_tile_loadd(int t, const void *base, long stride) {
    lmtail_emu_amx_t *s = lmtail_emu_tile("tileloadd", t);
    memset(s->t[t], 0, sizeof s->t[t]);
    for (int r = 0; r < s->rows[t]; ++r) memcpy(s->t[t][r], (const char *)base + r * stride, s->colsb[t]);
}

static inline void lmtail_emu_tile_stored(int t, void *base, long stride) {
    lmtail_emu_amx_t *s = lmtail_emu_tile("tilestored", t);
    for (int r = 0; r < s->rows[t]; ++r) memcpy((char *)base + r * stride, s->t[t][r], s->colsb[t]);
}

static inline void lmtail_emu_tile_zero(int t) {
    lmtail_emu_amx_t *s = lmtail_emu_tile("tilezero", t);
    memset(s->t[t], 0, sizeof s->t[t]);
}

static inline void lmtail_emu_tile_release(void) { memset(&lmtail_emu_amx, 0, sizeof lmtail_emu_amx); }

static inline uint16_t lmtail_emu_tile_u16(const uint8_t *row, int i) {
    uint16_t v;
    memcpy(&v, row + 2 * i, 2);
    return v;
}

/* TDPBF16PS dst += src1 . src2: dst [rows, N] fp32, src1 [rows, 2K] bf16, src2 [K, 2N] bf16
 * (VNNI pairs), K = colsb(src1)/4, N = colsb(dst)/4; per element the amx32 block order. */
static inline void lmtail_emu_tile_dpbf16ps(int d, int a, int b) {
    const char *insn = "tdpbf16ps";
    lmtail_emu_amx_t *s = lmtail_emu_tile(insn, d);
    lmtail_emu_tile(insn, a);
    lmtail_emu_tile(insn, b);
    if (d == a || d == b || a == b) lmtail_emu_amx_fault(insn, "distinct tile operands", 0, "1");
    if (s->colsb[d] != s->colsb[b]) lmtail_emu_amx_fault(insn, "colsb(dst)", s->colsb[d], "colsb(src2)");
    if (s->colsb[a] / 4 != s->rows[b]) lmtail_emu_amx_fault(insn, "rows(src2)", s->rows[b], "colsb(src1) / 4");
    if (s->rows[d] != s->rows[a]) lmtail_emu_amx_fault(insn, "rows(dst)", s->rows[d], "rows(src1)");
    const int K = s->rows[b], N = s->colsb[d] / 4;
    for (int m = 0; m < s->rows[d]; ++m)
        for (int n = 0; n < N; ++n) {
            float e = 0.0f, o = 0.0f, c;
            for (int k = 0; k < K; ++k) {
                const uint8_t *ar = s->t[a][m], *br = s->t[b][k];
                e = fma_ftz(lmtail_emu_bf16(lmtail_emu_tile_u16(ar, 2 * k)),
                            lmtail_emu_bf16(lmtail_emu_tile_u16(br, 2 * n)), e);
                o = fma_ftz(lmtail_emu_bf16(lmtail_emu_tile_u16(ar, 2 * k + 1)),
                            lmtail_emu_bf16(lmtail_emu_tile_u16(br, 2 * n + 1)), o);
            }
            memcpy(&c, s->t[d][m] + 4 * n, 4);
            c = add_ftz(lmtail_emu_daz(c), add_ftz(e, o));
            memcpy(s->t[d][m] + 4 * n, &c, 4);
        }
}

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) lmtail_emu_tile_loadconfig(config)
#define _tile_release() lmtail_emu_tile_release()
#define _tile_loadd(t, base, stride) lmtail_emu_tile_loadd((t), (base), (long)(stride))
#define _tile_stored(t, base, stride) lmtail_emu_tile_stored((t), (base), (long)(stride))
#define _tile_zero(t) lmtail_emu_tile_zero(t)
#define _tile_dpbf16ps(d, a, b) lmtail_emu_tile_dpbf16ps((d), (a), (b))

#endif /* LMTAIL_EMULATE_H */
