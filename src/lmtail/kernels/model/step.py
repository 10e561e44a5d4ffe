"""The native body step (kernels/model/step.c): the q32 body's layer loop in one C call.

step.c calls the declared kernels themselves (gemm_q.c's lmtail_gemm_q_cat, body.c's
lmtail_add_rms_rows32, lmtail_rope_qkv, lmtail_silu_mul, attend.c's lmtail_attend), reached as function
pointers of the libraries the kernel loader already built, in the order of the python loop
in model/llama.py (`_q32_layers`): the same bytes by construction
(tests/test_q32.py::test_native_step_equals_python_loop).
What it removes per token is python: ~10 validated calls x 30 layers, each allocating its
output. Everything it touches is built once: `Q32Model` per loaded model (weights, gammas,
rope tables: pointers into tensors it keeps alive), `StepBuffers` per KV cache (scratch for
up to n_max rows, grown only when a call has more rows).

Shape legend: N = B*T rows, H hidden, qd = nh*64, kvd = nkv*64, F FFN width, L layers,
P rope positions, S_cap cache slots (+ slack).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from lmtail.kernels.model import body as kbody
from lmtail.kernels.quant import gemm_q as kquant
from lmtail.kernels._cc import kernel_library

_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_library = kernel_library("model/step.c", {
    "lmtail_step_q32": ([_P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _INT, _INT], _INT),
    "lmtail_step_q32_rows": ([_P, _P, _P, _P, _P, _P, _P, _P, _I64, _INT, _INT], _INT),
}, what="native body step", fallback="the python layer loop (same bytes)")

_STEPS = ("qkv", "attend", "o", "ffn_norm", "gate_up", "down", "norm")


class _QLinear(ctypes.Structure):
    _fields_ = [("w", _P), ("fmt", _I64), ("n", _I64), ("k", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("lin", _QLinear * 7), ("attn_norm", _P), ("ffn_norm", _P)]


class _Model(ctypes.Structure):
    _fields_ = [("gemm_q", _P), ("norm", _P), ("rope", _P), ("attend", _P), ("silu", _P),
                ("layers", ctypes.POINTER(_Layer)), ("final_norm", _P), ("cos_t", _P), ("sin_t", _P),
                ("L", _I64), ("H", _I64), ("nh", _I64), ("nkv", _I64), ("F", _I64), ("lanes", _I64),
                ("eps", _F32), ("scale", _F32), ("gemm_isa", _I64), ("attend_isa", _I64),
                ("body_isa", _I64)]


class _Buffers(ctypes.Structure):
    _fields_ = [("qkv", _P), ("q", _P), ("att", _P), ("a", _P), ("gu", _P), ("s", _P), ("n_max", _I64)]


def available(gemm_backend: str, attend_backend: str) -> bool:
    """True when step.c, gemm_q.c and body.c are built and the chosen backends are C ones."""
    return (_library() is not None and kbody.available() and kquant.native_library() is not None
            and gemm_backend in kquant.ISA and attend_backend in kbody.ISA_CAP)


def _fn(lib, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


@dataclass(frozen=True)
class StepShape:
    """The model's widths as step.c sees them."""

    L: int
    H: int
    nh: int
    nkv: int
    F: int


class Q32Model:
    """The q32 body's model as step.c's model_t, built once: `linears` L tuples of the 7
    QuantWeights (q, k, v, o, gate, up, down), `attn_norms` / `ffn_norms` L x [H] fp32,
    `final_norm` [H] fp32, rope tables cos_t, sin_t [P, 32] fp32, the norm's lane count, eps,
    the attention scale, the gemm_q backend ("avx512" | "avx2" | "c") and the attend backend
    ("avx512" | "avx2" | "c": the micro-kernels attend.c may pick; the same bytes) and
    body.c's glue backend (body_isa: the cap of its silu_mul, add_rms_rows32 and rope_qkv
    rows; the same caps, another name: "c"). Keeps every tensor it points into alive."""

    def __init__(self, shape: StepShape, linears, attn_norms, ffn_norms, final_norm, cos_t, sin_t, *,
                 lanes: int, eps: float, scale: float, gemm_backend: str, attend_backend: str,
                 body_backend: str = "c"):
        keep = [t.contiguous() for t in (*attn_norms, *ffn_norms, final_norm, cos_t, sin_t)]
        self._keep = (keep, linears)
        an, fn_, (fin, cs, sn) = keep[:shape.L], keep[shape.L:2 * shape.L], keep[2 * shape.L:]
        layers = (_Layer * shape.L)()
        for i, ws in enumerate(linears):
            assert len(ws) == 7
            for j, w in enumerate(ws):
                layers[i].lin[j] = _QLinear(w.data.data_ptr(), kquant.FMT_CODE[w.fmt], w.shape[0], w.shape[1])
            layers[i].attn_norm, layers[i].ffn_norm = an[i].data_ptr(), fn_[i].data_ptr()
        self._layers = layers
        blib, qlib = kbody.native_library(), kquant.native_library()
        self.struct = _Model(
            gemm_q=_fn(qlib, "lmtail_gemm_q_cat"), norm=_fn(blib, "lmtail_add_rms_rows32"),
            rope=_fn(blib, "lmtail_rope_qkv"), attend=_fn(kbody.attend_library(), "lmtail_attend"), silu=_fn(blib, "lmtail_silu_mul_isa"),
            layers=ctypes.cast(layers, ctypes.POINTER(_Layer)), final_norm=fin.data_ptr(), cos_t=cs.data_ptr(),
            sin_t=sn.data_ptr(), L=shape.L, H=shape.H, nh=shape.nh, nkv=shape.nkv, F=shape.F, lanes=lanes,
            eps=eps, scale=scale, gemm_isa=kquant.ISA[gemm_backend], attend_isa=kbody.ISA_CAP[attend_backend],
            body_isa=kbody.ISA_CAP.get(body_backend, kbody.ISA_CAP["c"]))
        self.shape = shape


