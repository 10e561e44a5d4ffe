"""TailConfig as the tail's option surface: it checks its own fields (a ValueError naming
the field, expected vs got, for each rule), the choice sets and their signature codes live
next to it and every command line takes its choices and defaults from them, decode_tail's
keywords build one TailConfig, and TailOutput.lse is the log-normalizer the logprobs use
on both exchanges (bit views). Planted variants: a TailConfig without its checks, lse
from the mirror on the candidates path, a positional signature code.

Shape legend: R rows, H hidden, V vocab, k candidates.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import fields, replace

import numpy as np
import pytest
import torch

from conftest import bits, same_bits
from lmtail.tail import config as C
from lmtail.tail.config import TailConfig, resolve
from lmtail.kernels.gemm.bf16 import TAIL_ORDERS
from lmtail.kernels.tail.rowmass import row_mass
from lmtail.numerics import log64
from lmtail.tail.compose import TAIL_SIGNATURE, decode_tail, rows_tail, tail_signature

H, V = 64, 301  # odd vocab: no lane count lines up with a chunk
F32 = torch.float32

# ---------------------------------------------------------------------------------------
# each rule of TailConfig.__post_init__: (field values, the error it must raise)
# ---------------------------------------------------------------------------------------
def _re_tuple(t: tuple) -> str:
    """The regex of a tuple of str as the messages show it."""
    return "\\(" + ", ".join(f"'{x}'" for x in t) + ",?\\)"


BAD = [
    (dict(eps="1e-5"), r"eps must be a finite number >= 0; got '1e-5'"),
    (dict(eps=True), r"eps must be a finite number >= 0; got True"),
    (dict(eps=None), r"eps must be a finite number >= 0; got None"),
    (dict(eps=-1e-6), r"eps must be a finite number >= 0; got -1e-06"),
    (dict(eps=math.inf), r"eps must be a finite number >= 0; got inf"),
    (dict(eps=math.nan), r"eps must be a finite number >= 0; got nan"),
    (dict(eps=1e39), r"eps must be a finite number >= 0; got 1e\+39, which is inf in fp32"),
    (dict(eps=[1e-5]), r"eps must be a finite number >= 0; got \[1e-05\]"),
    (dict(hidden_actual=0), r"hidden_actual must be None \(H\) or an int in \[1, H\]; got 0"),
    (dict(hidden_actual=-4), r"hidden_actual must be None \(H\) or an int in \[1, H\]; got -4"),
    (dict(hidden_actual=12.0), r"hidden_actual must be None \(H\) or an int in \[1, H\]; got 12.0"),
    (dict(hidden_actual="12"), r"hidden_actual must be None \(H\) or an int in \[1, H\]; got '12'"),
    (dict(hidden_actual=True), r"hidden_actual must be None \(H\) or an int in \[1, H\]; got True"),
    (dict(k=0), r"k must be an int in \[1, V\]; got 0"),
    (dict(k=-1), r"k must be an int in \[1, V\]; got -1"),
    (dict(k=8.0), r"k must be an int in \[1, V\]; got 8.0"),
    (dict(k="8"), r"k must be an int in \[1, V\]; got '8'"),
    (dict(k=True), r"k must be an int in \[1, V\]; got True"),
    (dict(k=None), r"k must be an int in \[1, V\]; got None"),
] + [
    (dict([(flag, bad)]), rf"{flag} must be a bool; got {shown}")
    for flag in C.FLAGS for bad, shown in ((0, "0"), (1, "1"), ("True", "'True'"), (None, "None"),
                                           (np.bool_(True), "(np.)?True"))
] + [
    (dict([(name, bad)]), rf"{name} must be one of {_re_tuple(allowed)}; got {shown}")
    for name, allowed in (("gemm_order", ("chain", "amx32", "dp32")), ("tail_path", ("fused", "reference")),
                          ("exchange", ("mirror", "candidates")), ("head_input", ("bf16", "bf16x2", "fp32")))
    for bad, shown in (("bogus", "'bogus'"), (allowed[0].upper(), repr(allowed[0].upper())), (1, "1"),
                       (None, "None"), ((allowed[0],), _re_tuple((allowed[0],))))
] + [
    (dict(head_input="bf16x2", deferred_rms=False), r"head_input='bf16x2' needs deferred_rms=True .*got deferred_rms="),
    (dict(head_input="fp32", deferred_rms=False), r"head_input='fp32' needs deferred_rms=True .*got deferred_rms=False"),
]

GOOD = [dict(), dict(eps=0.0), dict(eps=0), dict(eps=np.float32(1e-6)), dict(hidden_actual=1),
        dict(hidden_actual=np.int64(60)), dict(k=1), dict(k=np.int32(7)), dict(head_input="bf16", deferred_rms=False)] + [
    dict([(flag, v)]) for flag in C.FLAGS for v in (False, True)] + [
    dict([(name, v)]) for name, allowed in C.CHOICES.items() for v in allowed if name != "head_input"] + [
    dict(head_input=v) for v in C.TAIL_HEAD_INPUTS]


@pytest.mark.parametrize("kw,match", BAD, ids=lambda v: str(v)[:40])
def test_each_rule_raises_naming_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        TailConfig(**kw)


@pytest.mark.parametrize("kw,match", BAD[::3], ids=lambda v: str(v)[:40])
def test_decode_tail_keywords_raise_the_same(kw, match):
    """The keywords build one TailConfig: the same words, before any work."""
    x, gamma, w = _problem(0, 2)
    with pytest.raises(ValueError, match=match):
        decode_tail(x, gamma, w, **dict(dict(k=4), **kw))


@pytest.mark.parametrize("kw", GOOD, ids=str)
def test_valid_fields_are_kept_as_given(kw):
    cfg = TailConfig(**kw)
    assert all(getattr(cfg, n) is v or getattr(cfg, n) == v for n, v in kw.items())


def test_replace_checks_again():
    with pytest.raises(ValueError, match=r"exchange must be one of .*; got 'all'"):
        replace(TailConfig(), exchange="all")
    with pytest.raises(ValueError, match=r"k must be an int in \[1, V\]; got 0"):
        replace(TailConfig(k=8), k=0)


class _Lax(TailConfig):
    """PLANTED: a TailConfig that checks nothing."""

    def __post_init__(self):
        pass


def test_planted_config_without_checks_is_caught():
    """The BAD table is a real test: a config without __post_init__'s rules accepts every row."""
    accepted = 0
    for kw, _ in BAD:
        try:
            _Lax(**kw)
            accepted += 1
        except ValueError:
            pass
    assert accepted == len(BAD)


