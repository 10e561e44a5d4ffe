/* lmtail's native body step: the q32 body's whole layer loop in ONE call (decode step,
 * batch decode or a prefill chunk). It computes nothing itself: it calls the declared
 * kernels it is handed (gemm_q.c's lmtail_gemm_q_cat, body.c's lmtail_add_rms_rows32,
 * lmtail_rope_qkv, lmtail_silu_mul, attend.c's lmtail_attend) in the order model/llama.py's python loop
 * calls them, on buffers the caller allocated once, so its bytes are the python loop's by
 * construction (tests/test_q32.py::test_native_step_equals_python_loop checks them equal).
 * What it removes is per-op python:
 * argument checks, tensor allocation, ctypes marshalling (~10 calls x 30 layers a token).
 *
 * Shape legend: N = B*T rows this call, H hidden, nh / nkv query / KV heads, HD = 64,
 * qd = nh*HD, kvd = nkv*HD, F FFN width, S_cap cache slots (+ slack), L layers.
 *   h, y     [N, H]            fp32  in: h = embedding rows; out: pre-final-norm h, final-normed y
 *   qkv      [N, qd + 2 kvd]   fp32  scratch (q | k | v side by side by columns)
 *   q, att   [N, qd]           fp32  scratch (roped queries, attention output)
 *   a        [N, H]            fp32  scratch (o / down projection output)
 *   gu       [N, 2F]           fp32  scratch (gate | up)
 *   s        [N, F]            fp32  scratch (silu(gate) * up)
 *   kc[l]    [B, nkv, HD, S_cap] fp32, vc[l] [B, nkv, S_cap, HD] fp32: layer l's cache
 *
 * Per layer l (Q4_1 / Q8_0 / ... blocks through gemm_q, everything else fp32; q|k|v and gate|up
 * each one gemm_q call over the concatenated columns):
 *   qkv = y @ [Wq; Wk; Wv]^T;  q, kc, vc = rope_qkv(qkv, pos);  att = attend(q, kc, vc)
 *   a = att @ Wo^T;            h, y = add_rms32(a, h, ffn_norm[l])
 *   gu = y @ [Wg; Wu]^T;       s = silu_mul(gu);  a = s @ Wd^T
 *   h, y = add_rms32(a, h, attn_norm[l + 1] or final_norm)
 * The first norm (h, y = add_rms32(embed, 0, attn_norm[0])) runs here too.
 * Two entries: lmtail_step_q32 (B rows x T tokens sharing one cache per layer: a decode step,
 * batch decode, a prefill chunk) and lmtail_step_q32_rows (R rows of one token, each in its
 * own one-row cache at its own position: the server's continuous batch).
 */
#include <stddef.h>
#include "lmtail_kernels.h"
#include <stdint.h>

typedef int (*gemm_q_fn)(const float *a, int64_t lda, const uint8_t *const *ws, const int64_t *ns, int nw, int fmt,
                         int64_t K, float *out, int64_t ldc, int64_t M, int nthreads, int isa);
typedef int (*norm32_fn)(const float *x, int64_t ldx, const float *r, const float *gamma, int64_t N,
                         int64_t H, float eps, int64_t lanes, float *h, float *y, int cap);
typedef void (*rope_fn)(const float *qkv, int64_t ld, const float *cs, const float *sn, const int64_t *pos,
                        float *q_out, float *kt, float *v, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                        int64_t S_cap, int64_t s0, int cap);
typedef int (*attend_fn)(const float *q, const float *kt, const float *v, float *out, const int64_t *pad,
                         int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t S_cap, int64_t s0, float scale,
                         int threads, int isa_cap);
typedef void (*silu_fn)(const float *gu, float *out, int64_t M, int64_t F, int64_t ld, int cap);

/* One linear: a QuantWeight's blocks (fmt: gemm_q's code), N outputs of K inputs. */
typedef struct {
    const uint8_t *w;
    int64_t fmt, n, k;
} qlinear_t;

enum { LIN_Q, LIN_K, LIN_V, LIN_O, LIN_GATE, LIN_UP, LIN_DOWN, NLIN };

