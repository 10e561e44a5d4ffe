"""The SmolLM2 body's C kernels (kernels/model/body.c, attend.c, their shared exp32.h): their
ctypes bindings, unchecked.

lmtail.model.body holds the ops (validation, declarations, the torch spellings, the backend
tables); this module only hands validated tensors to C. Every function here assumes what its
docstring says about shapes, dtypes and strides (the op checked it once) and allocates its
outputs. Shape legend: B rows, T new tokens, nh / nkv query / KV heads, HD = 64 head dim,
S_cap cache slots, F FFN width, M rows, N rows of a norm, H hidden, P positions.

Numerics: the top comments of body.c, attend.c and exp32.h, and model/body.py's
declarations (exp32, silu_mul, attend, add_rms_rows, rope_qkv, silu_mul_bf16); `constants()`
returns exp32's constants as the C code holds them, for the test that compares them with
model/body.py's.

`isa` (exp32, silu_mul, attend, add_rms_rows32, rope_qkv) caps the micro-kernels body.c /
attend.c may pick (every one gives the same bytes): "avx512" the widest this CPU has (AVX-512,
else AVX2 + FMA, else portable), "avx2" at most AVX2 + FMA, "c" the portable C only
(add_rms_rows32 and rope_qkv have 16-lane and portable rows: "avx2" runs the portable C). emulated=True runs them on the emulated builds (SIMDe and
lmtail_emulate.h: every path, on any CPU with AVX2 + FMA + F16C; the "emu-avx512" rows).
"""
from __future__ import annotations

import ctypes

import torch

from lmtail.kernels._cc import kernel_library

HD = 64  # the head dim attend.c is built for
ISA_CAP = {"avx512": 0, "avx2": 1, "c": 2}  # the C kernels' ISA cap of each `isa` name
_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "lmtail_exp32_isa": ([_P, _P, _I64, _INT], None),
    "lmtail_silu_mul_isa": ([_P, _P, _I64, _I64, _I64, _INT], None),
    "lmtail_add_rms_rows": ([_P, _I64, _INT, _P, _P, _I64, _I64, _F32, _I64, _P, _P], _INT),
    "lmtail_add_rms_rows32": ([_P, _I64, _P, _P, _I64, _I64, _F32, _I64, _P, _P, _INT], _INT),
    "lmtail_rope_qkv": ([_P, _I64, _P, _P, _P, _P, _P, _P] + [_I64] * 6 + [_INT], None),
    "lmtail_silu_mul_bf16": ([_P, _P, _I64, _I64, _I64, _INT], None),
    "lmtail_body_constants": ([_P], _INT),
}
_ATTEND_SIGNATURES = {"lmtail_attend": ([_P] * 5 + [_I64] * 6 + [_F32, _INT, _INT], _INT)}
native_library = kernel_library("model/body.c", _SIGNATURES, what="model body", fallback="the torch emulation (same bytes, slow)")
_emulated = kernel_library("model/body.c", _SIGNATURES, what="model body", emulated=True)
_attend_library = kernel_library("model/attend.c", _ATTEND_SIGNATURES, what="attention",
                                 fallback="the torch emulation (same bytes, slow)")
_attend_emulated = kernel_library("model/attend.c", _ATTEND_SIGNATURES, what="attention", emulated=True)


def _lib(emulated: bool):
    """body.c's native library, or its emulated build."""
    return _emulated() if emulated else native_library()


def attend_library(emulated: bool = False):
    """attend.c's native library (or its emulated build); None when it was not built."""
    return _attend_emulated() if emulated else _attend_library()


def available() -> bool:
    """True when body.c and attend.c were built (else the ops run their torch spellings)."""
    return native_library() is not None and _attend_library() is not None


def constants() -> torch.Tensor:
    """[14] fp32: LOG2E, RND, LN2_HI, LN2_LO, X_HI, X_LO, C[0..7], as body.c holds them."""
    out = torch.empty(14, dtype=torch.float32)
    assert native_library().lmtail_body_constants(out.data_ptr()) == 14
    return out


def exp32(x: torch.Tensor, isa: str = "avx512", *, emulated: bool = False) -> torch.Tensor:
    """exp32 elementwise: x fp32 (any shape; copied when not contiguous) -> fp32."""
    xc = x.contiguous()
    y = torch.empty_like(xc)
    _lib(emulated).lmtail_exp32_isa(xc.data_ptr(), y.data_ptr(), xc.numel(), ISA_CAP[isa])
    return y


def silu_mul(gu: torch.Tensor, isa: str = "avx512", *, emulated: bool = False) -> torch.Tensor:
    """gu [M, 2F] fp32 -> silu(gate) * up [M, F] fp32."""
    if gu.stride(1) != 1:
        gu = gu.contiguous()
    M, F = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(M, F, dtype=torch.float32)  # [M, F]
    if M:
        _lib(emulated).lmtail_silu_mul_isa(gu.data_ptr(), out.data_ptr(), M, F, gu.stride(0), ISA_CAP[isa])
    return out


