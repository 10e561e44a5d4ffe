"""The declared-order pieces of the SmolLM2 body: exp32, silu_mul, rope tables, attention,
and the model loop's fused glue (add_rms_rows, rope_qkv, silu_mul_bf16: the bytes of the
ops they replace, lmtail.glue.norms.add_rms, apply_rope + cache writes, silu_mul + bf16 round).

Every function here computes from IEEE basic operations (+, -, *, /, fma, casts) in a
stated order, so its bytes are the same on every CPU and for every backend (one
kernels._backend.Dispatch table per op; backend=None takes the fastest verified row, measured
once per machine: docs/backends.md):
  "avx512" the C kernels with the AVX-512F micro-kernels (attention's register tiles;
           16 lanes: exp32, silu_mul, silu_mul_bf16, add_rms_rows32, rope_qkv);
  "avx2"   the C kernels with the AVX2 + FMA micro-kernels (8 lanes: attention, exp32,
           silu_mul; add_rms_rows32 and rope_qkv run their portable C there);
  "c"      the portable C kernels (kernels/model/body.c through kernels.model.body; compiled as
           AVX-512 / AVX2 / default clones picked at load: the same bits, only explicit
           fmaf fuses);
  "torch"  the same operations spelled in torch (fma emulated exactly by numerics.fma32):
           slow, for tests and machines without a C compiler.
The float64 references they are checked against live in lmtail.reference.model. The model
loop (lmtail.model.llama) validates once per forward and calls kernels.model.body directly.

Shape legend: B rows, T new tokens, nh / nkv query / KV heads, g = nh // nkv, hd head dim
(64), S_cap cache slots (capacity + SLACK), F FFN width, M rows of a linear, P positions.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ..checks import check_threads
from ..kernels import _backend, cpu
from ..kernels.model import body as kbody
from ..glue.norms import NormResult, add_rms, inv_rms, ssq_decl
from ..numerics import Decl, SumDecl, exp64, fma32, log64
from ..orders import strided

HD = kbody.HD  # the head dim the C attention kernel is built for
SLACK = 64  # key-cache slots past capacity: the kernel reads whole 64-key blocks
ATTEND_MIN_WORK = 1 << 21  # attention multiply-adds per worker thread at least (~0.3 ms)

# exp32's constants, bit for bit as in body.c
_F = np.float32
LOG2E = _F(float.fromhex("0x1.715476p+0"))
RND = _F(float.fromhex("0x1.8p+23"))
LN2_HI = _F(float.fromhex("0x1.63p-1"))
LN2_LO = _F(float.fromhex("-0x1.bd0106p-13"))
X_HI, X_LO = _F(88.0), _F(-86.0)
EXP_C = tuple(_F(float.fromhex(h)) for h in (
    "0x1p+0", "0x1p+0", "0x1p-1", "0x1.555556p-3", "0x1.555556p-5", "0x1.111112p-7",
    "0x1.6c16c2p-10", "0x1.a01a02p-13"))  # fp32(1/k!), k = 0..7

EXP32_ULP = 2  # declared accuracy: |exp32(x) - exp(x)| <= 2 ulp for x in [-86, 88]
SILU_ULP = 4  # silu_mul(g, 1) vs g * sigmoid(g): <= 4 ulp where the result is normal
ROPE_ULP = 1  # rope cos/sin vs the exact values: <= 1 ulp of fp32 (float64 error < 1e-15 before rounding)


# ---------------------------------------------------------------------------------------
# declarations
# ---------------------------------------------------------------------------------------
def exp32_decl() -> Decl:
    return Decl(op="exp32", rounding_points=(
        "t = fl32(x * LOG2E); n = fl32(fl32(t + 1.5*2^23) - 1.5*2^23)",
        "r = fma(-n, LN2_HI, x); r = fma(-n, LN2_LO, r)",
        "p = Horner over fp32(1/k!), k = 7..0: 7 fmas", "y = fl32(p * 2^n)",
        "x > 88 -> +inf, x < -86 -> +0, NaN -> NaN"), sums=())


def silu_mul_decl() -> Decl:
    return Decl(op="silu_mul", rounding_points=(
        "e = exp32(-g)", "d = fl32(1 + e)", "s = fl32(g / d) (silu(-inf) = -0)",
        "y = fl32(s * u)"), sums=())


def rope_decl() -> Decl:
    return Decl(op="rope", rounding_points=(
        "inv_freq_i = exp64(fl64(log64(base) * fl64(-2i / hd)))", "theta = fl64(p * inv_freq_i)",
        "k = round(fl64(theta * 2/pi)); r = theta - k*P1 - k*P2 - k*P3 (float64, 3-part pi/2)",
        "sin r, cos r: float64 Horner (Taylor to r^17 / r^18); quadrant by k mod 4",
        "cos, sin rounded once to fp32",
        "x' = (fl32(fl32(xe*cos) - fl32(xo*sin)), fl32(fl32(xe*sin) + fl32(xo*cos)))"), sums=())


def attend_decl(n_keys: int, head_dim: int = HD) -> Decl:
    """The attention of one query over its n_keys = position + 1 keys."""
    return Decl(op="attend", rounding_points=(
        "s_j = fl32(dot_j * scale)", "m = max_j s_j (exact)", "e_j = exp32(fl32(s_j - m))",
        "out_d = fl32(acc_d / den)", "pad query (position < 0) -> +0.0"), sums=(
        SumDecl(name="dot", dtype="fp32", depth=head_dim,
                order="fma chain d = 0..hd-1 from +0.0 of q_d * k_jd"),
        SumDecl(name="den", dtype="fp32", depth=n_keys,
                order="sequential j = 0..n-1 (position order) from +0.0 of e_j"),
        SumDecl(name="acc", dtype="fp32", depth=n_keys,
                order="fma chain j = 0..n-1 (position order) from +0.0 of e_j * v_jd"),
    ))


# ---------------------------------------------------------------------------------------
# backends
# ---------------------------------------------------------------------------------------
def _c_avx512() -> bool:
    return kbody.available() and cpu.has("avx512f")


def _c_avx2() -> bool:
    return kbody.available() and cpu.has("avx2", "fma")


def _emulated() -> bool:
    """The "emu-avx512" rows (body.c's emulated build) run here."""
    return kbody.available() and cpu.emulation_runs()


def available_backends() -> tuple[str, ...]:
    """Backends of this module on this machine, in the table's order (backend=None takes the
    fastest verified one; all give the same bytes)."""
    return ATTEND.names()


def _f32(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be torch.float32; got {t.dtype}")


# ---------------------------------------------------------------------------------------
# exp32, silu_mul
# ---------------------------------------------------------------------------------------
def _exp32_torch(x: torch.Tensor) -> torch.Tensor:
    """exp32 in torch: the same operations as body.c, fma by numerics.fma32."""
    f = functools.partial(torch.tensor, dtype=torch.float32)
    xc = torch.where(x > float(X_HI), f(float(X_HI)), x)
    xc = torch.where(xc < float(X_LO), f(float(X_LO)), xc)
    xc = torch.where(torch.isnan(xc), f(0.0), xc)
    t = xc * f(float(LOG2E))
    n = (t + f(float(RND))) - f(float(RND))
    r = fma32(-n, f(float(LN2_HI)), xc)
    r = fma32(-n, f(float(LN2_LO)), r)
    p = torch.full_like(x, float(EXP_C[7]))
    for c in reversed(EXP_C[:7]):
        p = fma32(p, r, f(float(c)))
    s = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    y = p * s
    y = torch.where(x < float(X_LO), f(0.0), y)
    y = torch.where(x > float(X_HI), f(math.inf), y)
    return torch.where(torch.isnan(x), f(math.nan), y)


EXP32 = _backend.Dispatch("exp32", (
    _backend.Backend("avx512", functools.partial(kbody.exp32, isa="avx512"), _c_avx512),
    _backend.Backend("avx2", functools.partial(kbody.exp32, isa="avx2"), _c_avx2),
    _backend.Backend("c", functools.partial(kbody.exp32, isa="c"), kbody.available),
    _backend.Backend("torch", _exp32_torch, device=None),
    _backend.Backend("emu-avx512", functools.partial(kbody.exp32, isa="avx512", emulated=True), _emulated,
                     emulated=True),
))


def exp32(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """exp(x) elementwise, fp32 -> fp32, by the declared exp32 (exp32_decl): range
    reduction by n = round(x log2 e), a degree-7 fma Horner polynomial, scaling by 2^n.
    Accuracy <= EXP32_ULP ulp on [-86, 88]; x > 88 -> inf, x < -86 -> +0, NaN -> NaN
    (0x7FC00000). Same bits for every backend and shape."""
    _f32("x", x)
    return EXP32.pick(backend).run(x)


def _silu_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    s = gate / (1.0 + _exp32_torch(-gate))
    s = torch.where(gate == -math.inf, torch.tensor(-0.0), s)
    return s * up


SILU_MUL = _backend.Dispatch("silu_mul", (
    _backend.Backend("avx512", functools.partial(kbody.silu_mul, isa="avx512"), _c_avx512),
    _backend.Backend("avx2", functools.partial(kbody.silu_mul, isa="avx2"), _c_avx2),
    _backend.Backend("c", functools.partial(kbody.silu_mul, isa="c"), kbody.available),
    _backend.Backend("torch", lambda gu: _silu_mul_torch(gu[:, :gu.shape[1] // 2], gu[:, gu.shape[1] // 2:]),
                     device=None),
    _backend.Backend("emu-avx512", functools.partial(kbody.silu_mul, isa="avx512", emulated=True), _emulated,
                     emulated=True),
))


def silu_mul(gu: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """silu(gate) * up for gu [M, 2F] fp32 = [gate | up] (the fused gate/up GEMM output)
    -> [M, F] fp32, by silu_mul_decl: fl32(fl32(g / fl32(1 + exp32(-g))) * u).
    Elementwise: a row's bytes never depend on M or the backend."""
    _f32("gu", gu)
    if gu.dim() != 2 or gu.shape[1] % 2:
        raise ValueError(f"gu must be [M, 2F]; got shape {tuple(gu.shape)}")
    return SILU_MUL.pick(backend).run(gu)


# ---------------------------------------------------------------------------------------
# rope
# ---------------------------------------------------------------------------------------
_P1 = 1.57079632673412561417e+00  # fdlibm's pi/2 in three 33-bit parts: k * P_i is exact
_P2 = 6.07710050630396597660e-11
_P3 = 2.02226624871116645580e-21
_TWO_OVER_PI = 6.36619772367581382433e-01
_SIN_C = [(-1) ** k / math.factorial(2 * k + 1) for k in range(9)]  # r^1 .. r^17
_COS_C = [(-1) ** k / math.factorial(2 * k) for k in range(10)]  # r^0 .. r^18


def cos_sin64(theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of float64 theta (|theta| < 2^20) from basic ops: k = round(theta 2/pi),
    r = theta - k pi/2 (three-part pi/2, |r| <= pi/4 + tiny), Taylor Horner in r^2,
    quadrant by k mod 4. Absolute error < 1e-15."""
    k = torch.round(theta * _TWO_OVER_PI)
    r = ((theta - k * _P1) - k * _P2) - k * _P3
    r2 = r * r
    s = torch.full_like(r, _SIN_C[-1])
    for c in reversed(_SIN_C[:-1]):
        s = s * r2 + c
    s = s * r
    c_ = torch.full_like(r, _COS_C[-1])
    for c in reversed(_COS_C[:-1]):
        c_ = c_ * r2 + c
    q = k.to(torch.int64) % 4
    cos = torch.where(q == 0, c_, torch.where(q == 1, -s, torch.where(q == 2, -c_, s)))
    sin = torch.where(q == 0, s, torch.where(q == 1, c_, torch.where(q == 2, -s, -c_)))
    return cos, sin


@functools.lru_cache(maxsize=4)
def rope_table(n_positions: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [P, hd/2] fp32 of theta = p * base^(-2i/hd) for p < P, i < hd/2, by
    rope_decl (float64 basic ops, one rounding to fp32; <= ROPE_ULP ulp). Cached."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    inv_freq = exp64(log64(torch.tensor(float(base), dtype=torch.float64)) * (-2.0 * i / head_dim))  # [hd/2]
    theta = torch.arange(n_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [P, hd/2]
    cos, sin = cos_sin64(theta)
    return cos.float(), sin.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of x [..., T, n, hd] by cos, sin [..., T, 1, hd/2]
    (fp32 elementwise: one rounding per product, one per sum)."""
    xe, xo = x[..., 0::2], x[..., 1::2]
    return torch.stack((xe * cos - xo * sin, xe * sin + xo * cos), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------
def _check_attend(q, kt, v, pad, s0):
    for name, t in (("q", q), ("kt", kt), ("v", v)):
        _f32(name, t)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be C-contiguous; got strides {t.stride()}")
    if q.dim() != 4 or kt.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, kt, v must be 4-D; got {q.dim()}, {kt.dim()}, {v.dim()}")
    B, T, nh, hd = q.shape
    _, nkv, _, s_cap = kt.shape
    if hd != HD or tuple(kt.shape) != (B, nkv, HD, s_cap) or tuple(v.shape) != (B, nkv, s_cap, HD):
        raise ValueError(f"expected q [B, T, nh, {HD}], kt [B, nkv, {HD}, S_cap], v [B, nkv, S_cap, {HD}]; "
                         f"got {tuple(q.shape)}, {tuple(kt.shape)}, {tuple(v.shape)}")
    if nkv < 1 or nh % nkv:
        raise ValueError(f"nh must be a multiple of nkv; got nh={nh}, nkv={nkv}")
    if pad.dtype != torch.int64 or tuple(pad.shape) != (B,):
        raise ValueError(f"pad must be [B] = [{B}] int64; got {tuple(pad.shape)} {pad.dtype}")
    if B and (int(pad.min()) < 0 or s0 + T + SLACK > s_cap):
        raise ValueError(f"need pad >= 0 and s0 + T + {SLACK} <= S_cap = {s_cap}; got pad min "
                         f"{int(pad.min())}, s0 + T = {s0 + T}")


def _attend_torch(q, kt, v, pad, s0, scale):
    """The declared attention in torch (fma32 chains), vectorized over all queries."""
    B, T, nh, hd = q.shape
    g = nh // kt.shape[1]  # query heads per kv head
    pos = (s0 + torch.arange(T))[None, :] - pad[:, None]  # [B, T]
    out = torch.zeros_like(q)
    n_max = int(pos.max()) + 1 if pos.numel() else 0
    if n_max <= 0:
        return out
    rows = torch.arange(B)[:, None, None]  # [B, 1, 1]
    slot = pad[:, None] + torch.arange(n_max)[None, :]  # [B, n_max]
    slot = slot.clamp(max=kt.shape[3] - 1)
    kh = torch.arange(nh) // g  # [nh]
    keys = kt[rows, kh[None, :, None], :, slot[:, None, :]]  # [B, nh, n_max, hd]
    vals = v[rows, kh[None, :, None], slot[:, None, :], :]  # [B, nh, n_max, hd]
    qq = q.permute(0, 2, 1, 3)  # [B, nh, T, hd]
    live = torch.arange(n_max)[None, None, :] <= pos[:, :, None]  # [B, T, n_max]
    live = live[:, None]  # [B, 1, T, n_max]
    dot = torch.zeros(B, nh, T, n_max)
    for d in range(hd):
        dot = fma32(qq[..., d:d + 1], keys[:, :, None, :, d], dot)
    s = dot * torch.tensor(scale, dtype=torch.float32)
    m = s.masked_fill(~live, -math.inf).amax(-1, keepdim=True)
    e = _exp32_torch(s - m)  # [B, nh, T, n_max]
    den = torch.zeros(B, nh, T)
    acc = torch.zeros(B, nh, T, hd)
    for j in range(n_max):
        lj = live[..., j]  # [B, 1, T]
        ej = e[..., j]
        den = torch.where(lj, den + ej, den)
        acc = torch.where(lj[..., None], fma32(ej[..., None], vals[:, :, None, j, :], acc), acc)
    o = acc / den[..., None]  # [B, nh, T, hd]
    o = torch.where((pos >= 0)[:, None, :, None], o, torch.zeros(()))
    return o.permute(0, 2, 1, 3).contiguous()


ATTEND = _backend.Dispatch("attend", (
    _backend.Backend("avx512", functools.partial(kbody.attend, isa="avx512"), _c_avx512),
    _backend.Backend("avx2", functools.partial(kbody.attend, isa="avx2"), _c_avx2),
    _backend.Backend("c", functools.partial(kbody.attend, isa="c"), kbody.available),
    _backend.Backend("torch", lambda q, kt, v, pad, s0, scale, threads: _attend_torch(q, kt, v, pad, s0, scale),
                     device=None),
    _backend.Backend("emu-avx512", functools.partial(kbody.attend, isa="avx512", emulated=True), _emulated,
                     emulated=True),
))


def attend_threads(threads: int | None, B: int, T: int, nh: int, s0: int) -> int:
    """attend's worker count: `threads`, or for None torch.get_num_threads() capped at one
    worker per ATTEND_MIN_WORK multiply-adds (a thread costs a handoff)."""
    work = B * T * nh * (s0 + T) * 2 * HD  # an upper bound
    return _backend.threads(threads, work=work, min_work=ATTEND_MIN_WORK)


def attend(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, pad: torch.Tensor, *, s0: int,
           scale: float, backend: str | None = None, threads: int | None = None) -> torch.Tensor:
    """Causal GQA attention of T new queries at slots s0..s0+T-1 over a left-padded cache.

    q [B, T, nh, 64] fp32 (after rope), kt [B, nkv, 64, S_cap] fp32 keys (after rope),
    transposed, v [B, nkv, S_cap, 64] fp32, pad [B] int64: key j of row b is slot pad[b]+j,
    query t of row b has position p = s0 + t - pad[b] and sees keys 0..p (causal; p < 0:
    a pad query, output +0). Query head h reads KV head h // (nh / nkv). S_cap >= s0 + T
    + SLACK. Order: attend_decl(p + 1) (one query's chains in position order, nothing
    from other queries, rows or slots): a query's bytes do not depend on B, T, its row's
    padding, whether its keys came by prefill or decode, the backend or `threads`
    (None: torch.get_num_threads(), at most one worker per ATTEND_MIN_WORK multiply-adds).
    O(p) scratch per query. Returns [B, T, nh, 64] fp32."""
    pad = torch.as_tensor(pad)
    _check_attend(q, kt, v, pad, s0)
    check_threads(threads)
    B, T, nh, _ = q.shape
    return ATTEND.pick(backend).run(q, kt, v, pad, s0, scale, attend_threads(threads, B, T, nh, s0))


# ---------------------------------------------------------------------------------------
# the model loop's fused glue (internal: the caller has validated shapes and dtypes once)
# ---------------------------------------------------------------------------------------
def add_rms_rows(x: torch.Tensor, residual: torch.Tensor, gamma32: torch.Tensor, *, eps: float,
                 lanes: int):
    """lmtail.glue.norms.add_rms(bf16(x), residual, gamma, eps=eps, order=orders.strided(lanes)),
    the same bytes (a NaN's payload aside, as there), in one C pass per row.

    x [N, H] fp32 (rounded once to bf16, as `.to(torch.bfloat16)` does) or bf16, unit column
    stride; residual [N, H] bf16 C-contiguous; gamma32 [H] fp32 C-contiguous (the exact
    widening of the norm weight). Returns norms.NormResult(h, y), both [N, H] bf16 (its numerics:
    h = bf16(x + residual), ssq by strided(lanes) fma chains, IEEE sqrt and division,
    y = bf16(fl32(h * inv) * gamma)). Row-independent. Without the C library: norms.add_rms."""
    if not kbody.available():
        return add_rms(x.to(torch.bfloat16), residual, gamma32, eps=eps, order=strided(lanes))
    N, H = x.shape
    assert residual.shape == (N, H) and residual.is_contiguous() and residual.dtype == torch.bfloat16
    assert gamma32.shape == (H,) and gamma32.dtype == torch.float32 and gamma32.is_contiguous()
    assert x.dtype in (torch.float32, torch.bfloat16) and (N <= 1 or x.stride(1) == 1) and lanes % 32 == 0
    return NormResult(*kbody.add_rms_rows(x, residual, gamma32, eps, lanes))


def add_rms32_decl(h: int, *, order=strided(256)) -> Decl:
    """add_rms_rows32 on rows of width h: norms.add_rms_decl's rounding points without its two
    bf16 roundings (the same sum of squares, norms.ssq_decl)."""
    return Decl("add_rms32", ("h = fl32(x + residual)  (residual None: x + 0.0)",
                              "ssq: fp32 sum of squares in the declared order", "m = fl32(ssq / n)",
                              "d = fl32(m + fp32(eps))", "r = fl32(sqrt(d))", "inv = fl32(1 / r)",
                              "t = fl32(h * inv)", "y = fl32(t * gamma32)"), (ssq_decl(h, order),))


NORM32_MAX_LANES = 1024  # body.c's add_rms_rows32 keeps its lane sums on the stack


def add_rms_rows32(x: torch.Tensor, residual: torch.Tensor | None, gamma32: torch.Tensor, *, eps: float,
                   lanes: int):
    """The fp32 stream's residual add + RMSNorm (the q32 body), one C pass per row:

        h = fl32(x + residual)                      (residual None: x + 0.0)
        ssq = strided(lanes) fp32 fma chains over h, 32-lane butterflies, groups in order
        inv = fl32(1 / sqrt(fl32(fl32(ssq / H) + eps)))   (IEEE sqrt and division)
        y = fl32(fl32(h * inv) * gamma)

    lmtail.glue.norms.add_rms's order without its two bf16 roundings (norms.inv_rms computes the
    same inv). x [N, H] fp32, unit column stride; residual [N, H] fp32 C-contiguous or None;
    gamma32 [H] fp32 C-contiguous; lanes a multiple of 32, <= NORM32_MAX_LANES. Returns
    NormResult(h, y), both [N, H] fp32. Row-independent. Without the C library: the torch
    spelling (norms.inv_rms), the same bytes."""
    assert lanes % 32 == 0 and 0 < lanes <= NORM32_MAX_LANES
    if not kbody.available():
        h = x + (torch.zeros((), dtype=torch.float32) if residual is None else residual)  # [N, H]
        inv = inv_rms(h, eps=eps, order=strided(lanes))  # [N]
        return NormResult(h, (h * inv[:, None]) * gamma32)
    N, H = x.shape
    assert residual is None or (residual.shape == (N, H) and residual.is_contiguous()
                                and residual.dtype == torch.float32)
    assert gamma32.shape == (H,) and gamma32.dtype == torch.float32 and gamma32.is_contiguous()
    assert x.dtype == torch.float32 and (N <= 1 or x.stride(1) == 1)
    return NormResult(*kbody.add_rms_rows32(x, residual, gamma32, eps, lanes))


def rope_qkv(qkv: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor, pos: torch.Tensor,
             kc: torch.Tensor, vc: torch.Tensor, *, s0: int, nh: int) -> torch.Tensor:
    """Split the fused q|k|v GEMM output, rope q and k (apply_rope's rounding points), and
    write keys / values into the cache at slots s0..s0+T-1; returns q [B, T, nh, 64] fp32.

    qkv [B*T, (nh + 2 nkv) 64] fp32 (unit column stride); cos_t, sin_t [P, 32] fp32 (rope_table);
    pos [B, T] int64 in [0, P); kc [B, nkv, 64, S_cap] and vc [B, nkv, S_cap, 64] fp32
    C-contiguous, written in place (k transposed). Elementwise: the same bytes as apply_rope on
    the slices, for every B and T. Without the C library: the torch spelling of the same."""
    B, T = pos.shape
    nkv = kc.shape[1]
    qd, kvd = nh * HD, nkv * HD
    if not kbody.available():
        cos, sin = cos_t[pos][:, :, None], sin_t[pos][:, :, None]  # [B, T, 1, hd/2]
        q = apply_rope(qkv[:, :qd].reshape(B, T, nh, HD), cos, sin)  # [B, T, nh, hd]
        k = apply_rope(qkv[:, qd:qd + kvd].reshape(B, T, nkv, HD), cos, sin)  # [B, T, nkv, hd]
        kc[:, :, :, s0:s0 + T] = k.permute(0, 2, 3, 1)
        vc[:, :, s0:s0 + T] = qkv[:, qd + kvd:].reshape(B, T, nkv, HD).transpose(1, 2)
        return q.contiguous()
    assert qkv.shape == (B * T, qd + 2 * kvd) and qkv.dtype == torch.float32 and (B * T <= 1 or qkv.stride(1) == 1)
    assert kc.is_contiguous() and vc.is_contiguous() and kc.shape[3] == vc.shape[2] >= s0 + T
    assert cos_t.is_contiguous() and sin_t.is_contiguous() and cos_t.shape[1] == HD // 2
    assert pos.dtype == torch.int64  # the caller guarantees 0 <= pos < P (no per-call scan)
    return kbody.rope_qkv(qkv, cos_t, sin_t, pos, kc, vc, s0, nh)


SILU_MUL_BF16 = _backend.Dispatch("silu_mul_bf16", (
    _backend.Backend("avx512", functools.partial(kbody.silu_mul_bf16, isa="avx512"), _c_avx512),
    _backend.Backend("c", functools.partial(kbody.silu_mul_bf16, isa="c"), kbody.available),
    _backend.Backend("emu-avx512", functools.partial(kbody.silu_mul_bf16, isa="avx512", emulated=True), _emulated,
                     emulated=True),
))


def silu_mul_bf16(gu: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """bf16(silu_mul(gu)): gu [M, 2F] fp32 -> [M, F] bf16, the GEMM input of the down
    projection; the same bytes as `silu_mul(gu).to(torch.bfloat16)` (NaN payload aside:
    the C rows store 0x7FC0). backend: one of SILU_MUL_BF16.names() (None: the fastest
    verified; without body.c the torch spelling)."""
    if not kbody.available():
        return silu_mul(gu).to(torch.bfloat16)
    assert gu.dtype == torch.float32 and gu.dim() == 2 and gu.shape[1] % 2 == 0
    return SILU_MUL_BF16.pick(backend, rows=gu.shape[0]).run(gu)


# ---------------------------------------------------------------------------------------
# the probes backends are verified and timed on (kernels._verify)
# ---------------------------------------------------------------------------------------
def _special(g: torch.Generator, n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, generator=g) * 20  # [n]
    if seed == 3:
        x[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-41, -0.0, 88.5, -87.0, 89.0])
    return x


@EXP32.probe(sources=("model/body.c",))
def _exp32_probe(rows: int, seed: int):
    """x [rows, 1000] fp32 (timing: [rows, 4096]); seed 3 plants NaN, inf, subnormal, the cut-offs."""
    g = torch.Generator().manual_seed(7000 + seed)
    n = 1000 if seed >= 0 else 4096
    x = _special(g, rows * n, seed).reshape(rows, n)  # [rows, n]
    return lambda name: exp32(x, backend=name)


def _gate_up(rows: int, seed: int) -> torch.Tensor:
    """gu [rows, 2F] fp32 (F = 500; timing 1536); seed 3 plants NaN, inf, subnormal gates."""
    g = torch.Generator().manual_seed(7100 + seed)
    f = 500 if seed >= 0 else 1536
    return _special(g, rows * 2 * f, seed).reshape(rows, 2 * f)  # [rows, 2F]


@SILU_MUL.probe(sources=("model/body.c",))
def _silu_mul_probe(rows: int, seed: int):
    gu = _gate_up(rows, seed)
    return lambda name: silu_mul(gu, backend=name)


@SILU_MUL_BF16.probe(sources=("model/body.c",))
def _silu_mul_bf16_probe(rows: int, seed: int):
    gu = _gate_up(rows, seed)
    return lambda name: silu_mul_bf16(gu, backend=name)


@ATTEND.probe(sources=("model/attend.c",))
def _attend_probe(rows: int, seed: int):
    """rows queries (T = 1, B = rows) of 3 heads over a 2-head cache at s0 = 37 (timing:
    9 / 3 heads, s0 = 500), with left padding."""
    g = torch.Generator().manual_seed(7200 + seed)
    nh, nkv, s0 = (4, 2, 37) if seed >= 0 else (9, 3, 500)
    cap = s0 + 1 + SLACK
    q = torch.randn(rows, 1, nh, HD, generator=g)  # [B, T, nh, 64]
    kt = torch.randn(rows, nkv, HD, cap, generator=g)  # [B, nkv, 64, S_cap]
    v = torch.randn(rows, nkv, cap, HD, generator=g)  # [B, nkv, S_cap, 64]
    pad = torch.randint(0, 5, (rows,), generator=g)  # [B]
    threads = torch.get_num_threads()
    return lambda name: attend(q, kt, v, pad, s0=s0, scale=0.125, backend=name, threads=threads)
