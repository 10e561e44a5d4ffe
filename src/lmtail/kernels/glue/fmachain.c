/* fmachain.c: lmtail's declared fp32 fma chains in C, bit-equal to the torch emulation.
 *
 * 1. lmtail_fma_sum: orders.fma_sum on fp32 rows [R, N] (b may broadcast: ldb = 0).
 *    Per row, T lanes (T a multiple of 32), vec elements a lane a pass, P = ceil(N / (T*vec))
 *    passes; lane t holds elements (p*T + t)*vec + j (p < P, j < vec), zero past N:
 *        acc_t = +0.0; for p, for j: acc_t = fmaf(a_i, b_i, acc_t)        (one rounding)
 *    a padded element (i >= N) is fmaf(0, 0, acc_t) = acc_t + (+0.0): exactly what the torch
 *    path does (it pads with zeros), and it does turn a -0.0 acc into +0.0, so it is done.
 *    Then per 32-lane group the xor butterfly as a fold (offsets 16, 8, 4, 2, 1: x[i] +=
 *    x[i + half]; placebo 1, 2, ..., 16: x[k] = x[2k] + x[2k+1]) and the T/32 group totals
 *    added in group order: orders.lane_totals, op for op.
 * 2. lmtail_moe_routed: norms' routed MoE chain, out[t, h] = fmaf(w[t, s], slot_s[t, h], .)
 *    over s = 0..R-1 from +0.0; slots fp32 or bf16 (widened exactly: bits << 16).
 *
 * fmaf is the correctly rounded fp32 fma (IEEE fusedMultiplyAdd): exactly what
 * numerics.fma32 emulates in float64; _mm512_fmadd_ps is the same operation on 16 lanes.
 * Compiled with -ffp-contract=off and no fast-math: nothing else is fused, reassociated or
 * flushed. Each worker (the caller's thread included) sets MXCSR to round-to-nearest, FTZ
 * and DAZ off, and restores the caller's value. A row is owned by one thread from the first
 * op to the last, so neither R nor the thread count can reach the bits. NaN sign and
 * payload are not declared (IEEE picks among input NaNs by operand position).
 */
#include <math.h>
#include "lmtail_kernels.h"

enum { ISA_GENERIC = 0, ISA_AVX512 = 2 };
enum { JOB_SUM = 0, JOB_MOE = 1 };

typedef struct {
    int kind, isa;
    /* JOB_SUM */
    const float *a, *b;
    int64_t N, lda, ldb;
    int lanes, vec, reverse;
    /* JOB_MOE */
    const void *slots;
    const float *w;
    int bf16;
    int64_t H, ld_slot, ldw, nslots;
    /* both */
    float *out;
    int64_t R;    /* rows (JOB_SUM) or tokens T (JOB_MOE) */
    int64_t next; /* next row to take (atomic) */
} job_t;

#define bf16f bf16_to_f32

/* orders.lane_totals on acc[T] (overwritten). */
static float lane_totals(float *acc, int T, int reverse) {
    if (!reverse) return lmtail_lane_totals(acc, T);
    float total = 0.0f;
    for (int g = 0; g < T / 32; ++g) {
        float *x = acc + 32 * g;
        for (int w = 16; w >= 1; w /= 2) /* k reads 2k, 2k+1 >= k: in place is safe */
            for (int k = 0; k < w; ++k) x[k] = x[2 * k] + x[2 * k + 1];
        total = g == 0 ? x[0] : total + x[0];
    }
    return total;
}

/* ---------------------------------------------------------------- generic (any CPU) */
static void chain_generic(const float *a, const float *b, int64_t N, int T, int vec,
                          float *acc) {
    const int64_t per = (int64_t)T * vec;
    for (int t = 0; t < T; ++t) acc[t] = 0.0f;
    for (int64_t base = 0; base < N; base += per)
        for (int t = 0; t < T; ++t)
            for (int j = 0; j < vec; ++j) {
                const int64_t i = base + (int64_t)t * vec + j;
                acc[t] = i < N ? fmaf(a[i], b[i], acc[t]) : acc[t] + 0.0f;
            }
}

