"""The peer table: lmtail vs llama.cpp and vLLM (CPU) on SmolLM2-135M-Instruct, every row measured.

    .venv/bin/python benchmarks/peers/table.py [--quick] [--rounds 4] [--new 32] [--body declared ...]
    make bench-peers          (runs this after setting up each peer's venv; docs/peers.md)

Each arm lives in its own venv, so each runs as a persistent worker process (one per venv:
lmtail_arm.py in .venv, llamacpp/bench.py in benchmarks/.venv-llamacpp, vllm/bench_decode.py
in benchmarks/.venv-vllm) speaking worker_proto.py's JSON lines. Every engine gets the same
token ids (the GGUF vocabulary, no BOS). The driver times the arms of a row side by side,
alternating A B B A across the workers (lmtail.bench.abba; each worker times its own work),
after checking they agree, and reports medians over rounds and the median of the paired
per-round ratios peer time / lmtail time (> 1: lmtail faster).

vLLM's decode seconds are stamps of its own engine steps (vllm/bench_decode.py).
Rows (threads 1 and 2 unless --threads):
  decode    tokens/s over N (--new) greedy steps after the first token of a short chat
            prompt (batch B: the first B of PROMPTS), every engine; llama.cpp's batch 1 is
            Llama.generate, its B > 1 llama.cpp's batched llama_decode (llamacpp/bench.py). Check first:
            every row's first greedy token equals lmtail's, except where the fp32 reference
            body scores the two within TIE_NATS (a near tie).
  prefill   tokens/s of one P-token prompt to its first token (P = 512, 2,048; receipt
            text): lmtail, llama.cpp (vLLM with --vllm-prefill). Check: the same next token
            (or a near tie of the fp32 reference).
  batch     each of 4 chat prompts alone vs the 4 in one batch, greedy, --batch-new tokens:
            the first step where a request's token moves, per engine.
  faithful  teacher-forced over the receipts' texts (first 256 tokens of each): argmax
            agreement with the fp32 reference (llama.FP32_OPS + logits_fp32) and mean
            KL(ref || engine); lmtail: the tail's fp32 logits of each body, llama.cpp:
            logits_all. (lmtail_arm.faithfulness: the same measure for any ops.)
A peer whose venv or model is missing prints a SKIP line and its cells read '-'.
Shape legend: B rows, N decode steps, P prompt tokens, T tokens, V vocab.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))

TIE_NATS = 0.1  # a differing first token is accepted when the fp32 reference scores both this close
# Short chat prompts with long answers (no row stops early). Each one's first greedy decision
# is clear in the fp32 reference: top-1 minus top-2 logit >= 0.6 nats (measured; a bf16
# engine such as vLLM moves logits by ~0.1-0.2 nats, and prompts closer than that, e.g.
# "Describe a day in the life of a lighthouse keeper." at 0.155, made the first-token check
# fail on a legitimate bf16 difference).
PROMPTS = (
    "Write a long story about a dragon who learns to cook.",       # 1.33 nats
    "Describe the history of the printing press.",                 # 3.94
    "Write a long letter to a friend about your summer holiday.",  # 2.09
    "Explain how the moon causes tides.",                          # 4.37
    "Explain how a computer stores numbers.",                      # 0.87
    "Write an essay about why people keep gardens.",               # 1.59
    "Describe how bread is made, from wheat to loaf.",             # 1.40
    "Tell a long story about a robot who wants to paint.",         # 1.14
    "Write a detailed guide to planning a hiking trip.",           # 1.92
    "Describe the life cycle of a butterfly in detail.",           # 1.20
    "Explain how a steam engine works.",                           # 0.98
    "Write a long story about a cat who travels the world.",       # 2.06
    "Describe the water cycle in detail.",                         # 4.66
    "Explain photosynthesis step by step.",                        # 4.03
    "Explain how the internet works.",                             # 4.14
    "Explain how airplanes fly.",                                  # 0.70
)


# ---------------------------------------------------------------------------------------
# pure helpers (tests/test_peers_table.py)
# ---------------------------------------------------------------------------------------
def paired_ratio(arm_s: list[float], base_s: list[float]) -> float:
    """Median over rounds of arm_s[r] / base_s[r] (> 1: the base was faster)."""
    if len(arm_s) != len(base_s) or not arm_s:
        raise ValueError(f"arm_s and base_s must be equal-length non-empty lists; got {len(arm_s)} and {len(base_s)}")
    if min(base_s) <= 0 or min(arm_s) <= 0:
        raise ValueError(f"times must be > 0; got arm {arm_s} base {base_s}")
    return statistics.median(a / b for a, b in zip(arm_s, base_s))


def abba_order(names: list[str], rounds: int) -> list[str]:
    """The call order A B .. B A ..: round r runs `names` forward when r is even, else reversed."""
    out = []
    for r in range(rounds):
        out += list(names if r % 2 == 0 else names[::-1])
    return out


def reduce_flags(flags_line: str) -> str:
    """The SIMD flags that matter here from /proc/cpuinfo's `flags : ...` line:
    avx2, fma, f16c, every avx512* and amx* (sorted, space separated), or '(none of avx2/avx512/amx)'."""
    words = flags_line.split(":", 1)[-1].split()
    keep = sorted({w for w in words if w in ("avx2", "fma", "f16c") or w.startswith(("avx512", "amx"))})
    return " ".join(keep) if keep else "(none of avx2/avx512/amx)"


def first_divergence(alone: list[int], batch: list[int]) -> int | None:
    """The first step (1-based) where the batched request's token differs from its run alone;
    None when they agree over the shorter length (and a length difference counts as a move
    at the first missing step)."""
    for i, (a, b) in enumerate(zip(alone, batch)):
        if a != b:
            return i + 1
    if len(alone) != len(batch):
        return min(len(alone), len(batch)) + 1
    return None


def divergence_cell(alone: list[list[int]], batch: list[list[int]] | None, why: str = "") -> str:
    """One engine's cell of the alone-vs-batch row."""
    if batch is None:
        return f"- ({why})" if why else "-"
    steps = [first_divergence(a, b) for a, b in zip(alone, batch)]
    same = sum(s is None for s in steps)
    n = max(len(a) for a in alone)
    if same == len(steps):
        return f"identical: {same}/{len(steps)} requests x {n} tokens"
    moved = ", ".join(f"req {i} @ step {s}" for i, s in enumerate(steps) if s is not None)
    return f"{same}/{len(steps)} identical; first move: {moved}"