typedef struct {
    qlinear_t lin[NLIN];
    const float *attn_norm, *ffn_norm; /* [H] fp32 each */
} layer_t;

/* The model, built once per loaded model (kernels/model/step.py Q32Model). */
typedef struct {
    gemm_q_fn gemm_q;
    norm32_fn norm;
    rope_fn rope;
    attend_fn attend;
    silu_fn silu;
    const layer_t *layers;
    const float *final_norm, *cos_t, *sin_t; /* [H]; rope tables [P, HD/2] */
    int64_t L, H, nh, nkv, F, lanes;
    float eps, scale;
    int64_t gemm_isa, attend_isa; /* gemm_q's isa code; attend.c's cap */
    int64_t body_isa;             /* body.c's cap: silu_mul, add_rms_rows32, rope_qkv */
} model_t;

/* The caller's buffers for up to n_max rows (kernels/model/step.py StepBuffers). */
typedef struct {
    float *qkv, *q, *att, *a, *gu, *s;
    int64_t n_max;
} buffers_t;

/* out = x @ [w_0; ...; w_{nw-1}]^T: nw consecutive linears of one format and one K (q|k|v,
 * gate|up) in ONE gemm_q call (lmtail_gemm_q_cat: one thread team for all their columns),
 * outputs side by side by columns; the same bytes as one call per linear. */
static int linear(const model_t *m, const qlinear_t *w, int nw, const float *x, int64_t ldx, float *out,
                  int64_t ldc, int64_t N, int threads) {
    const uint8_t *ws[3];
    int64_t ns[3];
    for (int s = 0; s < nw; ++s) {
        if (w[s].fmt != w[0].fmt || w[s].k != w[0].k) return -3;
        ws[s] = w[s].w;
        ns[s] = w[s].n;
    }
    return m->gemm_q(x, ldx, ws, ns, nw, (int)w[0].fmt, w[0].k, out, ldc, N, threads, (int)m->gemm_isa);
}

/* Where a call's keys and values live. Batch mode (rows == 0): one cache per layer for B rows
 * of T new tokens at slots s0.., kc[l] / vc[l], pos [B*T], pad [B] (llama.forward's layout).
 * Rows mode (rows == 1, T == 1): R one-row caches per layer, kc[l*R + r] / vc[l*R + r], row r
 * at its own slot s0s[r] (= its position: pad 0) in a cache of S_caps[r] slots; row r's rope
 * and attention are the calls a one-row batch-mode step makes, so its bytes are that step's. */
typedef struct {
    int64_t rows;
    float *const *kc, *const *vc;
    const int64_t *pos, *pad; /* batch: [B*T], [B]; rows: pos [R] (= s0s), pad [1] = {0} */
    int64_t B, T, S_cap, s0;  /* batch mode */
    const int64_t *s0s, *S_caps; /* rows mode: [R] each */
    int64_t attend_threads;
} attn_t;

static int attention(const model_t *m, const buffers_t *bf, const attn_t *at, int64_t l, int64_t ldqkv) {
    const int64_t qd = m->nh * 64;
    if (!at->rows) {
        m->rope(bf->qkv, ldqkv, m->cos_t, m->sin_t, at->pos, bf->q, at->kc[l], at->vc[l], at->B, at->T, m->nh,
                m->nkv, at->S_cap, at->s0, (int)m->body_isa);
        return m->attend(bf->q, at->kc[l], at->vc[l], bf->att, at->pad, at->B, at->T, m->nh, m->nkv, at->S_cap,
                         at->s0, m->scale, (int)at->attend_threads, (int)m->attend_isa);
    }
    for (int64_t r = 0; r < at->B; ++r) {
        float *kc = at->kc[l * at->B + r], *vc = at->vc[l * at->B + r];
        m->rope(bf->qkv + r * ldqkv, ldqkv, m->cos_t, m->sin_t, at->pos + r, bf->q + r * qd, kc, vc, 1, 1, m->nh,
                m->nkv, at->S_caps[r], at->s0s[r], (int)m->body_isa);
        if (m->attend(bf->q + r * qd, kc, vc, bf->att + r * qd, at->pad, 1, 1, m->nh, m->nkv, at->S_caps[r],
                      at->s0s[r], m->scale, (int)at->attend_threads, (int)m->attend_isa))
            return -1;
    }
    return 0;
}

