"""The layout by concern that issue 29 asks for, as a one-shot move: NOT applied to this tree.

    python tools/relayout.py        # from the repo root, on a clean tree; then review `git diff`

It moves every module to the folder of its concern (MODULES below: the tail's pieces into
lmtail/tail/, norms and router into lmtail/glue/, each kernel binding and its C sources into
kernels/{gemm,quant,model,tail,glue}/), with `git mv`, and rewrites what names them: imports
(through the AST: relative imports stay relative, re-spelled from the file's new package),
dotted names (`lmtail.sampler` -> `lmtail.tail.sampler`) and paths in text, and the C
sources' names in the kernel loaders (POST: _cc, _verify, setup.py, test_kernels). Tried on
the tree before the merges of 2026-12-03 evening: 28 files moved, 119 rewritten, the suite
then `11 failed, 1972 passed`: tests that name C files by their old folder (test_amx_config,
test_backends' sources check, test_emulated's per-file checks, test_wheel's source_key,
docs/backends.md's block) still to be fixed by hand after running it. Not run by any test.
"""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

SRC = Path("src/lmtail")

# old dotted module -> new dotted module
MODULES = {
    "lmtail.tail": "lmtail.tail.compose",
    "lmtail.config": "lmtail.tail.config",
    "lmtail.sampler": "lmtail.tail.sampler",
    "lmtail.candidates": "lmtail.tail.candidates",
    "lmtail.exchange": "lmtail.tail.exchange",
    "lmtail.layout": "lmtail.tail.layout",
    "lmtail.topk": "lmtail.tail.topk",
    "lmtail.processors": "lmtail.tail.processors",
    "lmtail.norms": "lmtail.glue.norms",
    "lmtail.router": "lmtail.glue.router",
    "lmtail.kernels.gemm": "lmtail.kernels.gemm.bf16",
    "lmtail.kernels._gemm_numba": "lmtail.kernels.gemm._numba",
    "lmtail.kernels.quant": "lmtail.kernels.quant.gemm_q",
    "lmtail.kernels.body": "lmtail.kernels.model.body",
    "lmtail.kernels.step": "lmtail.kernels.model.step",
    "lmtail.kernels.rows_tail": "lmtail.kernels.tail.rows_tail",
    "lmtail.kernels.shard_partials": "lmtail.kernels.tail.shard_partials",
    "lmtail.kernels.rowmass": "lmtail.kernels.tail.rowmass",
    "lmtail.kernels.fmachain": "lmtail.kernels.glue.fmachain",
    "lmtail.kernels.sampling": "lmtail.kernels.tail.sampling",
}
# C sources: basename -> group folder under kernels/
C_GROUPS = {
    "gemm_chain.c": "gemm", "gemm_amx32.c": "gemm", "gemm_dp32.c": "gemm",
    "gemm_q.c": "quant",
    "body.c": "model", "step.c": "model",
    "rows_tail.c": "tail", "shard_partials.c": "tail", "rowmass.c": "tail",
    "fmachain.c": "glue",
}
NEW_PACKAGES = {
    "lmtail.tail": '"""The decode sampling tail: final RMSNorm -> lm_head -> exchange -> top-k -> sampler."""\n',
    "lmtail.glue": '"""The shared glue ops around the big matmuls: norms and the MoE router."""\n',
    "lmtail.kernels.gemm": '"""GEMM bindings: the bf16 lm_head GEMM in its declared orders (chain, amx32, dp32)."""\n',
    "lmtail.kernels.quant": '"""Quantized-weight GEMM bindings: gemm_q on the GGUF\'s own Q4_1 / Q8_0 bytes."""\n',
    "lmtail.kernels.model": '"""The model body\'s kernels: norms, rope, silu, attention, and the native decode step."""\n',
    "lmtail.kernels.tail": '"""The tail passes\' kernels: rows_tail (top-k + sampler), shard_partials, row mass."""\n',
    "lmtail.kernels.glue": '"""The glue ops\' kernels: fp32 fma chains (norm sums, MoE routed sums)."""\n',
}


def mod_path(mod: str) -> Path:
    return Path("src") / (mod.replace(".", "/") + ".py")


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if Path(f).is_file()]