def fmt_rate(x: float | None) -> str:
    return "-" if x is None else (f"{x:,.0f}" if x >= 100 else f"{x:.1f}")


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table; the first column left-aligned, the others right-aligned."""
    if any(len(r) != len(header) for r in rows):
        raise ValueError(f"every row must have {len(header)} cells; got {[len(r) for r in rows]}")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# workers
# ---------------------------------------------------------------------------------------
class WorkerError(RuntimeError):
    pass


@dataclass
class Worker:
    """A persistent arm process (worker_proto.py). skip: why it is unusable ('' when up)."""

    name: str
    cmd: list[str]
    log: Path
    env: dict = field(default_factory=dict)
    start_timeout_s: float = 900.0
    proc: subprocess.Popen | None = None
    skip: str = ""
    info: dict = field(default_factory=dict)

    def start(self) -> None:
        if not Path(self.cmd[0]).exists():
            self.skip = f"{self.cmd[0]} missing (its setup.sh has not built the venv)"
            return
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log, "w"), text=True, cwd=ROOT,
                                     env={**os.environ, **self.env})

    def ready(self) -> bool:
        """Wait for the worker's first answer (its start-up); False (and skip set) when it cannot serve."""
        if self.skip:
            return False
        try:
            self.info = self.call("info", timeout_s=self.start_timeout_s)
            return True
        except WorkerError as e:
            self.skip = str(e)
            self.close()
            return False

    def call(self, op: str, timeout_s: float = 900.0, **args) -> dict:
        p = self.proc
        try:
            p.stdin.write(json.dumps({"op": op, **args}) + "\n")
            p.stdin.flush()
        except (BrokenPipeError, OSError):
            said = p.stdout.read() if p.poll() is not None else ""  # a worker that exited may have said SKIP
            raise WorkerError(said.strip() if said.startswith("SKIP") else
                              f"{self.name} worker exited (log: {self.log})") from None
        if not select.select([p.stdout], [], [], timeout_s)[0]:
            raise WorkerError(f"{self.name} worker gave no answer to {op!r} in {timeout_s:.0f} s (log: {self.log})")
        line = p.stdout.readline()
        if not line:
            raise WorkerError(f"{self.name} worker exited (log: {self.log}; last line: {tail(self.log)})")
        if line.startswith("SKIP"):
            raise WorkerError(line.strip())
        try:
            out = json.loads(line)
        except json.JSONDecodeError:
            raise WorkerError(f"{self.name} worker broke the protocol: {line[:200]!r}") from None
        if not out.pop("ok"):
            raise WorkerError(f"{self.name}: {out['error']}")
        return out

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def tail(path: Path) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
        return lines[-1][:300] if lines else ""
    except OSError:
        return ""


