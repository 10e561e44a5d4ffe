"""Planted-bug mutation run: does the test suite notice small wrong edits of the ops?

Each mutant is one textual edit of one source file (a declared order, a rounding point, a
tie rule, an fma split into a multiply and an add, ...). For each, the tree (src/, tests/,
pyproject.toml) is copied to a temporary directory, the edit applied there, and the test
files the mutant names run with the copy first on PYTHONPATH. A mutant is

    killed     some test failed (or the run errored: the edit broke an import)
    survived   every test passed: a hole in the suite (or an equivalent edit)
    stale      its `old` text is not in the file any more (the source moved on: update it)

    .venv/bin/python tools/mutate.py                    # every mutant
    .venv/bin/python tools/mutate.py --only tail.       # names containing "tail."
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


K = ("test_golden.py",)
MUTANTS = (
    Mutant("tail.ssq_order", "src/lmtail/tail.py", "SSQ_ORDER = strided(256)", "SSQ_ORDER = strided(128)",
           K + ("test_tail.py",), "the tail's declared ssq order: 256 -> 128 lanes"),
    Mutant("tail.rms_legacy_order", "src/lmtail/tail.py", "a = ((x * rms[:, None]) * g).to(torch.bfloat16)",
           "a = (x * (rms[:, None] * g)).to(torch.bfloat16)", K + ("test_tail.py",),
           "legacy rounding point: (x*rms)*gamma -> x*(rms*gamma)"),
    Mutant("norms.default_order", "src/lmtail/norms.py", "DEFAULT_ORDER = strided(256)",
           "DEFAULT_ORDER = Order(\"contiguous\", 256, 8)", K + ("test_norms.py",), "the norms' declared order"),
    Mutant("norms.mlx_once", "src/lmtail/norms.py",
           "t = t.to(torch.bfloat16).to(torch.float32)  # MLX stores x*inv as bf16", "t = t",
           K + ("test_norms.py",), "rms_parts 'mlx' without its bf16 rounding of x*inv"),
    Mutant("norms.eps_half", "src/lmtail/norms.py", "d = m + torch.full_like(m, eps)",
           "d = m + torch.full_like(m, eps * 0.5)", K + ("test_norms.py",), "eps halved"),
    Mutant("fmachain.torch_butterfly", "src/lmtail/kernels/fmachain.py", "g = g[..., :half] + g[..., half:]",
           "g = g[..., 0::2] + g[..., 1::2]", K + ("test_orders.py", "test_fmachain.py"),
           "torch butterfly folded pairwise (the placebo) instead of by halves"),
    Mutant("fmachain.torch_group_order", "src/lmtail/kernels/fmachain.py",
           "    total = g[..., 0, 0]\n    for k in range(1, t // 32):\n        total = total + g[..., k, 0]",
           "    total = g[..., t // 32 - 1, 0]\n    for k in range(t // 32 - 2, -1, -1):\n        total = total + g[..., k, 0]",
           K + ("test_orders.py", "test_fmachain.py"), "lane-group totals added last to first"),
    Mutant("router.ties_high", "src/lmtail/router.py", "return mono * e + (e - 1 - ids)", "return mono * e + ids",
           K + ("test_router.py",), "router ties to the higher expert id"),
    Mutant("router.sum_reversed", "src/lmtail/router.py",
           "    tot = s_sel[:, 0]\n    for j in range(1, k):\n        tot = tot + s_sel[:, j]",
           "    tot = s_sel[:, k - 1]\n    for j in range(k - 2, -1, -1):\n        tot = tot + s_sel[:, j]",
           K + ("test_router.py",), "weight normalizer summed in reverse of the returned order"),
    Mutant("topk.ties_high", "src/lmtail/topk.py", "local = (local.view(r, n, chunk) << 14) | ((chunk - 1) - pos)",
           "local = (local.view(r, n, chunk) << 14) | pos", K + ("test_topk.py",),
           "stage-1 ties to the higher lane"),
    Mutant("sampler.greedy_1e-4", "src/lmtail/sampler.py", "GREEDY_TEMPERATURE = 1e-5", "GREEDY_TEMPERATURE = 1e-4",
           K + ("test_sampler.py",), "greedy threshold moved"),
    Mutant("numerics.fma_tie", "src/lmtail/numerics.py", "torch.where(e > 0, above, below)",
           "torch.where(e > 0, below, above)", K + ("test_numerics.py",), "fma32 breaks float64 midpoints the wrong way"),
    Mutant("numerics.sqrt_no_fix", "src/lmtail/numerics.py", "r = torch.where(mid_hi * mid_hi < d64, up, r)",
           "r = torch.where(mid_hi * mid_hi < d64, r, r)", K + ("test_numerics.py",),
           "sqrt_rn32 without its upward correction"),
    Mutant("numerics.exp_degree12", "src/lmtail/numerics.py", "for c in reversed(_EXP_C[1:13]):",
           "for c in reversed(_EXP_C[2:13]):", K + ("test_numerics.py",), "exp64 polynomial with a wrong coefficient"),
    Mutant("gemm_chain.c.unfused", "src/lmtail/kernels/gemm_chain.c",
           "acc[r][0] = _mm512_fmadd_ps(b, w0, acc[r][0]);",
           "acc[r][0] = _mm512_add_ps(_mm512_mul_ps(b, w0), acc[r][0]);", K + ("test_gemm.py",),
           "AVX-512 GEMM column block 0 as multiply + add (two roundings)"),
    Mutant("fmachain.c.butterfly", "src/lmtail/kernels/fmachain.c",
           "for (int half = 16; half >= 1; half /= 2)", "for (int half = 1; half <= 16; half *= 2)",
           K + ("test_fmachain.py",), "plain-C butterfly folded 1..16 (halves of the wrong size)"),
    Mutant("fmachain.c.unfused", "src/lmtail/kernels/fmachain.c",
           "                    s[u] = _mm512_fmadd_ps(x, y, s[u]);\n                }",
           "                    s[u] = _mm512_add_ps(_mm512_mul_ps(x, y), s[u]);\n                }",
           K + ("test_fmachain.py", "test_norms.py"), "AVX-512 strided ssq chain as multiply + add"),
)


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
    src = (ROOT / m.path).read_text()
    if src.count(m.old) != 1:
        return dict(name=m.name, status="stale", seconds=0.0, detail=f"`old` occurs {src.count(m.old)}x in {m.path}")
    tests = [t for t in m.tests if t not in drop]
    if not tests:
        return dict(name=m.name, status="untested", seconds=0.0, detail="every test file it names is left out")
    with tempfile.TemporaryDirectory(prefix="lmtail-mut-") as d:
        tree = Path(d)
        _copy_tree(tree)
        (tree / m.path).write_text(src.replace(m.old, m.new))
        outcome, secs, last = _pytest(tree, tests, timeout)
    status = "survived" if outcome == "pass" else "killed"
    return dict(name=m.name, status=status, seconds=secs, detail=f"{outcome}: {last}", tests=tests)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="run mutants whose name contains this")
    p.add_argument("--drop", action="append", default=[], help="a test file to leave out (repeatable)")
    p.add_argument("--keep", action="append", default=[], help="run only these test files (repeatable)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant")
    p.add_argument("--list", action="store_true")
    args = p.parse_args(argv)
    muts = [m for m in MUTANTS if not args.only or args.only in m.name]
    if args.list:
        for m in muts:
            print(f"{m.name:<24} {m.path:<36} {m.what}")
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
        print(f"| {m.name} | {m.path.removeprefix('src/lmtail/')} | {m.what} | "
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