def old_module_of(path: str):
    p = Path(path)
    if p.parts[:2] == ("src", "lmtail") and p.suffix == ".py":
        parts = list(p.with_suffix("").parts[1:])
        if parts[-1] == "__init__":
            return ".".join(parts[:-1]), True
        return ".".join(parts), False
    if p.parts[0] == "benchmarks" and p.suffix == ".py" and len(p.parts) == 2:
        return "benchmarks." + p.stem, False
    return None, False


def map_module(mod: str) -> str:
    """Longest old prefix wins."""
    best = None
    for old in MODULES:
        if mod == old or mod.startswith(old + "."):
            if best is None or len(old) > len(best):
                best = old
    if best is None:
        return mod
    return MODULES[best] + mod[len(best):]


def is_module(mod: str, all_mods: set) -> bool:
    return mod in all_mods


def resolve(node: ast.ImportFrom, pkg: str) -> str:
    if node.level == 0:
        return node.module
    base = pkg.split(".")
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def relative(target: str, new_pkg: str) -> str:
    """`from X` spelling of absolute `target` seen from package new_pkg (relative when both in lmtail)."""
    if not (target.split(".")[0] == "lmtail" and new_pkg and new_pkg.split(".")[0] == "lmtail"):
        return target
    t, p = target.split("."), new_pkg.split(".")
    n = 0
    while n < min(len(t), len(p)) and t[n] == p[n]:
        n += 1
    ups = len(p) - n
    return "." * (ups + 1) + ".".join(t[n:])


DOTTED = re.compile(r"(?<![\w.])lmtail(?:\.\w+)+")


SHORT = re.compile(r"(?<![\w.])kernels\.(gemm|quant|body|step|rows_tail|shard_partials|rowmass|fmachain|sampling|_gemm_numba)\b")


def map_dotted_text(text: str) -> str:
    text = DOTTED.sub(lambda m: map_module(m.group(0)), text)
    return SHORT.sub(lambda m: map_module("lmtail." + m.group(0))[len("lmtail."):], text)


def rewrite_py(text: str, old_pkg: str, new_pkg: str, all_mods: set, where) -> str:
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    edits = []  # (start, end, new text)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            was_rel = node.level > 0
            src_mod = resolve(node, old_pkg)
            if not src_mod.startswith("lmtail") and not src_mod.startswith("benchmarks"):
                continue
            indent = lines[node.lineno - 1][: node.col_offset]
            groups = {}  # new from-module -> [alias text]
            for a in node.names:
                full = f"{src_mod}.{a.name}"
                if full in all_mods or full in MODULES:  # importing a module
                    new_full = map_module(full)
                    frm, name = new_full.rsplit(".", 1)
                    alias = a.asname or (a.name if name != a.name else None)
                else:
                    frm, name, alias = map_module(src_mod), a.name, a.asname
                txt = name + (f" as {alias}" if alias and alias != name else "")
                groups.setdefault(frm, []).append(txt)
            out = []
            for frm, names in groups.items():
                spelled = relative(frm, new_pkg) if was_rel else frm
                if frm.startswith("benchmarks"):
                    spelled = frm
                out.append(f"{indent}from {spelled} import {', '.join(names)}")
            new = "\n".join(out) + "\n"
            old = "".join(lines[node.lineno - 1: node.end_lineno])
            if old.strip().replace("(", "").replace(")", "").split() != new.strip().split():
                edits.append((node.lineno - 1, node.end_lineno, new))
            else:
                edits.append((node.lineno - 1, node.end_lineno, old))
        elif isinstance(node, ast.Import):
            indent = lines[node.lineno - 1][: node.col_offset]
            parts = []
            for a in node.names:
                parts.append(map_module(a.name) + (f" as {a.asname}" if a.asname else ""))
            edits.append((node.lineno - 1, node.end_lineno, f"{indent}import {', '.join(parts)}\n"))
    edits.sort()
    out, i = [], 0
    for s, e, new in edits:
        if s < i:
            continue  # nested (should not happen)
        out.append(map_dotted_text(fix_paths("".join(lines[i:s]), where)))
        # keep any trailing text after the statement on its last line (e.g. comments)
        last = lines[e - 1]
        tail = ""
        seg = "".join(lines[s:e])
        if new.rstrip("\n") != seg.rstrip("\n"):
            m = re.search(r"(\s+#.*)$", last.rstrip("\n"))
            if m and "#" not in new:
                tail = m.group(1)
            out.append(new.rstrip("\n") + tail + "\n")
        else:
            out.append(seg)
        i = e
    out.append(map_dotted_text(fix_paths("".join(lines[i:]), where)))
    return "".join(out)