def make_workers(args, log_dir: Path) -> dict[str, Worker]:
    venv = lambda n: str(ROOT / "benchmarks" / f".venv-{n}" / "bin" / "python")  # noqa: E731
    w = {"lmtail": Worker("lmtail", [sys.executable, str(HERE / "lmtail_arm.py"), "--worker"], log_dir / "lmtail.log")}
    if "llamacpp" in args.peers:
        from lmtail.model.gguf_loader import locate_gguf
        w["llama.cpp"] = Worker("llama.cpp", [args.llamacpp_python or venv("llamacpp"), str(HERE / "llamacpp" / "bench.py"), "--worker",
                                              "--gguf", str(locate_gguf())], log_dir / "llamacpp.log")
    if "vllm" in args.peers:
        w["vLLM"] = Worker("vLLM", [venv("vllm"), str(HERE / "vllm" / "bench_decode.py"), "--worker",
                                    "--timing", args.vllm_timing, "--bind", args.vllm_bind]
                           + (["--eager"] if args.vllm_eager else []),
                           log_dir / "vllm.log")
    return w


# ---------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------
@dataclass
class Timed:
    """One row's timing: per arm the seconds per round (or why it is missing)."""

    times: dict[str, list[float]] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    failed: str = ""


SETTLE_S = 0.5  # idle seconds before each timed call


def run_abba(calls: dict, rounds: int, check) -> Timed:
    """calls: arm -> zero-argument fn returning a worker answer with "s". The first call of
    each arm is the untimed check (check(outs) raises on disagreement); then `rounds`
    rounds in A B B A order, each timed call after SETTLE_S idle seconds: an engine's
    threads poll or spin for a while after its work (llama.cpp's threadpool, OpenMP teams,
    lmtail's kernel pools), and on 2 cores a spinning thread of the previous arm would take
    a core from the next one."""
    out = Timed()
    try:
        outs = {a: f() for a, f in calls.items()}
        check(outs)
    except (AssertionError, WorkerError) as e:
        out.failed = f"check failed: {e}"
        return out
    out.times = {a: [] for a in calls}
    for a in abba_order(list(calls), rounds):
        time.sleep(SETTLE_S)
        try:
            s = calls[a]()["s"]
        except WorkerError as e:
            out.failed = str(e)
            return out
        if not s > 0:
            out.failed = f"{a} reported a non-positive time {s:.4f} s"
            return out
        out.times[a].append(s)
    return out


class Reference:
    """The fp32 reference body, for near-tie checks and faithfulness (loaded in this process)."""

    def __init__(self):
        from lmtail.model import load_model
        self.bundle = load_model()

    def last_logits(self, ids: list[int]):
        """fp32 reference logits [V] after ids (the fp32 body, logits of the last position only)."""
        import lmtail_arm
        from lmtail.model import llama
        _, y = lmtail_arm._forward_all(self.bundle, ids, llama.FP32_OPS)  # [T, H]
        return llama.logits_fp32(self.bundle, y[-1])

    def tie(self, ids: list[int], a: int, b: int) -> float:
        lg = self.last_logits(ids)
        return float((lg[a] - lg[b]).abs())


