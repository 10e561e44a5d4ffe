/* lmtail: the bf16 GEMM in the declared "dp32" order (CPU kernels, all bit-equal).
 *
 * Shape legend: M rows of activations, H hidden (the summed axis), V columns,
 * NB = ceil(H/32) blocks of 32 K-lanes, Kp = 32*NB (H zero-padded), Vp = V rounded up to 32,
 * SW the width of one column strip (16: AVX2 and VDPBF16PS; 32: AVX-512 and plain C).
 *   a    [M, H]      bf16 bits, rows lda apart          activations
 *   w    [H, V]      bf16 bits, rows ldw apart          weight (plain layout), or
 *   wp   [Kp/2, Vp, 2] bf16 bits                        the amx32 packed layout (VNNI pairs,
 *        wp[(k/2)*2*Vp + 2*v + k%2] = w[k, v], 0 past H or V, subnormals stored as signed 0)
 *   out  [M, ldc]    fp32                               out[m*ldc + v] for v < V
 *
 * Numerics (the declaration; docs/gemm.md): for every (m, v) on its own
 *   acc = +0
 *   for block b = 0, 1, ..., NB-1 (lanes k = 32b + i; k >= H is a +0*+0 lane):
 *       t = +0
 *       for j = 0, 1, ..., 15:  t = fma(a[m,32b+2j+1], w[32b+2j+1,v], t)   (odd lane first)
 *                               t = fma(a[m,32b+2j],   w[32b+2j,v],   t)   (then even)
 *       acc = acc + t
 *   out = acc, a NaN stored as 0x7FC00000.
 * Every fma and add rounds once to nearest-even in fp32, then flushes a tiny result to the
 * zero of its sign (FTZ, tininess after rounding, as x86); every input (a, w, t, acc) is
 * read with DAZ (t and acc are FTZ results, never subnormal). This is what VDPBF16PS
 * computes per fp32 lane, one instruction per lane pair j (../shared/probes/dpbf16_order_probe.c).
 * Paths: "avx512bf16" (VDPBF16PS into a zeroed t, acc = acc + t under MXCSR FTZ|DAZ),
 * "avx512" and "avx2" (vector fmas under MXCSR FTZ|DAZ), "c" (plain C: the fma emulated
 * exactly in double, FTZ/DAZ in software). Work units are column tiles of NT columns, each
 * owned by one thread for all M rows; per chunk of KC lanes and per strip of SW columns the
 * weights are widened once into a panel (zero past H and V), then rows go through it in
 * register tiles. acc is parked in a per-thread [M, NT] buffer between blocks (an exact
 * fp32 store and load) and copied to out, NaN canonical, at the end of the tile. AVX2 with
 * fewer than MR rows reads the weight straight into registers, several strips at once
 * (direct_avx2), where the lanes are below H and the strips inside V.
 */
#include "lmtail_kernels.h"

enum { ISA_C = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_BF16 = 3 };
enum { MR = 4, NT = 256, KC = 256, MAXT = LMTAIL_MAXT };
/* direct_avx2's column tiles (fewer than MR rows): rows of w read in runs of 2 KiB per chunk.
 * [1, 2880] x [2880, 25136] on 2 Zen 3 threads (bench_tail --stages): 11.9 ms through the
 * panel, 9.2 ms direct at 256 columns, 8.9 ms at 1024 (amx32's stream path: 7.0 ms). */
enum { NT_DIRECT = 1024 };
/* Threads per call: each thread gets at least MIN_WEIGHT weight elements (256 KiB) */
enum { MIN_WEIGHT = 1 << 17 };


typedef struct {
    const uint16_t *w;  /* plain [H, ldw] or packed [Kp/2, 2*Vp] */
    int packed;
    int64_t ldw, Vp;
    const float *aw;    /* [M, Kp] fp32, DAZ applied, zero past H (emulations) */
    const uint16_t *ab; /* [M, Kp] bf16, DAZ applied, zero past H (VDPBF16PS) */
    float *out;
    int64_t M, H, Kp, V, ldc, sw, ntiles, nt; /* nt: columns per tile (NT or NT_DIRECT) */
    int isa;
    int64_t next, done; /* next tile to take, tiles finished (atomic) */
} job_t;

/* w[k, v] in either layout, DAZ applied (0 past H and V). */
static inline uint16_t w_at(const job_t *j, int64_t k, int64_t v) {
    if (k >= j->H || v >= j->V) return 0;
    if (j->packed) return j->w[(k >> 1) * 2 * j->Vp + 2 * v + (k & 1)];
    return daz16(j->w[k * j->ldw + v]);
}

