"""Pointer: this benchmark ships inside the package, as src/lmtail/benchmarks/bench_serve.py
(so `lmtail bench` finds it in an installed wheel too). Running this file runs that script
with the same arguments: `python benchmarks/bench_serve.py ARGS` = `lmtail bench --only serve`
with ARGS."""
import runpy

runpy.run_module("lmtail.benchmarks.bench_serve", run_name="__main__", alter_sys=True)