static void moe_row_generic(const job_t *j, int64_t t) {
    float *o = j->out + t * j->H;
    for (int64_t h = 0; h < j->H; ++h) o[h] = 0.0f;
    for (int64_t s = 0; s < j->nslots; ++s) {
        const float w = j->w[t * j->ldw + s];
        const int64_t off = s * j->ld_slot + t * j->H;
        if (j->bf16) {
            const uint16_t *x = (const uint16_t *)j->slots + off;
            for (int64_t h = 0; h < j->H; ++h) o[h] = fmaf(w, bf16f(x[h]), o[h]);
        } else {
            const float *x = (const float *)j->slots + off;
            for (int64_t h = 0; h < j->H; ++h) o[h] = fmaf(w, x[h], o[h]);
        }
    }
}

/* ---------------------------------------------------------------- AVX-512 */
#if defined(__x86_64__)
#define AVX512 LMTAIL_TARGET_AVX512F
enum { U = 4 }; /* independent 16-lane chains in flight (hides the fma latency) */

static inline __mmask16 mask16(int64_t left) {
    return left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

/* Lanes t0 .. t0 + 16*nb - 1 of the chain; masked-off loads are 0, so a padded element is
 * fmadd(0, 0, acc) = acc + 0, as in the generic path. vec > 1 gathers lane t's j-th element
 * (t*vec + j from the block start). */
static AVX512 void chain_avx512(const float *a, const float *b, int64_t N, int T, int vec,
                                float *acc) {
    const int64_t per = (int64_t)T * vec;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i vidx = _mm512_mullo_epi32(lane, _mm512_set1_epi32(vec));
    for (int t0 = 0; t0 < T; t0 += 16 * U) {
        const int nb = (T - t0) / 16 < U ? (T - t0) / 16 : U;
        __m512 s[U];
        for (int u = 0; u < U; ++u) s[u] = _mm512_setzero_ps();
        for (int64_t base = 0; base < N; base += per) {
            if (vec == 1) {
                for (int u = 0; u < nb; ++u) {
                    const int64_t i = base + t0 + 16 * u;
                    const __mmask16 m = mask16(N - i);
                    const __m512 x = _mm512_maskz_loadu_ps(m, m ? a + i : a);
                    const __m512 y = _mm512_maskz_loadu_ps(m, m ? b + i : b);
                    s[u] = _mm512_fmadd_ps(x, y, s[u]);
                }
            } else {
                for (int jj = 0; jj < vec; ++jj)
                    for (int u = 0; u < nb; ++u) {
                        const int64_t i0 = base + (int64_t)(t0 + 16 * u) * vec;
                        const int64_t left = N - i0 - jj; /* valid: t*vec < left */
                        const __mmask16 m = left <= 0 ? 0 : _mm512_cmplt_epi32_mask(
                            vidx, _mm512_set1_epi32(left > (1 << 30) ? (1 << 30) : (int)left));
                        const __m512i ix = _mm512_add_epi32(vidx, _mm512_set1_epi32(jj));
                        const __m512 x = m ? _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, ix, a + i0, 4)
                                           : _mm512_setzero_ps();
                        const __m512 y = m ? _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, ix, b + i0, 4)
                                           : _mm512_setzero_ps();
                        s[u] = _mm512_fmadd_ps(x, y, s[u]);
                    }
            }
        }
        for (int u = 0; u < nb; ++u) _mm512_storeu_ps(acc + t0 + 16 * u, s[u]);
    }
}

static AVX512 void moe_row_avx512(const job_t *j, int64_t t) {
    float *o = j->out + t * j->H;
    for (int64_t h = 0; h < j->H; h += 16) {
        const __mmask16 m = mask16(j->H - h);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t s = 0; s < j->nslots; ++s) {
            const __m512 w = _mm512_set1_ps(j->w[t * j->ldw + s]);
            const int64_t off = s * j->ld_slot + t * j->H + h;
            __m512 x;
            if (j->bf16) {
                const uint16_t *src = (const uint16_t *)j->slots + off;
                uint16_t tmp[16] = {0};
                if (m != 0xFFFF) { /* the row's tail: copy the lanes left (AVX-512F only) */
                    memcpy(tmp, src, sizeof(uint16_t) * (size_t)(j->H - h));
                    src = tmp;
                }
                const __m256i r = _mm256_loadu_si256((const __m256i *)src);
                x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16));
            } else {
                x = _mm512_maskz_loadu_ps(m, (const float *)j->slots + off);
            }
            acc = _mm512_fmadd_ps(w, x, acc);
        }
        _mm512_mask_storeu_ps(o + h, m, acc);
    }
}
#endif