class StepBuffers:
    """step.c's scratch for up to n_max rows (N = B*T of one call), allocated once and grown
    (never shrunk) when a call brings more rows; lives with its KV cache."""

    def __init__(self, shape: StepShape):
        self.shape, self.n_max, self.struct, self._keep = shape, 0, None, ()

    def ensure(self, n: int) -> None:
        if n <= self.n_max:
            return
        s = self.shape
        qd, kvd = s.nh * 64, s.nkv * 64
        bufs = [torch.empty(n, w, dtype=torch.float32) for w in (qd + 2 * kvd, qd, qd, s.H, 2 * s.F, s.F)]
        self._keep, self.n_max = bufs, n
        self.struct = _Buffers(*(b.data_ptr() for b in bufs), n)


def run_q32(model: Q32Model, bufs: StepBuffers, x: torch.Tensor, kc, vc, pos: torch.Tensor, pad: torch.Tensor,
            *, s0: int, gemm_threads: int, attend_threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of the whole body: x [N, H] fp32 embedding rows (N = B*T, C-contiguous;
    overwritten in place: it is returned as h), kc / vc the cache's L per-layer tensors, pos [B, T] int64 (>= 0, < P),
    pad [B] int64, s0 the first slot. Returns (h, y) [N, H] fp32: the pre-final-norm
    hidden states and the final-normed ones. Validated by the caller (model/llama.py)."""
    B, T = pos.shape
    N, H = B * T, model.shape.H
    bufs.ensure(N)
    h = x  # [N, H], overwritten layer by layer
    y = torch.empty(N, H, dtype=torch.float32)  # [N, H]
    kp = (ctypes.c_void_p * len(kc))(*(t.data_ptr() for t in kc))
    vp = (ctypes.c_void_p * len(vc))(*(t.data_ptr() for t in vc))
    pos_c, pad_c = pos.contiguous(), pad.contiguous()
    rc = _library().lmtail_step_q32(ctypes.byref(model.struct), ctypes.byref(bufs.struct), h.data_ptr(),
                                    y.data_ptr(), kp, vp, pos_c.data_ptr(), pad_c.data_ptr(), B, T,
                                    kc[0].shape[3], s0, gemm_threads, attend_threads)
    _check(rc)
    return h, y


def run_q32_rows(model: Q32Model, bufs: StepBuffers, x: torch.Tensor, caches) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of R rows, each in its OWN one-row cache at its own position (the
    continuous batch): x [R, H] fp32 embedding rows of the rows' new tokens (C-contiguous;
    overwritten in place: it is returned as h), caches R
    one-row model.llama.KVCache values (pad 0) with room for one more slot. Row r's bytes are
    those of a one-row batch-mode step on its cache (the same rope / attend calls; the
    stacked linears and norms are row-invariant). Does not advance cache.length (the caller
    does). Returns (h, y) [R, H] fp32. Validated by the caller (serve.batch)."""
    R, H = x.shape
    L = model.shape.L
    bufs.ensure(R)
    h, y = x, torch.empty(R, H, dtype=torch.float32)  # [R, H]
    kp = (ctypes.c_void_p * (L * R))(*(c.k[i].data_ptr() for i in range(L) for c in caches))
    vp = (ctypes.c_void_p * (L * R))(*(c.v[i].data_ptr() for i in range(L) for c in caches))
    s0s = torch.tensor([c.length for c in caches], dtype=torch.int64)  # [R]
    caps = torch.tensor([c.k[0].shape[3] for c in caches], dtype=torch.int64)  # [R] slots incl. slack
    threads = torch.get_num_threads()
    rc = _library().lmtail_step_q32_rows(ctypes.byref(model.struct), ctypes.byref(bufs.struct), h.data_ptr(),
                                         y.data_ptr(), kp, vp, s0s.data_ptr(), caps.data_ptr(), R, threads, 1)
    _check(rc)
    return h, y


def _check(rc: int) -> None:
    if rc != 0:
        layer, step = divmod(-1000 - rc, 10) if rc <= -1000 else (-1, 0)
        raise RuntimeError(f"native step failed (code {rc}: layer {layer}, "
                           f"{_STEPS[step - 1] if 0 < step <= len(_STEPS) else 'setup'})")
