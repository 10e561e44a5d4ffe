"""The tail's exact top-k, sampler and row_mass kinds' pieces: data, runs, float64 checks,
planted variants and case generators (the registry in tail_kinds.py names the kinds).

"rows data": rows [R, V] bf16, k, chunk, nan_fold (+ sp [R, 5] fp32, exact for the sampler).
Checks take (data, out, run, decl).

Shape legend: R rows, V vocab, k candidates.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..kernels.tail.rowmass import row_mass
from ..kernels.tail.rows_tail import available_backends as fused_backends
from ..kernels.tail.rows_tail import rows_tail_decl, rows_tail_fused
from ..numerics import Decl, U, log64
from ..reference.contract import decl_slack, logprob_ref, range_margin, sample_decision
from ..reference.tail import as_np, logprob_emulation, mass_emulation, sum64_emulation
from ..tail.compose import rows_tail
from ..tail.sampler import draw, sampling_plan, validate_params
from ..tail.topk import exact_topk, row_keys, split_keys
from .harness import Case, Kind, Verdict
from .logits_kinds import topk_verdict


# ---------------------------------------------------------------------------------------
# exact top-k
# ---------------------------------------------------------------------------------------
def rows_data(r, v, seed, *, k, chunk=512, scale=2.0, nan_fold=False):
    """bf16 rows [R, V] ~ N(0, scale) (bf16 ties are common at V = 1000s)."""
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(r, v, generator=g) * scale).to(torch.bfloat16)
    return dict(rows=rows, k=min(k, v), chunk=chunk, nan_fold=nan_fold)


def take_rows_rows(data, idx):
    out = dict(data, rows=data["rows"][list(idx)])
    if "sp" in data:
        out["sp"] = data["sp"][list(idx)]
    return out


def run_topk(data) -> dict:
    v, i, _ = exact_topk(data["rows"], k=data["k"], nan_fold=data["nan_fold"], chunk=data["chunk"])
    return {"topk_values": v, "topk_indices": i}


def check_topk(data, out, run, decl) -> Verdict:
    return topk_verdict(data["rows"], out["topk_values"], out["topk_indices"], data["k"], data["nan_fold"])


def topk_variant(data, defect=None) -> dict:
    """exact_topk with one defect: "ties_higher_id" (equal values ranked by the higher id)
    or "stage1_short" (stage 1 keeps only k/2 keys per chunk: not exact when more than
    k/2 winners share a chunk)."""
    rows, k, nf, chunk = data["rows"], data["k"], data["nan_fold"], data["chunk"]
    if defect == "ties_higher_id":
        v, i, _ = exact_topk(rows.flip(-1), k=k, nan_fold=nf, chunk=chunk)
        return {"topk_values": v, "topk_indices": rows.shape[1] - 1 - i}
    if defect == "stage1_short":
        r, n_v = rows.shape
        if not 1 <= k <= n_v:
            raise ValueError(f"k must be in [1, V={n_v}]; got {k}")
        n = -(-n_v // chunk)
        keys = torch.cat([row_keys(rows, nan_fold=nf), torch.zeros(r, n * chunk - n_v, dtype=torch.int64)], 1)
        s1 = torch.topk(keys.view(r, n, chunk), max(1, min(k, chunk) // 2), dim=-1).values
        cand = s1.reshape(r, -1)
        cand = torch.cat([cand, torch.zeros(r, max(0, k - cand.shape[1]), dtype=torch.int64)], 1)
        v, i = split_keys(torch.topk(cand, k, dim=-1).values)
        return {"topk_values": v, "topk_indices": i}
    return run_topk(data)


def _topk_no_crash(data, out, run, decl) -> Verdict:
    r, k = data["rows"].shape[0], data["k"]
    ok = tuple(out["topk_indices"].shape) == (r, k) and bool(((out["topk_indices"] >= 0) &
                                                               (out["topk_indices"] < data["rows"].shape[1])).all())
    return Verdict(ok, None, "NaN without the fold: unspecified but no crash, ids in range" if ok else
                   "NaN without the fold: bad shape or ids")


def topk_shapes(fast):
    table = [(1, 1, 1, 4096), (300, 37, 5, 8), (3, 4097, 256, 4096), (2, 10000, 256, 4096),
             (5, 129, 129, 16), (4, 1000, 1, 64), (2, 61, 60, 7)]
    return [Case(f"{r}x{v} k={k} chunk={c}", rows_data(r, v, 200 + i, k=k, chunk=c))
            for i, (r, v, k, c) in enumerate(table)]


def topk_random(fast):
    return [Case(f"seed {s}", rows_data(16, 3000, s, k=64, scale=(2.0, 0.01, 300.0, 1.0)[s % 4]))
            for s in range(2 if fast else 6)]


def topk_special(fast):
    d = rows_data(6, 300, 7, k=20, chunk=64, nan_fold=True)
    rows = d["rows"].float()
    rows[0, [0, 5, 77]] = math.nan  # NaN below every number (fold)
    rows[1] = math.nan  # an all-NaN row: ids 0..k-1
    rows[2, [3, 9, 200]] = math.inf  # +inf ties by id
    rows[2, [4, 8]] = -math.inf
    rows[3] = -math.inf  # all -inf: ids 0..k-1, never a pad lane
    rows[4] = torch.where(torch.arange(300) % 2 == 0, 0.0, -0.0)  # +-0 tie by id
    rows[5] = torch.randn(300, generator=torch.Generator().manual_seed(5)).sign() * 2.0**-130  # subnormal
    cases = [Case("NaN (folded), +-inf, all -inf, +-0, subnormal", dict(d, rows=rows.to(torch.bfloat16)))]
    nf = dict(d, rows=rows.to(torch.bfloat16), nan_fold=False)
    cases.append(Case("NaN without the fold: unspecified, no crash", nf, expect=_topk_no_crash))
    cases += [Case("k = 0 -> ValueError", dict(d, k=0), raises=r"k must be in \[1, V=300\]"),
              Case("k > V -> ValueError", dict(d, k=301), raises=r"k must be in \[1, V=300\]"),
              Case("chunk = 0 -> ValueError", dict(d, chunk=0), raises=r"chunk must be >= 1")]
    return cases


def topk_adversarial(fast):
    v, c = 1000, 128
    eq = torch.full((2, v), 1.5)  # all ties: ids 0..k-1
    one = torch.randn(1, v, generator=torch.Generator().manual_seed(9)) - 10
    one[0, 3 * c - 20:4 * c] = torch.linspace(5, 6, 20 + c)  # every winner in chunks 2-3
    one[0, c - 1] = one[0, c] = 7.0  # a tie straddling a chunk boundary
    asc = torch.arange(v, dtype=torch.float32)[None] / 8  # winners at the end, ties of 8
    rows = torch.cat([eq, one, asc]).to(torch.bfloat16)
    return [Case("ties everywhere, winners in one chunk, ties across chunk edges", dict(rows=rows, k=64, chunk=c, nan_fold=False)),
            Case("k = V with a padded last chunk", dict(rows=rows, k=v, chunk=c, nan_fold=False))]


# ---------------------------------------------------------------------------------------
# the sampler
# ---------------------------------------------------------------------------------------
def random_params(r, seed, k) -> torch.Tensor:
    """[R, 5] fp32 (top_k, top_p, temperature, u, min_p): a mix of every sampling option."""
    g = torch.Generator().manual_seed(1000 + seed)
    pick = lambda vals: torch.tensor(vals)[torch.randint(0, len(vals), (r,), generator=g)]  # noqa: E731
    return torch.stack([pick([0.0, 1.0, 5.0, 40.0, float(k), float(k + 7)]),
                        pick([1.0, 0.95, 0.8, 0.5, 0.1]), pick([1.0, 0.7, 1.5, 0.0, 0.05]),
                        torch.rand(r, generator=g) * (1 - 2.0**-24), pick([0.0, 0.0, 0.05])], 1).float()


def sampler_data(r, v, seed, *, k, scale=2.0):
    d = rows_data(r, v, seed, k=k, scale=scale)
    d["sp"] = random_params(r, seed, d["k"])
    return d


def run_sampler(data) -> dict:
    """rows_tail's tokens, logprobs, truncated flags, and (where the fused C kernel is built)
    "mass" [R, 3] float64: the kernel's own S1, lse1, nz per row (rows_tail_fused's
    debug_mass export; NaN on rows it leaves undecided)."""
    out = rows_tail(data["rows"], k=data["k"], sampling_params=data["sp"], nan_fold=data["nan_fold"])
    return with_fused_mass(data, {"tokens": out.tokens, "logprobs": out.logprobs, "truncated": out.truncated})


def with_fused_mass(data, res: dict) -> dict:
    """res plus "mass" [R, 3] float64 (S1, lse1, nz per row, NaN on undecided rows) from
    rows_tail_fused(debug_mass=True), where the fused C kernel is built; res as is where not."""
    if fused_backends():
        res = dict(res, mass=rows_tail_fused(data["rows"], k=data["k"], sampling_params=data["sp"],
                                             nan_fold=data["nan_fold"], debug_mass=True).debug_mass)
    return res


def sampler_variant(data, defect=None) -> dict:
    """rows_tail's sampler restated with one defect: "topp_drops_crossing" (keep iff the
    mass INCLUDING the candidate is < top_p) or "greedy_1e-3" (T < 1e-3 taken as greedy);
    the fused kernel's exported mass as run_sampler has it (no defect touches it)."""
    rows, k, sp, nf = data["rows"], data["k"], data["sp"], data["nan_fold"]
    validate_params(sp, rows.shape[0])
    vals, ids, _ = exact_topk(rows, k=k, nan_fold=nf)
    plan = sampling_plan(vals, rows, sp, nan_fold=nf)
    top_p = sp[:, 1].double()[:, None]
    if defect == "topp_drops_crossing":
        keep = plan["keep"] & ((plan["running"] < top_p) | (top_p >= 1))
        keep[:, 0] = True
        plan = dict(plan, keep=keep)
    if defect == "greedy_1e-3":
        plan = dict(plan, greedy=sp[:, 2].double() < 1e-3)
    pos = draw(plan)[:, None]
    v_tok = vals.double().gather(1, pos)[:, 0]
    return with_fused_mass(data, {"tokens": ids.gather(1, pos)[:, 0], "truncated": plan["truncated"],
                                  "logprobs": (v_tok - plan["lse1"]).to(torch.float32)})