/* The layer loop over N rows (h in: embedding rows; out: h, y). Returns 0, or the first
 * kernel's nonzero code as -1000 - layer * 10 - step (step 1..7: qkv, attend, o, ffn_norm,
 * gate_up, down, norm; the first norm: -1000 - 7). */
static int layers(const model_t *m, const buffers_t *bf, const attn_t *at, float *h, float *y, int64_t N,
                  int gemm_threads) {
    const int64_t H = m->H, qd = m->nh * 64, kvd = m->nkv * 64, F = m->F;
    const int64_t ldqkv = qd + 2 * kvd;
    if (N > bf->n_max) return -1;
    if (m->norm(h, H, NULL, m->layers[0].attn_norm, N, H, m->eps, m->lanes, h, y, (int)m->body_isa)) return -1007;
    for (int64_t l = 0; l < m->L; ++l) {
        const layer_t *ly = &m->layers[l];
        const int64_t code = -1000 - l * 10;
        if (linear(m, &ly->lin[LIN_Q], 3, y, H, bf->qkv, ldqkv, N, gemm_threads)) return (int)(code - 1);
        if (attention(m, bf, at, l, ldqkv)) return (int)(code - 2);
        if (linear(m, &ly->lin[LIN_O], 1, bf->att, qd, bf->a, H, N, gemm_threads)) return (int)(code - 3);
        if (m->norm(bf->a, H, h, ly->ffn_norm, N, H, m->eps, m->lanes, h, y, (int)m->body_isa)) return (int)(code - 4);
        if (linear(m, &ly->lin[LIN_GATE], 2, y, H, bf->gu, 2 * F, N, gemm_threads)) return (int)(code - 5);
        m->silu(bf->gu, bf->s, N, F, 2 * F, (int)m->body_isa);
        if (linear(m, &ly->lin[LIN_DOWN], 1, bf->s, F, bf->a, H, N, gemm_threads)) return (int)(code - 6);
        const float *next = l + 1 < m->L ? m->layers[l + 1].attn_norm : m->final_norm;
        if (m->norm(bf->a, H, h, next, N, H, m->eps, m->lanes, h, y, (int)m->body_isa)) return (int)(code - 7);
    }
    return 0;
}

/* Batch mode: B rows x T tokens in one cache per layer (llama.forward). */
int lmtail_step_q32(const model_t *m, const buffers_t *bf, float *h, float *y, float *const *kc,
                    float *const *vc, const int64_t *pos, const int64_t *pad, int64_t B, int64_t T,
                    int64_t S_cap, int64_t s0, int gemm_threads, int attend_threads) {
    const attn_t at = {.rows = 0, .kc = kc, .vc = vc, .pos = pos, .pad = pad, .B = B, .T = T, .S_cap = S_cap,
                       .s0 = s0, .attend_threads = attend_threads};
    return layers(m, bf, &at, h, y, B * T, gemm_threads);
}

/* Rows mode: R rows, one token each, row r in its own one-row caches kc/vc[l*R + r] at slot
 * s0s[r] of S_caps[r] (the continuous batch). */
int lmtail_step_q32_rows(const model_t *m, const buffers_t *bf, float *h, float *y, float *const *kc,
                         float *const *vc, const int64_t *s0s, const int64_t *S_caps, int64_t R,
                         int gemm_threads, int attend_threads) {
    static const int64_t pad0[1] = {0};
    const attn_t at = {.rows = 1, .kc = kc, .vc = vc, .pos = s0s, .pad = pad0, .B = R, .T = 1, .s0s = s0s,
                       .S_caps = S_caps, .attend_threads = attend_threads};
    return layers(m, bf, &at, h, y, R, gemm_threads);
}