/* ---------------------------------------------------------------- plain C */
/* The fp32 panel of lanes [k0, k0+kc) x strip [c0, c0+sw): p[(k-k0)*sw + c] = w[k, c0+c]
 * widened, DAZ, 0 padded. */
static void panel_f32(const job_t *j, int64_t k0, int64_t kc, int64_t c0, float *p) {
    const int64_t sw = j->sw;
    for (int64_t k = k0; k < k0 + kc; ++k) {
        float *pk = p + (k - k0) * sw;
        if (!j->packed && k < j->H && c0 + sw <= j->V) { /* a whole row of the strip */
            const uint16_t *src = j->w + k * j->ldw + c0;
            for (int64_t c = 0; c < sw; ++c) pk[c] = bf16_daz(src[c]);
            continue;
        }
        for (int64_t c = 0; c < sw; ++c) pk[c] = bf16_to_f32(w_at(j, k, c0 + c));
    }
}

/* One row x sw columns over kc lanes in plain C: acc parked in c[0..sw) (first: from +0). */
static void strip_c(const job_t *j, const float *a, const float *p, int64_t kc, float *c, int first) {
    float t[32];
    const int64_t sw = j->sw;
    for (int64_t b = 0; b < kc; b += 32) {
        for (int64_t v = 0; v < sw; ++v) t[v] = 0.0f;
        for (int64_t i = 0; i < 32; i += 2) {
            const float ao = a[b + i + 1], ae = a[b + i];
            const float *po = p + (b + i + 1) * sw, *pe = p + (b + i) * sw;
            for (int64_t v = 0; v < sw; ++v) {
                t[v] = fma_ftz(ao, po[v], t[v]);
                t[v] = fma_ftz(ae, pe[v], t[v]);
            }
        }
        for (int64_t v = 0; v < sw; ++v) c[v] = add_ftz(first && b == 0 ? 0.0f : c[v], t[v]);
    }
}

/* ---------------------------------------------------------------- AVX2 / AVX-512 */
#if defined(__x86_64__)
#define AVX2 LMTAIL_TARGET_AVX2_FMA
#define AVX512 LMTAIL_TARGET_AVX512
#define BF16 LMTAIL_TARGET_AVX512_BF16

/* panel_f32 with vector loads (the vector paths: MXCSR DAZ reads a subnormal as zero, so
 * the panel may keep it): rows < H of a whole strip, 16 columns per load; the rest (pad
 * rows, a strip past V on a plain weight) element by element. */
static AVX2 void panel_vec(const job_t *j, int64_t k0, int64_t kc, int64_t c0, float *p0) {
    const int64_t sw = j->sw;
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t k = k0; k < k0 + kc; ++k) {
        if (j->packed) { /* the pair (k, k+1): one dword per column; zero past H and V */
            if (k & 1) continue; /* written with its even row */
            const uint16_t *src = j->w + (k >> 1) * 2 * j->Vp + 2 * c0;
            for (int64_t c = 0; c < sw; c += 8) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(src + 2 * c));
                _mm256_store_ps(p0 + (k - k0) * sw + c, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
                _mm256_store_ps(p0 + (k + 1 - k0) * sw + c, _mm256_castsi256_ps(_mm256_and_si256(x, hi)));
            }
            continue;
        }
        if (k >= j->H || c0 + sw > j->V) {
            for (int64_t c = 0; c < sw; ++c) p0[(k - k0) * sw + c] = bf16_to_f32(w_at(j, k, c0 + c));
            continue;
        }
        const uint16_t *src = j->w + k * j->ldw + c0;
        for (int64_t c = 0; c < sw; c += 8) {
            const __m128i x = _mm_loadu_si128((const __m128i *)(src + c));
            _mm256_store_ps(p0 + (k - k0) * sw + c,
                            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16)));
        }
    }
}

