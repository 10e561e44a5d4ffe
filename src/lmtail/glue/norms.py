"""Shared glue ops around the matmuls: embedding rows, residual add + RMSNorm, MoE combine +
add + RMSNorm, per-part RMSNorm. Every rounding point and every sum is declared below;
the CPU path reproduces the declared order bit for bit (vectorized, see orders.py).

Common numerics (used by every norm here; `inv_rms`):
    ssq = sum_j h_j * h_j          fp32, the declared `order` (orders.sum_squares)
    m   = fl32(ssq / n)            n = the width (H, or the part), exact in fp32
    d   = fl32(m + eps32)          eps32 = fp32(eps) (1e-5 -> 9.99999974738e-06)
    r   = fl32(sqrt(d))            IEEE sqrt, correctly rounded (sqrt_rn32), no rsqrt
    inv = fl32(1 / r)              IEEE division
    fl32 = one round-to-nearest-even to fp32; bf16(.) = one rounding fp32 -> bf16 (RNE).
    gamma is widened to fp32 exactly (bf16 -> fp32 is exact; fp32 is used as is).

Special values (all norms): a NaN anywhere in a row (of a part) makes that row's y all NaN.
An inf (and no NaN) gives ssq = inf, inv = 0: y is NaN at the inf lanes (inf * 0) and a
signed zero elsewhere. A row whose squares overflow fp32 (|h| >~ 1.8e19) also gets inv = 0,
so y = +-0 there. An all-zero row gives inv = fl32(1/sqrt(eps32)) and y = +-0. Tiny and
subnormal values follow the formula (their squares may underflow to 0 exactly as fp32 does).
With eps32 = 0 a row (part) whose squares sum to 0 has no inv (1/0): a ValueError naming it.

Shape legend: T rows (tokens), H hidden width, V vocab rows of the table, S expert slots,
R = S - n_shared routed slots, P part width, G = H / P parts a row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_eps, check_threads, gamma32, is_int, need, need_tensor, undefined_rows
from ..kernels.glue import fmachain
from ..numerics import Decl, SumDecl, sqrt_rn32
from ..orders import Order, strided, sum_squares

DEFAULT_ORDER = strided(256)
_EPS = 1e-5


@dataclass(frozen=True)
class NormResult:
    """add_rms / moe_add_rms result, a frozen dataclass like every lmtail result (read by
    field name; also unpacks as `h, y = ...`, in field order)."""

    h: torch.Tensor  # [..., H] bf16, the new residual stream
    y: torch.Tensor  # [..., H] bf16, the normalized row

    def __iter__(self):
        return iter((self.h, self.y))


# ---------------------------------------------------------------------------------------
# validation helpers (ValueError at the public boundary, expected vs got; lmtail.checks)
# ---------------------------------------------------------------------------------------
def _check_eps_order(eps, order, backend=None, threads=None) -> None:
    check_eps(eps)
    need(isinstance(order, Order), f"order must be an orders.Order; got {type(order).__name__}")
    check_threads(threads)
    have = fmachain.available_backends()  # an emulated row ("emu-avx512") is taken when named too
    need(backend is None or backend in fmachain.FMA_SUM.names(emulated=True),
         f"backend must be one of {have}; got {backend!r}")


def _check_bf16(name: str, t, shape_txt: str) -> None:
    need_tensor(name, t, shape_txt)
    need(t.dtype == torch.bfloat16, f"{name} must be bf16 {shape_txt}; got {t.dtype}")


# ---------------------------------------------------------------------------------------
# embed_rows
# ---------------------------------------------------------------------------------------
def embed_rows(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """out[t] = table[ids[t]], the bf16 rows copied exactly (no arithmetic).

    ids [T] int (int32/int64, any integer dtype), table [V, H] bf16 -> out [T, H] bf16.
    An id < 0 or >= V is a ValueError naming the first bad position and id.
    """
    need_tensor("ids", ids, "[T] integer")
    integral = not ids.is_floating_point() and not ids.is_complex() and ids.dtype != torch.bool
    need(integral, f"ids must be an integer tensor [T]; got {ids.dtype}")
    need(ids.dim() == 1, f"ids must be [T]; got {tuple(ids.shape)}")
    _check_bf16("table", table, "[V, H]")
    need(table.dim() == 2, f"table must be [V, H]; got {tuple(table.shape)}")
    v = table.shape[0]
    ids64 = ids.to(torch.int64)  # [T]
    bad = (ids64 < 0) | (ids64 >= v)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0, 0])
        raise ValueError(f"ids[{pos}] = {int(ids64[pos])} is out of range [0, V={v})")
    return table.index_select(0, ids64)  # [T, H]


# ---------------------------------------------------------------------------------------
# inv_rms: the shared reciprocal RMS
# ---------------------------------------------------------------------------------------
def inv_rms(h32: torch.Tensor, *, eps: float = _EPS, order: Order = DEFAULT_ORDER,
            n: int | None = None, backend: str | None = None, threads: int | None = None) -> torch.Tensor:
    """inv = fl32(1 / fl32(sqrt(fl32(fl32(ssq / n) + eps32)))), ssq = sum h*h in `order`.

    h32 [..., N] fp32 -> inv [...] fp32. n (default N) is the divisor (a padded row may
    divide by its real width). Sum: fp32, order `order`, depth order.depth(N).
    NaN in a row -> NaN; inf or fp32-overflowing squares -> 0; zero row -> 1/sqrt(eps32).
    """
    need(isinstance(h32, torch.Tensor) and h32.dtype == torch.float32,
          f"h32 must be an fp32 tensor [..., N]; got {getattr(h32, 'dtype', type(h32).__name__)}")
    need(h32.dim() >= 1 and h32.shape[-1] >= 1, f"h32 must be [..., N] with N >= 1; got {tuple(h32.shape)}")
    _check_eps_order(eps, order, backend, threads)
    n = h32.shape[-1] if n is None else n
    need(is_int(n) and 1 <= n < 2**24, f"n must be an int in [1, 2**24); got {n!r}")
    ssq = sum_squares(h32, order, backend=backend, threads=threads)  # [...] fp32
    m = ssq / torch.full_like(ssq, float(n))  # tensor / tensor: a true IEEE division
    d = m + torch.full_like(m, eps)  # eps rounded to fp32 by full_like
    r = sqrt_rn32(d)
    undefined_rows(r, eps, "the norm's")
    return torch.ones_like(r) / r


def _norm_rows(h32: torch.Tensor, g32: torch.Tensor, inv: torch.Tensor, rounding: str) -> torch.Tensor:
    """y from h [..., N] fp32, gamma [N] fp32, inv [...] fp32.
    once: bf16(fl32(fl32(h * inv) * gamma)); mlx: bf16(fl32(gamma * bf16(fl32(h * inv))))."""
    t = h32 * inv.unsqueeze(-1)  # [..., N] fp32, one rounding
    if rounding == "mlx":
        t = t.to(torch.bfloat16).to(torch.float32)  # MLX stores x*inv as bf16
        return (g32 * t).to(torch.bfloat16)
    return (t * g32).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------
# add_rms
# ---------------------------------------------------------------------------------------
def add_rms(x: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, *, eps: float = _EPS,
            order: Order = DEFAULT_ORDER, backend: str | None = None,
            threads: int | None = None) -> NormResult:
    """Residual add + RMSNorm: returns NormResult(h, y), both bf16 [..., H].

    h = bf16(fl32(x + residual))            one fp32 add of the widened bf16s, one bf16 rounding
    y = bf16(fl32(fl32(h * inv) * gamma))   inv = inv_rms(h) (module docstring), fp32 products
                                            in that order, then one bf16 rounding
    Sums: ssq over H, fp32, `order`, depth order.depth(H) (strided(256), H=2688: 23).
    x, residual: [..., H] bf16 (same shape); gamma [H] or [1, H] bf16 or fp32.
    backend / threads: the sum's kernel (kernels.glue.fmachain; every backend the same bytes).
    Special values: h follows IEEE (inf + -inf = NaN); y as in the module docstring.
    Row-independent and deterministic: a row's bytes never depend on the other rows.
    """
    _check_bf16("x", x, "[..., H]")
    need(x.dim() >= 1 and x.shape[-1] >= 1, f"x must be [..., H] with H >= 1; got {tuple(x.shape)}")
    _check_bf16("residual", residual, f"{tuple(x.shape)}")
    need(residual.shape == x.shape, f"residual must be {tuple(x.shape)} like x; got {tuple(residual.shape)}")
    g32 = gamma32(gamma, x.shape[-1])
    _check_eps_order(eps, order, backend, threads)
    h = (x.to(torch.float32) + residual.to(torch.float32)).to(torch.bfloat16)  # [..., H]
    h32 = h.to(torch.float32)
    y = _norm_rows(h32, g32, inv_rms(h32, eps=eps, order=order, backend=backend, threads=threads), "once")
    return NormResult(h, y)


# ---------------------------------------------------------------------------------------
# moe_add_rms
# ---------------------------------------------------------------------------------------
def _moe_combine(slots: torch.Tensor, weights: torch.Tensor, n_shared: int, backend, threads) -> torch.Tensor:
    """c = bf16(fl32(routed + shared)) as fp32 [T, H] (see moe_add_rms; no validation).
    The routed chain is kernels.glue.fmachain.moe_routed (every backend the same bits; NaN
    payloads not declared)."""
    s = slots.shape[0]
    r = s - n_shared
    acc = fmachain.moe_routed(slots, weights, nslots=r, backend=backend, threads=threads)  # [T, H]
    if n_shared:
        sh = slots[r].to(torch.float32)  # [T, H]
        for i in range(r + 1, s):  # shared slots on their own, in order
            sh = sh + slots[i].to(torch.float32)
        acc = acc + sh
    return acc.to(torch.bfloat16).to(torch.float32)


def moe_add_rms(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gamma: torch.Tensor, *,
                eps: float = _EPS, n_shared: int = 2, order: Order = DEFAULT_ORDER,
                backend: str | None = None, threads: int | None = None) -> NormResult:
    """MoE combine + residual add + RMSNorm in one pass: returns NormResult(h, y), bf16 [T, H].

    routed = fma(w[:, R-1], s_{R-1}, ... fma(w[:, 0], s_0, +0.0))   fp32, exact fma, slot order
    shared = ((s_R + s_{R+1}) + ...)                                 fp32 adds, slot order
    c      = bf16(fl32(routed + shared))       (n_shared = 0: c = bf16(routed))
    h      = bf16(fl32(x + c))
    y      = as in add_rms, from h
    x [T, H] bf16; slots [S, T, H] bf16 (prefill) or fp32 (decode), the first R = S - n_shared
    routed, the last n_shared shared (weight 1); weights [T, R] fp32; gamma [H] or [1, H]
    bf16/fp32. backend / threads: the routed chain's and the sum's kernel (kernels.glue.fmachain).
    Sums: combine fp32 depth max(R, n_shared - 1) + 1 (Nemotron 6 + 2: 7); ssq over H, fp32,
    `order`, depth order.depth(H). No fp32 combine row is kept: c is rounded before the add.
    Special values: IEEE through the chain (inf * 0 weight = NaN, inf - inf = NaN), then
    as add_rms. Row-independent and deterministic.
    """
    _check_bf16("x", x, "[T, H]")
    need(x.dim() == 2 and x.shape[1] >= 1, f"x must be [T, H] with H >= 1; got {tuple(x.shape)}")
    t, h_ = x.shape
    need_tensor("slots", slots, f"[S, T={t}, H={h_}] bf16 or fp32")
    need(slots.dtype in (torch.bfloat16, torch.float32),
         f"slots must be bf16 or fp32 [S, T={t}, H={h_}]; got {slots.dtype}")
    need(slots.dim() == 3 and slots.shape[0] >= 1 and tuple(slots.shape[1:]) == (t, h_),
          f"slots must be [S, T={t}, H={h_}] with S >= 1; got {tuple(slots.shape)}")
    s = slots.shape[0]
    need(is_int(n_shared) and 0 <= n_shared <= s,
          f"n_shared must be an int in [0, S={s}]; got {n_shared!r}")
    r = s - n_shared
    need_tensor("weights", weights, f"[T={t}, R={r}] fp32")
    need(weights.dtype == torch.float32, f"weights must be fp32 [T={t}, R={r}]; got {weights.dtype}")
    need(tuple(weights.shape) == (t, r), f"weights must be [T, S - n_shared] = [{t}, {r}]; got {tuple(weights.shape)}")
    g32 = gamma32(gamma, h_)
    _check_eps_order(eps, order, backend, threads)
    c = _moe_combine(slots, weights, n_shared, backend, threads)  # [T, H] bf16 values
    h = (x.to(torch.float32) + c).to(torch.bfloat16)  # [T, H]
    h32 = h.to(torch.float32)
    y = _norm_rows(h32, g32, inv_rms(h32, eps=eps, order=order, backend=backend, threads=threads), "once")
    return NormResult(h, y)


# ---------------------------------------------------------------------------------------
# rms_parts
# ---------------------------------------------------------------------------------------
def rms_parts(x: torch.Tensor, gamma: torch.Tensor, *, part: int, rounding: str = "once",
              eps: float = _EPS, order: Order = DEFAULT_ORDER, backend: str | None = None,
              threads: int | None = None) -> torch.Tensor:
    """Independent RMSNorm of each part-wide slice of a row (Mamba group norm, MTP halves).

    x [..., H] bf16, H = G * part; gamma [H] or [1, H] bf16/fp32 -> y [..., H] bf16.
    backend / threads: the sum's kernel (kernels.glue.fmachain; every backend the same bytes).
    inv_g = inv_rms(x[..., g*P:(g+1)*P]) with n = P; the order's lanes apply per part.
    rounding="once": y = bf16(fl32(fl32(x * inv_g) * gamma))
    rounding="mlx":  y = bf16(fl32(gamma * bf16(fl32(x * inv_g))))   (MLX rounds twice)
    Sums: ssq per part, fp32, `order`, depth order.depth(P) (strided(256), P=512: 14).
    Special values: as the module docstring, per part (a NaN poisons only its part).
    """
    _check_bf16("x", x, "[..., H]")
    need(x.dim() >= 1 and x.shape[-1] >= 1, f"x must be [..., H] with H >= 1; got {tuple(x.shape)}")
    h_ = x.shape[-1]
    need(is_int(part) and part >= 1 and h_ % part == 0,
          f"part must be a positive int dividing H={h_}; got {part!r}")
    need(rounding in ("once", "mlx"), f"rounding must be 'once' or 'mlx'; got {rounding!r}")
    g32 = gamma32(gamma, h_)
    _check_eps_order(eps, order, backend, threads)
    xg = x.to(torch.float32).reshape(*x.shape[:-1], h_ // part, part)  # [..., G, P]
    inv = inv_rms(xg, eps=eps, order=order, backend=backend, threads=threads)  # [..., G]
    y = _norm_rows(xg, g32.reshape(h_ // part, part), inv, rounding)  # [..., G, P]
    return y.reshape(x.shape)


# ---------------------------------------------------------------------------------------
# declarations: the rounding points and sums each op above runs (the contract's ranges
# are computed from these)
# ---------------------------------------------------------------------------------------
_NORM_POINTS = ("ssq: fp32 sum of squares in the declared order", "m = fl32(ssq / n)",
                "d = fl32(m + fp32(eps))", "r = fl32(sqrt(d))", "inv = fl32(1 / r)")


def ssq_decl(n: int, order: Order = DEFAULT_ORDER) -> SumDecl:
    """The sum of squares of an n-wide row in `order`: fp32, depth order.depth(n)."""
    return SumDecl("ssq", "fp32", order.depth(n), order.describe(n))


def add_rms_decl(h: int, *, order: Order = DEFAULT_ORDER) -> Decl:
    """add_rms on rows of width h."""
    return Decl("add_rms", ("h = bf16(fl32(x + residual))",) + _NORM_POINTS
                + ("t = fl32(h * inv)", "y = bf16(fl32(t * gamma32))"), (ssq_decl(h, order),))


def moe_add_rms_decl(h: int, *, n_slots: int, n_shared: int, order: Order = DEFAULT_ORDER) -> Decl:
    """moe_add_rms on rows of width h with n_slots slots, the last n_shared shared."""
    r = n_slots - n_shared
    comb = SumDecl("combine", "fp32", max(r, n_shared - 1) + 1,
                   f"routed: acc = fma(w_s, slot_s, acc) for s = 0..{r - 1} from +0.0; shared: slot-order "
                   f"adds of {n_shared}; routed + shared")
    return Decl("moe_add_rms", ("c = bf16(fl32(routed + shared))", "h = bf16(fl32(x + c))") + _NORM_POINTS
                + ("t = fl32(h * inv)", "y = bf16(fl32(t * gamma32))"), (comb, ssq_decl(h, order)))


def rms_parts_decl(part: int, *, rounding: str, order: Order = DEFAULT_ORDER) -> Decl:
    """rms_parts with parts `part` wide (the sum runs per part)."""
    last = ("y = bf16(fl32(fl32(x * inv) * gamma32))" if rounding == "once"
            else "y = bf16(fl32(gamma32 * bf16(fl32(x * inv))))")
    return Decl(f"rms_parts[{rounding}]", _NORM_POINTS + (last,), (ssq_decl(part, order),))


def embed_rows_decl() -> Decl:
    """embed_rows: a copy, no rounding."""
    return Decl("embed_rows", ("none: an exact copy",), ())
