"""Docs that run: every ```python block of README.md and docs/*.md runs as written.

Each block is written to its own file and run as a script in a fresh interpreter (this
test's python), so a `launch` example with an `if __name__ == "__main__":` guard works (its
ranks re-import the file) and no block sees another's names. A block whose docstring says
`torchrun ... --nproc-per-node N` runs under `python -m torch.distributed.run` with N ranks.
Fences:
  ```python        runs in the default suite (small shapes: the whole file stays ~1 minute)
  ```python slow   runs only under `-m slow`
  ```text / ```bash / ```console   not run (signatures, output, shell, pseudo-code)
A failure names the block as FILE:LINE (the line of its opening fence).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)[ \t]*(.*)$")
TORCHRUN = re.compile(r"torchrun\b.*--nproc-per-node[ =](\d+)")
TIMEOUT_S = {"fast": 180, "slow": 600}


def fenced_blocks(path: Path) -> list[tuple[int, str, str, str]]:
    """(line of the opening fence, language, info after it, body) of every fenced block."""
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang, info = i + 1, m.group(1), m.group(2).strip()
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        assert j < len(lines), f"{path.name}:{start}: a ``` fence is never closed"
        blocks.append((start, lang, info, "\n".join(lines[i + 1:j]) + "\n"))
        i = j + 1
    return blocks


def python_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line of the opening fence, info after the language, code) of each ```python block."""
    return [(line, info, body) for line, lang, info, body in fenced_blocks(path) if lang == "python"]


def unlabelled_python(path: Path) -> list[int]:
    """Lines of bare ``` blocks holding a Python import: code that would never be run."""
    looks = re.compile(r"^(import \w|from [\w.]+ import )", re.M)
    return [line for line, lang, _, body in fenced_blocks(path) if lang == "" and looks.search(body)]


def _cases():
    for path in DOCS:
        for line, info, code in python_blocks(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            marks = [pytest.mark.slow] if info == "slow" else []
            yield pytest.param(where, info, code, id=where, marks=marks)


def test_fences_are_known():
    """A ```python block carries no info but `slow`; every other fence names a language."""
    for path in DOCS:
        for n, text in enumerate(path.read_text().splitlines(), 1):
            m = FENCE.match(text)
            if m and m.group(1) == "python":
                assert m.group(2).strip() in ("", "slow"), f"{path.name}:{n}: unknown fence info {text!r}"


def test_no_python_hides_in_a_bare_fence():
    """Python in a bare ``` block would escape this test: name its language."""
    for path in DOCS:
        assert not unlabelled_python(path), f"{path.name}: bare ``` blocks with Python at lines {unlabelled_python(path)}"


def test_the_parser_sees_every_block(tmp_path):
    """Planted: a doc with two python blocks, one slow, and a text block between them."""
    doc = tmp_path / "x.md"
    doc.write_text("a\n```python\nprint(1)\n```\n```text\nnot python\n```\n```python slow\nx = 2\n```\n")
    assert python_blocks(doc) == [(2, "", "print(1)\n"), (8, "slow", "x = 2\n")]
    doc.write_text("```\nfrom lmtail import add_rms\n```\n```text\nfrom lmtail import add_rms\n```\n")
    assert unlabelled_python(doc) == [1]  # the bare one only


@pytest.mark.parametrize("where,info,code", list(_cases()))
def test_doc_block_runs(where, info, code, tmp_path):
    script = tmp_path / (re.sub(r"\W", "_", where) + ".py")
    script.write_text(code)
    cmd = [sys.executable, str(script)]
    m = TORCHRUN.search(code)
    if m:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", m.group(1),
               str(script)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    timeout = TIMEOUT_S["slow" if info == "slow" else "fast"]
    try:
        p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{where}: the block ran past {timeout} s")
    if p.returncode != 0:
        tail = "\n".join((p.stdout + p.stderr).splitlines()[-30:])
        pytest.fail(f"{where}: the block exited with {p.returncode}:\n{tail}", pytrace=False)