/* ROWS rows x 16 columns (2 ymm) over all blocks; MXCSR has FTZ|DAZ; acc parked in c. */
static inline __attribute__((always_inline)) AVX2 void
tile_avx2(const int ROWS, const float *a, int64_t lda, const float *p, int64_t kc, float *c,
          int64_t ldc, int first) {
    for (int64_t b = 0; b < kc; b += 32) {
        __m256 t[MR][2];
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) t[r][0] = t[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 2
        for (int64_t i = b; i < b + 32; i += 2) {
            const __m256 wo0 = _mm256_load_ps(p + (i + 1) * 16), wo1 = _mm256_load_ps(p + (i + 1) * 16 + 8);
            const __m256 we0 = _mm256_load_ps(p + i * 16), we1 = _mm256_load_ps(p + i * 16 + 8);
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; ++r) {
                const __m256 ao = _mm256_broadcast_ss(a + r * lda + i + 1);
                const __m256 ae = _mm256_broadcast_ss(a + r * lda + i);
                t[r][0] = _mm256_fmadd_ps(ae, we0, _mm256_fmadd_ps(ao, wo0, t[r][0]));
                t[r][1] = _mm256_fmadd_ps(ae, we1, _mm256_fmadd_ps(ao, wo1, t[r][1]));
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r)
            for (int q = 0; q < 2; ++q) {
                float *cq = c + r * ldc + 8 * q;
                const __m256 acc = first && b == 0 ? _mm256_setzero_ps() : _mm256_load_ps(cq);
                _mm256_store_ps(cq, _mm256_add_ps(acc, t[r][q]));
            }
    }
}

/* Fewer than MR rows (decode): a tile of ROWS rows has only 2*ROWS t chains, each 32 fmas
 * deep per block, so the fma latency, not its throughput, would bound it. direct_avx2 runs
 * ROWS rows x S strips of 16 columns at once (2*ROWS*S chains) straight from the weight (no
 * panel: each bf16 widened in a register; MXCSR DAZ reads a subnormal as zero), lanes
 * [k0, k0+kc) all < H, columns [c0, c0+16S) all < V. The same steps per element as
 * tile_avx2: t from +0 per block, odd lane then even, acc = acc + t parked in c. */
static inline __attribute__((always_inline)) AVX2 __m256 wide8(const uint16_t *x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)x)), 16));
}

static inline __attribute__((always_inline)) AVX2 void
direct_avx2(const int ROWS, const int S, const job_t *j, const float *a, int64_t lda, int64_t k0, int64_t kc,
            int64_t c0, float *c, int64_t ldc, int first) {
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t b = k0; b < k0 + kc; b += 32) {
        __m256 t[3][4][2];
#pragma GCC unroll 12
        for (int r = 0; r < ROWS; ++r)
            for (int s = 0; s < S; ++s) t[r][s][0] = t[r][s][1] = _mm256_setzero_ps();
        for (int64_t i = b; i < b + 32; i += 2) {
            __m256 wo[4][2], we[4][2];
#pragma GCC unroll 4
            for (int s = 0; s < S; ++s)
                for (int q = 0; q < 2; ++q) {
                    const int64_t col = c0 + 16 * s + 8 * q;
                    if (j->packed) {
                        const uint16_t *px = j->w + (i >> 1) * 2 * j->Vp + 2 * col;
                        if (q == 0) _mm_prefetch((const char *)(px + 16 * 2 * j->Vp), _MM_HINT_T0); /* next block */
                        const __m256i x = _mm256_loadu_si256((const __m256i *)px);
                        we[s][q] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
                        wo[s][q] = _mm256_castsi256_ps(_mm256_and_si256(x, hi));
                    } else {
                        if (q == 0) { /* the next block's rows, these columns (32 bytes) */
                            _mm_prefetch((const char *)(j->w + (i + 32) * j->ldw + col), _MM_HINT_T0);
                            _mm_prefetch((const char *)(j->w + (i + 33) * j->ldw + col), _MM_HINT_T0);
                        }
                        we[s][q] = wide8(j->w + i * j->ldw + col);
                        wo[s][q] = wide8(j->w + (i + 1) * j->ldw + col);
                    }
                }
#pragma GCC unroll 3
            for (int r = 0; r < ROWS; ++r) {
                const __m256 ao = _mm256_broadcast_ss(a + r * lda + i + 1 - k0);
                const __m256 ae = _mm256_broadcast_ss(a + r * lda + i - k0);
#pragma GCC unroll 4
                for (int s = 0; s < S; ++s)
                    for (int q = 0; q < 2; ++q)
                        t[r][s][q] = _mm256_fmadd_ps(ae, we[s][q], _mm256_fmadd_ps(ao, wo[s][q], t[r][s][q]));
            }
        }
#pragma GCC unroll 12
        for (int r = 0; r < ROWS; ++r)
            for (int s = 0; s < S; ++s)
                for (int q = 0; q < 2; ++q) {
                    float *cq = c + r * ldc + 16 * s + 8 * q;
                    const __m256 acc = first && b == k0 ? _mm256_setzero_ps() : _mm256_load_ps(cq);
                    _mm256_store_ps(cq, _mm256_add_ps(acc, t[r][s][q]));
                }
    }
}

