"""The op registry: one record (`OpSpec`) per public op, the unit a new op is added as.

    from lmtail.ops import OPS, op, owner_of_kind
    spec = op("add_rms")
    spec.function()         # lmtail.glue.norms.add_rms
    spec.declaration()      # lmtail.glue.norms.add_rms_decl (every op has one; an exact op's has no sums)
    spec.backends()         # the op's backend names on this machine, fastest first
    spec.reference()        # its float64 reference (lmtail.reference.*)
    spec.kinds, spec.test, spec.bench    # its controls: those planted in its kinds (contract.walk)

A record names things by "module:attribute" strings, resolved on use, so importing this
module imports nothing of lmtail (cheap, and no cycle: none of the modules it names
imports it; lmtail.contract and the tests read it). `lmtail.contract.registry()` builds its
kind and control lists by walking OPS (a kind or control no record names is an error);
tests/test_registry.py checks every record resolves and its files exist, and
tests/test_api.py that every public op has a record. docs/ops.md: adding an op.

Shape legend: none (records, no tensors).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


def resolve(ref: str):
    """The object named "package.module:attribute"."""
    mod, _, attr = ref.partition(":")
    return getattr(importlib.import_module(mod), attr)


@dataclass(frozen=True)
class Backends:
    """A callable listing an op's backends, fastest first: `ref` (a public
    available_backends-style function, called with `args`; `keep`: only these of its names;
    `one`: the op takes no backend= and runs the first), or the fixed names `fixed`."""

    ref: str | None = None
    args: tuple = ()
    fixed: tuple[str, ...] = ()
    keep: tuple[str, ...] | None = None
    one: bool = False

    def __call__(self) -> tuple[str, ...]:
        if not self.ref:
            return self.fixed
        names = [n for n in resolve(self.ref)(*self.args) if self.keep is None or n in self.keep]
        return tuple(names[:1] if self.one else names)


TORCH_ONLY = Backends(fixed=("torch",))
BODY = Backends("lmtail.model.body:available_backends")
FUSED = Backends("lmtail.model.body:available_backends", keep=("c", "torch"), one=True)  # C when built


@dataclass(frozen=True)
class OpSpec:
    """One op: its public function, declaration, backends, float64 reference, the contract
    kinds that check it, its test and benchmark files (relative to the repository root).
    The planted controls are not named here: each control names the kind it is planted in,
    so an op's controls are those on its kinds (lmtail.contract.walk)."""

    name: str
    fn: str
    decl: str
    backends: Backends
    ref: str
    kinds: tuple[str, ...]
    test: str
    bench: str

    def function(self):
        return resolve(self.fn)

    def declaration(self):
        return resolve(self.decl)

    def reference(self):
        return resolve(self.ref)


