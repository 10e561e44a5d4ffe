"""The kernel backend layer (lmtail.kernels: _cc, cpu, _backend, lmtail_kernels.h): one
loader (the shared header in every cache key), one CPU probe, one dispatch, no C file with
its own copy of the shared helpers. The kernels' hidden numbers are tested in their own
files: the fused rows-tail kernel's float64 S / lse1 (debug export) and rows_tail.c's
constants in test_rows_tail.py, body.c's exp32 constants in test_model_body.py, the exp64
constants handed to C in test_rowmass.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmtail.kernels import _backend, _cc, cpu
from lmtail.kernels.tail import rowmass as RM
from lmtail.kernels.tail import rows_tail as RT
from lmtail.model import body as decl

KERNELS = Path(_cc.__file__).parent


# ---------------------------------------------------------------------------------------
# the layer: one loader, one probe, one dispatch, one header
# ---------------------------------------------------------------------------------------
def test_every_c_file_lives_under_kernels_and_includes_the_header():
    src = KERNELS.parent
    outside = [p for p in src.rglob("*.c") if KERNELS not in p.parents]
    assert not outside, f"C files outside kernels/: {outside}"
    for c in KERNELS.rglob("*.c"):
        assert '#include "lmtail_kernels.h"' in c.read_text(), c.name


def test_no_c_file_keeps_its_own_copy_of_the_shared_helpers():
    for c in KERNELS.rglob("*.c"):
        text = c.read_text()
        for private in ("pthread_create(", "_mm_setcsr(", "__builtin_cpu_supports(", "static inline double pow2(",
                        "exact_inverse(double s) {", "shifted_exp1(double z, double m, const double *K) {"):
            assert private not in text, f"{c.name} holds its own {private!r} (it belongs in lmtail_kernels.h)"


def test_the_header_is_in_every_cache_key(tmp_path, monkeypatch):
    """A changed header names another library file (so it is rebuilt); the same bytes the same."""
    src = KERNELS / "tail" / "rowmass.c"
    before = _cc.library_path(src, "gcc", "v1")
    assert _cc.library_path(src, "gcc", "v1") == before
    changed = tmp_path / "lmtail_kernels.h"
    changed.write_bytes(_cc.HEADER.read_bytes() + b"\n/* changed */\n")
    monkeypatch.setattr(_cc, "HEADER", changed)
    assert _cc.library_path(src, "gcc", "v1") != before


def test_cpu_features_agree_with_proc_cpuinfo():
    got = cpu.features()
    assert got <= set(cpu.NAMES)
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo to compare with")
    listed = cpu._from_cpuinfo()
    assert got - {"amx_bf16"} == listed - {"amx_bf16"}  # AMX also needs the OS's permission
    assert cpu.missing(*got) == ""
    assert cpu.missing("no_such_isa") == "CPU lacks no_such_isa"


def _table():
    return _backend.Dispatch("demo", (
        _backend.Backend("fast", lambda x: ("fast", x), available=lambda: False),
        _backend.Backend("c", lambda x: ("c", x)),
        _backend.Backend("cuda", lambda x: ("cuda", x), device="cuda"),
        _backend.Backend("torch", lambda x: ("torch", x), device=None),
    ))


def test_dispatch_resolution():
    t = _table()
    assert t.names() == ("c", "torch") and t.names("cuda") == ("cuda", "torch")
    assert t.pick(None).run(1) == ("c", 1)  # the first available row: a fixed order
    assert t.pick("torch").run(2) == ("torch", 2)
    assert t.pick(None, "cuda").name == "cuda"  # a device backend is one more row
    with pytest.raises(ValueError, match=r"backend must be one of \('c', 'torch'\); got 'fast'"):
        t.pick("fast")
    with pytest.raises(ValueError, match=r"backend must be one of \('cuda', 'torch'\) for x; got 'c'"):
        t.pick("c", "cuda", what=" for x")


def test_threads_resolution():
    n = torch.get_num_threads()
    assert _backend.threads(3) == 3 and _backend.threads(None) == n
    assert _backend.threads(None, work=10, min_work=100) == 1
    assert _backend.threads(None, work=10**9, min_work=1) == n
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"threads must be a positive int or None"):
            _backend.threads(bad)


def test_every_kernel_op_has_one_table():
    from lmtail.kernels.glue import fmachain
    from lmtail.kernels.gemm import bf16 as gemm

    tables = [fmachain.FMA_SUM, fmachain.MOE_ROUTED, RM.ROW_MASS, RM.TERMS, RT.ROWS_TAIL,
              *gemm.GEMM.values(), decl.EXP32, decl.SILU_MUL, decl.ATTEND]
    for t in tables:
        assert isinstance(t, _backend.Dispatch) and t.names(), t.op
    assert gemm.available_backends() == gemm.available_backends(gemm.DEFAULT_ORDER)