/* rows x strips: 1 x 4, 2 x 2, 3 x 2 (8 to 12 chains) */
enum { DIRECT_S1 = 4, DIRECT_S2 = 2, DIRECT_S3 = 2 };
#define DIRECT2_N(R, S)                                                                                \
    static AVX2 __attribute__((noinline)) void direct2_##R(const job_t *j, const float *a, int64_t lda, \
                                                           int64_t k0, int64_t kc, int64_t c0, float *c, \
                                                           int64_t ldc, int first) {                    \
        direct_avx2(R, S, j, a, lda, k0, kc, c0, c, ldc, first);                                        \
    }
DIRECT2_N(1, DIRECT_S1) DIRECT2_N(2, DIRECT_S2) DIRECT2_N(3, DIRECT_S3)
typedef void (*direct_fn)(const job_t *, const float *, int64_t, int64_t, int64_t, int64_t, float *, int64_t, int);
static const direct_fn DIRECT2[MR] = {0, direct2_1, direct2_2, direct2_3};
static const int DIRECT_S[MR] = {0, DIRECT_S1, DIRECT_S2, DIRECT_S3};

#define TILE2_N(R)                                                                          \
    static AVX2 __attribute__((noinline)) void tile2_##R(const float *a, int64_t lda,       \
                                                         const float *p, int64_t kc,       \
                                                         float *c, int64_t ldc, int first) { \
        tile_avx2(R, a, lda, p, kc, c, ldc, first);                                         \
    }
TILE2_N(1) TILE2_N(2) TILE2_N(3) TILE2_N(4)
typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int);
static const tile_fn TILE2[MR + 1] = {0, tile2_1, tile2_2, tile2_3, tile2_4};

/* ROWS rows x 32 columns (2 zmm) over all blocks; MXCSR has FTZ|DAZ; acc parked in c. */
static inline __attribute__((always_inline)) AVX512 void
tile_512(const int ROWS, const float *a, int64_t lda, const float *p, int64_t kc, float *c,
         int64_t ldc, int first) {
    for (int64_t b = 0; b < kc; b += 32) {
        __m512 t[MR][2];
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) t[r][0] = t[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 2
        for (int64_t i = b; i < b + 32; i += 2) {
            const __m512 wo0 = _mm512_load_ps(p + (i + 1) * 32), wo1 = _mm512_load_ps(p + (i + 1) * 32 + 16);
            const __m512 we0 = _mm512_load_ps(p + i * 32), we1 = _mm512_load_ps(p + i * 32 + 16);
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; ++r) {
                const __m512 ao = _mm512_set1_ps(a[r * lda + i + 1]);
                const __m512 ae = _mm512_set1_ps(a[r * lda + i]);
                t[r][0] = _mm512_fmadd_ps(ae, we0, _mm512_fmadd_ps(ao, wo0, t[r][0]));
                t[r][1] = _mm512_fmadd_ps(ae, we1, _mm512_fmadd_ps(ao, wo1, t[r][1]));
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r)
            for (int q = 0; q < 2; ++q) {
                float *cq = c + r * ldc + 16 * q;
                const __m512 acc = first && b == 0 ? _mm512_setzero_ps() : _mm512_load_ps(cq);
                _mm512_store_ps(cq, _mm512_add_ps(acc, t[r][q]));
            }
    }
}

#define TILE512_N(R)                                                                        \
    static AVX512 __attribute__((noinline)) void tile512_##R(const float *a, int64_t lda,   \
                                                             const float *p, int64_t kc,   \
                                                             float *c, int64_t ldc, int first) { \
        tile_512(R, a, lda, p, kc, c, ldc, first);                                          \
    }
TILE512_N(1) TILE512_N(2) TILE512_N(3) TILE512_N(4)
static const tile_fn TILE512[MR + 1] = {0, tile512_1, tile512_2, tile512_3, tile512_4};

/* The pair panel of strip [c0, c0+16) for VDPBF16PS: pp[(k/2)*32 + 2c + k%2] = w[k, c0+c]
 * (DAZ, 0 padded): one 64-byte row of 16 (even, odd) dwords per lane pair. */
