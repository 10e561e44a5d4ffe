"""The bf16 GEMM with a declared summation order: "chain", "amx32" or "dp32".

Shape legend:
  M  rows of activations (gbs, or a row block of it)
  H  hidden size: the summed axis;  NB = ceil(H/32) blocks of 32 K-lanes, Kp = 32 NB
  V  columns of the weight (V_s for the lm_head shard);  Vp = V rounded up to 32
  a    [M, H] bf16   GEMM input activations (any strides)
  w    [H, V] bf16   weight, already transposed, C-contiguous; or a PackedWeight
  out  [M, V] fp32

`gemm_bf16(a, w, order=...)` is the op; each order is a declaration (`gemm_decl(H, order)`,
docs/gemm.md) that every backend reproduces bit for bit. Per output element:

  "chain": acc = +0.0; for h = 0..H-1: acc = fl32(acc + a[m,h] * w[h,v]) (an fma: exact
      product, one rounding); IEEE subnormals kept. One sum, fp32, depth H.
  "amx32": acc = +0.0; for each 32-lane block b in order (lanes past H are +0 * +0):
      e = fma chain from +0 over the even lanes, o = over the odd lanes (16 steps each),
      then acc = fl32(acc + fl32(e + o)). Inputs read with DAZ (a subnormal bf16 is the
      zero of its sign); every fma and add flushed with FTZ (a result tiny after rounding
      becomes the zero of its sign). One sum, fp32, depth 16 + 1 + NB. This is the order
      of AMX TDPBF16PS, and an FMA emulation of it runs on any CPU.
  "dp32": acc = +0; for each 32-lane block b in order (lanes past H are +0 * +0): t = +0;
      for j = 0..15: t = fma(a[2j+1], w[2j+1], t), then t = fma(a[2j], w[2j], t) (odd lane
      of the pair first); then acc = fl32(acc + t). DAZ on every input, FTZ on every fma
      and add (as amx32). One sum, fp32, depth 32 + NB. This is VDPBF16PS per fp32 lane
      (AVX512-BF16), and an FMA emulation of it runs on any CPU.
All store a NaN result as the canonical quiet NaN 0x7FC00000; inf follows IEEE.
Byte for byte, a row's result does not depend on M or the other rows, the thread count,
the backend, repeats, the weight layout (plain or packed), or column slicing.
amx32 threads come from a per-process pool (kernels/gemm/gemm_amx32.c; a forked child starts
its own); with M <= 6 a call splits the columns once w holds 2^17 elements per thread.

Backends (`available_backends(order)`, all bit-equal; one `_backend.Dispatch` table per
order, GEMM[order]; backend=None takes the fastest verified row for the call's rows and
the weight's layout, measured once per machine: kernels._verify, docs/backends.md):
  chain : "avx512", "c" (kernels/gemm/gemm_chain.c), "numba" (when the optional numba is
          installed; imported only when used; the fallback without a C compiler)
  amx32 : "amx" (tile instructions; CPUs with AMX-BF16), "avx512", "avx2" (vector fmas
          under MXCSR FTZ|DAZ), "c" (plain C, the fma emulated exactly, FTZ/DAZ in
          software) (kernels/gemm/gemm_amx32.c); no fallback without a C compiler.
  dp32  : "avx512bf16" (VDPBF16PS; CPUs with AVX512-BF16), "avx512", "avx2" (vector fmas
          under MXCSR FTZ|DAZ), "c" (plain C, FTZ/DAZ in software) (kernels/gemm/gemm_dp32.c);
          no fallback without a C compiler.
  emulated rows (never chosen by backend=None; GEMM[order].names(emulated=True)): chain
          "emu-avx512", amx32 "emu-amx", "emu-avx512", "emu-avx2", dp32 "emu-avx512bf16",
          "emu-avx512": the same sources built against SIMDe with lmtail_emulate.h's exact
          VDPBF16PS and AMX tile models, on any AVX2 + FMA + F16C CPU (docs/emulated.md).
The default order is DEFAULT_ORDER = "amx32" (gemm_bf16, gemm_decl, the model body, TailConfig).
`pack_weight(w)` makes the one-time load layout (VNNI pairs) that AMX and VDPBF16PS read
(amx32 and dp32 take it; the chain takes the plain tensor).
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
from dataclasses import dataclass

import torch

from lmtail.kernels import _backend, cpu
from lmtail.kernels._verify import row_class as _verify_row_class
from lmtail.kernels._cc import kernel_library
from lmtail.numerics import Decl, SumDecl

ORDERS = ("chain", "amx32", "dp32")  # the orders gemm_bf16 and gemm_decl take
# the orders the tail takes (config.GEMM_ORDERS, TailConfig.gemm_order; each has its code by
# name in config.OPTION_CODES) and the ones the model body takes (model.llama.Ops.gemm_order)
TAIL_ORDERS = ("chain", "amx32", "dp32")
BODY_ORDERS = ("amx32", "chain")
DEFAULT_ORDER = "amx32"  # the one default GEMM order (gemm_bf16, gemm_decl, the body, the tail)


def gemm_decl(H: int, order: str = DEFAULT_ORDER) -> Decl:
    """The declaration of `gemm_bf16(order=order)` for hidden size H."""
    if order == "chain":
        return Decl(
            op="gemm_bf16_chain",
            rounding_points=("acc = fl32(acc + a*w) each h step (fma: exact product, 1 rounding)",
                             "NaN result -> canonical quiet NaN 0x7FC00000"),
            sums=(SumDecl(name="gemm", dtype="fp32", depth=H,
                          order="sequential chain h = 0..H-1 from +0.0, per output element"),),
        )
    if order == "amx32":
        nb = -(-H // 32)
        return Decl(
            op="gemm_bf16_amx32",
            rounding_points=(
                "inputs: a subnormal bf16 is read as the zero of its sign (DAZ)",
                "e, o = fl32(e + a*w) per even / odd lane of a 32-lane block (fma), FTZ",
                "s = fl32(e + o), FTZ", "acc = fl32(acc + s) per block in order, FTZ",
                "FTZ: a result tiny after rounding becomes the zero of its sign",
                "NaN result -> canonical quiet NaN 0x7FC00000"),
            sums=(SumDecl(name="gemm", dtype="fp32", depth=16 + 1 + nb,
                          order="per 32-lane block: even and odd fma chains from +0 (16 "
                                "each, lanes past H are +0*+0), acc = acc + (e + o), blocks "
                                "b = 0..ceil(H/32)-1 in order from acc = +0",
                          flush=True, roundings=34 * nb),),
        )
    if order == "dp32":
        nb = -(-H // 32)
        return Decl(
            op="gemm_bf16_dp32",
            rounding_points=(
                "inputs: a subnormal bf16 is read as the zero of its sign (DAZ)",
                "t = fl32(t + a*w) per lane of a 32-lane block, the pair's odd lane then its "
                "even lane (fma), FTZ",
                "acc = fl32(acc + t) per block in order, FTZ",
                "FTZ: a result tiny after rounding becomes the zero of its sign",
                "NaN result -> canonical quiet NaN 0x7FC00000"),
            sums=(SumDecl(name="gemm", dtype="fp32", depth=32 + nb,
                          order="per 32-lane block: one fma chain t from +0 over the lane "
                                "pairs j = 0..15, odd lane then even (lanes past H are +0*+0), "
                                "acc = acc + t, blocks b = 0..ceil(H/32)-1 in order from acc = +0",
                          flush=True, roundings=33 * nb),),
        )
    raise ValueError(f"order must be one of {ORDERS}; got {order!r}")


@dataclass(frozen=True)
class PackedWeight:
    """A weight [H, V] bf16 in the amx32 kernels' load-time layout.

    data [Kp/2, 2*Vp] bf16: data[k//2, 2*v + k%2] = w[k, v] (VNNI pairs, the layout AMX
    tiles read), zero past H and V, a subnormal stored as the zero of its sign (what DAZ
    reads anyway). Costs one pass over w and (Kp/H)*(Vp/V) times its bytes; the plain
    [H, V] tensor works everywhere too (AMX then re-lays each 32-column tile per call).
    """

    data: torch.Tensor
    H: int
    V: int

    def __post_init__(self):
        want = (16 * -(-self.H // 32), 2 * 32 * -(-self.V // 32))
        if not (isinstance(self.data, torch.Tensor) and self.data.dtype == torch.bfloat16
                and self.data.device.type == "cpu" and self.data.is_contiguous()
                and tuple(self.data.shape) == want):
            got = (f"{self.data.dtype} {tuple(self.data.shape)}"
                   if isinstance(self.data, torch.Tensor) else type(self.data).__name__)
            raise ValueError(f"PackedWeight.data must be a contiguous CPU bf16 [Kp/2, 2*Vp] = "
                             f"{want} for H={self.H}, V={self.V}; got {got}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.H, self.V)


# ---------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------
def _validate(a: torch.Tensor, w, out: torch.Tensor | None) -> None:
    for name, t, want in (("a", a, "[M, H]"), ("w", w, "[H, V]")):
        if name == "w" and isinstance(t, PackedWeight):
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {want}; got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D {want}; got shape {tuple(t.shape)}")
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be torch.bfloat16; got {t.dtype}")
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor; got device {t.device}")
    if a.shape[1] != w.shape[0]:
        raise ValueError(f"H mismatch: a is [M, H] = {tuple(a.shape)} but w is [H, V] = "
                         f"{tuple(w.shape)}; expected a.shape[1] == w.shape[0]")
    if isinstance(w, torch.Tensor) and not w.is_contiguous():
        raise ValueError(f"w must be C-contiguous [H, V]; got strides {w.stride()} for shape "
                         f"{tuple(w.shape)} (expected ({w.shape[1]}, 1))")
    if out is None:
        return
    M, V = a.shape[0], w.shape[1]
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a torch.float32 tensor; got {got}")
    if tuple(out.shape) != (M, V):
        raise ValueError(f"out must be [M, V] = {(M, V)}; got {tuple(out.shape)}")
    if out.device.type != "cpu":
        raise ValueError(f"out must be a CPU tensor; got device {out.device}")
    if M > 0 and V > 0 and (out.stride(1) != 1 or (M > 1 and out.stride(0) < V)):
        raise ValueError(f"out must have unit column stride and row stride >= V = {V}; "
                         f"got strides {out.stride()}")


def _validate_options(order: str, w, backend: str | None, threads: int | None) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}; got {order!r}")
    if isinstance(w, PackedWeight) and order == "chain":
        raise ValueError(f"a PackedWeight needs order='amx32' or 'dp32'; got order={order!r} "
                         "(pass the plain [H, V] tensor for the chain)")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"threads must be an int >= 1 or None; got {threads!r}")


# ---------------------------------------------------------------------------------------
# backends (unchecked: gemm_bf16 validated its arguments; out is [M, V] fp32, M, V, H > 0)
# ---------------------------------------------------------------------------------------
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_CHAIN_SIGS = {"lmtail_gemm_bf16_chain": ([_P] * 3 + [_I64] * 4 + [_INT] * 2, _INT)}
_AMX32_SIGS = {
    "lmtail_amx32_has": ([_INT], _INT),
    "lmtail_amx32_pack": ([_P, _I64, _I64, _I64, _P], None),
    "lmtail_amx32_pool_helpers": ((), _INT),
    "lmtail_amx32_vnni_tile": ([_P, _I64, _I64, _I64, _I64, _P], _INT),
    "lmtail_amx32_gemm": ([_P, _I64, _P, _I64, _INT, _P] + [_I64] * 4 + [_INT] * 2, _INT),
}
_DP32_SIGS = {
    "lmtail_dp32_has": ([_INT], _INT),
    "lmtail_dp32_gemm": ([_P, _I64, _P, _I64, _INT, _P] + [_I64] * 4 + [_INT] * 2, _INT),
}
_chain_library = kernel_library("gemm/gemm_chain.c", _CHAIN_SIGS, what="gemm", fallback="the numba fallback")
_amx32_lib = kernel_library("gemm/gemm_amx32.c", _AMX32_SIGS, what="gemm amx32", fallback="no amx32 backend")
_dp32_lib = kernel_library("gemm/gemm_dp32.c", _DP32_SIGS, what="gemm dp32", fallback="no dp32 backend")
# the emulated builds (SIMDe and lmtail_emulate.h's models): the "emu-<isa>" rows
_chain_emu = kernel_library("gemm/gemm_chain.c", _CHAIN_SIGS, what="gemm", emulated=True)
_amx32_emu = kernel_library("gemm/gemm_amx32.c", _AMX32_SIGS, what="gemm amx32", emulated=True)
_dp32_emu = kernel_library("gemm/gemm_dp32.c", _DP32_SIGS, what="gemm dp32", emulated=True)


def _c_library():
    """The compiled chain kernel, or None (tests replace this to drop it)."""
    return _chain_library()


def _amx32_library():
    """The compiled amx32 kernels, or None (no compiler, failed build)."""
    return _amx32_lib()


def _dp32_library():
    """The compiled dp32 kernels, or None (no compiler, failed build)."""
    return _dp32_lib()


def _chain_c(isa: int, library=lambda: _c_library()):
    def run(a, w, out, threads):
        M = a.shape[0]
        aT = a.detach().float().t().contiguous()  # [H, M] fp32, exact widening
        ldc = out.stride(0) if M > 1 else w.shape[1]
        used = library().lmtail_gemm_bf16_chain(aT.data_ptr(), w.data_ptr(), out.data_ptr(), M,
                                                a.shape[1], w.shape[1], ldc, threads, isa)
        assert used == isa, (used, isa)
    return run


@functools.lru_cache(maxsize=None)
def _numba_installed() -> bool:
    """numba is an optional extra: the backend is offered only when it can be imported."""
    return importlib.util.find_spec("numba") is not None


def _chain_numba(a, w, out, threads):
    from lmtail.kernels.gemm import _numba as _gemm_numba  # numba is imported only when this backend runs

    _gemm_numba.chain(a, w, out)


def _amx32_c(isa: int, name: str, library=lambda: _amx32_library(), entry="lmtail_amx32_gemm",
             order="amx32"):
    """The backend `name` of the amx32 kernel, or of any kernel with its C signature and
    weight layouts (plain or PackedWeight): dp32 passes its library and entry point."""
    def run(a, w, out, threads):
        M, H = a.shape
        if a.stride(1) != 1:
            a = a.contiguous()
        lda = a.stride(0) if M > 1 else H
        packed = isinstance(w, PackedWeight)
        if packed:
            wt, V, ldw = w.data, w.V, 0
        else:
            wt, V = w, w.shape[1]
            ldw = V
        ldc = out.stride(0) if M > 1 else V
        rc = getattr(library(), entry)(a.data_ptr(), lda, wt.data_ptr(), ldw, int(packed),
                                       out.data_ptr(), M, H, V, ldc, threads, isa)
        if rc != 0:
            raise RuntimeError(f"gemm_bf16 {order} backend {name!r} failed (code {rc}: "
                               f"{'ISA unavailable' if rc == -1 else 'out of memory'})")
    return run


def _has(library, *features: str):
    return lambda: library() is not None and cpu.has(*features)


_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


def _emu(name: str, run, native) -> _backend.Backend:
    """The emulated row "emu-<name>": `run` on an emulated build, offered where the `native`
    library builds and cpu.emulation_runs() (never chosen by backend=None)."""
    return _backend.Backend(f"emu-{name}", run, lambda: native() is not None and cpu.emulation_runs(),
                            emulated=True)


GEMM = {
    "chain": _backend.Dispatch("gemm_bf16 chain", (
        _backend.Backend("avx512", _chain_c(2), _has(lambda: _c_library(), "avx512f", "avx512bw", "avx512vl")),
        _backend.Backend("c", _chain_c(0), _has(lambda: _c_library())),
        _backend.Backend("numba", _chain_numba, _numba_installed),
        _emu("avx512", _chain_c(2, _chain_emu), lambda: _c_library()),
    )),
    "amx32": _backend.Dispatch("gemm_bf16 amx32", (
        _backend.Backend("amx", _amx32_c(3, "amx"), _has(lambda: _amx32_library(), *_AVX512, "amx_bf16")),
        _backend.Backend("avx512", _amx32_c(2, "avx512"), _has(lambda: _amx32_library(), *_AVX512)),
        _backend.Backend("avx2", _amx32_c(1, "avx2"), _has(lambda: _amx32_library(), "avx2", "fma")),
        _backend.Backend("c", _amx32_c(0, "c"), _has(lambda: _amx32_library())),
        *(_emu(name, _amx32_c(isa, f"emu-{name}", _amx32_emu), lambda: _amx32_library())
          for name, isa in (("amx", 3), ("avx512", 2), ("avx2", 1))),
    )),
    "dp32": _backend.Dispatch("gemm_bf16 dp32", (
        *(_backend.Backend(name, _amx32_c(isa, name, lambda: _dp32_library(), "lmtail_dp32_gemm", "dp32"),
                           _has(lambda: _dp32_library(), *features))
          for name, isa, features in (("avx512bf16", 3, (*_AVX512, "avx512_bf16")),
                                      ("avx512", 2, _AVX512), ("avx2", 1, ("avx2", "fma")),
                                      ("c", 0, ()))),
        *(_emu(name, _amx32_c(isa, f"emu-{name}", _dp32_emu, "lmtail_dp32_gemm", "dp32"), lambda: _dp32_library())
          for name, isa in (("avx512bf16", 3), ("avx512", 2))),
    )),
}


def available_backends(order: str = DEFAULT_ORDER) -> tuple[str, ...]:
    """The backends this machine runs for `order`, in the table's order
    (backend=None takes the fastest verified one; all give
    the same bytes). amx32 / dp32 without a C compiler: () (gemm_bf16 then raises
    RuntimeError)."""
    if order not in GEMM:
        raise ValueError(f"order must be one of {ORDERS}; got {order!r}")
    return GEMM[order].names()


def _run(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, backend: str,
         threads: int | None = None) -> None:
    """out[:, :] = the chain, computed by `backend` (inputs already validated)."""
    row = GEMM["chain"].pick(backend)
    row.run(a, w, out, torch.get_num_threads() if threads is None else threads)


def gemm_unchecked(a: torch.Tensor, w, row: _backend.Backend, threads: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """gemm_bf16 on arguments validated once by the caller (the model body): a [M, H] bf16,
    w [H, V] bf16 C-contiguous or a PackedWeight (amx32 / dp32 rows only), row = GEMM[order].pick(...),
    threads >= 1. Returns out [M, V] fp32 (allocated when None)."""
    M, H = a.shape
    V = w.V if isinstance(w, PackedWeight) else w.shape[1]
    if out is None:
        out = torch.empty(M, V, dtype=torch.float32)  # [M, V]
    if M == 0 or V == 0:
        return out
    if H == 0:
        return out.zero_()
    row.run(a, w, out, threads)
    return out


# ---------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------
def pack_weight(w: torch.Tensor) -> PackedWeight:
    """The one-time load layout of w [H, V] bf16 for order="amx32" or "dp32" (see PackedWeight).
    Raises ValueError on a non-bf16, non-2-D, non-CPU or non-contiguous w."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor [H, V]; got {type(w).__name__}")
    _validate(torch.empty(0, w.shape[0] if w.dim() >= 1 else 0, dtype=torch.bfloat16), w, None)
    H, V = w.shape
    kp, vp = 32 * -(-H // 32), 32 * -(-V // 32)
    data = torch.empty(kp // 2, 2 * vp, dtype=torch.bfloat16)  # [Kp/2, 2 Vp]
    lib = _amx32_library()
    if lib is None:
        raise RuntimeError("pack_weight needs the amx32 C kernel (no C compiler?)")
    lib.lmtail_amx32_pack(w.data_ptr(), V, H, V, data.data_ptr())
    return PackedWeight(data=data, H=H, V=V)


def gemm_bf16(a: torch.Tensor, w, *, order: str = DEFAULT_ORDER, out: torch.Tensor | None = None,
              backend: str | None = None, threads: int | None = None) -> torch.Tensor:
    """out = a @ w in the declared summation `order` ("chain", "amx32" or "dp32"; module docstring,
    docs/gemm.md, `gemm_decl(H, order)`).

    a [M, H] bf16 (any strides); w [H, V] bf16 C-contiguous, or `pack_weight(w)` (amx32
    and dp32) -> [M, V] fp32. out: optional [M, V] fp32 destination with unit column stride and
    row stride >= V (e.g. a row block `full[r0:r1]`); returned when given.
    backend: one of available_backends(order) (None = the fastest verified for M rows and
    w's layout, measured once per machine: kernels._verify); threads: worker threads
    (None = torch.get_num_threads()). The bytes depend on neither, nor on M, the layout of
    w or repeats. The GIL is released while the kernel runs.
    Raises TypeError for a non-tensor a or w; ValueError (nothing written) on wrong dtypes,
    ranks, an H mismatch, a non-contiguous w, a bad out, order, backend or threads;
    RuntimeError for amx32 or dp32 on a machine without a C compiler.
    """
    _validate(a, w, out)
    _validate_options(order, w, backend, threads)
    if not available_backends(order):
        raise RuntimeError(f"gemm_bf16 order={order!r} needs its C kernel, which could not be "
                           "built on this machine (see the RuntimeWarning)")
    row = GEMM[order].pick(backend, what=f" for order={order!r} on this machine", rows=a.shape[0],
                           layout="packed" if isinstance(w, PackedWeight) else "plain")
    nthreads = torch.get_num_threads() if threads is None else threads
    return gemm_unchecked(a, w, row, nthreads, out)


# ---------------------------------------------------------------------------------------
# the probes backends are verified and timed on (kernels._verify)
# ---------------------------------------------------------------------------------------
PACKED_NATIVE = ("amx", "avx512bf16")  # rows whose instructions read the packed layout as it is


def _gemm_probe(order: str):
    def probe(rows: int, seed: int, layout: str = "plain"):
        """a [rows, H] x w [H, V] bf16: odd H and V with random values, w packed for seed 1;
        seed 3 plants bf16 subnormals, NaN, inf and products that overflow; seed -1 the
        timing shape, w in `layout` ("plain" or "packed")."""
        g = torch.Generator().manual_seed(1000 + seed)
        H, V = (100, 77) if seed >= 0 else (512, 2048)
        a = (torch.randn(rows, H, generator=g) * 3).to(torch.bfloat16)  # [rows, H]
        w = (torch.randn(H, V, generator=g) * 0.05).to(torch.bfloat16)  # [H, V]
        if seed == 3:
            tiny = torch.tensor([1e-39, -3e-40], dtype=torch.float32).to(torch.bfloat16)
            a[:, 1:3], w[4, :2] = tiny, tiny
            a[0, 7], w[9, 5], w[11, 6], w[12, 7] = float("nan"), float("inf"), 3e38, -3e38
        if order != "chain" and (seed == 1 or layout == "packed"):
            w = pack_weight(w)
        threads = torch.get_num_threads()
        return lambda name: gemm_bf16(a, w, order=order, backend=name, threads=threads)
    return probe


for _order, _table in GEMM.items():
    _table.probe(_gemm_probe(_order), layouts=("plain",) if _order == "chain" else ("plain", "packed"),
                 sources=({"chain": "gemm/gemm_chain.c", "amx32": "gemm/gemm_amx32.c", "dp32": "gemm/gemm_dp32.c"}[_order],))


def weight_for(w: torch.Tensor, *, order: str = DEFAULT_ORDER, rows: int = 1):
    """The layout to keep a weight used every step in: `pack_weight(w)` when this machine's
    fastest verified amx32 / dp32 row for `rows` rows is faster on the packed layout than
    the fastest on the plain one (measured once per machine, kernels._verify), else w.
    The bytes of gemm_bf16 never depend on it. w [H, V] bf16 C-contiguous."""
    _validate(torch.empty(0, w.shape[0] if w.dim() >= 1 else 0, dtype=torch.bfloat16), w, None)
    _validate_options(order, w, None, None)
    table = GEMM[order]
    if order == "chain" or not table.checked():
        return w
    rec, cls = table.record(), _verify_row_class(rows)
    plain, packed = rec.times.get(cls, {}), rec.times.get(f"{cls}/packed", {})
    ok = {n for n, s in rec.status.items() if s != "failed"}
    best = lambda t: min((v for n, v in t.items() if n in ok), default=float("inf"))  # noqa: E731
    return pack_weight(w) if best(packed) < best(plain) else w