def attend(q, kt, v, pad, s0: int, scale: float, threads: int, *, isa: str, emulated: bool = False) -> torch.Tensor:
    """The declared attention: q [B, T, nh, 64], kt [B, nkv, 64, S_cap], v [B, nkv, S_cap, 64]
    fp32 C-contiguous, pad [B] int64 >= 0, S_cap >= s0 + T + SLACK, threads >= 1; isa: the
    micro-kernels' cap (module docstring; the same bits). -> [B, T, nh, 64]."""
    B, T, nh, _ = q.shape
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    pad_c = pad.contiguous()
    rc = attend_library(emulated).lmtail_attend(q.data_ptr(), kt.data_ptr(), v.data_ptr(), out.data_ptr(), pad_c.data_ptr(),
                                  B, T, nh, kt.shape[1], kt.shape[3], s0, float(scale), threads, ISA_CAP[isa])
    if rc != 0:
        raise MemoryError("attend: scratch allocation failed")
    return out


def add_rms_rows(x: torch.Tensor, residual: torch.Tensor, gamma32: torch.Tensor, eps: float, lanes: int):
    """x [N, H] fp32 or bf16 (unit column stride), residual [N, H] bf16 and gamma32 [H] fp32
    C-contiguous, lanes % 32 == 0 -> (h, y) [N, H] bf16 (model.body.add_rms_rows)."""
    N, H = x.shape
    h = torch.empty(N, H, dtype=torch.bfloat16)  # [N, H]
    y = torch.empty(N, H, dtype=torch.bfloat16)  # [N, H]
    ldx = x.stride(0) if N > 1 else H
    rc = native_library().lmtail_add_rms_rows(x.data_ptr(), ldx, int(x.dtype == torch.bfloat16), residual.data_ptr(),
                                        gamma32.data_ptr(), N, H, float(eps), lanes, h.data_ptr(), y.data_ptr())
    if rc != 0:
        raise MemoryError("add_rms_rows: scratch allocation failed")
    return h, y


def add_rms_rows32(x: torch.Tensor, residual: torch.Tensor | None, gamma32: torch.Tensor, eps: float,
                   lanes: int, isa: str = "avx512", *, emulated: bool = False):
    """x [N, H] fp32 (unit column stride), residual [N, H] fp32 C-contiguous or None (+0),
    gamma32 [H] fp32 C-contiguous, lanes % 32 == 0, lanes <= 1024 -> (h, y) [N, H] fp32
    (model.body.add_rms_rows32)."""
    N, H = x.shape
    h = torch.empty(N, H, dtype=torch.float32)  # [N, H]
    y = torch.empty(N, H, dtype=torch.float32)  # [N, H]
    ldx = x.stride(0) if N > 1 else H
    rp = None if residual is None else residual.data_ptr()
    rc = _lib(emulated).lmtail_add_rms_rows32(x.data_ptr(), ldx, rp, gamma32.data_ptr(), N, H, float(eps), lanes,
                                              h.data_ptr(), y.data_ptr(), ISA_CAP[isa])
    assert rc == 0, f"add_rms_rows32: lanes {lanes} rejected"
    return h, y


def rope_qkv(qkv, cos_t, sin_t, pos, kc, vc, s0: int, nh: int, isa: str = "avx512", *,
             emulated: bool = False) -> torch.Tensor:
    """qkv [B*T, (nh + 2 nkv) 64] fp32 (unit column stride), cos_t, sin_t [P, 32] fp32 and kc, vc
    C-contiguous, pos [B, T] int64 in [0, P) -> q [B, T, nh, 64] (model.body.rope_qkv)."""
    B, T = pos.shape
    nkv = kc.shape[1]
    pos_c = pos.contiguous()
    q = torch.empty(B, T, nh, HD, dtype=torch.float32)  # [B, T, nh, hd]
    ld = qkv.stride(0) if B * T > 1 else qkv.shape[1]
    _lib(emulated).lmtail_rope_qkv(qkv.data_ptr(), ld, cos_t.data_ptr(), sin_t.data_ptr(), pos_c.data_ptr(),
                                   q.data_ptr(), kc.data_ptr(), vc.data_ptr(), B, T, nh, nkv, kc.shape[3], s0,
                                   ISA_CAP[isa])
    return q


def silu_mul_bf16(gu: torch.Tensor, isa: str = "avx512", *, emulated: bool = False) -> torch.Tensor:
    """gu [M, 2F] fp32 -> bf16(silu_mul(gu)) [M, F]; isa caps the rows body.c may pick
    (AVX-512 where the CPU has it, or emulated)."""
    if gu.stride(1) != 1:
        gu = gu.contiguous()
    M, F = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(M, F, dtype=torch.bfloat16)  # [M, F]
    if M:
        _lib(emulated).lmtail_silu_mul_bf16(gu.data_ptr(), out.data_ptr(), M, F, gu.stride(0) if M > 1 else 2 * F,
                                            ISA_CAP[isa])
    return out