/* ---------------------------------------------------------------- threads */
static void do_row(const job_t *j, int64_t i, float *acc) {
    if (j->kind == JOB_MOE) {
#if defined(__x86_64__)
        if (j->isa == ISA_AVX512) {
            moe_row_avx512(j, i);
            return;
        }
#endif
        moe_row_generic(j, i);
        return;
    }
    const float *a = j->a + i * j->lda, *b = j->b + i * j->ldb;
#if defined(__x86_64__)
    if (j->isa == ISA_AVX512)
        chain_avx512(a, b, j->N, j->lanes, j->vec, acc);
    else
#endif
        chain_generic(a, b, j->N, j->lanes, j->vec, acc);
    j->out[i] = lane_totals(acc, j->lanes, j->reverse);
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    const unsigned csr = lmtail_mxcsr_pin(LMTAIL_MXCSR_IEEE);
    float *acc = NULL;
    if (j->kind == JOB_SUM && posix_memalign((void **)&acc, 64, sizeof(float) * j->lanes))
        acc = NULL;
    for (;;) {
        if (j->kind == JOB_SUM && !acc) break; /* the other threads take the rows */
        const int64_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (i >= j->R) break;
        do_row(j, i, acc);
    }
    free(acc);
    lmtail_mxcsr_restore(csr);
    return NULL;
}

static int run(job_t *j, int nthreads) {
    if (nthreads > j->R) nthreads = (int)j->R;
    if (nthreads < 1) nthreads = 1;
    lmtail_parallel(worker, j, nthreads);
    return j->next >= j->R ? j->isa : -1;
}

/* isa: the kernel wanted; 2 = AVX-512 (F) on a CPU without it falls back to 0 = generic C. */
static int pick_isa(int isa) {
    return isa == ISA_AVX512 && lmtail_cpu_has(LMTAIL_CPU_AVX512F) ? ISA_AVX512 : ISA_GENERIC;
}

/* out[i] = fma_sum(a[i, :], b[i, :]) for i < R (see top). a: row stride lda, b: row stride
 * ldb (0: one row for all), both unit stride along N. lanes % 32 == 0, vec >= 1.
 * Returns the ISA used, or -1 if a row could not be done (out of memory). */
int lmtail_fma_sum(const float *a, const float *b, float *out, int64_t R, int64_t N,
                   int64_t lda, int64_t ldb, int lanes, int vec, int reverse, int nthreads,
                   int isa) {
    if (lanes < 32 || lanes % 32 || vec < 1) return -2;
    job_t j;
    memset(&j, 0, sizeof j);
    j.kind = JOB_SUM;
    j.isa = pick_isa(isa);
    j.a = a, j.b = b, j.N = N, j.lda = lda, j.ldb = ldb;
    j.lanes = lanes, j.vec = vec, j.reverse = reverse;
    j.out = out, j.R = R;
    return run(&j, nthreads);
}

/* out[t, h] = routed chain over s < nslots (see top). slots: fp32 (bf16 = 0) or bf16
 * (bf16 = 1), slot s row t at slots + s*ld_slot + t*H (elements), contiguous along H;
 * w[t, s] at w + t*ldw + s; out [T, H] contiguous. Returns the ISA used. */
int lmtail_moe_routed(const void *slots, int bf16, const float *w, float *out, int64_t T,
                      int64_t H, int64_t nslots, int64_t ld_slot, int64_t ldw, int nthreads,
                      int isa) {
    job_t j;
    memset(&j, 0, sizeof j);
    j.kind = JOB_MOE;
    j.isa = pick_isa(isa);
    j.slots = slots, j.bf16 = bf16, j.w = w;
    j.H = H, j.ld_slot = ld_slot, j.ldw = ldw, j.nslots = nslots;
    j.out = out, j.R = T;
    return run(&j, nthreads);
}
