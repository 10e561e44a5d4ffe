"""Boundary checks shared by every public op: one rule per argument kind, one message shape.

Every public op validates its arguments here, before any work or collective, and raises
    ValueError  "<name> must be <expected>; got <got>"   for a bad value, shape or dtype,
    TypeError   "<name> must be a torch.Tensor ...; got <type>"   for a non-tensor where a
                tensor is required.
Nothing is written or mutated on the error path.

Shape legend: H hidden width (gamma's length).
"""
from __future__ import annotations

import math
import numbers
import tempfile
from pathlib import Path

import torch


def need(cond: bool, msg: str) -> None:
    """ValueError(msg) unless cond."""
    if not cond:
        raise ValueError(msg)


def need_tensor(name: str, t, expected: str) -> None:
    """TypeError unless t is a torch.Tensor; `expected` names its shape and dtype.
    ValueError unless it lives on the CPU (lmtail's kernels read host memory; a meta
    tensor has no data)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {expected}; got {type(t).__name__}")
    need(t.device.type == "cpu", f"{name} must be a CPU tensor; got device {t.device}")


def is_int(v) -> bool:
    """An integer (Python or NumPy) that is not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v) -> bool:
    """A real number (Python or NumPy int or float) that is not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def is_finite_real(v) -> bool:
    """A real number (not bool) that is finite as a Python float (an int past float's range is not)."""
    if not is_real(v):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def fp32_value(v: float) -> float:
    """v rounded once to fp32 (RNE; beyond fp32's range: +-inf), as a Python float."""
    return torch.tensor(float(v), dtype=torch.float64).to(torch.float32).item()


def check_eps(eps) -> None:
    """eps: a real number (not bool), >= 0 and finite both as given and rounded to fp32
    (the value every norm and the tail adds)."""
    need(is_finite_real(eps) and eps >= 0, f"eps must be a finite number >= 0; got {eps!r}")
    need(math.isfinite(fp32_value(eps)), f"eps must be a finite number >= 0; got {eps!r}, which is inf in fp32")


def check_positive(name: str, v) -> None:
    """v: a real number (not bool) > 0, finite as given and in fp32."""
    need(is_finite_real(v) and v > 0, f"{name} must be a finite number > 0; got {v!r}")
    need(math.isfinite(fp32_value(v)), f"{name} must be a finite number > 0; got {v!r}, which is inf in fp32")


def undefined_rows(r: torch.Tensor, eps: float, what: str) -> None:
    """ValueError naming the rows whose root mean square r [...] is 0 with fp32(eps) = 0:
    their 1/r is inf and their output undefined (what: the op, for the message)."""
    if fp32_value(eps) != 0 or not bool((r == 0).any()):
        return
    bad = torch.nonzero(r == 0)  # [n, r.dim()]
    rows = [int(i[0]) if r.dim() == 1 else tuple(int(j) for j in i) for i in bad[:8]]
    more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
    raise ValueError(f"eps={eps!r} (0 in fp32) leaves {what} row(s) {rows}{more} undefined: their sum "
                     "of squares is 0, so 1/sqrt(0) = inf; use eps > 0")


def check_k(k, hi: int, what: str) -> None:
    """k: an int in [1, hi]; `what` names the bound (e.g. "V=32000")."""
    need(is_int(k) and 1 <= k <= hi, f"k must be an int in [1, {what}]; got {k!r}")


def gamma32(gamma, h: int) -> torch.Tensor:
    """gamma [H] or [1, H], bf16 or fp32 -> fp32 [H], widened exactly (bf16 -> fp32 is exact)."""
    need_tensor("gamma", gamma, f"[H={h}]")
    need(gamma.dtype in (torch.bfloat16, torch.float32), f"gamma must be bf16 or fp32; got {gamma.dtype}")
    need(tuple(gamma.shape) in ((h,), (1, h)), f"gamma must be [H={h}] or [1, H]; got {tuple(gamma.shape)}")
    return gamma.reshape(h).to(torch.float32)


def check_threads(threads) -> None:
    """threads: None or an int >= 1 (bytes never depend on it)."""
    need(threads is None or (is_int(threads) and threads >= 1),
         f"threads must be a positive int or None; got {threads!r}")



def nan_policy(ids: torch.Tensor, has_nan: torch.Tensor, all_nan: torch.Tensor, *, nan_fold: bool) -> None:
    """The sampler's NaN policy on rows ids [n] (the caller's row numbers) with has_nan /
    all_nan [n] bool: a row holding NaN is a ValueError naming the rows unless nan_fold
    (then its NaN lanes carry no mass); a row of NaN only has no distribution at all and
    is a ValueError either way. Never a silent change of a row's sampling mode."""
    if not bool(has_nan.any()):
        return
    if not nan_fold:
        raise ValueError(f"decode_tail: NaN in the logits of rows {_first_rows(ids[has_nan])} (from a NaN or inf "
                         "input or weight); nan_fold=False samples only NaN-free rows: fix the input or "
                         "pass nan_fold=True to give NaN lanes no probability")
    if bool(all_nan.any()):
        raise ValueError(f"decode_tail: the logits of rows {_first_rows(ids[all_nan])} are all NaN: no lane "
                         "has a probability to sample from")


def _first_rows(idx: torch.Tensor, n: int = 8) -> str:
    idx = idx.tolist()
    return str(idx[:n]) + (f" and {len(idx) - n} more" if len(idx) > n else "")


# ---------------------------------------------------------------------------------------
# command-line file arguments
# ---------------------------------------------------------------------------------------
def writable_file(flag: str, path) -> None:
    """ValueError naming flag unless `path` can be written as a file: tried, not inferred from
    permission bits (root passes os.access on read-only mounts such as /proc): the file is
    opened for append (nothing truncated) and, if this call created it, removed again."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise ValueError(f"{flag}: expected a file path, got the folder {str(p)!r}")
    if not parent.is_dir():
        raise ValueError(f"{flag}: the folder {str(parent)!r} of {str(p)!r} does not exist")
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{flag}: cannot write {str(p)!r} ({e.strerror})") from None
    if not existed:
        p.unlink()


def writable_dir(flag: str, path: Path) -> None:
    """ValueError naming flag unless `path` is, or is now made as, a folder a file can be
    written in: the folder is created (parents too) and a probe file written and removed."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag}: expected a folder, got the file {str(p)!r}")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p):
            pass
    except OSError as e:
        raise ValueError(f"{flag}: cannot write {str(p)!r} ({e.strerror})") from None