def test_defaults_are_the_documented_ones():
    """The docstring's defaults (the exchange's was once written "mirror")."""
    cfg = TailConfig()
    assert (cfg.exchange, cfg.head_input, cfg.gemm_order, cfg.tail_path, cfg.k, cfg.eps) == (
        "candidates", "bf16", "amx32", "fused", 256, 1e-5)
    doc = TailConfig.__doc__
    for f in fields(TailConfig):
        if isinstance(f.default, str):
            assert f'{f.name} ("{f.default}")' in doc or f.name == "gemm_order", f.name
    assert 'exchange ("candidates")' in doc and 'exchange ("mirror")' not in doc


# ---------------------------------------------------------------------------------------
# config= or keywords
# ---------------------------------------------------------------------------------------
def test_resolve_one_or_the_other():
    cfg = TailConfig(k=8)
    assert resolve(None, dict(k=8)) == cfg
    assert resolve(cfg, dict(k=256, eps=1e-5, exchange="candidates")) is cfg  # keywords at their defaults
    with pytest.raises(ValueError, match=r"either as config= or as keywords, not both; .*keywords \{'k': 8\}"):
        resolve(cfg, dict(k=8))
    with pytest.raises(ValueError, match=r"not both; .*keywords \{'k': 256.0\}"):
        resolve(cfg, dict(k=256.0))  # not the default's type: a keyword given, not silently dropped
    x, gamma, w = _problem(0, 2)
    with pytest.raises(ValueError, match=r"config must be a TailConfig; got dict"):
        decode_tail(x, gamma, w, config=dict(k=4))


def test_config_and_keywords_give_the_same_bytes():
    x, gamma, w = _problem(1, 5)
    sp = _params(1, 5)
    for ex in C.EXCHANGES:
        a = decode_tail(x, gamma, w, k=6, exchange=ex, sampling_params=sp, hidden_actual=60,
                        zero_interleaved_pad=False)
        b = decode_tail(x, gamma, w, config=TailConfig(k=6, exchange=ex, hidden_actual=60,
                                                       zero_interleaved_pad=False), sampling_params=sp)
        for f in ("logits", "topk_values", "topk_indices", "tokens", "logprobs", "truncated", "lse"):
            assert same_bits(getattr(a, f), getattr(b, f)), (ex, f)