def sampler_verdict(rows_bf16, sp, k, nan_fold, out, *, exact=False, decl: Decl | None = None) -> Verdict:
    """Per row, the float64 decision on the row's own bf16 values (delta = 0): on a
    certified row the truncated flag must be the defined one and, where the exact token can be
    drawn from k candidates (`comparable`), the token must match; near-ties (a mass within
    the float64 slack of a threshold) are counted; the logprob must be within
    slack*(1 + |lse| + |lp|) + u32 of the float64 log_softmax at its token."""
    r64 = as_np(rows_bf16)
    if nan_fold:
        r64 = np.where(np.isnan(r64), -np.inf, r64)
    n_v = r64.shape[1]
    slack = 0.0 if exact else decl_slack(decl or rows_tail_decl(n_v, k), n_v, k)
    spn = sp.double().numpy()
    spn = np.pad(spn, ((0, 0), (0, 5 - spn.shape[1])), constant_values=0.0)
    if sp.shape[1] < 4:
        spn[:, 3] = 0.5
    tok, lp, tr = out["tokens"].numpy(), out["logprobs"].double().numpy(), out["truncated"].numpy()
    counts = dict(certified=0, matched=0, near_ties=0, truncated=0)
    worst, fail = math.inf, ""
    for i in range(r64.shape[0]):
        tk, tp, t, u, mp = spn[i]
        dec = sample_decision(r64[i], np.zeros(n_v), top_k=tk, top_p=tp, temperature=t, u=u,
                              min_p=mp, k=k, slack=slack)
        if not dec["certified"]:
            counts["near_ties"] += 1
            continue
        counts["truncated"] += dec["truncated"]
        if bool(tr[i]) != dec["truncated"] and not fail:
            fail = (f"row {i} {spn[i].tolist()}: truncated flag {bool(tr[i])}, defined {dec['truncated']} "
                    f"(k={k}, {dec['n_filter']} filtered, {dec['n_keep']} kept)")
        if not dec["comparable"]:
            continue
        counts["certified"] += 1
        if tok[i] != dec["token"] and not fail:
            fail = (f"row {i} {spn[i].tolist()}: token {tok[i]}, float64 gives {dec['token']} "
                    f"(slot {dec['slot']} of {dec['n_keep']} kept)")
        else:
            counts["matched"] += 1
        ref = logprob_ref(r64[i])[tok[i]]
        if not (lp[i] == ref or np.isnan(ref) and np.isnan(lp[i])):
            lse = abs(r64[i].max()) + abs(ref)
            err = slack * (1 + lse + abs(ref)) + U["fp32"] * (abs(ref) + 1e-300) * 1.0001
            inside, m = range_margin(lp[i], ref - err, ref + err)
            worst = min(worst, float(m))
            if not inside and not fail:
                fail = f"row {i}: logprob {lp[i]!r} vs float64 {ref!r} (bound {err:.3g})"
    detail = fail or (f"{counts['matched']}/{counts['certified']} certified rows match, "
                      f"{counts['near_ties']} near-ties, {counts['truncated']} truncated")
    return Verdict(not fail, None if worst == math.inf else worst, detail, counts)


