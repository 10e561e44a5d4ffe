"""Pointer: this benchmark ships inside the package, as src/lmtail/benchmarks/bench_norms.py
(so `lmtail bench` finds it in an installed wheel too). Running this file runs that script
with the same arguments: `python benchmarks/bench_norms.py ARGS` = `lmtail bench --only norms`
with ARGS."""
import runpy

runpy.run_module("lmtail.benchmarks.bench_norms", run_name="__main__", alter_sys=True)
