"""Speed of body.c's glue rows at SmolLM2's shapes: each op's "avx512" row (16 lanes) against
its "avx2" row (exp32, silu_mul: 8 lanes) or its portable C (add_rms_rows32, rope_qkv: the
compiler's x86-64-v4 clone on an AVX-512 CPU), A-B-B-A in one process after checking the
outputs equal bit for bit.

    .venv/bin/python -m lmtail.benchmarks.bench_body_ops [--rounds 6] [--number 200] [--threads 1]
    .venv/bin/python -m lmtail.benchmarks.bench_body_ops --step [--rows 1 16] [--steps 8] [--threads 1]

--step times the whole q32 decode step (generate's native step, SmolLM2) with body.c's cap
at "avx512" (the 16-lane glue rows) against "avx2" (silu_mul's 8-lane rows, the norm and
rope as the compiler's clones: the rows the step took before the 16-lane ones existed), the
same cached model with its cap switched between arms; the arms' final hidden states are
checked equal bit for bit first.

Each timed call is one ctypes call of body.c's entry on preallocated buffers (~1 us of
python per call, in both arms). Ratio = median paired time / the base arm's (< 1: the avx512 row is faster).
Shape legend: N rows, H hidden (576), F FFN width (1536), nh / nkv heads (9 / 3), S slots.
"""
from __future__ import annotations

import argparse
import ctypes
import time

import torch

from lmtail.bench import abba, check_bitwise, format_table
from lmtail.kernels.model import body as kbody
from lmtail.kernels.quant import gemm_q as kquant
from lmtail.model import body as decl
from lmtail.model import llama
from lmtail.model.gguf_loader import load_model

H, F, NH, NKV, S = 576, 1536, 9, 3, 1200


def cases(n: int) -> dict:
    """op name -> (arm -> zero-argument call, base arm) at n rows. Each arm writes its own
    preallocated outputs through body.c's entry (no allocation timed) and returns them."""
    lib, cap = kbody.native_library(), kbody.ISA_CAP
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 1024, generator=g) * 10  # [N, 1024] (attention-like exp rows)
    gu = torch.randn(n, 2 * F, generator=g) * 4  # [N, 2F]
    a, r, gam = torch.randn(n, H, generator=g), torch.randn(n, H, generator=g), torch.rand(H, generator=g)
    qkv = torch.randn(n, (NH + 2 * NKV) * 64, generator=g)  # [N, (nh + 2 nkv) 64]
    cos_t, sin_t = decl.rope_table(S, 64, 10000.0)
    pos = torch.full((n,), 1000, dtype=torch.int64)  # [B] (T = 1)

    def exp(isa):
        y = torch.empty_like(x)
        return lambda: (lib.lmtail_exp32_isa(x.data_ptr(), y.data_ptr(), x.numel(), cap[isa]), y)[1]

    def silu(isa):
        o = torch.empty(n, F)
        return lambda: (lib.lmtail_silu_mul_isa(gu.data_ptr(), o.data_ptr(), n, F, 2 * F, cap[isa]), o)[1]

    def norm(isa):
        h, y = torch.empty(n, H), torch.empty(n, H)
        return lambda: (lib.lmtail_add_rms_rows32(a.data_ptr(), H, r.data_ptr(), gam.data_ptr(), n, H,
                                                  ctypes.c_float(1e-5), 256, h.data_ptr(), y.data_ptr(),
                                                  cap[isa]), h, y)[1:]

    def rope(isa):
        q, kc, vc = torch.empty(n, NH * 64), torch.zeros(n, NKV, 64, S), torch.zeros(n, NKV, S, 64)
        return lambda: (lib.lmtail_rope_qkv(qkv.data_ptr(), qkv.shape[1], cos_t.data_ptr(), sin_t.data_ptr(),
                                            pos.data_ptr(), q.data_ptr(), kc.data_ptr(), vc.data_ptr(), n, 1,
                                            NH, NKV, S, 1000, cap[isa]), q, kc[..., 1000], vc[:, :, 1000])[1:]

    return {
        "exp32 [N, 1024]": ({i: exp(i) for i in ("avx2", "avx512")}, "avx2"),
        "silu_mul [N, 2F]": ({i: silu(i) for i in ("avx2", "avx512")}, "avx2"),
        "add_rms_rows32 [N, H]": ({i: norm(i) for i in ("c", "avx512")}, "c"),
        "rope_qkv [N, 960]": ({i: rope(i) for i in ("c", "avx512")}, "c"),
    }


def step_arm(bundle, body_isa: int, rows: int, steps: int, prompt: int):
    """A zero-argument call: `steps` decode steps of `rows` rows after a `prompt`-token
    prefill (done once here; each call rewinds the cache to it and rewrites the same slots),
    with the native step's body.c cap set to body_isa. Returns (seconds per step, last y)."""
    ops = llama.lmtail_ops(body="q32")
    model = llama.q32_model(bundle, ops.fused_norm_lanes, kquant.GEMM_Q.pick(None, rows=rows).name,
                            decl.ATTEND.pick(None, rows=rows).name)
    cache = llama.new_cache(bundle.config, pad=torch.zeros(rows, dtype=torch.int64), capacity=prompt + steps)
    llama.prefill(bundle, torch.arange(100, 100 + prompt).repeat(rows, 1), cache, ops=ops)  # [B, P]
    nxt = torch.full((rows, 1), 500, dtype=torch.int64)

    def run():
        model.struct.body_isa = body_isa  # the cached model is shared by both arms
        cache.length = prompt
        t = time.perf_counter()
        for _ in range(steps):
            _, y = llama.forward(bundle, nxt, cache, ops=ops)  # [B, 1, H]
        return (time.perf_counter() - t) / steps, y

    return run


def main_step(args) -> None:
    bundle = load_model()
    res = {}
    for n in args.rows:
        for prompt in args.prompts:
            arms = {isa: step_arm(bundle, kbody.ISA_CAP[isa], n, args.steps, prompt) for isa in ("avx2", "avx512")}
            res[f"decode step, B={n}, context {prompt}, threads={args.threads}"] = abba(
                arms, base="avx2", rounds=args.rounds, timer=lambda fn: fn()[0],
                check=lambda name, out, base: check_bitwise(name, out[1], base[1]))
    print(format_table(res, title="q32 decode step: body.c cap avx512 vs avx2 (ratio < 1: faster)"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--number", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--step", action="store_true", help="time the whole q32 decode step instead")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, nargs="+", default=[100], help="--step: context lengths")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.step:
        return main_step(args)
    res = {}
    for n in args.rows:
        for name, (arms, base) in cases(n).items():
            res[f"{name}, N={n}"] = abba(arms, base=base, rounds=args.rounds, number=args.number,
                                         check=check_bitwise)
    print(format_table(res, title="body.c glue rows: avx512 vs avx2 / portable C (ratio < 1: avx512 faster)"))


if __name__ == "__main__":
    main()