# ---------------------------------------------------------------------------------------
# the choice sets, their codes and the command lines
# ---------------------------------------------------------------------------------------
def test_choice_sets_and_codes():
    assert C.CHOICES == {"gemm_order": C.GEMM_ORDERS, "tail_path": C.TAIL_PATHS, "exchange": C.EXCHANGES,
                         "head_input": C.TAIL_HEAD_INPUTS}
    assert C.GEMM_ORDERS == TAIL_ORDERS
    for name, allowed in C.CHOICES.items():
        codes = C.OPTION_CODES[name]
        assert set(codes) == set(allowed) and len(set(codes.values())) == len(codes), name
    # the signature's bytes are the ones the positional codes gave (ranks of older builds agree)
    old = {"gemm_order": ("chain", "amx32", "dp32"), "tail_path": ("fused", "reference"),
           "exchange": ("mirror", "candidates"), "head_input": ("bf16", "bf16x2", "fp32")}
    assert C.OPTION_CODES == {n: {v: i for i, v in enumerate(t)} for n, t in old.items()}


def _sig(cfg):
    x, gamma, w = _problem(0, 4)
    return dict(zip(TAIL_SIGNATURE, tail_signature(x, gamma, w, None, cfg, hops=(2,), batch_groups=1, fence=False)))


def test_signature_codes_each_choice_by_name():
    for name, codes in C.OPTION_CODES.items():
        for v, code in codes.items():
            kw = {name: v} if name != "head_input" or v != "fp32" else None
            if kw is None:
                continue  # "fp32" needs a QuantWeight head (tests/test_tail_q8.py signs it)
            assert _sig(TailConfig(**kw))[name][0] == code, (name, v)
    positional = {o: i for i, o in enumerate(sorted(C.GEMM_ORDERS))}  # PLANTED: another tuple's positions
    assert any(positional[o] != _sig(TailConfig(gemm_order=o))["gemm_order"][0] for o in C.GEMM_ORDERS)


ONE_CHANGE = dict(eps=2e-5, hidden_actual=60, zero_interleaved_pad=False, k=7, deferred_rms=False, nan_fold=True,
                  gemm_order="chain", tail_path="reference", exchange="mirror", head_input="bf16x2")


def test_signature_signs_every_field_but_the_rank_local_ones():
    """Every TailConfig field is in the ranks' signature (a new one with no line in tail.py)
    but emit_logits and debug_taps (what a rank returns); a change in any signed field
    changes its int64, a hidden_actual of None signs as H."""
    local = {"emit_logits", "debug_taps"}  # outputs only: the one options ranks may differ on
    assert set(C.RANK_LOCAL) == local and set(C.SIGNED) == {f.name for f in fields(TailConfig)} - local
    assert set(C.SIGNED) <= set(TAIL_SIGNATURE) and not local & set(TAIL_SIGNATURE)
    base = _sig(TailConfig())
    for name in sorted(set(ONE_CHANGE)):
        kw = {name: ONE_CHANGE[name]} | ({"deferred_rms": True} if name == "head_input" else {})
        got = _sig(TailConfig(**kw))
        assert [n for n in TAIL_SIGNATURE if got[n][0] != base[n][0]] == [name], name
    assert set(ONE_CHANGE) | local == {f.name for f in fields(TailConfig)}  # a new field needs its row here
    for name in local:
        assert _sig(TailConfig(**{name: not getattr(TailConfig, name)})) == base, name
    assert _sig(TailConfig(hidden_actual=H)) == base


def _parser(module: str) -> argparse.ArgumentParser:
    import importlib

    ap = argparse.ArgumentParser()
    importlib.import_module(module).configure(ap)
    return ap


@pytest.mark.parametrize("module", ["lmtail.model.generate_cli", "lmtail.serve.cli"])
def test_command_lines_take_choices_and_defaults_from_config(module):
    acts = {a.dest: a for a in _parser(module)._actions}
    assert acts["exchange"].choices is C.EXCHANGES and acts["exchange"].default == TailConfig.exchange
    assert acts["head_input"].choices is C.TAIL_HEAD_INPUTS
    if "k" in acts:
        assert acts["k"].default == TailConfig.k


