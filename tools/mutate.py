"""Planted-bug mutation run: does the test suite notice small wrong edits of the ops?

Each mutant is one textual edit of one source file (a declared order, a rounding point, a
tie rule, an fma split into a multiply and an add, ...). For each, the tree (src/, tests/,
pyproject.toml) is copied to a temporary directory, the edit applied there, and the test
files the mutant names run with the copy first on PYTHONPATH. A mutant is

    killed     some test failed (or the run errored: the edit broke an import)
    survived   every test passed: a hole in the suite (or an equivalent edit)
    stale      its `old` text is not in the file any more (the source moved on: update it)

A mutant names its file by a path hint; when the hint is gone or no longer holds `old`
exactly once (kernels move), the file is found by searching src/ for the one file that
holds `old` exactly once (and `anchor`, a name it defines, when `old` is not unique).

    .venv/bin/python tools/mutate.py                    # every mutant
    .venv/bin/python tools/mutate.py --only tail.       # names containing "tail."
    .venv/bin/python tools/mutate.py --only 'body.*,rows_tail.c.*' --keep test_golden.py --keep test_contract.py
                                                        # a quick subset: fnmatch patterns, two files
    .venv/bin/python tools/mutate.py --drop test_golden.py   # without a test file: what it adds
    .venv/bin/python tools/mutate.py --keep test_golden.py   # only that file
    .venv/bin/python tools/mutate.py --list

The working tree is never touched. The baseline (no edit) runs first, one test file at a
time; a file that is red without any edit is left out (and listed), since it cannot judge. C kernels recompile per mutated source
(lmtail's kernel cache is keyed by the source's hash).

Shape legend: none (a report).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # replaced once; must occur exactly once
    new: str
    tests: tuple[str, ...]  # test files under tests/
    what: str
    anchor: str = ""  # text the file must also hold (disambiguates an `old` several files share)


def locate(m: Mutant) -> tuple[str | None, str]:
    """(the repository-relative path the mutant edits, or None; why not). The hint m.path
    when it holds `old` exactly once (and the anchor), else the one file under src/ that does."""
    def fits(p: Path) -> bool:
        try:
            t = p.read_text()
        except (OSError, UnicodeDecodeError):
            return False
        return t.count(m.old) == 1 and m.anchor in t

    hint = ROOT / m.path
    if hint.is_file() and fits(hint):
        return m.path, ""
    hits = [p for p in sorted((ROOT / "src").rglob("*" + hint.suffix)) if "__pycache__" not in p.parts and fits(p)]
    if len(hits) == 1:
        return str(hits[0].relative_to(ROOT)), ""
    return None, f"`old` found once (with anchor {m.anchor!r}) in {len(hits)} files under src/, not 1"


K = ("test_golden.py",)
PR = ("test_processors.py",)
KC = K + ("test_contract.py",)
MUTANTS = (
    Mutant("tail.ssq_order", "src/lmtail/tail/compose.py", "SSQ_ORDER = strided(256)", "SSQ_ORDER = strided(128)",
           K + ("test_tail.py",), "the tail's declared ssq order: 256 -> 128 lanes"),
    Mutant("tail.rms_legacy_order", "src/lmtail/tail/compose.py", "a = ((x * rms[:, None]) * g).to(torch.bfloat16)",
           "a = (x * (rms[:, None] * g)).to(torch.bfloat16)", K + ("test_tail.py",),
           "legacy rounding point: (x*rms)*gamma -> x*(rms*gamma)"),
    Mutant("norms.default_order", "src/lmtail/glue/norms.py", "DEFAULT_ORDER = strided(256)",
           "DEFAULT_ORDER = Order(\"contiguous\", 256, 8)", K + ("test_norms.py",), "the norms' declared order"),
    Mutant("norms.mlx_once", "src/lmtail/glue/norms.py",
           "t = t.to(torch.bfloat16).to(torch.float32)  # MLX stores x*inv as bf16", "t = t",
           K + ("test_norms.py",), "rms_parts 'mlx' without its bf16 rounding of x*inv"),
    Mutant("norms.eps_half", "src/lmtail/glue/norms.py", "d = m + torch.full_like(m, eps)",
           "d = m + torch.full_like(m, eps * 0.5)", K + ("test_norms.py",), "eps halved"),
    Mutant("fmachain.torch_butterfly", "src/lmtail/kernels/glue/fmachain.py", "g = g[..., :half] + g[..., half:]",
           "g = g[..., 0::2] + g[..., 1::2]", K + ("test_orders.py", "test_fmachain.py"),
           "torch butterfly folded pairwise (the placebo) instead of by halves"),
    Mutant("fmachain.torch_group_order", "src/lmtail/kernels/glue/fmachain.py",
           "    total = g[..., 0, 0]\n    for k in range(1, t // 32):\n        total = total + g[..., k, 0]",
           "    total = g[..., t // 32 - 1, 0]\n    for k in range(t // 32 - 2, -1, -1):\n        total = total + g[..., k, 0]",
           K + ("test_orders.py", "test_fmachain.py"), "lane-group totals added last to first"),
    Mutant("router.ties_high", "src/lmtail/glue/router.py", "return mono * e + (e - 1 - ids)", "return mono * e + ids",
           K + ("test_router.py",), "router ties to the higher expert id"),
    Mutant("router.sum_reversed", "src/lmtail/glue/router.py",
           "    tot = s_sel[:, 0]\n    for j in range(1, k):\n        tot = tot + s_sel[:, j]",
           "    tot = s_sel[:, k - 1]\n    for j in range(k - 2, -1, -1):\n        tot = tot + s_sel[:, j]",
           K + ("test_router.py",), "weight normalizer summed in reverse of the returned order"),
    Mutant("topk.ties_high", "src/lmtail/tail/topk.py", "local = (local.view(r, n, chunk) << 14) | ((chunk - 1) - pos)",
           "local = (local.view(r, n, chunk) << 14) | pos", K + ("test_topk.py",),
           "stage-1 ties to the higher lane"),
    Mutant("sampler.greedy_1e-4", "src/lmtail/tail/sampler.py", "GREEDY_TEMPERATURE = 1e-5  #", "GREEDY_TEMPERATURE = 1e-4  #",
           K + ("test_sampler.py",), "greedy threshold moved"),
    Mutant("numerics.fma_tie", "src/lmtail/numerics.py", "torch.where(e > 0, above, below)",
           "torch.where(e > 0, below, above)", K + ("test_numerics.py",), "fma32 breaks float64 midpoints the wrong way"),
    Mutant("numerics.sqrt_no_fix", "src/lmtail/numerics.py", "r = torch.where(mid_hi * mid_hi < d64, up, r)",
           "r = torch.where(mid_hi * mid_hi < d64, r, r)", K + ("test_numerics.py",),
           "sqrt_rn32 without its upward correction"),
    Mutant("numerics.exp_degree12", "src/lmtail/numerics.py", "for c in reversed(_EXP_C[1:13]):",
           "for c in reversed(_EXP_C[2:13]):", K + ("test_numerics.py",), "exp64 polynomial with a wrong coefficient"),
    Mutant("gemm_chain.c.unfused", "src/lmtail/kernels/gemm/gemm_chain.c",
           "acc[r][0] = _mm512_fmadd_ps(b, w0, acc[r][0]);",
           "acc[r][0] = _mm512_add_ps(_mm512_mul_ps(b, w0), acc[r][0]);", K + ("test_gemm.py",),
           "AVX-512 GEMM column block 0 as multiply + add (two roundings)"),
    Mutant("lane_totals.butterfly", "src/lmtail/kernels/lmtail_kernels.h",
           "for (int half = 16; half >= 1; half /= 2)", "for (int half = 1; half <= 16; half *= 2)",
           K + ("test_fmachain.py", "test_q32.py"),
           "the shared plain-C lane fold (fmachain, body norms, tail norm) 1..16: halves of the wrong size"),
    Mutant("fmachain.c.unfused", "src/lmtail/kernels/glue/fmachain.c",
           "                    s[u] = _mm512_fmadd_ps(x, y, s[u]);\n                }",
           "                    s[u] = _mm512_add_ps(_mm512_mul_ps(x, y), s[u]);\n                }",
           K + ("test_fmachain.py", "test_norms.py"), "AVX-512 strided ssq chain as multiply + add"),
    # issue 17's four holes: the fused kernel's float64 mass, the rope table, body.c's constants
    Mutant("kernels_h.sexp4_coef", "src/lmtail/kernels/lmtail_kernels.h", "p[u] = _mm256_mul_pd(r[u], KV[K_C0 + 13]);",
           "p[u] = _mm256_mul_pd(r[u], KV[K_C0 + 12]);", KC + ("test_rows_tail.py", "test_shard_partials.py"),
           "the shared AVX2 exp64 (sexp4): the degree-13 coefficient read as 1/12!", anchor="sexp4"),
    # the sampler's candidate steps, written once in lmtail_kernels.h (rows_tail.c's fused draw and
    # shard_partials.c's candidates sampler both run them), the per-pass "ties past k" answers, the
    # one Python record (kernels/tail/sampling.py): test_sampling_edges.py runs each edge rule on every pass
    Mutant("sampling_h.min_p_strict", "src/lmtail/kernels/lmtail_kernels.h", "(p[j] >= floor_p));",
           "(p[j] > floor_p));", ("test_sampler.py", "test_sampling_edges.py"),
           "the shared C min-p cut drops a tie with the maximum (> for >=): every C pass"),
    Mutant("sampling_h.top_p_drops_crossing", "src/lmtail/kernels/lmtail_kernels.h",
           "((c[j] - p[j] < s->top_p) || s->top_p >= 1.0)", "((c[j] < s->top_p) || s->top_p >= 1.0)",
           ("test_sampling_edges.py",), "the shared C top-p keeps by the mass including the candidate (drops the crossing token)"),
    Mutant("sampling_h.top_k_above_k_unflagged", "src/lmtail/kernels/lmtail_kernels.h",
           "if (s->top_k > 0) return s->top_k > k || ties_past_k;", "if (s->top_k > 0) return ties_past_k;",
           ("test_sampling_edges.py",), "the shared C truncation flag misses top_k > k"),
    Mutant("sampling_h.ties_past_k_unflagged", "src/lmtail/kernels/lmtail_kernels.h",
           "if (s->top_k > 0) return s->top_k > k || ties_past_k;", "if (s->top_k > 0) return s->top_k > k;",
           ("test_sampling_edges.py",), "the shared C truncation flag misses a threshold tie past the k-th candidate"),
    Mutant("sampling_h.threshold_strict", "src/lmtail/kernels/lmtail_kernels.h",
           "acc[j % 256] + (v[j] >= thr ? e[j] : 0.0)", "acc[j % 256] + (v[j] > thr ? e[j] : 0.0)",
           ("test_sampling_edges.py", "test_rows_tail.py"),
           "the shared C top-k normalizer leaves out the candidates tied with the threshold"),
    Mutant("sampling_h.draw_over_all_candidates", "src/lmtail/kernels/lmtail_kernels.h",
           "    const double total = c[n_keep - 1];\n"
           "    for (int64_t j = 0; j < k; ++j) pos += keep[j] && (c[j] / total <= s->u);\n"
           "    return pos > n_keep - 1 ? n_keep - 1 : pos;",
           "    const double total = c[k - 1];\n"
           "    for (int64_t j = 0; j < k; ++j) pos += c[j] / total <= s->u;\n"
           "    return pos > k - 1 ? k - 1 : pos;",
           ("test_sampling_edges.py",), "the shared C draw over every candidate's mass, not clamped to the kept prefix"),
    Mutant("rows_tail.c.ties_past_k_strict", "src/lmtail/kernels/tail/rows_tail.c", "c += d >= thr;", "c += d > thr;",
           ("test_sampling_edges.py",), "the fused pass's count of row lanes at the threshold misses ties past k"),
    Mutant("shard_partials.c.ties_past_k_strict", "src/lmtail/kernels/tail/shard_partials.c",
           "const int ties_past_k = has_out && out >= thr;", "const int ties_past_k = has_out && out > thr;",
           ("test_sampling_edges.py",), "the candidates C sampler misses an outside lane tied with the threshold"),
    Mutant("rows_tail.c.keys_ties_high", "src/lmtail/kernels/tail/rows_tail.c",
           "(uint64_t)(0xFFFFFFFFu - (uint32_t)v)", "(uint64_t)(0xFFFFFFFFu - (uint32_t)(v ^ 1))",
           ("test_sampling_edges.py",), "the fused top-k breaks ties between ids 2j and 2j + 1 to the higher id"),
    Mutant("sampling.default_u_zero", "src/lmtail/kernels/tail/sampling.py", '(DEFAULT_U if name == "u" else 0.0)',
           '(0.0 if name == "u" else 0.0)', ("test_sampler.py", "test_sampling_edges.py"),
           "the one record builder draws u = 0 for a tensor without a u column"),
    Mutant("sampling.top_k_wraps", "src/lmtail/kernels/tail/sampling.py",
           "np.clip(spd[:, COL.top_k], -1.0, TOP_K_MAX).astype(np.int64)",
           "np.clip(spd[:, COL.top_k].astype(np.int64), -1, int(TOP_K_MAX))",
           ("test_sampling_edges.py",), "the one record builder converts top_k before clamping (1e30 wraps to off)"),
    Mutant("sampler.min_p_strict", "src/lmtail/tail/sampler.py", "keep = keep & (p >= min_p[:, None] * p[:, :1])",
           "keep = keep & (p > min_p[:, None] * p[:, :1])", ("test_sampler.py",),
           "the torch sampler's min-p cut drops a tie with the maximum"),
    Mutant("rows_tail.c.lanes_128", "src/lmtail/kernels/tail/rows_tail.c", "LANES = 256", "LANES = 128",
           KC + ("test_rows_tail.py",), "fused kernel's full-row mass in 128 lane chains", anchor="lmtail_rows_tail("),
    Mutant("rope.p1_ulp", "src/lmtail/model/body.py", "_P1 = 1.57079632673412561417e+00", "_P1 = 1.5707963267341258",
           KC + ("test_model_body_ops.py", "test_model_body.py"), "rope table's pi/2 high part one ulp up (3 table entries move by an ulp)"),
    Mutant("exp32.h.exp32_coef", "src/lmtail/kernels/model/exp32.h", "0x1.111112p-7f", "0x1.111114p-7f",
           KC + ("test_model_body_ops.py", "test_model_body.py"), "exp32.h's exp32 fp32(1/5!) one ulp up (body.py keeps it)", anchor="exp32_512_in"),
    # the new contract kinds (body ops, the row mass)
    Mutant("rowmass.c.lanes_128", "src/lmtail/kernels/tail/rowmass.c", "LANES = 256", "LANES = 128",
           KC + ("test_rowmass.py",), "row_mass's sum64 in 128 lane chains", anchor="lmtail_row_mass("),
    Mutant("rows_tail.decl_depth", "src/lmtail/kernels/tail/rows_tail.py", "depth=-(-V // LANES) + 8",
           "depth=-(-V // LANES) + 4", KC + ("test_rows_tail.py",), "rows_tail_decl's S depth: tree of 4 levels"),
    Mutant("body.exp32_torch_ln2lo", "src/lmtail/model/body.py", 'LN2_LO = _F(float.fromhex("-0x1.bd0106p-13"))',
           'LN2_LO = _F(float.fromhex("-0x1.bd0108p-13"))', KC + ("test_model_body_ops.py", "test_model_body.py"),
           "body.py's exp32 LN2_LO one ulp off (body.c keeps it)"),
    Mutant("body.silu_recip", "src/lmtail/model/body.py", "s = gate / (1.0 + _exp32_torch(-gate))",
           "s = gate * (1.0 / (1.0 + _exp32_torch(-gate)))", KC + ("test_model_body_ops.py", "test_model_body.py"),
           "torch silu: the sigmoid rounded first"),
    Mutant("body.attend_den_reversed", "src/lmtail/model/body.py",
           "    for j in range(n_max):\n        lj = live[..., j]",
           "    for j in reversed(range(n_max)):\n        lj = live[..., j]", KC + ("test_model_body_ops.py", "test_model_body.py"),
           "torch attention: keys summed last to first"),
    Mutant("body.apply_rope_fused", "src/lmtail/model/body.py",
           "torch.stack((xe * cos - xo * sin, xe * sin + xo * cos), dim=-1)",
           "torch.stack(((xe.double() * cos - xo.double() * sin).float(), xe * sin + xo * cos), dim=-1)",
           KC + ("test_model_body_ops.py", "test_model_body.py"), "apply_rope's even lane rounded once (float64 inside)"),
    Mutant("body.add_rms_rows_lanes", "src/lmtail/model/body.py",
           "return NormResult(*kbody.add_rms_rows(x, residual, gamma32, eps, lanes))",
           "return NormResult(*kbody.add_rms_rows(x, residual, gamma32, eps, lanes // 2))",
           KC + ("test_model_body_ops.py", "test_model_body.py"), "add_rms_rows runs half the lane chains it is asked for"),
    # the fused kernel's float64 mass and log (rows_tail.c), the shared exp64 (lmtail_kernels.h),
    # the constant packer: seen by the sampler kind's mass comparison and the debug_mass tests
    Mutant("rows_tail.c.tree_pairs", "src/lmtail/kernels/tail/rows_tail.c",
           "for (int t = 0; t < w; ++t) acc[t] = acc[t] + acc[t + w];",
           "for (int t = 0; t < w; ++t) acc[t] = acc[2 * t] + acc[2 * t + 1];", KC + ("test_rows_tail.py",),
           "fused kernel's 256 -> 1 tree by adjacent pairs instead of halves", anchor="lmtail_rows_tail("),
    Mutant("kernels_h.sexp4_c0_c2", "src/lmtail/kernels/lmtail_kernels.h", "p[u] = _mm256_add_pd(p[u], KV[K_C0]);",
           "p[u] = _mm256_add_pd(p[u], KV[K_C0 + 2]);", KC + ("test_rows_tail.py", "test_shard_partials.py"),
           "the shared AVX2 exp64 (sexp4): the constant term C0 read as C2", anchor="sexp4"),
    Mutant("rows_tail.c.log_c29", "src/lmtail/kernels/tail/rows_tail.c", "1.0 / 27, 1.0 / 29};", "1.0 / 27, 1.0 / 31};",
           KC + ("test_rows_tail.py",), "fused kernel's log64 series: 1/29 -> 1/31", anchor="lmtail_rows_tail("),
    Mutant("rows_tail.c.sqrt2_digit", "src/lmtail/kernels/tail/rows_tail.c", "LOG_L[16] = {1.4142135623730951,",
           "LOG_L[16] = {1.4142135623730950,", KC + ("test_rows_tail.py",),
           "fused kernel's log64 SQRT2 split: last digit 1 -> 0 (one double down)", anchor="lmtail_rows_tail("),
    Mutant("lmtail_log64.series_shift", "src/lmtail/kernels/lmtail_kernels.h",
           "for (int j = 13; j >= 0; --j) p = p * s2 + L[1 + j];", "for (int j = 13; j >= 0; --j) p = p * s2 + L[j];",
           ("test_rows_tail.py", "test_candidates.py"),
           "the shared C log64 (rows_tail's lse, the owner's lse1): series coefficients read one slot early"),
    Mutant("numerics.log64_c29", "src/lmtail/numerics.py", "_LOG_C = tuple(1.0 / (2 * i + 1) for i in range(15))",
           "_LOG_C = tuple(1.0 / (2 * i + 1) for i in range(14)) + (1.0 / 31,)",
           K + ("test_numerics.py", "test_rows_tail.py"),
           "numerics.log64's series: 1/29 -> 1/31 (rows_tail.c keeps 1/29)"),
    Mutant("kernels_h.select_keeps_wrong_side", "src/lmtail/kernels/lmtail_kernels.h",
           "if (t <= j) hi = j;", "if (t <= j) lo = i;",
           K + ("test_rows_tail.py", "test_shard_partials.py"),
           "select_top continues into the wrong part of the shared partition"),
    Mutant("kernels_h.sort_small_parts_ascending", "src/lmtail/kernels/lmtail_kernels.h",
           "while (j > 0 && a[j - 1] < x) {", "while (j > 0 && a[j - 1] > x) {",
           K + ("test_rows_tail.py", "test_shard_partials.py"), "sort_desc's insertion pass sorts ascending"),
    Mutant("kernels_h.exp64_horner_c13", "src/lmtail/kernels/lmtail_kernels.h", "double p = r * K[K_C0 + 13];",
           "double p = r * 0.0;", ("test_rowmass.py", "test_rows_tail.py", "test_kernels.py"),
           "the shared scalar exp64 (plain-C backends): Horner without its degree-13 coefficient"),
    Mutant("rowmass.constants_drop", "src/lmtail/kernels/tail/rowmass.py", "c = numerics.exp64_constants()\n",
           "c = numerics.exp64_constants()[:16] + (0.0,)\n", KC + ("test_rowmass.py", "test_rows_tail.py"),
           "the exp64 constant packer drops C13 (0 in its place; every C kernel gets it)"),
    Mutant("exp32.h.exp32_c7", "src/lmtail/kernels/model/exp32.h", "0x1.a01a02p-13f", "0x1.a01a04p-13f",
           KC + ("test_model_body_ops.py", "test_model_body.py"), "exp32.h's exp32 C7 = fp32(1/7!) last digit 2 -> 4", anchor="exp32_512_in"),
    Mutant("exp32.h.ln2_lo", "src/lmtail/kernels/model/exp32.h", "LN2_LO = -0x1.bd0106p-13f;", "LN2_LO = -0x1.bd0108p-13f;",
           KC + ("test_model_body_ops.py", "test_model_body.py"), "exp32.h's exp32 LN2_LO last digit 6 -> 8", anchor="exp32_512_in"),
    # gemm_q (GGUF Q8_0 / Q4_1)
    Mutant("gemm_q.c.nibbles_avx2", "src/lmtail/kernels/quant/gemm_q.c",
           "{_mm256_and_si256(x0, f), _mm256_and_si256(x1, f), _mm256_srli_epi32(x0, 4),\n"
           "                          _mm256_srli_epi32(x1, 4)};",
           "{_mm256_srli_epi32(x0, 4), _mm256_srli_epi32(x1, 4), _mm256_and_si256(x0, f),\n"
           "                          _mm256_and_si256(x1, f)};", KC + ("test_quant.py",),
           "AVX2 Q4_1 dequantization: high nibbles first", anchor="lmtail_gemm_q("),
    Mutant("gemm_q.c.nibbles_c", "src/lmtail/kernels/quant/gemm_q.c", "v[j] = d * (float)(blk[4 + j] & 15) + m;",
           "v[j] = d * (float)(blk[4 + j] >> 4) + m;", ("test_quant.py",),
           "plain-C Q4_1 dequantization: weight j from the high nibble", anchor="lmtail_gemm_q("),
    Mutant("gemm_q.c.lanes_16_c", "src/lmtail/kernels/quant/gemm_q.c",
           "for (int i = 0; i < QK; ++i) l[i] = fma_rn(am[QK * b + i], wrow[QK * b + i], l[i]);",
           "for (int i = 0; i < QK; ++i) l[i % 16] = fma_rn(am[QK * b + i], wrow[QK * b + i], l[i % 16]);",
           ("test_quant.py",), "plain-C gemm_q in 16 lane chains", anchor="lmtail_gemm_q("),
    Mutant("gemm_q.c.lanes_16_avx2", "src/lmtail/kernels/quant/gemm_q.c",
           "acc[c][i] = _mm256_fmadd_ps(_mm256_loadu_ps(ab + 8 * i), v[i], acc[c][i]);",
           "acc[c][i & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(ab + 8 * i), v[i], acc[c][i & 1]);",
           ("test_contract.py", "test_quant.py"), "AVX2 gemm_q at M = 1 (decode) in 16 lane chains",
           anchor="lmtail_gemm_q("),
    Mutant("gemm_q.c.cat_seam", "src/lmtail/kernels/quant/gemm_q.c",
           "while (s + 1 < j->nw && n >= j->end[s]) ++s;", "while (s + 1 < j->nw && n > j->end[s]) ++s;",
           ("test_quant.py",), "concatenated weights (q|k|v): each seam's first column read past the weight before"),
    # the q32 body, its native step, the Q8_0 head
    Mutant("body.c.norm32_gamma_first", "src/lmtail/kernels/model/body.c", "y[i] = (h[i] * inv) * gamma[i];",
           "y[i] = (h[i] * gamma[i]) * inv;", ("test_q32.py", "test_contract.py"),
           "the fp32 norm's products swapped: fl32(fl32(h * gamma) * inv)"),
    Mutant("exp32.h.silu512_ninf_dropped", "src/lmtail/kernels/model/exp32.h",
           "sv = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(gv, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), sv, _mm512_set1_ps(-0.0f));",
           "", ("test_body_avx512.py",),
           "the 16-lane silu loses its -inf select (silu(-inf) NaN instead of -0.0)"),
    Mutant("body.c.ssq512_tree_level", "src/lmtail/kernels/model/body.c",
           "_mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 1, 1, 1))", "_mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 2, 2, 2))",
           ("test_body_avx512.py",), "the 16-lane norm's butterfly adds lanes 8..11 where 4..7 belong"),
    Mutant("body.c.exp512_tail_lane", "src/lmtail/kernels/model/body.c",
           "_mm512_mask_storeu_ps(y + i, k, exp32_512(", "_mm512_storeu_ps(y + i, exp32_512(",
           ("test_body_avx512.py",), "the 16-lane exp row writes past n in its last, partial vector"),
    Mutant("step.c.ffn_norm_gamma", "src/lmtail/kernels/model/step.c",
           "if (m->norm(bf->a, H, h, ly->ffn_norm, N, H", "if (m->norm(bf->a, H, h, ly->attn_norm, N, H",
           ("test_q32.py",), "the native step's post-attention norm with the wrong gamma"),
    Mutant("step.c.rows_shared_slot", "src/lmtail/kernels/model/step.c",
           "m->nkv, at->S_caps[r], at->s0s[r], (int)m->body_isa);", "m->nkv, at->S_caps[r], at->s0s[0], (int)m->body_isa);",
           ("test_q32.py",), "the rows step writes every row's key / value at row 0's slot"),
    Mutant("llama.q32_bf16_attention", "src/lmtail/model/llama.py",
           "h, y = norm(kern.linear(att.view(B * T, nh * hd), q.w_o), h, layers[i].ffn_norm)",
           "h, y = norm(kern.linear(att.view(B * T, nh * hd).bfloat16().float(), q.w_o), h, layers[i].ffn_norm)",
           ("test_q32.py",), "the q32 python loop rounds the attention output to bf16 (the quant body's point)"),
    Mutant("tail.q8_head_bf16_input", "src/lmtail/tail/compose.py",
           "return _deferred_input(x * g, None if h_u == h else real, cfg.head_input), rms",
           "return _deferred_input((x * g).bfloat16().float(), None if h_u == h else real, cfg.head_input), rms",
           K + ("test_tail_q8.py", "test_contract.py"), "the Q8_0 head's fp32 input rounded to bf16"),
    Mutant("quant.decl_depth", "src/lmtail/kernels/quant/gemm_q.py", "depth=nb + 5,", "depth=nb // 2 + 5,",
           ("test_contract.py", "test_quant.py"), "gemm_q_decl's depth: half the lane chain"),
    # gemm_bq (the order bq32: exact bf16 parts x the block's integers, AMX's tile order)
    Mutant("gemm_bq.c.pair_sum_last_512", "src/lmtail/kernels/quant/gemm_bq.c",
           "c = _mm512_add_ps(c, _mm512_add_ps(e[r][1], o[r][1]));",
           "c = _mm512_add_ps(_mm512_add_ps(c, e[r][1]), o[r][1]);",
           ("test_gemm_bq.py",), "AVX-512 bq32: part 1 added as c = (c + e) + o, not c + (e + o)"),
    Mutant("gemm_bq.c.split_two_parts_c", "src/lmtail/kernels/quant/gemm_bq.c",
           "p[2] = flushz16(f2u(r2) >> 16);", "p[2] = 0;",
           ("test_gemm_bq.py",), "the scalar split (c, avx2 paths) drops p2: a 2-part split"),
    Mutant("gemm_bq.c.amx_part2_dropped", "src/lmtail/kernels/quant/gemm_bq.c",
           "_tile_dpbf16ps(0, 4, 5);", "",
           ("test_gemm_bq.py",), "AMX bq32: the first group's C tile skips part 2's TDPBF16PS (run by emu-amx)"),
    Mutant("gemm_bq.c.scale_rounded_c", "src/lmtail/kernels/quant/gemm_bq.c",
           "y = fma_ftz(j->d[x], block_c(j, pr, g, c, b), y);",
           "y = add_ftz(y, j->d[x] * block_c(j, pr, g, c, b));",
           ("test_gemm_bq.py",), "plain-C bq32: d*c rounded before its add (no fma)"),
    # gemm_bf16 in the dp32 order
    Mutant("gemm_dp32.c.direct_even_first", "src/lmtail/kernels/gemm/gemm_dp32.c",
           "t[r][s][q] = _mm256_fmadd_ps(ae, we[s][q], _mm256_fmadd_ps(ao, wo[s][q], t[r][s][q]));",
           "t[r][s][q] = _mm256_fmadd_ps(ao, wo[s][q], _mm256_fmadd_ps(ae, we[s][q], t[r][s][q]));",
           ("test_dp32.py",), "dp32 AVX2 decode rows (direct_avx2): even lane first"),
    Mutant("gemm_dp32.c.even_first_avx2", "src/lmtail/kernels/gemm/gemm_dp32.c",
           "t[r][0] = _mm256_fmadd_ps(ae, we0, _mm256_fmadd_ps(ao, wo0, t[r][0]));",
           "t[r][0] = _mm256_fmadd_ps(ao, wo0, _mm256_fmadd_ps(ae, we0, t[r][0]));",
           K + ("test_dp32.py",), "AVX2 dp32: each pair's even lane first (columns 0-7 of a strip)",
           anchor="lmtail_dp32_gemm("),
    Mutant("gemm_dp32.c.acc_no_ftz_c", "src/lmtail/kernels/gemm/gemm_dp32.c",
           "c[v] = add_ftz(first && b == 0 ? 0.0f : c[v], t[v]);",
           "c[v] = (first && b == 0 ? 0.0f : c[v]) + t[v];",
           ("test_dp32.py",), "plain-C dp32: the block add acc + t without FTZ", anchor="lmtail_dp32_gemm("),
    Mutant("gemm.dp32_decl_depth", "src/lmtail/kernels/gemm/bf16.py", "depth=32 + nb,", "depth=16 + nb,",
           ("test_dp32.py",), "gemm_decl(H, 'dp32')'s depth: half the pair chain"),
    # the candidates exchange (issue 19) and the bf16x2 head input
    Mutant("candidates.combine_torch_sum", "src/lmtail/tail/candidates.py", "return top, sum64(s * e)",
           "return top, (s * e).sum(dim=1)", K + ("test_candidates.py",),
           "chunk terms summed by torch's own order instead of sum64"),
    Mutant("candidates.mt_from_m1", "src/lmtail/tail/candidates.py", "m1 / t[:, None], torch.zeros", "m1 * t[:, None], torch.zeros",
           K + ("test_candidates.py",), "the owner's recomputed mT multiplies by T"),
    Mutant("candidates.ties_strict", "src/lmtail/tail/candidates.py", "self.out >= thr[:, 0]", "self.out > thr[:, 0]",
           KC + ("test_candidates.py",), "a lane tied with the top-k threshold outside the candidates not flagged"),
    Mutant("shard_partials.c.tree_level", "src/lmtail/kernels/tail/shard_partials.c",
           "for (int h = LANES / 2; h >= 1; h /= 2) {", "for (int h = LANES / 4; h >= 1; h /= 2) {",
           K + ("test_shard_partials.py", "test_candidates.py"), "the chunk sum's halving tree without its first level"),
    Mutant("attend.c.avx2_den_skips_last_key", "src/lmtail/kernels/model/attend.c",
           "for (int k = 0; k < m; ++k) D[g] = _mm256_add_ps(D[g], r[k]);",
           "for (int k = 0; k + 1 < m; ++k) D[g] = _mm256_add_ps(D[g], r[k]);",
           ("test_model_body_ops.py",), "AVX2 attention: a partial key block's last e left out of den"),
    Mutant("attend.c.avx2_pv_reversed_keys", "src/lmtail/kernels/model/attend.c",
           "const __m256 b = _mm256_broadcast_ss(&eb[i][jj]);",
           "const __m256 b = _mm256_broadcast_ss(&eb[i][jn - 1 - jj]);",
           ("test_model_body_ops.py",), "AVX2 attention: a value block's chain in reversed key order (wrong e per v)"),
    Mutant("gemm_q.c.lanes_leaf_order", "src/lmtail/kernels/quant/gemm_q.c",
           "return ((i & 1) << 4) | ((i & 2) << 2) | (i & 4) | ((i & 8) >> 2) | ((i & 16) >> 4);",
           "return i;", ("test_quant.py",), "lanes path: the tree summed in lane order, not the halving tree's"),
    Mutant("shard_partials.c.scale_nan_canonical", "src/lmtail/kernels/tail/shard_partials.c",
           "for (int64_t i = 0; i < V; ++i) xr[i] = xr[i] * sr;",
           "for (int64_t i = 0; i < V; ++i) xr[i] = xr[i] != xr[i] ? u2f(0x7FC00000u) : xr[i] * sr;",
           ("test_shard_partials.py",), "deferred scale: NaN logits stored canonical (payloads lost)"),
    Mutant("candidates.at_t_top_k_zero", "src/lmtail/tail/candidates.py",
           "return top_k <= 0 and t >= GREEDY_TEMPERATURE and t != 1.0",
           "return top_k < 0 and t >= GREEDY_TEMPERATURE and t != 1.0",
           ("test_candidates.py",), "the T pass skipped for top_k = 0 rows (top-k off)"),
    Mutant("sampler.params_ok_top_p_open", "src/lmtail/tail/sampler.py", "0 < p <= 1 and 0 <= t < inf",
           "0 < p < 1 and 0 <= t < inf", ("test_sampler.py",), "host param check: top_p = 1 refused"),
    Mutant("tail.bf16x2_lo_dropped", "src/lmtail/tail/compose.py", "acc = acc2[:, 0] + acc2[:, 1]", "acc = acc2[:, 0]",
           KC, "bf16x2 without the a_lo GEMM row"),
    Mutant("tail.lse_m1_only", "src/lmtail/tail/compose.py",
           "lse = candidates.MergedStats(merged, sampling_params, cfg.nan_fold).lse1()",
           "lse = merged.mass[0]", ("test_config.py",), "TailOutput.lse on the candidates path: m1 without log64(S1)"),
    Mutant("tail.lse_undecided_unfilled", "src/lmtail/tail/compose.py", 'lse[left] = plan["lse1"]', "pass",
           ("test_config.py",), "TailOutput.lse (mirror, fused): the rows the reference sampler decides left NaN"),
    Mutant("config.k_zero_accepted", "src/lmtail/tail/config.py", "if not (is_int(self.k) and self.k >= 1):",
           "if not (is_int(self.k) and self.k >= 0):", ("test_config.py",), "TailConfig accepts k = 0"),
    Mutant("config.signature_rank_local", "src/lmtail/tail/config.py",
           'RANK_LOCAL = ("emit_logits", "debug_taps")', 'RANK_LOCAL = ("emit_logits", "debug_taps", "nan_fold")',
           ("test_config.py",), "the ranks' signature leaves nan_fold out"),
    # the logits-processor seam (lmtail.tail.processors) and where the tail applies it
    Mutant("processors.presence_sign", "src/lmtail/tail/processors.py", "g = np.where(pres, g - p, g)",
           "g = np.where(pres, g + p, g)", PR, "presence penalty added instead of subtracted"),
    Mutant("processors.frequency_count_off", "src/lmtail/tail/processors.py", "g = np.where(freq, g - f * c, g)",
           "g = np.where(freq, g - f * (c + 1), g)", PR, "frequency penalty on count + 1"),
    Mutant("processors.bias_twice", "src/lmtail/tail/processors.py", "g = np.where(hb, g + b, g)",
           "g = np.where(hb, g + b + b, g)", PR, "logit_bias added twice (one rounding)"),
    Mutant("processors.rep_then_bias_swapped", "src/lmtail/tail/processors.py",
           "g = flat[idx]  # [n] fp32", "g = flat[idx]  # [n] fp32\n    g = np.where(hb, g + b, g)\n    hb = hb & False",
           PR, "logit_bias applied first (before the penalties)"),
    Mutant("processors.rep_prompt_dropped", "src/lmtail/tail/processors.py", "rep_ids=np.union1d(prompt, cnt_ids)",
           "rep_ids=cnt_ids", PR, "repetition penalty over the output tokens only"),
    Mutant("processors.mask_not_offset", "src/lmtail/tail/processors.py", "~pl.allowed.numpy()[v0:v0 + vs]", "~pl.allowed.numpy()[:vs]",
           PR, "the allowed mask read from lane 0 on every shard (wrong past rank 0)"),
    Mutant("processors.shard_edge", "src/lmtail/tail/processors.py", "ids[(ids >= v0) & (ids < v0 + vs)]",
           "ids[(ids >= v0) & (ids <= v0 + vs)]", PR, "a shard also edits the next shard's first id"),
    Mutant("processors.neutral_rep_skipped", "src/lmtail/tail/processors.py", "if r != 1 else empty, r=r",
           "if r > 1 else empty, r=r", PR, "repetition penalties below 1 ignored"),
    Mutant("tail.processing_dropped_one_rank", "src/lmtail/tail/compose.py",
           "apply_plans(logits, plans, v0=0)  # the seam", "pass  # the seam", PR,
           "decode_tail on one rank ignores processing"),
    Mutant("tail.processing_rank_offset", "src/lmtail/tail/compose.py", "apply_plans(lg, plans[rows], v0=me * vs)",
           "apply_plans(lg, plans[rows], v0=0)", PR, "candidates ranks: every rank edits ids 0.. (no shard offset)"),
    Mutant("batch.bq32_rows_shared_position", "src/lmtail/serve/batch.py",
           "kern.rope_qkv(qkv[r:r + 1], cos_t, sin_t, pos[r],", "kern.rope_qkv(qkv[r:r + 1], cos_t, sin_t, pos[0],",
           ("test_q32.py",), "the bq32 rows step ropes every row at the first row's position"),
    Mutant("serve.ride_run_never_plain", "src/lmtail/serve/engine.py", "if self._rides >= RIDE_RUN:",
           "if False:", ("test_serve_ride.py",),
           "every decode step carries a chunk while a prompt is prefilled (the medians freeze)"),
    Mutant("serve.chunker_unprimed", "src/lmtail/serve/engine.py", "pre.chunker.prime(self._cost, budget)",
           "pass", ("test_serve_ride.py",), "a new group's first chunk is FIRST_CHUNK, not primed from the last cost"),
    Mutant("serve.chunker_last_only", "src/lmtail/serve/engine.py",
           "self.cost + COST_GAIN * (per - self.cost)", "per", ("test_serve_ride.py",),
           "the Chunker's cost is the last chunk's alone (no smoothing)"),
    Mutant("serve.touch_unpaced", "src/lmtail/serve/engine.py",
           "idle = TOUCH_IDLE if self._rows and n > TOUCH_PACED else 0.0", "idle = 0.0", ("test_serve_ride.py",),
           "a long prompt's page faults taken at once beside decoding rows"),
    Mutant("serve.counts_double", "src/lmtail/serve/engine.py", "r.counts[tid] = r.counts.get(tid, 0) + 1",
           "r.counts[tid] = r.counts.get(tid, 0) + 2", ("test_serve_processors.py",),
           "the engine counts each generated token twice (penalties)"),
)


def select(mutants, pattern: str | None) -> list:
    """The mutants whose name matches one of the comma-separated fnmatch patterns (or
    contains it as a substring); all when pattern is None."""
    from fnmatch import fnmatch

    pats = [p.strip() for p in (pattern or "").split(",") if p.strip()]
    return [m for m in mutants if not pats or any(fnmatch(m.name, p) or p in m.name for p in pats)]


def _copy_tree(dst: Path) -> None:
    for part in ("src", "tests"):
        shutil.copytree(ROOT / part, dst / part, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy2(ROOT / "pyproject.toml", dst / "pyproject.toml")


def _pytest(tree: Path, tests, timeout: float) -> tuple[str, float, str]:
    """(outcome, seconds, last line): outcome 'pass' | 'fail' | 'error' | 'timeout'."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *[f"tests/{t}" for t in tests]]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - t0, ""
    last = (p.stdout.strip().splitlines() or [""])[-1]
    outcome = {0: "pass", 1: "fail"}.get(p.returncode, "error")
    return outcome, time.perf_counter() - t0, last


