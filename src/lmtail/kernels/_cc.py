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
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

# -ffp-contract=off: the compiler may not fuse a*b+c on its own; the kernels' fmas are
# explicit calls. No -ffast-math (it would also set FTZ/DAZ at load time). No -march:
# wide-ISA functions carry target attributes and are dispatched at run time.
FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-ffp-contract=off",
         "-fno-fast-math", "-Wall")
BUILD_TIMEOUT_S = 120
HEADER = Path(__file__).with_name("lmtail_kernels.h")  # the one shared header


def _cache_dir() -> Path:
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


def source_key(source: Path) -> str:
    """sha256 of a kernel source's bytes and the shared header's: what a prebuilt library
    must have been built from to be loaded for it."""
    return hashlib.sha256(Path(source).read_bytes() + b"\0" + HEADER.read_bytes()).hexdigest()


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


def library_path(source: Path, cc: str, version: str) -> Path:
    """The cache file of `source` built by compiler `cc` (version line `version`): named by a
    hash of the source's bytes, the shared header's bytes, the flags and the machine."""
    key = hashlib.sha256(Path(source).read_bytes() + b"\0" + HEADER.read_bytes()
                         + repr((version, cc, FLAGS, platform.machine())).encode())
    return _cache_dir() / f"{Path(source).stem}-{key.hexdigest()[:16]}.so"


def load_c_library(source: Path) -> ctypes.CDLL:
    """The package's prebuilt library for `source` when its bytes match, else compile
    `source` (cached) and return the loaded library. Raises RuntimeError with the
    compiler's message when there is no compiler or the build fails."""
    lib = prebuilt(source)
    if lib is not None:
        return ctypes.CDLL(str(lib))
    cc, version = _compiler()
    lib = library_path(source, cc, version)
    if not lib.exists():
        tmp = lib.with_name(f"{lib.stem}.{os.getpid()}.tmp.so")
        cmd = [cc, *FLAGS, f"-I{HEADER.parent}", str(source), "-o", str(tmp), "-lm"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
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


def kernel_library(source: str, signatures: dict, *, what: str, fallback: str):
    """A cached loader for the kernel `source` (a file name under kernels/): () -> the bound
    library (`bind(lib, signatures)`), or None with one RuntimeWarning naming `fallback`
    when it cannot be built. Every kernel module gets its library from here."""
    @functools.lru_cache(maxsize=None)
    def library():
        lib = load_optional(Path(__file__).with_name(source), what=what, fallback=fallback)
        return None if lib is None else bind(lib, signatures)
    return library
