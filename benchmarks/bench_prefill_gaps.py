"""Pointer: this benchmark ships inside the package, as src/lmtail/benchmarks/bench_prefill_gaps.py
(so `lmtail bench` finds it in an installed wheel too). Running this file runs that script
with the same arguments: `python benchmarks/bench_prefill_gaps.py ARGS` = `lmtail bench --only
prefill_gaps` with ARGS."""
import runpy

runpy.run_module("lmtail.benchmarks.bench_prefill_gaps", run_name="__main__", alter_sys=True)
