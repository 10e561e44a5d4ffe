"""Speed of the glue ops against a plain torch composition of the same math, A-B-B-A in one
process.

    .venv/bin/python -m lmtail.benchmarks.bench_norms [--rounds 6] [--threads 1] [--quick]

Per case, base "torch" (the composition) and arm "lmtail" (the op). The two sum in
different orders, so before timing each arm's outputs are checked against float64 ideals
(reference.tail.rms_ref for 1/rms) with stated tolerances: h of add_rms and embed_rows
bitwise (no sum involved); every normed y within 2^-6 relative of h * rms * gamma in
float64 from the arm's own h (two bf16 roundings and fp32 products); moe h within 2^-7 of
|h| + |combine| of the float64 combine; router ids equal the float64 top-k and weights
within 2^-20 relative. Ratio = median paired time / torch's (< 1: lmtail faster).
Shape legend: T rows, H width, S slots, G x P parts, E experts, K slices.
"""
from __future__ import annotations

import argparse

import torch

from lmtail.bench import abba, assert_bitwise, assert_within, format_table, wall_time
from lmtail.glue.norms import add_rms, embed_rows, moe_add_rms, rms_parts
from lmtail.reference.tail import rms_ref
from lmtail.glue.router import router_topk

EPS = 1e-5
Y_RTOL = 2.0**-6


def _torch_norm(h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * g.float()).to(torch.bfloat16)


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
    t = xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + EPS)
    if mlx:
        return (g.float().reshape(-1, part) * t.to(torch.bfloat16).float()).to(torch.bfloat16).reshape(x.shape)
    return (t * g.float().reshape(-1, part)).to(torch.bfloat16).reshape(x.shape)


def _torch_router(sl, k, scale=2.5):
    s = torch.sigmoid(sl.sum(0))
    v, ids = torch.topk(s, k, dim=-1)
    return ids, v / (v.sum(-1, keepdim=True) + 1e-20) * scale


# ---------------------------------------------------------------- float64 checks

def _y_ideal(h: torch.Tensor, g: torch.Tensor, part: int | None = None) -> torch.Tensor:
    """float64 h * rms(h) * gamma, rms over each part (default: the whole row)."""
    part = h.shape[-1] if part is None else part
    hp = h.double().reshape(-1, part)  # [T*G, P]
    rms = torch.from_numpy(rms_ref(hp, eps=EPS, interleaved=False))  # [T*G]
    return (hp * rms[:, None]).reshape(h.shape) * g.double()


def _norm_check(h_of, g, part=None, *, h_exact=True):
    """validate(out, who): y of the arm within Y_RTOL of float64 from its own h; h bitwise
    equal to h_of() when h_exact."""
    def validate(out, who):
        h, y = out if isinstance(out, tuple) else (None, out)
        if h is not None and h_exact:
            assert_bitwise(h, h_of(), what=f"{who} h")
        base = h_of() if h is None else h
        assert_within(y, _y_ideal(base, g, part), atol=0.0, rtol=Y_RTOL, what=f"{who} y")
    return validate


def _moe_check(x, slots, w, g, n_shared=2):
    rr = slots.shape[0] - n_shared
    c = (w.double().t().unsqueeze(-1) * slots[:rr].double()).sum(0) + slots[rr:].double().sum(0)  # [T, H]
    h_ideal = x.double() + c

    def validate(out, who):
        h, y = out
        assert_within(h, h_ideal, atol=2.0**-7 * c.abs(), rtol=2.0**-7, what=f"{who} h")
        assert_within(y, _y_ideal(h, g), atol=0.0, rtol=Y_RTOL, what=f"{who} y")
    return validate


def _router_check(sl, k, scale=2.5):
    s = torch.sigmoid(sl.double().sum(0))  # [T, E]
    v, ids = torch.topk(s, k, dim=-1)
    wts = v / v.sum(-1, keepdim=True) * scale

    def validate(out, who):
        got_ids, got_w = out
        assert_bitwise(got_ids, ids, what=f"{who} ids")
        assert_within(got_w, wts, atol=0.0, rtol=2.0**-20, what=f"{who} weights")
    return validate


def _both(validate):
    def check(name, out, base_out):
        validate(base_out, "torch")
        validate(out, name)
    return check


def cases(quick: bool):
    bf = torch.bfloat16
    t = 16 if quick else 300
    g576, g2688 = torch.randn(576).to(bf), torch.randn(2688).to(bf)
    xa = torch.randn(t, 576).to(bf), torch.randn(t, 576).to(bf)
    x16 = torch.randn(16, 2688).to(bf), torch.randn(16, 2688).to(bf)
    w16 = torch.rand(16, 6)
    sl16b, sl16f = torch.randn(8, 16, 2688).to(bf), torch.randn(8, 16, 2688)
    xp, gp = torch.randn(128, 4096).to(bf), torch.randn(4096).to(bf)
    xm, gm = torch.randn(32, 5376).to(bf), torch.randn(5376).to(bf)
    rl = torch.randn(2, t, 128)
    tab, ids = torch.randn(49152, 576).to(bf), torch.randint(0, 49152, (t,))
    h_a = (xa[0].float() + xa[1].float()).to(bf)
    h_16 = (x16[0].float() + x16[1].float()).to(bf)
    return [
        (f"add_rms {t}x576 (llama layer)", lambda: tuple(add_rms(*xa, g576)), lambda: _torch_add_rms(*xa, g576),
         _norm_check(lambda: h_a, g576)),
        ("add_rms 16x2688", lambda: tuple(add_rms(*x16, g2688)), lambda: _torch_add_rms(*x16, g2688),
         _norm_check(lambda: h_16, g2688)),
        ("moe_add_rms 16x2688 bf16 slots", lambda: tuple(moe_add_rms(x16[0], sl16b, w16, g2688)),
         lambda: _torch_moe(x16[0], sl16b, w16, g2688), _moe_check(x16[0], sl16b, w16, g2688)),
        ("moe_add_rms 16x2688 fp32 slots", lambda: tuple(moe_add_rms(x16[0], sl16f, w16, g2688)),
         lambda: _torch_moe(x16[0], sl16f, w16, g2688), _moe_check(x16[0], sl16f, w16, g2688)),
        ("rms_parts mlx 128x(8x512)", lambda: rms_parts(xp, gp, part=512, rounding="mlx"),
         lambda: _torch_parts(xp, gp, 512, True), _norm_check(lambda: xp, gp, 512)),
        ("rms_parts once 32x(2x2688)", lambda: rms_parts(xm, gm, part=2688),
         lambda: _torch_parts(xm, gm, 2688, False), _norm_check(lambda: xm, gm, 2688)),
        (f"router_topk {t}x128 k=6", lambda: tuple(router_topk(rl, k=6)), lambda: _torch_router(rl, 6),
         _router_check(rl, 6)),
        (f"embed_rows {t} of 49152x576", lambda: embed_rows(ids, tab), lambda: tab[ids],
         lambda out, who: assert_bitwise(out, tab[ids], what=f"{who} rows")),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="16-row cases, 2 rounds (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results = {}
    for name, ours, theirs, validate in cases(args.quick):
        number = max(1, int(0.02 / max(wall_time(ours), 1e-6)))  # about 20 ms of calls per sample
        results[name] = abba({"torch": theirs, "lmtail": ours}, base="torch", rounds=args.rounds,
                             number=number, check=_both(validate))
    print(format_table(results, title=f"glue ops vs a torch composition, torch {torch.__version__}, "
                       f"{args.threads} thread(s); ratio = time / torch's"))


if __name__ == "__main__":
    main()
