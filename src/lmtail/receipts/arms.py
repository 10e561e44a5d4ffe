"""Receipt arms: named ways to compute the tail's fp32 logits from the same hidden states.

Every arm maps TailInputs (pre-final-norm hidden rows, the final norm's gamma, the bf16
lm_head) to logits [N, V] fp32. The built-in arms are compositions of lmtail's ops that
differ in ONE declared choice each:

    chain        ssq strided(256), deferred rms, GEMM order "chain"    (decode_tail's math)
    amx32        as chain, GEMM order "amx32"        (when kernels.gemm.bf16 offers it)
    legacy       as chain, deferred_rms=False: a = bf16((x*rms)*gamma), logits = gemm(a, W)
    contiguous   as chain, ssq order contiguous(256)
    placebo      as chain, the GEMM chain run over h = H-1..0 (same precision, one reorder)
    placebo_norm as chain, the ssq butterfly folded 1,2,4,8,16 (orders.placebo)
    torch        plain torch: rsqrt(mean(x^2) + eps), bf16(x*gamma) @ W in fp32 BLAS, * rms
    tail         lmtail.tail.compose.decode_tail(...).logits as shipped (whatever its defaults are)
    bf16x2       decode_tail(..., head_input="bf16x2").logits: the head GEMM's activation as two
                 bf16 rows a_hi + a_lo (a_hi = bf16(x*gamma), a_lo = bf16(x*gamma - a_hi)),
                 two GEMMs in the default order summed in fp32, * rms

An ArmRegistry holds them; users add their own with `registry.register(Arm(...))` (or
a module given to `lmtail receipt --arm-module`, exposing register_arms(registry)).

Shape legend: N rows, H hidden, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..kernels.gemm.bf16 import available_backends as gemm_backends
from ..kernels.gemm.bf16 import gemm_bf16
from ..numerics import sqrt_rn32
from ..orders import Order, contiguous, placebo, strided, sum_squares


@dataclass(frozen=True)
class TailInputs:
    """What every arm reads. scratch: a per-run cache arms may fill (e.g. a flipped weight)."""

    hidden: torch.Tensor  # [N, H] fp32 pre-final-norm hidden states
    gamma: torch.Tensor  # [H] fp32 final norm weight
    weight: torch.Tensor  # [H, V] bf16 C-contiguous lm_head (transposed)
    eps: float
    scratch: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Arm:
    """A named logits function. available() returns None when it can run, else why not."""

    name: str
    fn: Callable[[TailInputs], torch.Tensor]  # -> [N, V] fp32
    description: str
    available: Callable[[], str | None] = lambda: None


class ArmRegistry:
    """An ordered name -> Arm map; register() refuses a duplicate name unless replace=True."""

    def __init__(self):
        self._arms: dict[str, Arm] = {}

    def register(self, arm: Arm, *, replace: bool = False) -> None:
        if not isinstance(arm, Arm):
            raise TypeError(f"register takes an Arm; got {type(arm).__name__}")
        if arm.name in self._arms and not replace:
            raise ValueError(f"arm {arm.name!r} is already registered (pass replace=True)")
        self._arms[arm.name] = arm

    def get(self, name: str) -> Arm:
        if name not in self._arms:
            raise ValueError(f"unknown arm {name!r}; registered: {', '.join(self._arms)}")
        return self._arms[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self._arms)


# ---------------------------------------------------------------------------------------
# the composition every lmtail arm shares
# ---------------------------------------------------------------------------------------
def compose_tail(inp: TailInputs, *, ssq_order: Order, deferred_rms: bool,
                 gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The tail's norm + GEMM (no pad lanes): [N, H] -> [N, V] fp32, rounding as decode_tail:
    ssq in ssq_order (fp32), rms = 1/sqrt_rn32(ssq/H + eps), then
    deferred: a = bf16(x*gamma), logits = gemm(a, W) * rms;  legacy: a = bf16((x*rms)*gamma), gemm(a, W)."""
    x = inp.hidden.to(torch.float32)  # [N, H]
    h = x.shape[1]
    ssq = sum_squares(x, ssq_order)  # [N]
    s = sqrt_rn32(ssq / torch.tensor(float(h), dtype=torch.float32) + torch.tensor(inp.eps, dtype=torch.float32))
    rms = torch.tensor(1.0, dtype=torch.float32) / s  # [N]
    if deferred_rms:
        return gemm((x * inp.gamma).to(torch.bfloat16), inp.weight) * rms[:, None]
    return gemm(((x * rms[:, None]) * inp.gamma).to(torch.bfloat16), inp.weight)


