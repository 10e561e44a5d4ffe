"""Speed of the glue ops against a plain torch composition of the same math (same outputs
up to summation order), side by side in one process, alternating A B B A.

    .venv/bin/python benchmarks/bench_norms.py [--rounds 6] [--threads 1]

Prints, per case, the median per-round time of each arm and the median of the paired
per-round ratios lmtail / torch (> 1: lmtail slower), and how many rounds each arm won.
A few seconds in all. Shape legend: T rows, H width, S slots, G x P parts, E experts.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmtail.norms import add_rms, embed_rows, moe_add_rms, rms_parts
from lmtail.router import router_topk


def _torch_norm(h: torch.Tensor, g: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * g.float()).to(torch.bfloat16)


def _torch_add_rms(x, r, g):
    h = (x.float() + r.float()).to(torch.bfloat16)
    return h, _torch_norm(h, g)


def _torch_moe(x, slots, w, g, n_shared=2):
    rr = slots.shape[0] - n_shared
    c = (w.t().unsqueeze(-1) * slots[:rr].float()).sum(0) + slots[rr:].float().sum(0)
    h = (x.float() + c.to(torch.bfloat16).float()).to(torch.bfloat16)
    return h, _torch_norm(h, g)


def _torch_parts(x, g, part, mlx):
    xg = x.float().reshape(*x.shape[:-1], -1, part)
    t = xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + 1e-5)
    if mlx:
        return (g.float().reshape(-1, part) * t.to(torch.bfloat16).float()).to(torch.bfloat16).reshape(x.shape)
    return (t * g.float().reshape(-1, part)).to(torch.bfloat16).reshape(x.shape)


def _torch_router(sl, k, scale=2.5):
    s = torch.sigmoid(sl.sum(0))
    v, ids = torch.topk(s, k, dim=-1)
    return ids, v / (v.sum(-1, keepdim=True) + 1e-20) * scale


def cases():
    bf = torch.bfloat16
    g576, g2688 = torch.randn(576).to(bf), torch.randn(2688).to(bf)
    x300 = torch.randn(300, 576).to(bf), torch.randn(300, 576).to(bf)
    x16 = torch.randn(16, 2688).to(bf), torch.randn(16, 2688).to(bf)
    w16 = torch.rand(16, 6)
    sl16b, sl16f = torch.randn(8, 16, 2688).to(bf), torch.randn(8, 16, 2688)
    xp, gp = torch.randn(128, 4096).to(bf), torch.randn(4096).to(bf)
    xm, gm = torch.randn(32, 5376).to(bf), torch.randn(5376).to(bf)
    rl = torch.randn(2, 300, 128)
    tab, ids = torch.randn(49152, 576).to(bf), torch.randint(0, 49152, (300,))
    return [
        ("add_rms 300x576 (llama layer)", lambda: add_rms(*x300, g576), lambda: _torch_add_rms(*x300, g576)),
        ("add_rms 16x2688", lambda: add_rms(*x16, g2688), lambda: _torch_add_rms(*x16, g2688)),
        ("moe_add_rms 16x2688 bf16 slots", lambda: moe_add_rms(x16[0], sl16b, w16, g2688),
         lambda: _torch_moe(x16[0], sl16b, w16, g2688)),
        ("moe_add_rms 16x2688 fp32 slots", lambda: moe_add_rms(x16[0], sl16f, w16, g2688),
         lambda: _torch_moe(x16[0], sl16f, w16, g2688)),
        ("rms_parts mlx 128x(8x512)", lambda: rms_parts(xp, gp, part=512, rounding="mlx"),
         lambda: _torch_parts(xp, gp, 512, True)),
        ("rms_parts once 32x(2x2688)", lambda: rms_parts(xm, gm, part=2688), lambda: _torch_parts(xm, gm, 2688, False)),
        ("router_topk 300x128 k=6", lambda: router_topk(rl, 6), lambda: _torch_router(rl, 6)),
        ("embed_rows 300 of 49152x576", lambda: embed_rows(ids, tab), lambda: tab[ids]),
    ]


def _time(fn, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds A B B A")
    print(f"{'case':34s} {'lmtail ms':>10s} {'torch ms':>10s} {'ratio':>7s}  won (lmtail:torch)")
    for name, a, b in cases():
        a(), b()  # warm up
        reps = max(1, int(0.02 / max(_time(a, 1), 1e-6)))
        ta, tb, ratios = [], [], []
        for r in range(args.rounds):
            order = (a, b) if r % 2 == 0 else (b, a)
            t = {fn: _time(fn, reps) for fn in order}
            ta.append(t[a]), tb.append(t[b]), ratios.append(t[a] / t[b])
        won = sum(x < 1 for x in ratios)
        print(f"{name:34s} {statistics.median(ta) * 1e3:10.3f} {statistics.median(tb) * 1e3:10.3f} "
              f"{statistics.median(ratios):7.2f}  {won}:{args.rounds - won}")


if __name__ == "__main__":
    main()