def first_token_check(ref: Reference, prompts: list[list[int]], base: str):
    def check(outs):
        base_first = [t[0] for t in outs[base]["tokens"]]
        for arm, o in outs.items():
            for r, toks in enumerate(o["tokens"]):
                if toks[0] != base_first[r]:
                    gap = ref.tie(prompts[r], toks[0], base_first[r])
                    if gap >= TIE_NATS:
                        raise AssertionError(f"{arm} row {r}: first token {toks[0]} vs {base} {base_first[r]}, "
                                             f"fp32 gap {gap:.3f} >= {TIE_NATS}")
    return check


def next_token_check(ref: Reference, ids: list[int], base: str):
    def check(outs):
        for arm, o in outs.items():
            if o["token"] != outs[base]["token"]:
                gap = ref.tie(ids, o["token"], outs[base]["token"])
                if gap >= TIE_NATS:
                    raise AssertionError(f"{arm}: next token {o['token']} vs {base} {outs[base]['token']}, "
                                         f"fp32 gap {gap:.3f} >= {TIE_NATS}")
    return check


def lm_arm(body: str) -> str:
    return f"lmtail[{body}]"


def call_for(workers, arm: str, op: str, **kw):
    """A zero-argument call of `op` on the worker behind `arm` (lmtail[body] -> lmtail, body=)."""
    if arm.startswith("lmtail["):
        return lambda: workers["lmtail"].call(op, body=arm[7:-1], **kw)
    return lambda: workers[arm].call(op, **kw)


def decode_row(workers, arms, ref, prompts, n, threads, rounds) -> Timed:
    calls = {a: call_for(workers, a, "decode", prompts=prompts, n=n, threads=threads) for a in arms}
    return run_abba(calls, rounds, first_token_check(ref, prompts, arms[0]))


def prefill_row(workers, arms, ref, ids, threads, rounds) -> Timed:
    calls = {a: call_for(workers, a, "prefill", ids=ids, threads=threads) for a in arms}
    return run_abba(calls, rounds, next_token_check(ref, ids, arms[0]))


# ---------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------
def env_lines(workers, args, load0) -> list[str]:
    import torch
    cpu = "?"
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "?":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line
    except OSError:
        pass
    vers = [f"torch {torch.__version__}"] + [w.info.get("version", "?") + (f" ({w.info['mode']})" if "mode" in w.info else "")
                                             for w in workers.values() if not w.skip]
    sysinfo = [f"- llama.cpp system info: {w.info['system_info'].strip()}" for w in workers.values()
               if not w.skip and "system_info" in w.info]
    return [f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; host {platform.node()}, "
            f"{os.cpu_count()} logical CPUs",
            f"- CPU: {cpu}; flags: {reduce_flags(flags)}",
            f"- versions: {', '.join(vers)}",
            f"- load average at start {load0}, at end {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
            f"(the box is shared: times are noisy, ratios are paired per round)",
            f"- rounds {args.rounds} (A B B A), decode N = {args.new} steps, lmtail bodies {', '.join(args.body)} "
            f"(ratios against lmtail[{args.body[0]}])"] + sysinfo