def check_sampler(data, out, run, decl) -> Verdict:
    return sampler_verdict(data["rows"], data["sp"], data["k"], data["nan_fold"], out,
                           exact=bool(data.get("exact", False)), decl=decl)


def _sp(rows):
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), 5)


def _tokens_are(want):
    def expect(data, out, run, decl):
        got = out["tokens"].tolist()
        return Verdict(got == list(want), None, f"tokens {got}" + ("" if got == list(want) else f", defined {list(want)}"))
    return expect


def sampler_shapes(fast):
    table = [(1, 5, 5), (300, 37, 8), (7, 1000, 64), (3, 4097, 256), (2, 61, 61)]
    return [Case(f"{r}x{v} k={k}", sampler_data(r, v, 300 + i, k=k)) for i, (r, v, k) in enumerate(table)]


def sampler_random(fast):
    return [Case(f"seed {s}", sampler_data(64, 1000, s, k=64, scale=(2.0, 0.5, 8.0, 1.0, 4.0, 2.0)[s]))
            for s in range(2 if fast else 6)]


def sampler_special(fast):
    t_above = float(np.nextafter(np.float32(1e-5), np.float32(1)))
    d = rows_data(7, 100, 17, k=16)
    rows = d["rows"].float()
    rows[:, 40] = rows[:, 41] = rows.max() + 1  # a tied top two (ids 40, 41)
    sp = _sp([[0, 1, 0, 0.9, 0], [0, 1, np.float32(1e-5), 0.9, 0], [2, 1, t_above, 0.75, 0],
              [2, 1, 5e-4, 0.75, 0], [5, 1, 1, 0, 0], [5, 1, 1, 1 - 2.0**-24, 0], [20, 1, 1, 0.5, 0]])
    cases = [Case("T = 0, fp32(1e-5) greedy; T just above 1e-5 and 5e-4 sample the tie; u = 0, "
                  "u = 1-2^-24; top_k > k flagged", dict(d, rows=rows.to(torch.bfloat16), sp=sp))]
    inf_row = torch.full((2, 16), 1.0)
    inf_row[:, [3, 7]] = math.inf
    cases.append(Case("two +inf lanes split the mass: u = 0.25 -> id 3, u = 0.75 -> id 7",
                      dict(rows=inf_row.to(torch.bfloat16), k=16, chunk=512, nan_fold=False,
                           sp=_sp([[0, 1, 1, 0.25, 0], [0, 1, 1, 0.75, 0]])), expect=_tokens_are([3, 7])))
    cases.append(Case("all -inf row: uniform, u = 0.3 -> id 2; u = 0.99 -> id 7",
                      dict(rows=torch.full((2, 8), -math.inf).to(torch.bfloat16), k=8, chunk=512, nan_fold=False,
                           sp=_sp([[0, 1, 1, 0.3, 0], [0, 1, 1, 0.99, 0]])), expect=_tokens_are([2, 7])))
    nrows = rows_data(3, 64, 18, k=64)["rows"].float()
    nrows[:, [0, 4]] = math.nan
    cases.append(Case("NaN lanes (folded) never chosen", dict(rows=nrows.to(torch.bfloat16), k=64, chunk=512, nan_fold=True,
                                                           sp=_sp([[0, 1, 0, 0.5, 0], [0, 1, 1, 0.5, 0], [3, 0.9, 0.7, 0.2, 0]]))))
    base = dict(rows=rows[:1].to(torch.bfloat16), k=16, chunk=512, nan_fold=False)
    for label, row, match in (("NaN param", [0, math.nan, 1, 0.5, 0], "has NaN"),
                              ("top_p = 0", [0, 0, 1, 0.5, 0], r"top_p must be in \(0, 1\]"),
                              ("top_p > 1", [0, 1.5, 1, 0.5, 0], r"top_p must be in \(0, 1\]"),
                              ("T < 0", [0, 1, -1, 0.5, 0], "temperature must be >= 0"),
                              ("u = 1", [0, 1, 1, 1.0, 0], r"u must be in \[0, 1\)"),
                              ("top_k = 2.5", [2.5, 1, 1, 0.5, 0], "top_k must be a whole number")):
        cases.append(Case(f"{label} -> ValueError naming row 0", dict(base, sp=_sp([row])), raises=rf"row 0: {match}"))
    return cases