def _chain(a, w):
    return gemm_bf16(a, w, order="chain")


def _amx32(a, w):
    return gemm_bf16(a, w, order="amx32")


def _amx32_available() -> str | None:
    """None when gemm_bf16(order="amx32") runs here, else why not (no C compiler)."""
    if not gemm_backends("amx32"):
        return "gemm_bf16(order='amx32') has no backend here (its C kernel could not be built)"
    return None


def _chain_reversed(inp: TailInputs):
    """The chain GEMM over h = H-1..0: flip a's columns and W's rows (cached per run)."""
    w_rev = inp.scratch.get("w_rev")
    if w_rev is None:
        w_rev = inp.scratch["w_rev"] = inp.weight.flip(0).contiguous()  # [H, V]
    return lambda a, w: gemm_bf16(a.flip(1).contiguous(), w_rev, order="chain")


def _torch_tail(inp: TailInputs) -> torch.Tensor:
    """Plain torch, the same formula: torch's own reduction orders and BLAS."""
    wf = inp.scratch.get("w_f32")
    if wf is None:
        wf = inp.scratch["w_f32"] = inp.weight.float()  # [H, V]
    x = inp.hidden.to(torch.float32)
    rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + inp.eps)  # [N, 1]
    return ((x * inp.gamma).to(torch.bfloat16).float() @ wf) * rms


def _decode_tail(inp: TailInputs) -> torch.Tensor:
    from ..tail.compose import decode_tail

    return decode_tail(inp.hidden, inp.gamma, inp.weight, eps=inp.eps, zero_interleaved_pad=False, k=1).logits


def _decode_tail_bf16x2(inp: TailInputs) -> torch.Tensor:
    from ..tail.compose import decode_tail

    return decode_tail(inp.hidden, inp.gamma, inp.weight, eps=inp.eps, zero_interleaved_pad=False, k=1,
                       head_input="bf16x2").logits


def default_arms() -> ArmRegistry:
    """A fresh registry holding the built-in arms (module docstring)."""
    reg = ArmRegistry()
    s256 = strided(256)
    reg.register(Arm("chain", lambda i: compose_tail(i, ssq_order=s256, deferred_rms=True, gemm=_chain),
                     "ssq strided(256), deferred rms, GEMM fp32 chain h = 0..H-1"))
    reg.register(Arm("amx32", lambda i: compose_tail(i, ssq_order=s256, deferred_rms=True, gemm=_amx32),
                     "as chain, GEMM order amx32 (32-lane K blocks, even/odd chains)", _amx32_available))
    reg.register(Arm("legacy", lambda i: compose_tail(i, ssq_order=s256, deferred_rms=False, gemm=_chain),
                     "as chain, deferred_rms=False: a = bf16((x*rms)*gamma)"))
    reg.register(Arm("contiguous", lambda i: compose_tail(i, ssq_order=contiguous(256), deferred_rms=True,
                                                          gemm=_chain),
                     "as chain, ssq order contiguous(256)"))
    reg.register(Arm("placebo", lambda i: compose_tail(i, ssq_order=s256, deferred_rms=True,
                                                       gemm=_chain_reversed(i)),
                     "PLACEBO: as chain, GEMM chain over h = H-1..0 (same precision, one reorder)"))
    reg.register(Arm("placebo_norm", lambda i: compose_tail(i, ssq_order=placebo(s256), deferred_rms=True,
                                                            gemm=_chain),
                     "PLACEBO: as chain, ssq butterfly folded 1,2,4,8,16"))
    reg.register(Arm("torch", _torch_tail, "plain torch: rsqrt(mean(x^2)+eps), bf16(x*gamma) @ W (BLAS), * rms"))
    reg.register(Arm("tail", _decode_tail, "lmtail.tail.compose.decode_tail(...).logits with its shipped defaults"))
    reg.register(Arm("bf16x2", _decode_tail_bf16x2,
                     "decode_tail(..., head_input='bf16x2', k=1).logits: a = a_hi + a_lo, two bf16 rows, "
                     "two GEMMs in the default order, acc_hi + acc_lo in fp32, * rms"))
    return reg
