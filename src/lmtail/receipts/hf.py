"""The optional HF arm: Hugging Face transformers' float32 forward of the same GGUF, a
reference nobody here wrote. It runs in a separate interpreter (the benchmark-only venv
`benchmarks/.venv-hf`, built by benchmarks/peers/hf/), never as a dependency of lmtail:
this module only starts that interpreter on `_hf_child.py` and reads back its logits.

Compared with lmtail's fp32 body (model.llama.logits_fp32 on the FP32_OPS forward: fp32
head, no tail rounding) on the same rows, so the distance is the two forwards' own.

Shape legend: N scored rows of a passage, V vocab.
"""
from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

CHILD = Path(__file__).with_name("_hf_child.py")


def default_python() -> Path:
    """benchmarks/.venv-hf/bin/python of the checkout this package lives in."""
    return Path(__file__).resolve().parents[3] / "benchmarks" / ".venv-hf" / "bin" / "python"


def status(python: Path) -> str | None:
    """None when `python` imports transformers and accelerate, else why the arm is skipped."""
    if not Path(python).is_file():
        return f"no interpreter at {python} (build the benchmark venv: benchmarks/peers/hf/)"
    r = subprocess.run([str(python), "-c", "import transformers, accelerate"], capture_output=True, text=True)
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"{python} cannot import transformers + accelerate ({last})"
    return None


def hf_logits(python: Path, gguf: str, passages: list[tuple[list[int], list[int]]], *, timeout: float = 900):
    """[(ids, positions)] -> list of [len(positions), V] float64 arrays of HF's logits."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.json", Path(tmp) / "out.npz"
        src.write_text(json.dumps({"gguf": gguf, "passages": [{"ids": list(i), "positions": list(p)}
                                                               for i, p in passages]}))
        r = subprocess.run([str(python), str(CHILD), str(src), str(dst)], capture_output=True, text=True,
                           timeout=timeout)
        if r.returncode:
            raise RuntimeError(f"HF child failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
        with np.load(dst) as z:
            return [z[f"logits_{i}"].astype(np.float64) for i in range(len(passages))]


def compare_body(hf: np.ndarray, body: np.ndarray) -> dict:
    """rel-L2 per row of HF's logits [N, V] vs lmtail's fp32 body [N, V], and argmax agreement."""
    rel = np.linalg.norm(hf - body, axis=1) / np.linalg.norm(body, axis=1)
    return {"rows": int(hf.shape[0]), "rel_l2_mean": float(rel.mean()), "rel_l2_max": float(rel.max()),
            "argmax_agree": float((hf.argmax(1) == body.argmax(1)).mean())}
