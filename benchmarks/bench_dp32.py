"""Pointer: this benchmark ships inside the package, as src/lmtail/benchmarks/bench_dp32.py
(so `lmtail bench` finds it in an installed wheel too). Running this file runs that script
with the same arguments: `python benchmarks/bench_dp32.py ARGS` = `python -m lmtail.benchmarks.bench_dp32`
with ARGS."""
import runpy

runpy.run_module("lmtail.benchmarks.bench_dp32", run_name="__main__", alter_sys=True)
