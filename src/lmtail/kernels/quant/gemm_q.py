"""GEMM over weights in GGUF's own block formats (Q8_0, Q4_1), read directly, declared.

Shape legend:
  M  rows of activations;  K  the summed axis (a multiple of 32);  NB = K/32 blocks per row
  N  output columns = the weight's rows (GGUF row-major: row n is NB blocks of BS bytes)
  a    [M, K] fp32       activations (never quantized)
  w    QuantWeight       fmt "Q8_0" (BS = 34) or "Q4_1" (BS = 20), shape (N, K),
                         data [N, NB*BS] uint8 (the file's bytes)
  out  [M, N] fp32       out = a @ dequantize(w)^T

The weight values are the ones the format defines (`dequantize(w)`, exact):
  Q8_0: d fp16, q[32] int8                        value j = fp32(d) * q[j]     (exact)
  Q4_1: d fp16, m fp16, qs[16] (q[j] = qs[j] & 15, q[j+16] = qs[j] >> 4)
                                                  value j = fl32(d*q[j] + m)   (d*q exact)
`gemm_q` sums them in the declared order "lanes32" (`gemm_q_decl(K, fmt)`, docs/quant.md):
per output element, 32 fp32 lane chains from +0, lane j = fma(a[32b+j], w[32b+j], lane j)
for blocks b = 0, 1, ... in order, then the halving tree l[j] += l[j+h], h = 16, 8, 4, 2, 1.
IEEE fp32 throughout (gradual underflow: MXCSR pinned to 0x1F80, FTZ/DAZ off), a NaN stored
as 0x7FC00000. Byte for byte, a row's result does not depend on M or the other rows, the
thread count, the backend or repeats.

Backends (`available_backends()`, fastest first, all bit-equal): "avx512", "avx2" (FMA and
F16C), "c" (plain C, the fma emulated exactly) from kernels/quant/gemm_q.c; "torch" (an
emulation of the declared order with numerics.fma32: slow, always there).
"""
from __future__ import annotations

import ctypes
import functools
import warnings
from dataclasses import dataclass

import torch

from lmtail.checks import is_int, need, need_tensor
from lmtail.kernels import _backend, cpu
from lmtail.kernels._cc import kernel_library
from lmtail.numerics import Decl, SumDecl, fma32

QK = 32  # weights per block
BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20}
FORMATS = tuple(BLOCK_BYTES)
FMT_CODE = {"Q8_0": 0, "Q4_1": 1}
ISA = {"avx512": 2, "avx2": 1, "c": 0}
_ERRORS = {-1: "backend unavailable on this CPU", -2: "a buffer could not be allocated",
           -3: "bad shape or format"}

_SIGNATURES = {
    "lmtail_gemm_q_has": ((ctypes.c_int,), ctypes.c_int),
    "lmtail_gemm_q": ((ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                       ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_int, ctypes.c_int), ctypes.c_int),
    "lmtail_gemm_q_cat": ((ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                           ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_int, ctypes.c_int), ctypes.c_int)}
native_library = kernel_library("quant/gemm_q.c", _SIGNATURES, what="gemm_q", fallback="the torch emulation")
# the emulated build (SIMDe, lmtail_emulate.h): the "emu-avx512" row, on any AVX2 + FMA + F16C CPU
_emulated = kernel_library("quant/gemm_q.c", _SIGNATURES, what="gemm_q", emulated=True)


# ---------------------------------------------------------------------------------------
# the declaration
# ---------------------------------------------------------------------------------------
def gemm_q_decl(K: int, fmt: str) -> Decl:
    """The declaration of `gemm_q` for a weight of format `fmt` with K summed lanes."""
    need(fmt in FORMATS, f"fmt must be one of {FORMATS}; got {fmt!r}")
    need(is_int(K) and K > 0 and K % QK == 0, f"K must be a positive multiple of {QK}; got {K!r}")
    nb = K // QK
    value = ("w = fp32(d) * q (Q8_0: exact, no rounding)" if fmt == "Q8_0" else
             "w = fl32(fp32(d) * q + fp32(m)) (Q4_1: d*q exact, one rounding, an fma)")
    return Decl(
        op=f"gemm_q_{fmt.lower()}_lanes32",
        rounding_points=(
            value,
            "l[j] = fl32(l[j] + a*w) per lane j = 0..31, per block in order (fma: exact "
            "product, 1 rounding)",
            "halving tree: l[j] = fl32(l[j] + l[j+h]) for h = 16, 8, 4, 2, 1",
            "IEEE gradual underflow (MXCSR 0x1F80: to nearest, FTZ/DAZ off); inf/NaN IEEE",
            "NaN result -> canonical quiet NaN 0x7FC00000"),
        sums=(SumDecl(name="gemm", dtype="fp32", depth=nb + 5,
                      order="32 lane chains from +0: lane j takes k = 32b + j for blocks "
                            "b = 0..NB-1 in order (fma); then the halving tree l[j] + l[j+h], "
                            "h = 16, 8, 4, 2, 1, per output element",
                      flush=False, roundings=QK * nb + 31),),
    )


