"""`import lmtail` is light: a kernel library loads torch and numpy, not the model's, the
receipts' or the plots' dependencies (those are pip extras). Run in a fresh interpreter
so no other test's imports count. Planted: the same probe sees a module it imports."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("numba", "scipy", "matplotlib", "rich", "gguf", "tokenizers")


def loaded_after(code: str) -> list[str]:
    """The HEAVY modules present in sys.modules after running `code` in a fresh python."""
    probe = code + f"\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_lmtail_loads_no_heavy_dependency():
    """`import lmtail`, then building sampling params and the layout maps: nothing heavy."""
    code = ("import lmtail\n"
            "lmtail.sampling_tensor([lmtail.SamplingParams(seed=1)], positions=[0])\n"
            "lmtail.owned_rows(0, 2, 4)")
    assert loaded_after(code) == []


def test_planted_heavy_import_is_seen():
    pytest.importorskip("rich")
    assert loaded_after("import lmtail, rich") == ["rich"]
