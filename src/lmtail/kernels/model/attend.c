/* lmtail model body kernels: the declared-order attention (CPU), a library of its own; exp32
 * comes from exp32.h (shared with body.c).
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
 * Each worker pins MXCSR to round-to-nearest with FTZ/DAZ off and restores it.
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

/* Positions per work unit: UP2 on the AVX2 kernels (one multi-position call), UP512 on the
 * AVX-512 ones (one call) and the portable ones; UP, the most of them, sizes the scratch. */
enum { HD = 64, JB = 64, QB = 3, UP512 = 2, UP2 = 8, UP = UP2 > UP512 ? UP2 : UP512 };

/* The micro-kernel set under the caller's cap: 2 AVX-512, 1 AVX2 + FMA, 0 portable. */
static int pick_isa(int cap) {
    if (cap <= 0 && lmtail_cpu_has(LMTAIL_CPU_AVX512F)) return 2;
    if (cap <= 1 && lmtail_cpu_has(LMTAIL_ISA_AVX2)) return 1;
    return 0;
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
enum { G2 = 3, KB2 = 32, EB = 64, NQ2 = UP2 * QB }; /* tile rows; keys per score / value block */

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
#endif

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
