"""`lmtail doctor`: what this machine runs, checked, and which backend each op uses.

One screen: the CPU (model, the ISA flags the kernels dispatch on), the compiler, where the
compiled kernels and their verdicts are cached, then per op every backend of its table with
its status (reference: the plain emulation every hardware row is checked against;
verified; failed and why; unavailable: this CPU lacks the ISA or the kernel is not built;
emulated: a SIMDe / AMX-model build, for tests), its measured time per shape class (rows 1 /
2-16 / more, on the op's probe) and the classes it is chosen for. The first run on a
machine makes the verdicts (one child process per op, ~2-5 s each); later runs read them.
`--json`: the same as one JSON object, for a bug report; `--recheck`: check again.

Shape legend: none (a report).
"""
from __future__ import annotations

import json
import platform
import sys
import time

CLASS_TITLES = {"1": "1 row", "16": "2-16 rows", "many": ">16 rows"}


def tables() -> list:
    """Every op's backend table (importing the modules that define them)."""
    from lmtail.kernels.glue import fmachain
    from lmtail.kernels.gemm import bf16 as gemm
    from lmtail.kernels.quant import gemm_bq, gemm_q as quant
    from lmtail.kernels.tail import rowmass, rows_tail, shard_partials
    from lmtail.model import body

    return [*gemm.GEMM.values(), quant.GEMM_Q, gemm_bq.GEMM_BQ, rows_tail.ROWS_TAIL, rowmass.ROW_MASS,
            rowmass.TERMS, shard_partials.SHARD_PARTIALS, fmachain.FMA_SUM, fmachain.MOE_ROUTED,
            body.EXP32, body.SILU_MUL, body.SILU_MUL_BF16, body.ATTEND]


def table_report(table) -> dict:
    """One op: {op, backends: [{name, status, reason, times {class: s}, chosen [classes]}]}."""
    have, emulated = table.names("cpu"), table.names("cpu", emulated=True)
    rec = table.record() if table.checked() else None
    rows = []
    for r in table.rows:
        if r.device not in (None, "cpu"):
            continue
        entry = {"name": r.name, "status": "unavailable", "reason": "", "times": {}, "chosen": []}
        if r.name in have:
            if rec is None:
                entry["status"] = "reference" if r.name in ("c", "torch", "numba") else "unchecked"
            else:
                entry["status"] = rec.status.get(r.name, "not timed")
                entry["reason"] = rec.reason.get(r.name, "")
                entry["times"] = {c: t[r.name] for c, t in rec.times.items() if r.name in t}
                entry["chosen"] = [c for c, n in rec.chosen.items() if n == r.name]
            if rec is None and r.name == have[0]:
                entry["chosen"] = list(CLASS_TITLES)
        elif r.name in emulated:
            entry["status"] = "emulated"
        rows.append(entry)
    return {"op": table.op, "cache": rec.path if rec else "", "backends": rows}


def recheck(table) -> None:
    """Drop the table's cached record (disk and process), so the next look makes it anew."""
    from lmtail.kernels import _verify

    _verify.cache_file(table, table.cache_dir).unlink(missing_ok=True)
    table._record = None


def machine_report() -> dict:
    import torch

    from lmtail.kernels import _cc, _verify, cpu

    compiler = _cc.compiler_line()
    built = (f"prebuilt with the package ({_cc.PREBUILT})" if _cc.prebuilt_manifest()
             else "compiled here at first use")
    return {"cpu": _verify.cpu_model(), "machine": platform.machine(),
            "features": sorted(cpu.features()), "compiler": compiler,
            "cache": str(_cc.cache_dir()), "kernels": built, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _title(key: str) -> str:
    """"16" -> "2-16 rows"; "16/packed" -> "2-16 rows packed"."""
    cls, _, layout = key.partition("/")
    return CLASS_TITLES[cls] + (f" {layout}" if layout else "")


def _ms(s) -> str:
    if s is None:
        return ""
    if s == float("inf"):
        return "(>30x)"
    return f"{s * 1e3:.3g} ms"


def render(report: dict) -> str:
    m = report["machine"]
    lines = [f"lmtail doctor, {m['date']}",
             f"CPU       {m['cpu']} ({m['machine']}): {' '.join(m['features']) or 'no vector ISA used'}",
             f"compiler  {m['compiler']}",
             f"kernels   {m['kernels']}",
             f"torch     {m['torch']}, {m['threads']} threads; Python {m['python']}",
             f"cache     {m['cache']} (compiled kernels; verdicts/ holds each op's record)",
             "",
             f"{'op':<20} {'backend':<11} {'status':<11} " + " ".join(f"{t:>10}" for t in CLASS_TITLES.values())
             + "  chosen for"]
    for op in report["ops"]:
        shown = [b for b in op["backends"] if b["status"] != "emulated"]
        emulated = [b["name"] for b in op["backends"] if b["status"] == "emulated"]
        for i, b in enumerate(shown):
            times = " ".join(f"{_ms(b['times'].get(c)):>10}" for c in CLASS_TITLES)
            chosen = ", ".join(_title(c) for c in b["chosen"])
            lines.append(f"{op['op'] if i == 0 else '':<20} {b['name']:<11} {b['status']:<11} {times}  {chosen}")
            packed = " ".join(f"{_ms(b['times'].get(c + '/packed')):>10}" for c in CLASS_TITLES)
            if packed.strip():
                lines.append(f"{'':<20} {'':<11} {'  packed w':<11} {packed}")
            if b["reason"]:
                lines.append(f"{'':<20} {'':<11} ^ {b['reason']}")
        if emulated:
            lines.append(f"{'':<20} {'emulated':<11} {', '.join(emulated)} (SIMDe / AMX-model builds: tests only)")
    failed = [(o["op"], b["name"]) for o in report["ops"] for b in o["backends"] if b["status"] == "failed"]
    lines += ["", (f"{len(failed)} backend(s) failed their check and are not used: "
                   + ", ".join(f"{o} {n}" for o, n in failed)) if failed else
              "every backend this CPU runs passed its bit-for-bit check against the plain C emulation"]
    return "\n".join(lines)


def configure(parser) -> None:
    parser.description = __doc__.split("\n\n")[1].replace("\n", " ")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--recheck", action="store_true",
                        help="forget this machine's cached verdicts and check every backend again "
                             "(e.g. after a check was killed by something outside lmtail)")


def check(args) -> None:
    """Nothing to check: doctor takes no values."""


def run(args) -> int:
    report = {"machine": machine_report(), "ops": []}
    for table in tables():
        if args.recheck:
            recheck(table)
        if not args.json:
            print(f"checking {table.op} ...", file=sys.stderr, flush=True)
        report["ops"].append(table_report(table))
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0