static void panel_pairs(const job_t *j, int64_t k0, int64_t kc, int64_t c0, uint16_t *pp) {
    if (j->packed) { /* already pairs, DAZ applied, zero past H and V: 64 bytes per pair */
        for (int64_t q = 0; q < kc / 2; ++q) memcpy(pp + q * 32, j->w + (k0 / 2 + q) * 2 * j->Vp + 2 * c0, 64);
        return;
    }
    for (int64_t k = 0; k < kc; ++k)
        for (int64_t c = 0; c < 16; ++c) pp[(k >> 1) * 32 + 2 * c + (k & 1)] = w_at(j, k0 + k, c0 + c);
}

/* ROWS rows x 16 columns: per block t = 0, 16 VDPBF16PS (pair j: odd then even, DAZ, FTZ),
 * then acc = acc + t (vaddps under MXCSR FTZ|DAZ); acc parked in c (ldc-strided buffer). */
static BF16 void tile_bf16(int rows, const uint16_t *a, int64_t lda, const uint16_t *pp,
                           int64_t kc, float *c, int64_t ldc, int first) {
    for (int64_t b = 0; b < kc; b += 32) {
        __m512 t[MR];
        for (int r = 0; r < rows; ++r) t[r] = _mm512_setzero_ps();
        for (int64_t i = b; i < b + 32; i += 2) {
            const __m512i wv = _mm512_load_si512((const void *)(pp + (i >> 1) * 32));
            /* a's lanes i, i+1 as one dword: the low half (even lane) is VDPBF16PS's 2nd term */
            for (int r = 0; r < rows; ++r) {
                uint32_t pair;
                memcpy(&pair, a + r * lda + i, 4); /* (a[i], a[i+1]) as one dword */
                const __m512i av = _mm512_set1_epi32((int)pair);
                t[r] = _mm512_dpbf16_ps(t[r], (__m512bh)av, (__m512bh)wv);
            }
        }
        for (int r = 0; r < rows; ++r) {
            float *cr = c + r * ldc;
            const __m512 acc = first && b == 0 ? _mm512_setzero_ps() : _mm512_load_ps(cr);
            _mm512_store_ps(cr, _mm512_add_ps(acc, t[r]));
        }
    }
}
#endif

/* ---------------------------------------------------------------- one tile */
/* Tile t: all M rows x columns [c0, c0+nc), nc <= nt. panel: KC*sw fp32 (or the bf16 pair
 * panel); acc [M, nt] fp32: the tile's acc, copied to out (NaN canonical) at the end. */
static void tile(const job_t *j, int64_t t, void *panel, float *acc) {
    const int64_t sw = j->sw, nt = j->nt, c0 = t * nt, nc = j->V - c0 < nt ? j->V - c0 : nt;
    for (int64_t k0 = 0; k0 < j->Kp; k0 += KC) {
        const int64_t kc = j->Kp - k0 < KC ? j->Kp - k0 : KC;
        const int first = k0 == 0;
        int64_t s = 0;
#if defined(__x86_64__)
        if (j->isa == ISA_AVX2 && j->M < MR && k0 + kc <= j->H) { /* decode rows: direct_avx2 */
            const int64_t w16 = 16 * DIRECT_S[j->M];
            for (; s + w16 <= nc; s += w16)
                DIRECT2[j->M](j, j->aw + k0, j->Kp, k0, kc, c0 + s, acc + s, nt, first);
        }
#endif
        for (; s < nc; s += sw) {
#if defined(__x86_64__)
            if (j->isa == ISA_BF16) panel_pairs(j, k0, kc, c0 + s, (uint16_t *)panel);
            else if (j->isa != ISA_C) panel_vec(j, k0, kc, c0 + s, (float *)panel);
            else
#endif
                panel_f32(j, k0, kc, c0 + s, (float *)panel);
            for (int64_t m = 0; m < j->M; m += MR) {
                const int rows = j->M - m < MR ? (int)(j->M - m) : MR;
                float *c = acc + m * nt + s;
#if defined(__x86_64__)
                if (j->isa == ISA_BF16)
                    tile_bf16(rows, j->ab + m * j->Kp + k0, j->Kp, (const uint16_t *)panel, kc, c, nt, first);
                else if (j->isa == ISA_AVX512)
                    TILE512[rows](j->aw + m * j->Kp + k0, j->Kp, (const float *)panel, kc, c, nt, first);
                else if (j->isa == ISA_AVX2)
                    TILE2[rows](j->aw + m * j->Kp + k0, j->Kp, (const float *)panel, kc, c, nt, first);
                else
#endif
                    for (int r = 0; r < rows; ++r)
                        strip_c(j, j->aw + (m + r) * j->Kp + k0, (const float *)panel, kc, c + nt * r, first);
            }
        }
    }
    for (int64_t m = 0; m < j->M; ++m)
        for (int64_t c = 0; c < nc; ++c) j->out[m * j->ldc + c0 + c] = canon_nan(acc[m * nt + c]);
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    /* round to nearest, exceptions masked; FTZ|DAZ for the vector paths (the plain C path
     * does both in software and needs IEEE subnormals from the hardware) */
    const unsigned csr = lmtail_mxcsr_pin(j->isa == ISA_C ? LMTAIL_MXCSR_IEEE : LMTAIL_MXCSR_FTZ_DAZ);
    void *panel = NULL;
    float *acc = NULL;
    int ok = !posix_memalign(&panel, 64, sizeof(float) * KC * 32) &&
             !posix_memalign((void **)&acc, 64, sizeof(float) * j->M * j->nt);
    while (ok) { /* a worker without buffers takes no tile; the others take them all */
        const int64_t t = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (t >= j->ntiles) break;
        tile(j, t, panel, acc);
        __atomic_fetch_add(&j->done, 1, __ATOMIC_RELAXED);
    }
    lmtail_mxcsr_restore(csr);
    free(panel);
    free(acc);
    return NULL;
}

