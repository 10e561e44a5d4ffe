"""Load a kernel's shared library with ctypes: the one the package was built with, or one
built here once and cached.

Prebuilt: an installed lmtail (wheel or sdist: setup.py) carries every kernel compiled in
kernels/_prebuilt/ with a manifest of each library's `source_key` (the source's and the
shared header's bytes); a library whose key matches the installed source is loaded as it
is, with no compiler on the machine. Built here (a developer's checkout, an edited source,
the emulated test builds): no torch headers, no ninja: one `cc -O3 -shared` call (about a
second), keyed by the
source bytes, the shared header's bytes (lmtail_kernels.h, #included by every kernel and
found by -I), the flags, the compiler's version line and the machine, written to a temp
name and renamed into place, so concurrent first calls (pytest workers, torchrun ranks)
never load a half-written file. The cache lives in $XDG_CACHE_HOME/lmtail (default
~/.cache/lmtail), or in the temp dir when that is not writable.

The emulated variant of a kernel (`emulated=True`): the same source and FLAGS plus
EMULATE_FLAGS and SIMDe's include dir, so every AVX-512 / AVX512-BF16 / AMX path of it runs,
slowly, on any x86-64 CPU with AVX2 + FMA + F16C (lmtail_emulate.h; docs/emulated.md). SIMDe
comes from PyPI's cmeel-simde (<site-packages>/cmeel.prefix/include) or Debian's
libsimde-dev (/usr/include); with neither the emulated variant is simply not built (its
backend rows are unavailable, no warning). It is built at first use, never by a row's
availability check. Its cache key adds the variant's flags, the
bytes of lmtail_emulate.h (the copy next to the source when there is one, as the compiler
finds it) and of SIMDe's version header.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

# -ffp-contract=off: the compiler may not fuse a*b+c on its own; the kernels' fmas are
# explicit calls. No -ffast-math (it would also set FTZ/DAZ at load time). No -march:
# wide-ISA functions carry target attributes and are dispatched at run time.
FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-ffp-contract=off",
         "-fno-fast-math", "-Wall")
BUILD_TIMEOUT_S = 120
EMULATED_BUILD_TIMEOUT_S = 900  # SIMDe's 512-bit ops are many more for -O3: gemm_amx32 takes 30-60 s
HEADER = Path(__file__).with_name("lmtail_kernels.h")  # the one shared header
# the emulated variant: SIMDe for every intrinsic, lmtail_emulate.h's exact models, no ISA
# targets (lmtail_kernels.h); -mavx2 -mfma -mf16c make SIMDe's 512-bit ops native 256-bit ones
EMULATE_FLAGS = ("-DLMTAIL_EMULATE", "-mavx2", "-mfma", "-mf16c", "-Wno-psabi")
EMULATE_HEADER = Path(__file__).with_name("lmtail_emulate.h")
SIMDE_VERSION_FILE = Path("simde") / "simde-common.h"  # holds SIMDE_VERSION


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmtail"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    tmp = Path(tempfile.gettempdir()) / f"lmtail-{os.getuid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def _compiler() -> tuple[str, str]:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler found on PATH (looked for gcc, cc)")
    ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    return cc, (ver.stdout.splitlines() or ["?"])[0]


PREBUILT = Path(__file__).with_name("_prebuilt")  # setup.py's output in an installed package


def source_bytes(source: Path) -> bytes:
    """A kernel source's bytes, the shared header's, and those of each header of its own
    folder it includes (`#include "x.h"` beside it, e.g. model/exp32.h): every byte its
    build reads from lmtail (lmtail_emulate.h: the emulated variant's key)."""
    src = Path(source)
    text = src.read_bytes()
    local = sorted({m.decode() for m in re.findall(rb'#include "([^"/]+)"', text)}
                   - {HEADER.name, EMULATE_HEADER.name})
    return b"\0".join([text, HEADER.read_bytes(), *((src.parent / n).read_bytes() for n in local
                                                    if (src.parent / n).is_file())])


def source_key(source: Path) -> str:
    """sha256 of `source_bytes(source)`: what a prebuilt library must have been built from
    to be loaded for it."""
    return hashlib.sha256(source_bytes(source)).hexdigest()


@functools.lru_cache(maxsize=1)
def prebuilt_manifest() -> dict:
    """kernels/_prebuilt/manifest.json ({} when the package was not built with its kernels)."""
    try:
        return json.loads((PREBUILT / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


def prebuilt(source: Path) -> Path | None:
    """The package's own library for `source` when it was built from these exact bytes."""
    entry = prebuilt_manifest().get("libraries", {}).get(Path(source).stem)
    lib = PREBUILT / f"{Path(source).stem}.so"
    if entry and entry.get("source_key") == source_key(source) and lib.exists():
        return lib
    return None


def compiler_line() -> str:
    """The compiler the loaded kernels come from: the prebuilt manifest's, else the one on
    PATH, else "no compiler" (the verdict cache keys on it)."""
    parts = []
    if prebuilt_manifest():
        parts.append(f"prebuilt: {prebuilt_manifest().get('compiler', '?')}")
    try:
        parts.append(_compiler()[1])
    except (RuntimeError, OSError, subprocess.SubprocessError):
        parts.append("no compiler on PATH")
    return "; ".join(parts)


@functools.lru_cache(maxsize=None)
def simde_include() -> Path | None:
    """The include dir holding SIMDe's simde/x86/avx512.h: PyPI cmeel-simde's
    (<dir on sys.path>/cmeel.prefix/include), else Debian's /usr/include; None when neither
    has it, or on a machine that is not x86-64 (no emulated variant then)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    dirs = [Path(p) / "cmeel.prefix" / "include" for p in sys.path if p] + [Path("/usr/include")]
    return next((d for d in dirs if (d / "simde" / "x86" / "avx512.h").is_file()), None)


def _variant(source: Path, emulated: bool) -> tuple[tuple[str, ...], bytes]:
    """The extra flags and extra key bytes of a variant: () and b"" for the native build."""
    if not emulated:
        return (), b""
    simde = simde_include()
    if simde is None:
        raise RuntimeError("no SIMDe headers (pip install cmeel-simde, or apt install libsimde-dev)")
    local = Path(source).with_name(EMULATE_HEADER.name)  # the copy the compiler finds first
    header = local if local.is_file() else EMULATE_HEADER
    version = (simde / SIMDE_VERSION_FILE).read_bytes() if (simde / SIMDE_VERSION_FILE).is_file() else b""
    return (*EMULATE_FLAGS, f"-I{simde}"), b"\0".join((b"emulated", header.read_bytes(), version))


def library_path(source: Path, cc: str, version: str, *, emulated: bool = False) -> Path:
    """The cache file of `source` built by compiler `cc` (version line `version`): named by a
    hash of `source_bytes(source)`, the flags and the machine (and,
    emulated, the variant's flags, lmtail_emulate.h's and SIMDe's version header's bytes).
    Raises RuntimeError for emulated=True without SIMDe."""
    extra, extra_key = _variant(source, emulated)
    key = hashlib.sha256(source_bytes(source)
                         + repr((version, cc, FLAGS + extra, platform.machine())).encode() + extra_key)
    stem = Path(source).stem + ("-emu" if emulated else "")
    return cache_dir() / f"{stem}-{key.hexdigest()[:16]}.so"


def load_c_library(source: Path, *, emulated: bool = False) -> ctypes.CDLL:
    """The package's prebuilt library for `source` when its bytes match (native builds),
    else compile `source` (cached) and return the loaded library; emulated=True builds its
    emulated variant (module docstring). Raises RuntimeError with the compiler's message when
    there is no compiler or the build fails (emulated: or there is no SIMDe)."""
    lib = None if emulated else prebuilt(source)
    if lib is not None:
        return ctypes.CDLL(str(lib))
    cc, version = _compiler()
    lib = library_path(source, cc, version, emulated=emulated)
    if not lib.exists():
        tmp = lib.with_name(f"{lib.stem}.{os.getpid()}.tmp.so")
        extra, _ = _variant(source, emulated)
        cmd = [cc, *FLAGS, *extra, f"-I{HEADER.parent}", str(source), "-o", str(tmp), "-lm"]
        res = subprocess.run(cmd, capture_output=True, text=True,
                             timeout=EMULATED_BUILD_TIMEOUT_S if emulated else BUILD_TIMEOUT_S)
        if res.returncode != 0:
            raise RuntimeError(f"building {source} failed: {' '.join(cmd)}\n{res.stderr}")
        os.replace(tmp, lib)
    return ctypes.CDLL(str(lib))


def load_optional(source: Path, *, what: str, fallback: str):
    """load_c_library, or None with a RuntimeWarning naming the fallback the caller uses
    (no compiler, a failed build): kernels degrade to a slower path with the same bytes."""
    try:
        return load_c_library(source)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        warnings.warn(f"lmtail {what}: C kernel unavailable, using {fallback}: {exc}",
                      RuntimeWarning, stacklevel=3)
        return None


def bind(lib: ctypes.CDLL, signatures: dict) -> ctypes.CDLL:
    """Declare C signatures on a loaded library: {name: (argtypes, restype)}; returns lib."""
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = list(argtypes), restype
    return lib


def kernel_library(source: str, signatures: dict, *, what: str, fallback: str = "",
                   emulated: bool = False):
    """A cached loader for the kernel `source` (a file name under kernels/): () -> the bound
    library (`bind(lib, signatures)`), or None with one RuntimeWarning naming `fallback`
    when it cannot be built. Every kernel module gets its library from here.
    emulated=True: the loader of its emulated variant (module docstring), built at its first
    call (an "emu-<isa>" row's first run; kernels.cpu.emulation_runs() says whether to offer
    the rows at all, without building): None without SIMDe; a failed build raises
    RuntimeError with the compiler's message (a bug in the emulation, not a missing tool)."""
    path = Path(__file__).parent / source

    @functools.lru_cache(maxsize=None)
    def library():
        if emulated:
            return None if simde_include() is None else bind(load_c_library(path, emulated=True), signatures)
        lib = load_optional(path, what=what, fallback=fallback)
        return None if lib is None else bind(lib, signatures)
    return library