def timed_cells(t: Timed, arms, all_arms, work: float) -> tuple[list[str], list[str]]:
    """(value cells for all_arms: work / median s, ratio cells for all_arms[1:] vs all_arms[0])."""
    base = all_arms[0]
    vals, ratios = [], []
    for a in all_arms:
        if a not in arms or t.failed or a not in t.times:
            vals.append("-")
        else:
            vals.append(fmt_rate(work / statistics.median(t.times[a])))
    for a in all_arms[1:]:
        ok = a in t.times and base in t.times and not t.failed
        ratios.append(fmt_ratio(paired_ratio(t.times[a], t.times[base])) if ok else "-")
    return vals, ratios


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (< 3 min after start-up): 2 rounds, "
                    "N 8, batch 4, prefill 512, threads 1, 1 faithfulness text")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds per row (2 = one A B B A)")
    ap.add_argument("--new", type=int, default=16, help="decode steps N timed after the first token")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prefill", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--batch-new", type=int, default=48, help="tokens per request in the alone-vs-batch row")
    ap.add_argument("--texts", type=int, default=6, help="receipt texts for faithfulness (256 tokens each)")
    ap.add_argument("--body", nargs="+", default=None,
                    help="lmtail bodies to measure (first = the base of every ratio; default: generate()'s, "
                         "and bq32 on a CPU with AMX)")
    ap.add_argument("--peers", nargs="*", default=["llamacpp", "vllm"], choices=["llamacpp", "vllm"],
                    help="peer arms (none: lmtail alone)")
    ap.add_argument("--vllm-prefill", action="store_true", help="time vLLM's prefill too (generate, max_tokens 1)")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (faster start)")
    ap.add_argument("--vllm-timing", choices=["steps", "subtract"], default="steps",
                    help="vLLM decode seconds: stamps of its engine steps (default) or time(N+1) - time(1)")
    ap.add_argument("--vllm-bind", default="nobind", help="VLLM_CPU_OMP_THREADS_BIND (nobind, or a cpu list: 0-1)")
    ap.add_argument("--llamacpp-python", default=None, help="python for the llama.cpp worker "
                    "(default: benchmarks/.venv-llamacpp/bin/python)")
    ap.add_argument("--log-dir", default=None, help="worker logs (default: a temp dir, printed)")
    args = ap.parse_args(argv)
    import lmtail_arm
    if args.body is None:
        args.body = lmtail_arm.table_bodies()
    if args.quick:
        args.rounds, args.new, args.batches, args.prefill, args.texts = 2, 8, [1, 4], [512], 1
        args.threads, args.batch_new = [1], 16
    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    t_start = time.time()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="lmtail-peers-"))
    workers = make_workers(args, log_dir)
    for w in workers.values():
        w.start()
    try:
        return run_table(args, workers, log_dir, load0, t_start)
    finally:
        for w in workers.values():
            w.close()


