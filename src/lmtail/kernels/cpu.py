"""The one CPU-feature probe: `features()`, the ISA extensions lmtail's kernels dispatch on.

Every kernel module's backend rows and every test's skip reason read this (the C kernels
read the same bits through lmtail_kernels.h's lmtail_cpu_features, so Python and C never
disagree). Names: "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq",
"avx512_bf16", "amx_bf16" (AMX-BF16 and AMX-TILE, and the OS lets this process use tiles),
"f16c".
Without a C compiler it reads /proc/cpuinfo's flags instead (Linux; else no feature).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from lmtail.kernels import _cc
from lmtail.kernels._cc import kernel_library

# bit i of lmtail_cpu_features() (lmtail_kernels.h's LMTAIL_CPU_* enum, in order)
NAMES = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "amx_bf16", "avx512_bf16", "f16c")
# what an emulated build (_cc.py's emulated variant: -mavx2 -mfma -mf16c) needs to run: its
# "emu-<isa>" backend rows are available where the CPU has these (and SIMDe was found)
EMULATION_NEEDS = ("avx2", "fma", "f16c")

_library = kernel_library("cpu.c", {"lmtail_cpu_bits_export": ((), ctypes.c_uint)},
                          what="cpu probe", fallback="/proc/cpuinfo")


def _from_cpuinfo() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    have = set(flags)
    names = {n for n in NAMES if n in have}
    if {"amx_bf16", "amx_tile"} - have:
        names.discard("amx_bf16")
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def features() -> frozenset[str]:
    """The ISA extensions of this CPU (and OS, for AMX) the kernels use, as names (module
    docstring); probed once per process."""
    lib = _library()
    if lib is None:
        return _from_cpuinfo()
    bits = lib.lmtail_cpu_bits_export()
    return frozenset(n for i, n in enumerate(NAMES) if bits >> i & 1)


def has(*names: str) -> bool:
    """True when this CPU has every one of `names`."""
    return set(names) <= features()


def emulation_runs() -> bool:
    """True when this machine can build and run the kernels' emulated variants (SIMDe found,
    the CPU has EMULATION_NEEDS): the availability of every "emu-<isa>" row. Builds nothing."""
    return _cc.simde_include() is not None and has(*EMULATION_NEEDS)


def missing(*names: str) -> str:
    """A skip reason: "CPU lacks avx512bw, avx512dq" ("" when nothing is missing)."""
    lack = [n for n in names if n not in features()]
    return f"CPU lacks {', '.join(lack)}" if lack else ""
