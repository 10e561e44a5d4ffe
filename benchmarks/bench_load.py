"""Pointer: this benchmark ships inside the package, as src/lmtail/benchmarks/bench_load.py
(so `lmtail bench` finds it in an installed wheel too). Running this file runs that script
with the same arguments: `python benchmarks/bench_load.py ARGS` = `lmtail bench --only load`
with ARGS."""
import runpy

runpy.run_module("lmtail.benchmarks.bench_load", run_name="__main__", alter_sys=True)