def run_mutant(m: Mutant, drop: set, timeout: float) -> dict:
    path, why = locate(m)
    if path is None:
        return dict(name=m.name, status="stale", seconds=0.0, detail=why)
    src = (ROOT / path).read_text()
    tests = [t for t in m.tests if t not in drop]
    if not tests:
        return dict(name=m.name, status="untested", seconds=0.0, detail="every test file it names is left out")
    with tempfile.TemporaryDirectory(prefix="lmtail-mut-") as d:
        tree = Path(d)
        _copy_tree(tree)
        (tree / path).write_text(src.replace(m.old, m.new))
        outcome, secs, last = _pytest(tree, tests, timeout)
    status = "survived" if outcome == "pass" else "killed"
    return dict(name=m.name, status=status, seconds=secs, detail=f"{outcome}: {last}", tests=tests, path=path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None,
                   help="comma-separated fnmatch patterns or substrings of mutant names (default: all)")
    p.add_argument("--drop", action="append", default=[], help="a test file to leave out (repeatable)")
    p.add_argument("--keep", action="append", default=[], help="run only these test files (repeatable)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant")
    p.add_argument("--list", action="store_true")
    args = p.parse_args(argv)
    muts = select(MUTANTS, args.only)
    if args.list:
        for m in muts:
            path, why = locate(m)
            print(f"{m.name:<28} {path or 'STALE: ' + why:<40} {m.what}")
        return 0
    drop = set(args.drop)
    base_tests = sorted({t for m in muts for t in m.tests if t not in drop})
    if args.keep:
        base_tests = [t for t in base_tests if t in args.keep]
        drop |= {t for m in muts for t in m.tests} - set(base_tests)
    with tempfile.TemporaryDirectory(prefix="lmtail-mut-") as d:
        _copy_tree(Path(d))
        for t in base_tests:  # a file red without any edit cannot judge a mutant: leave it out
            outcome, secs, last = _pytest(Path(d), [t], args.timeout * 2)
            print(f"baseline {t}: {outcome} in {secs:.0f} s: {last}")
            if outcome != "pass":
                drop.add(t)
    if drop:
        print(f"left out: {', '.join(sorted(drop))}")
    rows = [run_mutant(m, drop, args.timeout) for m in muts]
    print("\n| mutant | file | what | tests | result | s |\n|---|---|---|---|---|---|")
    for m, r in zip(muts, rows):
        print(f"| {m.name} | {r.get('path', m.path).removeprefix('src/lmtail/')} | {m.what} | "
              f"{', '.join(r.get('tests', [])) or '-'} | {r['status']} ({r['detail']}) | {r['seconds']:.0f} |")
    killed = sum(r["status"] == "killed" for r in rows)
    survived = [r["name"] for r in rows if r["status"] == "survived"]
    stale = [r["name"] for r in rows if r["status"] == "stale"]
    print(f"\n{killed}/{len(rows)} killed; survived: {survived or 'none'}; stale: {stale or 'none'}")
    untested = [r["name"] for r in rows if r["status"] == "untested"]
    if untested:
        print(f"untested (their test files left out): {untested}")
    return 0 if not survived and not stale else 1


if __name__ == "__main__":
    sys.exit(main())