def path_moves() -> dict:
    moves = {}
    for old, new in MODULES.items():
        op = mod_path(old)
        if op.is_file():
            moves[str(op)] = str(mod_path(new))
    for c, g in C_GROUPS.items():
        moves[f"src/lmtail/kernels/{c}"] = f"src/lmtail/kernels/{g}/{c}"
    return moves


MOVES = None


def fix_paths(text: str, is_py: bool) -> str:
    for old, new in MOVES.items():
        o, n = old[len("src/lmtail/"):], new[len("src/lmtail/"):]
        # src/lmtail/X, lmtail/X, kernels/X (for kernels files)
        text = re.sub(r"(?<![\w/.])src/lmtail/" + re.escape(o), "src/lmtail/" + n, text)
        text = re.sub(r"(?<![\w/.])lmtail/" + re.escape(o), "lmtail/" + n, text)
        if o.startswith("kernels/"):
            text = re.sub(r"(?<![\w/.])" + re.escape(o), n, text)
    if is_py == "src":
        for c, g in C_GROUPS.items():
            text = re.sub(r"([\"'])" + re.escape(c) + r"\1", lambda m: f"{m.group(1)}{g}/{c}{m.group(1)}", text)
    return text


def main():
    global MOVES
    MOVES = path_moves()
    files = tracked()
    all_mods = set()
    for f in files:
        m, _ = old_module_of(f)
        if m:
            all_mods.add(m)
    new_texts = {}
    for f in files:
        p = Path(f)
        if p.suffix in (".png", ".gguf", ".so") or "/.venv" in f:
            continue
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        if p.suffix == ".py":
            old_mod, is_pkg = old_module_of(f)
            old_pkg = (old_mod if is_pkg else old_mod.rsplit(".", 1)[0]) if old_mod else ""
            newf = MOVES.get(f, f)
            new_mod, new_is_pkg = old_module_of(newf)
            new_pkg = (new_mod if new_is_pkg else new_mod.rsplit(".", 1)[0]) if new_mod else ""
            try:
                new = rewrite_py(text, old_pkg, new_pkg, all_mods, "src" if f.startswith("src/") else "other")
            except SyntaxError:
                new = map_dotted_text(fix_paths(text, "other"))
        else:
            new = map_dotted_text(fix_paths(text, False))
        if new != text:
            new_texts[f] = new
    for f, t in new_texts.items():
        Path(f).write_text(t)
    for pkg, doc in NEW_PACKAGES.items():
        d = Path("src") / pkg.replace(".", "/")
        d.mkdir(parents=True, exist_ok=True)
    for old, new in MOVES.items():
        Path(new).parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "mv", old, new], check=True)
    for pkg, doc in NEW_PACKAGES.items():
        init = Path("src") / pkg.replace(".", "/") / "__init__.py"
        if not init.exists():
            init.write_text(doc)
            subprocess.run(["git", "add", str(init)], check=True)
    post()
    print(f"rewrote {len(new_texts)} files, moved {len(MOVES)}")


POST = {
    "src/lmtail/kernels/_cc.py": [("path = Path(__file__).with_name(source)", "path = Path(__file__).parent / source")],
    "src/lmtail/kernels/_verify.py": [('kernels.glob("*.c")', 'kernels.rglob("*.c")')],
    "tests/test_kernels.py": [("KERNELS = Path(RT.__file__).parent", "KERNELS = Path(_cc.__file__).parent"),
                              ('outside = [p for p in src.rglob("*.c") if p.parent != KERNELS]',
                               'outside = [p for p in src.rglob("*.c") if KERNELS not in p.parents]'),
                              ('KERNELS.glob("*.c")', 'KERNELS.rglob("*.c")'),
                              ('KERNELS / "rowmass.c"', 'KERNELS / "tail" / "rowmass.c"')],
    "setup.py": [('sorted(KERNELS.glob("*.c"))', 'sorted(p for p in KERNELS.rglob("*.c") if "_prebuilt" not in p.parts)')],
}


def post():
    for f, reps in POST.items():
        t = Path(f).read_text()
        for a, b in reps:
            assert a in t, (f, a)
            t = t.replace(a, b)
        Path(f).write_text(t)


if __name__ == "__main__":
    main()
