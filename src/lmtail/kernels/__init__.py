"""lmtail.kernels: the fast CPU kernels behind lmtail's ops (each with a declared order;
every backend of an op gives the same bytes), and the one backend layer they share.

The layer (every kernel module uses it; a new kernel or backend plugs in here):
  _cc               the one loader: builds a kernels/*.c once (cached by the bytes of the
                    source AND of lmtail_kernels.h), `kernel_library(source, signatures)`;
                    `emulated=True` builds its emulated variant (SIMDe + lmtail_emulate.h:
                    every AVX-512 / AVX512-BF16 / AMX path on any AVX2 CPU; docs/emulated.md)
  lmtail_kernels.h  the one C header: bit helpers, DAZ/FTZ and NaN canonicalisation, the
                    MXCSR pin, exp64's shifted term (scalar + AVX-512), the sampler's
                    candidate steps on an `lmtail_sampling` row (every C pass's one copy),
                    the CPU probe, the thread pool (`lmtail_parallel`)
  sampling          the one sampling schema: the public [R, 3|4|5] tensor's column names
                    (COL, SAMPLING_COLUMNS) and `sampling_records`, the one conversion to the
                    C kernels' lmtail_sampling records (torch's sampler reads it too)
  cpu               the one CPU-feature probe, `cpu.features()` (the C kernels read the same bits)
  _backend          the one dispatch: `Dispatch(op, [Backend(name, run, available, device)])`,
                    `backend=` (None: the fastest verified row, checked and timed once per
                    machine in a child process: `_verify`)
                    and `threads=` (None: torch.get_num_threads(), capped by work) resolved once
Calling convention of the ops: keyword-only `backend=` and `threads=`; backend names "amx",
"avx512", "avx2", "c", "torch" (and "numba"); the emulated rows "emu-<isa>" (never the
default; `Dispatch.names(emulated=True)`) run the emulated builds.

The kernels:
  gemm       the lm_head / body GEMM `gemm_bf16` in two declared orders: "amx32" (AMX's
             TDPBF16PS block order, emulated exactly without AMX; the default) and "chain"
  rows_tail  the fused post-exchange pass: exact top-k, full-row mass and the draw
  rowmass    the sampler's full-row float64 max / exp64 / sum64 pass (`row_mass`)
  fmachain   declared-order fp32 fma reductions for the norms and the MoE routed chain
  body       the SmolLM2 body's C kernels (exp32, silu, attention, fused add+RMSNorm rows,
             rope + cache write), unchecked; lmtail.model.body holds the ops
"""
