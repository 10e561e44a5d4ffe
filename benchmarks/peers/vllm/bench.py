"""vLLM's real CPU sampler vs lmtail's rows_tail (fused path) on the same logits and params, A-B-B-A.

Run in the benchmark-only venv that setup.sh builds (never a dependency of lmtail):

    bash benchmarks/peers/vllm/setup.sh
    PYTHONPATH=src benchmarks/.venv-vllm/bin/python benchmarks/peers/vllm/bench.py [--quick]

Shape legend: rows [R, V] bf16 (lmtail's input), logits [R, V] fp32 (vLLM's: an exact copy).
  base   lmtail   lmtail.tail.compose.rows_tail(rows, k=256, sampling_params=sp, path="fused"): exact
                  top-k, tokens, raw logprobs, truncation flags
  arm    vllm     vllm.v1.sample.sampler.Sampler().forward(logits.clone(), metadata) with a
                  hand-built SamplingMetadata (temperature, top_k, top_p, one seeded
                  torch.Generator per row, max_num_logprobs=0: the sampled token's raw
                  logprob); on x86 it draws with its compiled _C.fused_gumbel_argmax. The
                  clone (Sampler divides the logits in place) is inside the arm's time.
Both draw from the same filtered distribution with different random streams, so the check
is distributional, stated here: every vLLM token lies in lmtail's exact candidate set
(top-50 ids for the top-k mix; the top-256 ids for the top-k-off mix, on rows lmtail does
not flag truncated), and vLLM's fp32 raw logprob of its token is within 1e-4 of the float64
log_softmax of the bf16 row. Ratio = median paired time / lmtail's (> 1: vLLM slower).
Prints one SKIP line and exits 0 when vLLM cannot be imported.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))  # this checkout's lmtail
from lmtail.benchmarks import bench_rows_tail as brt  # noqa: E402  (the shared row maker)
from lmtail.bench import abba, format_table  # noqa: E402

K = brt.K


def vllm_sampler():
    """(Sampler, make_metadata) or a reason string when vLLM is not importable."""
    try:
        from vllm.v1.sample.logits_processor import LogitsProcessors
        from vllm.v1.sample.metadata import SamplingMetadata
        from vllm.v1.sample.sampler import Sampler
    except Exception as e:  # noqa: BLE001 - any import failure means: skip, and say why
        return f"{type(e).__name__}: {e}"

    def make_metadata(sp: torch.Tensor, seed: int):
        r = sp.shape[0]
        top_k = sp[:, 0].to(torch.int32)
        return SamplingMetadata(
            temperature=sp[:, 2].clone(), all_greedy=False, all_random=True,
            top_p=sp[:, 1].clone(), top_k=None if bool((top_k <= 0).all()) else top_k,
            generators={i: torch.Generator().manual_seed(seed + i) for i in range(r)},
            max_num_logprobs=0, no_penalties=True, prompt_token_ids=None,
            frequency_penalties=torch.zeros(r), presence_penalties=torch.zeros(r),
            repetition_penalties=torch.ones(r), output_token_ids=[[] for _ in range(r)],
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())

    return Sampler(), make_metadata


def case(R: int, V: int, mix: str, rounds: int, sampler, make_metadata):
    rows = brt.make_rows(R, V, seed=V + R)  # [R, V] bf16
    logits = rows.float()  # [R, V] fp32, exact
    sp = brt.make_params(R, mix)
    ref = brt.fused(rows, sp)
    lsm = rows.double().log_softmax(dim=-1)  # [R, V] float64 reference for the logprob check
    top_k = int(sp[0, 0])

    def check(name, out, base_out):
        tok = out.sampled_token_ids[:, 0].long()  # [R]
        cand = ref.topk_indices[:, :top_k] if top_k > 0 else ref.topk_indices
        rows_ok = torch.ones(R, dtype=torch.bool) if top_k > 0 else ~ref.truncated
        inside = (cand == tok[:, None]).any(dim=1)
        assert bool(inside[rows_ok].all()), f"vLLM tokens outside lmtail's candidates: rows {(~inside & rows_ok).nonzero()[:, 0].tolist()}"
        lp = out.logprobs_tensors.logprobs[:, 0].double()  # [R] the sampled token's
        err = (lp - lsm.gather(1, tok[:, None])[:, 0]).abs().max().item()
        assert err < 1e-4, f"vLLM raw logprob off the float64 log_softmax by {err:.3g}"

    arms = {"lmtail fused": lambda: brt.fused(rows, sp),
            "vllm Sampler": lambda: sampler.forward(logits.clone(), make_metadata(sp, seed=R))}
    return abba(arms, base="lmtail fused", rounds=rounds, check=check)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gbs", type=int, nargs="+", default=[128])
    p.add_argument("--v", type=int, nargs="+", default=[201088])
    p.add_argument("--mix", nargs="+", default=list(brt.MIXES), choices=list(brt.MIXES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="gbs 8, V 49152, 2 rounds (a smoke run)")
    args = p.parse_args()
    if args.quick:
        args.gbs, args.v, args.rounds = [8], [49152], 2
    got = vllm_sampler()
    if isinstance(got, str):
        print(f"SKIP: vLLM's sampler is not importable here ({got}); run "
              f"benchmarks/peers/vllm/setup.sh and use benchmarks/.venv-vllm/bin/python")
        return 0
    sampler, make_metadata = got
    results = {f"gbs={R} V={V} {mix}": case(R, V, mix, args.rounds, sampler, make_metadata)
               for V in args.v for R in args.gbs for mix in args.mix}
    print(format_table(results, title=f"vLLM V1 Sampler.forward (CPU) vs lmtail fused rows_tail, "
                       f"{torch.get_num_threads()} thread(s); ratio = time / lmtail's"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