# ---------------------------------------------------------------------------------------
# TailOutput.lse: the log-normalizer the logprobs use, on both exchanges
# ---------------------------------------------------------------------------------------
def _problem(seed, gbs, v=V):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(gbs, H, generator=g) * 2
    x[gbs // 2] = 0.0  # a zero row: logits all 0 (the fused kernel leaves it to the reference sampler)
    gamma = torch.rand(H, generator=g) + 0.5
    w = (torch.randn(H, v, generator=g) * 0.3).to(torch.bfloat16)
    return x, gamma, w


def _params(seed, r):
    g = torch.Generator().manual_seed(seed + 7)
    sp = torch.stack([torch.randint(0, 12, (r,), generator=g).float(), 0.5 + 0.5 * torch.rand(r, generator=g),
                      torch.rand(r, generator=g) * 1.5, torch.rand(r, generator=g) * 0.999,
                      torch.rand(r, generator=g) * 0.1], 1)
    sp[::3, 2] = 0.0  # greedy rows mixed in
    return sp


def _old_serve_lse(out, exchange):
    """What the server computed before TailOutput.lse: the candidates' merged taps m1 +
    log64(S1), or row_mass over the bf16 mirror of the logits."""
    if exchange == "candidates":
        return out.taps["m1"] + log64(out.taps["S1"])
    row64 = out.logits.to(torch.bfloat16).double()
    m, s, _ = row_mass(row64, torch.ones(row64.shape[0], dtype=torch.float64))
    return m + log64(s)


def _token_value(out):
    """[R] float64: the value of each row's token among its candidates."""
    pos = (out.topk_indices == out.tokens[:, None]).int().argmax(dim=1)  # [R]
    return out.topk_values.double().gather(1, pos[:, None])[:, 0]


@pytest.mark.parametrize("exchange", C.EXCHANGES)
@pytest.mark.parametrize("seed,gbs,v", [(0, 7, V), (1, 1, 97), (2, 12, 1000), (3, 5, 4099)])
def test_lse_is_what_the_logprobs_use(exchange, seed, gbs, v):
    x, gamma, w = _problem(seed, gbs, v)
    sp = _params(seed, gbs)
    out = decode_tail(x, gamma, w, k=8, sampling_params=sp, exchange=exchange, debug_taps=True)
    assert out.lse.dtype == torch.float64 and out.lse.shape == (gbs,)
    assert same_bits(out.lse, _old_serve_lse(out, exchange))  # the bytes the server's logprobs had
    assert same_bits(out.logprobs, (_token_value(out) - out.lse).to(F32))
    if exchange == "mirror":  # the reference path: the same lse bits
        ref = decode_tail(x, gamma, w, k=8, sampling_params=sp, exchange=exchange, tail_path="reference")
        assert same_bits(ref.lse, out.lse)
    none = decode_tail(x, gamma, w, k=8, exchange=exchange)
    assert none.lse is None  # no sampling: no lse (as tokens and logprobs)


def test_planted_lse_from_the_mirror_on_the_candidates_path_is_caught():
    x, gamma, w = _problem(4, 9, 1000)
    sp = _params(4, 9)
    out = decode_tail(x, gamma, w, k=8, sampling_params=sp, exchange="candidates", debug_taps=True)
    wrong = _old_serve_lse(out, "mirror")  # PLANTED: the mirror's normalizer for fp32 decisions
    assert not same_bits(wrong, out.lse)
    assert not same_bits(out.logprobs, (_token_value(out) - wrong).to(F32))


def test_rows_tail_carries_lse():
    x, gamma, w = _problem(5, 6)
    sp = _params(5, 6)
    full = decode_tail(x, gamma, w, k=8, sampling_params=sp, exchange="mirror")
    mirror = decode_tail(x, gamma, w, k=8, exchange="mirror").logits.to(torch.bfloat16)  # [R, V]
    for path in C.TAIL_PATHS:
        rows = rows_tail(mirror, k=8, sampling_params=sp, path=path)
        assert same_bits(rows.lse, full.lse) and same_bits(rows.logprobs, full.logprobs), path
        assert torch.equal(bits(rows.tokens), bits(full.tokens)), path


def test_serve_body_choices_are_the_rows_bodies():
    """`lmtail serve --body` offers exactly the bodies serve.batch.step_rows runs (spelled in the
    CLI so --help imports no torch); a body outside them is refused by the engine by name."""
    from lmtail.serve import batch
    from lmtail.serve.cli import SERVE_BODIES

    acts = {a.dest: a for a in _parser("lmtail.serve.cli")._actions}
    assert acts["body"].choices == SERVE_BODIES and set(SERVE_BODIES) == set(batch.ROWS_BODIES)
    assert "fp32" not in SERVE_BODIES and "quant" not in SERVE_BODIES
    import types

    import torch

    from lmtail.model import llama
    with pytest.raises(ValueError, match=r"ops.body must be one of \('declared', 'q32', 'bq32'\).*got 'fp32'"):
        batch.step_rows(types.SimpleNamespace(config=None), torch.zeros(1, dtype=torch.int64), [], llama.FP32_OPS)
