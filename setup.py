"""lmtail's build: the Python package plus its C kernels, compiled once here.

Every src/lmtail/kernels/*.c becomes a plain shared library (loaded with ctypes, no Python
C API) in lmtail/kernels/_prebuilt/, with the flags the declared orders need (kernels/_cc.py
FLAGS: -O3 -ffp-contract=off, no fast-math, no -march: each wide-ISA function carries its
own target attribute and is dispatched at run time, so one binary serves every x86-64 CPU),
and a manifest.json naming each library's source hash, the compiler and the flags. At run
time `_cc.load_c_library` takes a prebuilt library whose source hash matches the installed
source (no compiler needed), and compiles at first use only where none matches (a
developer's edited checkout, the emulated test builds). The wheel is platform-specific.

Why setuptools (not scikit-build-core / meson-python): the kernels are ten plain C files
with one flag set and no Python bindings; a 60-line command around the same compiler call
the run-time loader makes needs nothing else to install, and keeps one definition of the
flags (_cc.FLAGS) for both paths.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
KERNELS = ROOT / "src" / "lmtail" / "kernels"


def _cc_module():
    """kernels/_cc.py itself (FLAGS, source_key), loaded without importing lmtail (torch)."""
    spec = importlib.util.spec_from_file_location("_lmtail_cc", KERNELS / "_cc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildKernels(build_py):
    """build_py, then every kernel compiled into <build_lib>/lmtail/kernels/_prebuilt/."""

    def run(self):
        super().run()
        if self.editable_mode:
            return  # an editable checkout compiles at first use (the sources change)
        cc_mod = _cc_module()
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if cc is None:
            raise RuntimeError("building lmtail's kernels needs a C compiler (gcc or cc) on PATH")
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 check=True).stdout.splitlines()[0]
        out = Path(self.build_lib) / "lmtail" / "kernels" / "_prebuilt"
        out.mkdir(parents=True, exist_ok=True)
        sources = sorted(p for p in KERNELS.rglob("*.c") if "_prebuilt" not in p.parts)

        def build(src: Path) -> tuple[str, dict]:
            lib = out / f"{src.stem}.so"
            cmd = [cc, *cc_mod.FLAGS, f"-I{KERNELS}", str(src), "-o", str(lib), "-lm"]
            subprocess.run(cmd, check=True)
            return src.stem, {"source_key": cc_mod.source_key(src),
                              "sha256": hashlib.sha256(lib.read_bytes()).hexdigest()}

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # one gcc per core
            libraries = dict(pool.map(build, sources))
        manifest = {"compiler": version, "flags": list(cc_mod.FLAGS), "libraries": libraries}
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


class BinaryDistribution(Distribution):
    """The wheel carries compiled libraries: a platform wheel, not py3-none-any."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildKernels}, distclass=BinaryDistribution)
