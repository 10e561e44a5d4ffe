"""The AMX tile configuration reaches LDTILECFG whole, on any x86-64 machine (compile only).

GCC 12's `_tile_loadconfig(p)` names an 8-byte memory operand, so stores that fill a local
64-byte config are dead to the compiler and get dropped; LDTILECFG then raises #GP on AMX
CPUs. gemm_amx32.c loads a static const config instead. This test compiles the kernel with
the kernels' own flags, finds every `ldtilecfg` in the assembly, and requires its operand to
be a constant object whose 64 bytes are the declared configuration (palette 1, tiles 0-7 of
16 rows x 64 bytes, the rest zero). The planted variant is the local-config function that
faulted (the probe's pattern): the same check goes red on it.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lmtail.kernels import _cc

KERNELS = Path(_cc.__file__).parent
WANT = bytes([1] + [0] * 15) + b"".join(int(64).to_bytes(2, "little") for _ in range(8)) \
    + bytes(16) + bytes([16] * 8) + bytes(8)  # palette 1; colsb[0..7] = 64; rows[0..7] = 16

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc to compile with")

PLANTED = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
typedef struct { uint8_t palette_id, start_row, rsv[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg_t;
__attribute__((target("amx-tile"))) void amx_config(void) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
}
"""


def assemble(source: Path, tmp: Path) -> str:
    """The assembly gcc makes of `source` with the kernels' flags (-S instead of a library)."""
    flags = [f for f in _cc.FLAGS if f != "-shared"]
    out = tmp / (source.stem + ".s")
    subprocess.run(["gcc", *flags, f"-I{KERNELS}", "-S", str(source), "-o", str(out)],
                   check=True, capture_output=True, timeout=300)
    return out.read_text()


def data_bytes(asm: str, label: str) -> bytes | None:
    """The bytes the data directives after `label:` emit (None when the label is absent)."""
    lines = asm.splitlines()
    try:
        i = next(n for n, ln in enumerate(lines) if ln.strip() == f"{label}:")
    except StopIteration:
        return None
    out = bytearray()
    width = {".byte": 1, ".value": 2, ".short": 2, ".2byte": 2, ".long": 4, ".4byte": 4, ".quad": 8}
    for ln in lines[i + 1:]:
        parts = ln.strip().split(None, 1)
        if not parts or parts[0].endswith(":") or len(out) >= 64:
            break
        op, arg = parts[0], (parts[1] if len(parts) > 1 else "")
        if op in width:
            for v in arg.split(","):
                out += (int(v.strip(), 0) & (256 ** width[op] - 1)).to_bytes(width[op], "little")
        elif op in (".zero", ".skip"):
            out += bytes(int(arg.split(",")[0], 0))
        elif op in (".string", ".asciz", ".ascii"):
            text = arg.strip()[1:-1].encode().decode("unicode_escape").encode("latin-1")
            out += text + (b"\0" if op != ".ascii" else b"")
        elif op.startswith("."):
            continue  # .align, .type, .size: no bytes
        else:
            break
    return bytes(out[:64])


def ldtilecfg_operands(asm: str) -> list[str]:
    return re.findall(r"^\s*ldtilecfg\s+(\S+)", asm, flags=re.M)


def config_problems(asm: str) -> list[str]:
    """Each ldtilecfg whose operand is not a constant holding WANT, as a reason."""
    bad = []
    for op in ldtilecfg_operands(asm):
        m = re.fullmatch(r"([A-Za-z_.$][\w.$]*)\(%rip\)", op)
        if m is None:
            bad.append(f"ldtilecfg {op}: not a constant object (a local config's stores can be dropped)")
            continue
        got = data_bytes(asm, m.group(1))
        if got != WANT:
            bad.append(f"ldtilecfg {op}: holds {got!r}, expected the declared configuration")
    return bad


def test_every_ldtilecfg_reads_the_whole_declared_config(tmp_path):
    asm = assemble(KERNELS / "gemm" / "gemm_amx32.c", tmp_path)
    assert ldtilecfg_operands(asm), "gemm_amx32.c no longer loads a tile config: update this test"
    assert config_problems(asm) == []


def test_planted_local_config_goes_red(tmp_path):
    src = tmp_path / "planted.c"
    src.write_text(PLANTED)
    asm = assemble(src, tmp_path)
    assert len(ldtilecfg_operands(asm)) == 1
    problems = config_problems(asm)
    assert len(problems) == 1 and "not a constant object" in problems[0]


def test_planted_wrong_constant_goes_red(tmp_path):
    src = tmp_path / "wrong.c"
    src.write_text(PLANTED.replace(
        "__attribute__((target(\"amx-tile\"))) void amx_config(void) {",
        "static const tilecfg_t CFG = {.palette_id = 1, .colsb = {64, 64}, .rows = {16, 8}};\n"
        "__attribute__((target(\"amx-tile\"))) void amx_config(void) { _tile_loadconfig(&CFG); }\n"
        "__attribute__((target(\"amx-tile\"))) void unused(void) {"))
    problems = config_problems(assemble(src, tmp_path))
    assert any("expected the declared configuration" in p for p in problems)