# ---------------------------------------------------------------------------------------
# the weight
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantWeight:
    """A weight [N, K] in a GGUF block format, held as the file's bytes.

    fmt: "Q8_0" or "Q4_1"; shape: (N, K), K a multiple of 32; data: a contiguous CPU uint8
    tensor [N, K/32 * BLOCK_BYTES[fmt]] (row n = its K/32 blocks in order)."""

    fmt: str
    shape: tuple[int, int]
    data: torch.Tensor

    def __post_init__(self):
        need(self.fmt in FORMATS, f"QuantWeight.fmt must be one of {FORMATS}; got {self.fmt!r}")
        shp = self.shape
        need(isinstance(shp, tuple) and len(shp) == 2 and all(is_int(s) for s in shp)
             and shp[0] >= 0 and shp[1] > 0 and shp[1] % QK == 0,
             f"QuantWeight.shape must be (N, K) ints with K a positive multiple of {QK}; got {shp!r}")
        need_tensor("QuantWeight.data", self.data, "[N, K/32 * block bytes] uint8")
        want = (shp[0], shp[1] // QK * BLOCK_BYTES[self.fmt])
        need(self.data.dtype == torch.uint8 and self.data.is_contiguous()
             and tuple(self.data.shape) == want,
             f"QuantWeight.data must be a contiguous uint8 {list(want)} for {self.fmt} {shp}; "
             f"got {self.data.dtype} {list(self.data.shape)}")

    @classmethod
    def from_gguf(cls, tensor) -> "QuantWeight":
        """From a gguf.ReaderTensor of type Q8_0 or Q4_1 (its shape is GGUF's [K, N],
        innermost first; the bytes are shared with the reader's memory map, not copied)."""
        kind = getattr(getattr(tensor, "tensor_type", None), "name", None)
        need(kind in FORMATS, f"tensor must be a gguf ReaderTensor of type {FORMATS}; got {kind!r}")
        K, N = (int(s) for s in tensor.shape)
        with warnings.catch_warnings():  # the map is read-only; nothing here writes to it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(tensor.data.reshape(N, -1))  # [N, NB*BS], a view of the file
        return cls(kind, (N, K), data)

    @classmethod
    def quantize(cls, w: torch.Tensor, fmt: str) -> "QuantWeight":
        """Quantize a float tensor [N, K] with gguf.quants (ggml's reference quantizer;
        for tests and benchmarks: a model's weights come from its file)."""
        import gguf

        need(fmt in FORMATS, f"fmt must be one of {FORMATS}; got {fmt!r}")
        need_tensor("w", w, "[N, K] float")
        need(w.dim() == 2 and w.shape[1] % QK == 0 and w.shape[1] > 0 and w.is_floating_point(),
             f"w must be a float [N, K] with K a positive multiple of {QK}; got {w.dtype} {list(w.shape)}")
        raw = gguf.quants.quantize(w.detach().float().numpy(), gguf.GGMLQuantizationType[fmt])
        return cls(fmt, (int(w.shape[0]), int(w.shape[1])), torch.from_numpy(raw.copy()))

    def rows(self, start: int, stop: int) -> "QuantWeight":
        """Rows start..stop-1 (0 <= start <= stop <= N): QuantWeight(fmt, (stop - start, K)),
        its data a view of these rows' bytes (no copy). A vocab-parallel rank r of VTP takes
        the head's rows(r * V_s, (r + 1) * V_s), V_s = N / VTP."""
        n = self.shape[0]
        need(is_int(start) and is_int(stop) and 0 <= start <= stop <= n,
             f"rows(start, stop) needs ints 0 <= start <= stop <= N={n}; got ({start!r}, {stop!r})")
        return QuantWeight(self.fmt, (int(stop) - int(start), self.shape[1]), self.data[start:stop])

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _fields(w: QuantWeight):
    """(d, m, q) fp32 [N, NB, 1], [N, NB, 1] (None for Q8_0), [N, NB, 32]: exact values."""
    N, K = w.shape
    blk = w.data.view(N, K // QK, BLOCK_BYTES[w.fmt])  # [N, NB, BS]
    d = blk[..., 0:2].contiguous().view(torch.float16).float()  # exact widening
    if w.fmt == "Q8_0":
        return d, None, blk[..., 2:].contiguous().view(torch.int8).float()
    m = blk[..., 2:4].contiguous().view(torch.float16).float()
    qs = blk[..., 4:]  # [N, NB, 16]
    return d, m, torch.cat((qs & 15, qs >> 4), dim=-1).float()


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The format's values, exactly: fp32 [N, K] (Q8_0 d*q, exact; Q4_1 fl32(d*q + m), the
    product exact so one rounding). Equal bit for bit to gguf.quants.dequantize."""
    need(isinstance(w, QuantWeight), f"w must be a QuantWeight; got {type(w).__name__}")
    d, m, q = _fields(w)
    v = d * q if m is None else d * q + m  # [N, NB, 32]: d*q exact, + m one rounding
    return v.reshape(w.shape)


# ---------------------------------------------------------------------------------------
# backends
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _c_backends(lib) -> tuple[str, ...]:
    """The C backends `lib` runs on this CPU (its own probe: AVX-512/AVX2, FMA, F16C)."""
    return () if lib is None else tuple(b for b in ISA if lib.lmtail_gemm_q_has(ISA[b]))


def _c_available(backend: str):
    return lambda: backend in _c_backends(native_library())


def lanes_emulation(a: torch.Tensor, wv: torch.Tensor, lanes: int = QK) -> torch.Tensor:
    """The declared order step by step: fp32 [M, K] x fp32 values [N, K] -> fp32 [M, N].
    `lanes` chains (lane j takes k = lanes*b + j, exact fp32 fma each), then the halving
    tree; NaN -> 0x7FC00000. lanes=32 is the declaration; another power of two is a
    planted wrong variant for tests."""
    M, K = a.shape
    N = wv.shape[0]
    acc = torch.zeros(M, N, lanes, dtype=torch.float32)  # [M, N, lanes]
    a3 = a.float().reshape(M, 1, K // lanes, lanes)  # [M, 1, B, lanes]
    w3 = wv.reshape(1, N, K // lanes, lanes)  # [1, N, B, lanes]
    for b in range(K // lanes):
        acc = fma32(a3[:, :, b], w3[:, :, b], acc)
    h = lanes // 2
    while h >= 1:
        acc = acc[..., :h] + acc[..., h:2 * h]
        h //= 2
    out = acc[..., 0]
    return torch.where(torch.isnan(out), torch.tensor(float("nan")), out)


def _run_c(backend: str, library=lambda: native_library()):
    def run(a: torch.Tensor, w: QuantWeight, out: torch.Tensor, threads: int) -> None:
        if a.stride(1) != 1 or (a.shape[0] > 1 and a.stride(0) < a.shape[1]):
            a = a.contiguous()
        M, K = a.shape
        rc = library().lmtail_gemm_q(a.data_ptr(), a.stride(0), w.data.data_ptr(), FMT_CODE[w.fmt],
                                      w.shape[0], K, out.data_ptr(), out.stride(0), M, threads,
                                      ISA[backend])
        if rc != 0:
            raise RuntimeError(f"gemm_q backend {backend!r} failed: {_ERRORS.get(rc, rc)}")
    return run


def _run_torch(a: torch.Tensor, w: QuantWeight, out: torch.Tensor, threads: int) -> None:
    out.copy_(lanes_emulation(a, dequantize(w)))


GEMM_Q = _backend.Dispatch("gemm_q", (
    _backend.Backend("avx512", _run_c("avx512"), _c_available("avx512")),
    _backend.Backend("avx2", _run_c("avx2"), _c_available("avx2")),
    _backend.Backend("c", _run_c("c"), _c_available("c")),
    _backend.Backend("torch", _run_torch),
    _backend.Backend("emu-avx512", _run_c("avx512", _emulated),
                     lambda: native_library() is not None and cpu.emulation_runs(), emulated=True),
))


def available_backends() -> tuple[str, ...]:
    """The backends this machine runs, in the table's order
    (backend=None takes the fastest verified one; all give the same bytes)."""
    return GEMM_Q.names()


# ---------------------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------------------
def _validate(a, w, out) -> None:
    """ValueError / TypeError naming the bad argument (messages built only on failure: this
    runs on every call)."""
    need_tensor("a", a, "[M, K] fp32")
    if not isinstance(w, QuantWeight):
        raise ValueError(f"w must be a QuantWeight; got {type(w).__name__}")
    if a.dim() != 2 or a.dtype != torch.float32:
        raise ValueError(f"a must be a 2-D torch.float32 [M, K]; got {a.dtype} {list(a.shape)}")
    if a.shape[1] != w.shape[1]:
        raise ValueError(f"K mismatch: a is [M, K] = {list(a.shape)} but w is [N, K] = "
                         f"{list(w.shape)}; expected a.shape[1] == w.shape[1]")
    if out is None:
        return
    M, N = a.shape[0], w.shape[0]
    need_tensor("out", out, "[M, N] fp32")
    if out.dtype != torch.float32 or out.shape != (M, N):
        raise ValueError(f"out must be a torch.float32 [M, N] = {[M, N]}; got {out.dtype} "
                         f"{list(out.shape)}")
    if M * N and (out.stride(1) != 1 or (M > 1 and out.stride(0) < N)):
        raise ValueError(f"out must have unit column stride and row stride >= N = {N}; got "
                         f"strides {out.stride()}")


def gemm_q(a: torch.Tensor, w: QuantWeight, *, out: torch.Tensor | None = None,
           backend: str | None = None, threads: int | None = None) -> torch.Tensor:
    """out [M, N] fp32 = a [M, K] fp32 @ dequantize(w)^T in the declared lanes32 order.

    a: any strides (copied when its rows are not unit-stride). out: optional, written in
    place (unit column stride). backend: one of available_backends() (None: the fastest).
    threads: the C backends split the columns over up to this many threads (None:
    torch.get_num_threads()); the bytes never depend on it, nor on the backend.
    Raises ValueError naming the argument for a bad one; RuntimeError if a C backend fails.
    """
    _validate(a, w, out)
    nthreads = _backend.threads(threads)  # the C kernel gives each thread enough work
    M, N = a.shape[0], w.shape[0]
    row = GEMM_Q.pick(backend, rows=M)
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32)
    if M and N:
        row.run(a, w, out, nthreads)
    return out


# ---------------------------------------------------------------------------------------
# the probes backends are verified and timed on (kernels._verify)
# ---------------------------------------------------------------------------------------
@GEMM_Q.probe(sources=("quant/gemm_q.c",))
def _gemm_q_probe(rows: int, seed: int):
    """a [rows, K] fp32 x a Q8_0 (even seeds) or Q4_1 (odd seeds) weight [N, K]; seed 3
    plants subnormal fp16 d and m, NaN and inf activations; seed -1: a Q4_1 timing shape."""
    g = torch.Generator().manual_seed(2000 + seed)
    N, K = (77, 96) if seed >= 0 else (2048, 576)
    fmt = "Q8_0" if seed >= 0 and seed % 2 == 0 else "Q4_1"
    a = torch.randn(rows, K, generator=g) * 2  # [rows, K]
    w = QuantWeight.quantize(torch.randn(N, K, generator=g) * 0.1, fmt)
    if seed == 3:
        blk = w.data.view(N, K // QK, BLOCK_BYTES[fmt])  # [N, NB, BS]
        blk[:3, 0, 0:2] = torch.tensor([1, 0x80], dtype=torch.uint8)  # d: fp16 subnormals
        blk[:3, 1, 2:4] = torch.tensor([7, 0x83], dtype=torch.uint8)  # m: fp16 subnormals
        a[0, 3], a[-1, 5] = float("nan"), float("inf")
    threads = torch.get_num_threads()
    return lambda name: gemm_q(a, w, backend=name, threads=threads)