def run_table(args, workers, log_dir, load0, t_start) -> int:
    import lmtail_arm
    ref = Reference()
    for name, w in workers.items():
        if not w.ready():
            print(f"SKIP {name}: {w.skip}")
    if workers["lmtail"].skip:
        print(f"lmtail's own arm failed to start: {workers['lmtail'].skip}")
        return 1
    up = [n for n in ("llama.cpp", "vLLM") if n in workers and not workers[n].skip]
    print(f"(workers up after {time.time() - t_start:.0f} s: lmtail{''.join(', ' + n for n in up)}; logs in {log_dir})",
          flush=True)
    lm = [lm_arm(b) for b in args.body]
    all_arms = lm + up
    chat = [ref.bundle.tokenizer.encode(ref.bundle.tokenizer.chat_prompt(p)) for p in PROMPTS]
    header = ["row", "threads"] + all_arms + [f"{a} ÷ {all_arms[0]}" for a in all_arms[1:]]
    rows = []

    def emit(label, threads, vals, ratios, note=""):
        rows.append([label + (f" ({note})" if note else ""), str(threads)] + vals + ratios)
        print(f"  {label}, threads {threads}: " + ", ".join(f"{a} {v}" for a, v in zip(all_arms, vals))
              + (f" [{note}]" if note else ""), flush=True)

    for b in args.batches:
        arms = lm + up
        for t in args.threads:
            res = decode_row(workers, arms, ref, chat[:b], args.new, t, args.rounds)
            vals, ratios = timed_cells(res, arms, all_arms, b * args.new)
            emit(f"decode tok/s, batch {b}", t, vals, ratios, res.failed)
    texts = lmtail_arm.receipt_texts(ref.bundle, tokens=256, count=max(args.texts, 1))
    long_ids = [i for ids in lmtail_arm.receipt_texts(ref.bundle, tokens=256, count=6) for i in ids]
    for p in args.prefill:
        ids = (long_ids * (p // len(long_ids) + 1))[:p]
        arms = lm + [a for a in up if a == "llama.cpp" or (a == "vLLM" and args.vllm_prefill)]
        for t in args.threads:
            res = prefill_row(workers, arms, ref, ids, t, max(2, args.rounds // 2))
            vals, ratios = timed_cells(res, arms, all_arms, p)
            emit(f"prefill tok/s, {p:,} tokens", t, vals, ratios, res.failed)
    rows.append(alone_vs_batch_row(workers, all_arms, chat[:4], args.batch_new, min(args.threads)))
    print(f"  alone vs batch: {rows[-1][2:2 + len(all_arms)]}", flush=True)
    rows += faithfulness_rows(workers, all_arms, ref, texts[:args.texts], log_dir)
    print()
    print("### SmolLM2-135M-Instruct (Q4_1 GGUF): lmtail vs llama.cpp and vLLM, CPU\n")
    print("\n".join(env_lines(workers, args, load0)))
    for n in ("llama.cpp", "vLLM"):
        if n in workers and workers[n].skip:
            print(f"- SKIP {n}: {workers[n].skip}")
    print()
    print(markdown_table(header, rows))
    print(f"\nRates are medians over rounds; a ratio is the median of the paired per-round time ratios "
          f"arm / {all_arms[0]} (> 1: {all_arms[0]} faster). Decode: N = {args.new} greedy steps after the first "
          f"token of a short chat prompt (PROMPTS[:B]); prefill: receipt text to its first token. "
          f"Total {time.time() - t_start:.0f} s.")
    return 0


def alone_vs_batch_row(workers, all_arms, prompts, n, threads) -> list[str]:
    cells = []
    for a in all_arms:
        try:
            o = call_for(workers, a, "alone_vs_batch", prompts=prompts, n=n, threads=threads)()
            cells.append(divergence_cell(o["alone"], o.get("batch"), o.get("why", "")))
        except WorkerError as e:
            cells.append(f"- ({e})")
    return [f"request alone vs in a batch of {len(prompts)}, greedy {n} tokens", str(threads)] + cells + \
        ["-"] * (len(all_arms) - 1)


def faithfulness_rows(workers, all_arms, ref, texts, log_dir) -> list[list[str]]:
    import numpy as np
    import torch
    import lmtail_arm
    refs = [lmtail_arm.reference_logits(ref.bundle, ids) for ids in texts]
    res = {}
    for a in all_arms:
        if a.startswith("lmtail["):
            fn = lmtail_arm.lmtail_logits(lmtail_arm.ops_for(a[7:-1]))
        elif a == "llama.cpp":
            def fn(bundle, ids, _w=workers[a]):
                path = str(log_dir / "llamacpp-logits.npy")
                _w.call("logits", ids=ids, path=path)
                return torch.from_numpy(np.load(path))
        else:
            continue  # vLLM: no full-vocabulary teacher-forced logits through its offline API
        try:
            res[a] = lmtail_arm.faithfulness(ref.bundle, texts, fn, refs=refs)
        except WorkerError as e:
            print(f"  faithfulness {a}: {e}")
    n = sum(len(t) for t in texts)
    agree = [f"{100 * res[a]['agree']:.1f}%" if a in res else "-" for a in all_arms]
    kl = [f"{res[a]['kl']:.2e}" if a in res else "-" for a in all_arms]
    pad = ["-"] * (len(all_arms) - 1)
    what = f"{len(texts)} receipt texts x 256 = {n} positions, vs fp32 reference"
    print(f"  faithfulness: {dict(zip(all_arms, agree))} {dict(zip(all_arms, kl))}", flush=True)
    return [[f"teacher-forced argmax agreement ({what})", "-"] + agree + pad,
            ["teacher-forced mean KL(ref ‖ engine), nats", "-"] + kl + pad]


if __name__ == "__main__":
    raise SystemExit(main())