def sampler_adversarial(fast):
    """Exact dyadic decisions: 4 equal maxima (ids 2, 5, 9, 11), the rest -inf, so every
    p is 1/4 and every mass and cdf is exact; top_p and u sit ON the boundaries."""
    row = torch.full((16,), -math.inf)
    row[[2, 5, 9, 11]] = 3.0
    sp = _sp([[0, 0.5, 1, 0.5, 0], [0, 0.5, 1, 0.4999, 0], [2, 1, 1, 0.75, 0], [0, 0.75, 1, 0.0, 0],
              [0, 0.25, 1, 0.9, 0], [0, 1, 0.5, 0.9, 1.0], [0, 1, 1, 0.5, 0], [0, 1, 1, 0.25, 0]])
    rows = row.repeat(sp.shape[0], 1).to(torch.bfloat16)
    return [Case("top_p and u exactly on mass boundaries, ties at the top-k threshold",
                 dict(rows=rows, k=16, chunk=512, nan_fold=False, sp=sp, exact=True))]


def readout_rows(r=8, v=1024, seed=0) -> torch.Tensor:
    """bf16 rows [R, V] whose raw logprob shows the full-row mass S1's last bit: vmax = 1
    at one id, ~30 lanes at 1 - U(22, 26) (terms ~2^-33, several in the max's lane chain
    mod 256 and mod 128), the rest -inf. S1 - 1 < 2^-28, so lse1 - 1 = log64(S1) is exact
    in fp32 and the greedy token's logprob is -(lse1 - 1) to the bit: a wrong lane count
    or exp term in the fused kernel's mass changes it."""
    rng = np.random.default_rng(seed)
    rows = np.full((r, v), -np.inf)
    for i in range(r):
        top = int(rng.integers(0, 256))
        rows[i, top] = 1.0
        lanes = np.concatenate([top + 128 * np.arange(1, v // 128), rng.integers(0, v, 24)]) % v
        lanes = lanes[lanes != top]
        rows[i, lanes] = 1.0 - rng.uniform(22, 26, lanes.size)
    return torch.from_numpy(rows.astype(np.float32)).to(torch.bfloat16)


def sampler_bytes(fast):
    """The byte gates' sampler inputs: random rows, and greedy readout rows (S1's bits)."""
    rows = readout_rows()
    sp = _sp([[0, 1, 0, 0.5, 0]] * rows.shape[0])
    return [Case("seed 0", sampler_data(64, 1000, 0, k=64)),
            Case("readout rows: logprob = -(lse1 - 1) exactly", dict(rows=rows, k=4, chunk=512, nan_fold=False, sp=sp))]


def emulate_sampler(data, *, lanes=256) -> dict:
    """The reference path's tokens and truncated flags, and the raw logprob emulated from
    the declared mass (reference.tail.logprob_emulation: sum64 in `lanes` chains)."""
    out = rows_tail(data["rows"], k=data["k"], sampling_params=data["sp"], nan_fold=data["nan_fold"], path="reference")
    lp = logprob_emulation(data["rows"], out.tokens.numpy(), lanes=lanes)
    res = {"tokens": out.tokens, "logprobs": torch.from_numpy(lp), "truncated": out.truncated}
    if fused_backends():
        res["mass"] = mass_rows_emulation(data["rows"], data["nan_fold"], lanes=lanes)
    return res


def mass_rows_emulation(rows_bf16, nan_fold: bool, *, lanes=256) -> torch.Tensor:
    """[R, 3] float64 (S1, lse1, nz) by the declaration: reference.tail.mass_emulation at
    T = 1 (sum64 in `lanes` chains), lse1 = fl64(vmax + log64(S1)); NaN on rows the declared
    mass leaves undefined (a NaN lane without nan_fold, no finite maximum). The fused
    kernel's debug_mass export must equal it bit for bit (the emulate gate)."""
    r64 = as_np(rows_bf16)  # [R, V]
    nan_row = np.isnan(r64).any(axis=1)
    r64 = np.where(np.isnan(r64), -np.inf, r64)  # nan_fold: a NaN lane counts as -inf
    with np.errstate(invalid="ignore"):
        m, s, nz = mass_emulation(r64, np.ones(r64.shape[0]), lanes=lanes)
    lse1 = m + log64(torch.from_numpy(s)).numpy()
    res = torch.from_numpy(np.stack([s, lse1, nz.astype(np.float64)], axis=1))  # [R, 3]
    res[torch.from_numpy((nan_row & (not nan_fold)) | ~np.isfinite(m))] = float("nan")
    return res


def sampler_mass_lanes_128(data) -> dict:
    """Control: the op with its full-row mass summed in 128 lane chains (the logprob and
    the exported mass)."""
    out, emu = run_sampler(data), emulate_sampler(data, lanes=128)
    return dict(out, **{n: emu[n] for n in ("logprobs", "mass") if n in emu})


# ---------------------------------------------------------------------------------------
# row_mass: the full-row max, mass and massive-lane count (the sampler's normalizer)
# ---------------------------------------------------------------------------------------
def row_mass_decl(data) -> Decl:
    """row_mass's one sum is rows_tail_decl's "S (full row)" (single-sourced)."""
    return Decl("row_mass", ("z = fl64(row / scale)", "m = max z", "e = exp64(z - m) (z == m -> 1)", "S = sum64(e)"),
                (rows_tail_decl(data["row"].shape[1], 1).sum("S (full row)"),))


def run_row_mass(data) -> dict:
    m, s, nz = row_mass(data["row"], data["scale"])
    return {"m": m, "S": s, "nz": nz}


def emulate_row_mass(data, *, lanes=256, exp=None) -> dict:
    """(m, S, nz) by the declaration (reference.tail.mass_emulation); lanes / exp: planted
    variants (another lane count, another exp for the terms)."""
    if exp is not None:  # control: another exp for the terms
        z = data["row"] / data["scale"][:, None]
        m = z.max(1).values
        e = torch.where(z == m[:, None], torch.ones_like(z), exp(z - m[:, None]))
        return {"m": m, "S": torch.from_numpy(sum64_emulation(e.numpy(), lanes)), "nz": (e > 0).sum(1)}
    m, s, nz = mass_emulation(data["row"], data["scale"], lanes=lanes)
    return {"m": torch.from_numpy(m), "S": torch.from_numpy(s), "nz": torch.from_numpy(nz).to(torch.int64)}


def check_row_mass(data, out, run, decl) -> Verdict:
    """m = max(row / scale) exactly; S within (bound(S) + 2^-50) * S* of the float64
    S* = sum exp(z - m) (libm; exp64's < 2 ulp per term); nz = #{z - m > -745}."""
    z = as_np(data["row"]) / as_np(data["scale"])[:, None]
    m = z.max(axis=1)
    got_m = out["m"].numpy()
    if not np.array_equal(got_m, m):
        return Verdict(False, None, f"m = {got_m.tolist()}, max(row/scale) = {m.tolist()}")
    with np.errstate(invalid="ignore"):
        d = np.where(z == m[:, None], 0.0, z - m[:, None])
    exact = np.exp(d).sum(axis=1)
    b = decl.sum("S (full row)").bound() + 2.0**-50
    inside, mg = range_margin(out["S"].numpy(), exact * (1 - b), exact * (1 + b))
    if not inside.all():
        r = int(np.nonzero(~inside)[0][0])
        return Verdict(False, float(mg.min()), f"S[{r}] = {float(out['S'][r])!r} outside +-{b:.3g} of {exact[r]!r}")
    nz = (d > -745).sum(axis=1)
    if not np.array_equal(out["nz"].numpy(), nz):
        return Verdict(False, float(mg.min()), f"nz = {out['nz'].tolist()}, lanes with mass = {nz.tolist()}")
    return Verdict(True, float(mg.min()), f"{len(exact)} rows: m exact, S in range, nz exact")


def mass_data(r, v, seed, *, scale=2.0, temps=(1.0,)):
    g = torch.Generator().manual_seed(seed)
    row = (torch.randn(r, v, generator=g) * scale).to(torch.bfloat16).double()
    t = torch.tensor(temps, dtype=torch.float32).double()
    return {"row": row, "scale": t[torch.arange(r) % len(temps)]}


def _mass_specials(fast):
    row = torch.randn(5, 300, generator=torch.Generator().manual_seed(3)).double()
    row[0, 7] = math.inf  # +inf max: z == m -> 1, the rest 0
    row[1] = -math.inf  # all -inf: every lane z == m -> S = V
    row[2, :150] = -1000.0  # terms below exp64's floor: no mass
    row[3] = 5.0  # all tied: S = V exactly
    row[4, ::2] = -720.0  # subnormal terms
    return [Case("+inf lane, all -inf, floor-deep lanes, all tied, subnormal terms",
                 {"row": row, "scale": torch.ones(5, dtype=torch.float64)}),
            Case("float32 row -> ValueError", {"row": row.float(), "scale": torch.ones(5, dtype=torch.float64)},
                 raises=r"row must be torch.float64")]


def mass_kind() -> Kind:
    gens = {"shapes": lambda fast: [Case(f"{r}x{v}", mass_data(r, v, 70 + i)) for i, (r, v) in
                                    enumerate([(1, 1), (3, 255), (2, 257), (4, 4097), (2, 49155)])],
            "random": lambda fast: [Case(f"seed {s}", mass_data(8, 3000, s, scale=(2.0, 20.0, 0.1)[s], temps=(1.0, 0.7, 1.3)))
                                    for s in range(2 if fast else 3)],
            "special": _mass_specials,
            "adversarial": lambda fast: [Case("readout rows (terms ~2^-33 beside a 1)",
                                              {"row": readout_rows().double(), "scale": torch.ones(8, dtype=torch.float64)})]}
    return Kind("tail.row_mass", row_mass_decl, run_row_mass, check_row_mass, gens,
                take_rows=lambda d, idx: dict(d, row=d["row"][list(idx)], scale=d["scale"][list(idx)]),
                emulate=emulate_row_mass, about="row_mass -> m, S, nz; S in rows_tail_decl's sum64 range")
