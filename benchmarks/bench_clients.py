"""Pointer: this benchmark ships inside the package, as src/lmtail/benchmarks/bench_clients.py
(so `lmtail bench` finds it in an installed wheel too). Running this file runs that script
with the same arguments: `python benchmarks/bench_clients.py ARGS` = `lmtail bench --only clients`
with ARGS."""
import runpy

runpy.run_module("lmtail.benchmarks.bench_clients", run_name="__main__", alter_sys=True)