/* ---------------------------------------------------------------- exported */
/* 1 if this CPU runs `isa`. */
int lmtail_dp32_has(int isa) {
    if (isa == ISA_C) return 1;
    if (isa == ISA_AVX2) return lmtail_cpu_has(LMTAIL_ISA_AVX2);
    if (isa == ISA_AVX512) return lmtail_cpu_has(LMTAIL_ISA_AVX512);
    if (isa == ISA_BF16) return lmtail_cpu_has(LMTAIL_ISA_AVX512 | LMTAIL_CPU_AVX512_BF16);
    return 0;
}

/* out = a @ w in the dp32 order on up to nthreads threads with `isa` (one lmtail_dp32_has
 * accepts). Returns 0 on success, -1 on an unavailable isa, -2 when a buffer cannot be
 * allocated. */
int lmtail_dp32_gemm(const uint16_t *a, int64_t lda, const uint16_t *w, int64_t ldw, int packed,
                     float *out, int64_t M, int64_t H, int64_t V, int64_t ldc, int nthreads,
                     int isa) {
    if (!lmtail_dp32_has(isa)) return -1;
    const int64_t Kp = (H + 31) / 32 * 32;
    job_t j;
    memset(&j, 0, sizeof j);
    j.w = w; j.packed = packed; j.ldw = ldw; j.Vp = (V + 31) / 32 * 32;
    j.out = out; j.M = M; j.H = H; j.Kp = Kp; j.V = V; j.ldc = ldc; j.isa = isa;
    j.sw = isa == ISA_AVX2 || isa == ISA_BF16 ? 16 : 32;
    j.nt = isa == ISA_AVX2 && M < MR ? NT_DIRECT : NT;
    j.ntiles = (V + j.nt - 1) / j.nt;
    float *aw = NULL;
    uint16_t *ab = NULL;
    if (isa == ISA_BF16) {
        if (posix_memalign((void **)&ab, 64, sizeof(uint16_t) * (M * Kp + 2))) return -2;
        for (int64_t m = 0; m < M; ++m)
            for (int64_t k = 0; k < Kp; ++k) ab[m * Kp + k] = k < H ? daz16(a[m * lda + k]) : 0;
        j.ab = ab;
    } else {
        if (posix_memalign((void **)&aw, 64, sizeof(float) * (M * Kp + 1))) return -2;
        for (int64_t m = 0; m < M; ++m)
            for (int64_t k = 0; k < Kp; ++k) aw[m * Kp + k] = k < H ? bf16_daz(a[m * lda + k]) : 0.0f;
        j.aw = aw;
    }
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAXT) nthreads = MAXT;
    const int64_t work = Kp * V / MIN_WEIGHT; /* each thread reads at least MIN_WEIGHT of w */
    if (nthreads > work) nthreads = work < 1 ? 1 : (int)work;
    if (nthreads > j.ntiles) nthreads = (int)j.ntiles;
    lmtail_parallel(worker, &j, nthreads);
    free(aw);
    free(ab);
    return j.done == j.ntiles ? 0 : -2;
}