_D32 = "tail.logits.deferred.fp32"
_GEMM_AMX32 = Backends("lmtail.kernels.gemm.bf16:available_backends", ("amx32",))  # the tail's GEMM (TailConfig's order)
OPS: tuple[OpSpec, ...] = (
    # ------------------------------------------------------------------ the decode tail
    # the decode tail, in the stages the contract checks it: logits, the bf16 mirror's
    # top-k, then end to end (certified tokens, the ranks gate); top-k and sampler below
    OpSpec("decode_tail.logits", "lmtail.tail.compose:decode_tail", "lmtail.tail.compose:tail_decl", _GEMM_AMX32,
           "lmtail.reference.tail:logits_range",
           (_D32, "tail.logits.legacy.fp32", "tail.logits.deferred.fp16", "tail.logits.deferred.bf16",
            f"{_D32}.chain", "tail.logits.legacy.fp32.chain", f"{_D32}.dp32", "tail.logits.legacy.fp32.dp32",
            f"{_D32}.bf16x2", f"{_D32}.chain.bf16x2", f"{_D32}.dp32.bf16x2"),
           "tests/test_tail.py", "src/lmtail/benchmarks/bench_tail.py"),
    OpSpec("decode_tail.mirror", "lmtail.tail.compose:decode_tail", "lmtail.tail.compose:tail_decl", _GEMM_AMX32,
           "lmtail.reference.tail:mirror_range", ("tail.mirror.bf16",), "tests/test_tail.py", "src/lmtail/benchmarks/bench_tail.py"),
    OpSpec("decode_tail", "lmtail.tail.compose:decode_tail", "lmtail.tail.compose:tail_decl", _GEMM_AMX32,
           "lmtail.reference.contract:ideal_bound", ("tail.decode",),
           "tests/test_tail.py", "src/lmtail/benchmarks/bench_tail.py"),
    # decode_tail(exchange="candidates"): shard fp32 top-(k+1) + 256 global mass chunks, merged
    # by the owner (lmtail.tail.candidates); checked on the op's own fp32 logits, VTP-invariant
    OpSpec("candidates_exchange", "lmtail.tail.candidates:merge", "lmtail.tail.candidates:candidates_decl",
           Backends("lmtail.kernels.tail.shard_partials:available_backends"),
           "lmtail.reference.candidates:candidates_emulation", ("tail.exchange.candidates",),
           "tests/test_candidates.py", "src/lmtail/benchmarks/bench_exchange.py"),
    # decode_tail with the checkpoint's Q8_0 head (head_input="fp32"): gemm_q lanes32 on fp32(x*gamma)
    OpSpec("decode_tail.q8_0", "lmtail.tail.compose:decode_tail", "lmtail.tail.compose:tail_decl",
           Backends("lmtail.kernels.quant.gemm_q:available_backends"), "lmtail.reference.tail:logits_range",
           ("tail.head.q8_0",), "tests/test_tail_q8.py", "src/lmtail/benchmarks/bench_tail.py"),
    # the logits-processor seam between the GEMM's fp32 logits and the exchange (decode_tail(processing=))
    OpSpec("logits_processors", "lmtail.tail.processors:apply_processing", "lmtail.tail.processors:processors_decl",
           TORCH_ONLY, "lmtail.reference.processors:processed_logits", ("tail.processors",),
           "tests/test_processors.py", "src/lmtail/benchmarks/bench_tail.py"),
    OpSpec("exact_topk", "lmtail.tail.topk:exact_topk", "lmtail.tail.topk:exact_topk_decl", TORCH_ONLY, "lmtail.reference.tail:topk_ref",
           ("tail.topk.exact",), "tests/test_topk.py", "src/lmtail/benchmarks/bench_rows_tail.py"),
    OpSpec("rows_tail", "lmtail.tail.compose:rows_tail", "lmtail.kernels.tail.rows_tail:rows_tail_decl",
           Backends("lmtail.kernels.tail.rows_tail:available_backends"), "lmtail.reference.contract:sample_decision",
           ("tail.sampler",), "tests/test_rows_tail.py", "src/lmtail/benchmarks/bench_rows_tail.py"),
    OpSpec("row_mass", "lmtail.kernels.tail.rowmass:row_mass", "lmtail.kernels.tail.rows_tail:rows_tail_decl",
           Backends("lmtail.kernels.tail.rowmass:available_backends"), "lmtail.reference.tail:mass_emulation",
           ("tail.row_mass",), "tests/test_rowmass.py", "src/lmtail/benchmarks/bench_rowmass.py"),
    # ------------------------------------------------------------------ the GEMM, per order
    OpSpec("gemm_bf16.amx32", "lmtail.kernels.gemm.bf16:gemm_bf16", "lmtail.kernels.gemm.bf16:gemm_decl",
           Backends("lmtail.kernels.gemm.bf16:available_backends", ("amx32",)), "lmtail.reference.gemm:gemm_range",
           ("gemm.amx32",), "tests/test_gemm.py", "src/lmtail/benchmarks/bench_gemm.py"),
    OpSpec("gemm_bf16.chain", "lmtail.kernels.gemm.bf16:gemm_bf16", "lmtail.kernels.gemm.bf16:gemm_decl",
           Backends("lmtail.kernels.gemm.bf16:available_backends", ("chain",)), "lmtail.reference.gemm:gemm_range",
           ("gemm.chain",), "tests/test_gemm.py", "src/lmtail/benchmarks/bench_gemm.py"),
    OpSpec("gemm_bf16.dp32", "lmtail.kernels.gemm.bf16:gemm_bf16", "lmtail.kernels.gemm.bf16:gemm_decl",
           Backends("lmtail.kernels.gemm.bf16:available_backends", ("dp32",)), "lmtail.reference.gemm:gemm_range",
           ("gemm.dp32",), "tests/test_dp32.py", "src/lmtail/benchmarks/bench_gemm.py"),
    OpSpec("gemm_q", "lmtail.kernels.quant.gemm_q:gemm_q", "lmtail.kernels.quant.gemm_q:gemm_q_decl",
           Backends("lmtail.kernels.quant.gemm_q:available_backends"), "lmtail.reference.quant:gemm_q_range",
           ("gemm_q.lanes32",), "tests/test_quant.py", "src/lmtail/benchmarks/bench_quant.py"),
    OpSpec("gemm_bq", "lmtail.kernels.quant.gemm_bq:gemm_bq", "lmtail.kernels.quant.gemm_bq:gemm_bq_decl",
           Backends("lmtail.kernels.quant.gemm_bq:available_backends"), "lmtail.reference.quant:gemm_bq_range",
           ("gemm_bq.bq32",), "tests/test_gemm_bq.py", "src/lmtail/benchmarks/bench_bq.py"),
    # ------------------------------------------------------------------ the glue ops
    OpSpec("add_rms", "lmtail.glue.norms:add_rms", "lmtail.glue.norms:add_rms_decl",
           Backends("lmtail.kernels.glue.fmachain:available_backends"), "lmtail.reference.glue:norm_range",
           ("glue.add_rms_h", "glue.add_rms_y"),
           "tests/test_norms.py", "src/lmtail/benchmarks/bench_norms.py"),
    OpSpec("moe_add_rms", "lmtail.glue.norms:moe_add_rms", "lmtail.glue.norms:moe_add_rms_decl",
           Backends("lmtail.kernels.glue.fmachain:available_backends"), "lmtail.reference.glue:moe_h_range",
           ("glue.moe_bf16_h", "glue.moe_bf16_y", "glue.moe_f32_h", "glue.moe_f32_y"),
           "tests/test_norms.py", "src/lmtail/benchmarks/bench_norms.py"),
    OpSpec("rms_parts", "lmtail.glue.norms:rms_parts", "lmtail.glue.norms:rms_parts_decl",
           Backends("lmtail.kernels.glue.fmachain:available_backends"), "lmtail.reference.glue:norm_range",
           ("glue.rms_parts_once_y", "glue.rms_parts_mlx_y"),
           "tests/test_norms.py", "src/lmtail/benchmarks/bench_norms.py"),
    OpSpec("embed_rows", "lmtail.glue.norms:embed_rows", "lmtail.glue.norms:embed_rows_decl", TORCH_ONLY,
           "lmtail.reference.glue:bf16_array", ("glue.embed_rows",), "tests/test_norms.py", "src/lmtail/benchmarks/bench_norms.py"),
    OpSpec("router_topk", "lmtail.glue.router:router_topk", "lmtail.glue.router:router_topk_decl", TORCH_ONLY,
           "lmtail.reference.glue:router_check", ("glue.router_topk",),
           "tests/test_router.py", "src/lmtail/benchmarks/bench_norms.py"),
    # ------------------------------------------------------------------ the model body
    OpSpec("exp32", "lmtail.model.body:exp32", "lmtail.model.body:exp32_decl", BODY, "lmtail.reference.model:exp_ref",
           ("body.exp32",), "tests/test_model_body_ops.py",
           "src/lmtail/benchmarks/bench_model.py"),
    OpSpec("silu_mul", "lmtail.model.body:silu_mul", "lmtail.model.body:silu_mul_decl", BODY,
           "lmtail.reference.model:silu_mul_ref", ("body.silu_mul",), "tests/test_model_body_ops.py", "src/lmtail/benchmarks/bench_model.py"),
    OpSpec("silu_mul_bf16", "lmtail.model.body:silu_mul_bf16", "lmtail.model.body:silu_mul_decl",
           FUSED, "lmtail.reference.model:silu_mul_ref", ("body.silu_mul_bf16",),
           "tests/test_model_body.py", "src/lmtail/benchmarks/bench_model.py"),
    OpSpec("rope_table", "lmtail.model.body:rope_table", "lmtail.model.body:rope_decl", TORCH_ONLY,
           "lmtail.reference.model:rope_ref", ("body.rope_table",), "tests/test_model_body_ops.py", "src/lmtail/benchmarks/bench_model.py"),
    OpSpec("apply_rope", "lmtail.model.body:apply_rope", "lmtail.model.body:rope_decl", TORCH_ONLY,
           "lmtail.reference.model:rope_apply_range", ("body.apply_rope",),
           "tests/test_model_body_ops.py", "src/lmtail/benchmarks/bench_model.py"),
    OpSpec("rope_qkv", "lmtail.model.body:rope_qkv", "lmtail.model.body:rope_decl",
           FUSED, "lmtail.reference.model:rope_apply_range", ("body.rope_qkv",),
           "tests/test_model_body.py", "src/lmtail/benchmarks/bench_model.py"),
    OpSpec("attend", "lmtail.model.body:attend", "lmtail.model.body:attend_decl", BODY,
           "lmtail.reference.model:attend_range", ("body.attend",),
           "tests/test_model_body_ops.py", "src/lmtail/benchmarks/bench_model.py"),
    OpSpec("add_rms_rows", "lmtail.model.body:add_rms_rows", "lmtail.glue.norms:add_rms_decl",
           FUSED, "lmtail.reference.glue:norm_range", ("body.add_rms_rows",),
           "tests/test_model_body.py", "src/lmtail/benchmarks/bench_model.py"),
    OpSpec("add_rms_rows32", "lmtail.model.body:add_rms_rows32", "lmtail.model.body:add_rms32_decl",
           FUSED, "lmtail.reference.glue:norm_range32", ("body.add_rms_rows32",),
           "tests/test_q32.py", "src/lmtail/benchmarks/bench_model.py"),
)


def op(name: str) -> OpSpec:
    """The record called `name` (KeyError naming the registered ones)."""
    for spec in OPS:
        if spec.name == name:
            return spec
    raise KeyError(f"no op {name!r}; registered: {[s.name for s in OPS]}")


def owner_of_kind(kind: str) -> OpSpec:
    """The one record whose kinds include `kind` (KeyError if none)."""
    for spec in OPS:
        if kind in spec.kinds:
            return spec
    raise KeyError(f"no op record names contract kind {kind!r}")
