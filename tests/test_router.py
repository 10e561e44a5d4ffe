"""router.py: the all-underflow guard, tie order, the float64 check seeing a misselection,
and errors (the router kind's gates and controls run in tests/test_contract.py).

Shape legend: K slices, T rows, E experts, k chosen.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import bits
from lmtail.contract import glue_kinds as gk
from lmtail.reference import glue as ref
from lmtail.glue.router import router_topk, router_topk_decl, selection_keys

CONTROLS = [c for c in gk.glue_controls() if c.kind == "glue.router_topk"]
DECL6 = router_topk_decl(6, n_slices=2)  # the declaration of router_topk(k=6) on two slices


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)  # the properties hold for any data; a seed keeps failures reproducible


# The router kind's gates and its controls run once, in tests/test_contract.py (glue.router_topk).


def test_all_underflow_rows_give_zero_weights():
    """Three rows whose logits are two slices of -50: ids 0..5, weights +0.0, never NaN;
    the unguarded control gives NaN on exactly these rows."""
    d = gk.underflow_case()
    ids, w = router_topk(d["slices"], k=6)
    assert ids.tolist() == [[0, 1, 2, 3, 4, 5]] * 3
    assert torch.equal(w.view(torch.int32), torch.zeros(3, 6, dtype=torch.int32))
    bad = next(c for c in CONTROLS if c.name == "glue.router_no_guard").run(d)
    assert torch.isnan(bad["weights"]).all()


def test_ties_go_to_the_lower_id():
    sl = torch.zeros(1, 3, 10)
    sl[0, 0] = torch.tensor([1.0, 2, 2, 1, 2, 0, 0, 2, 0, 0])  # four tied at the top
    sl[0, 1, ::3] = float("nan")  # NaN experts rank below every number
    sl[0, 2] = torch.tensor([0.0, -0.0] * 5)  # +-0 logits: one tie
    ids, w = router_topk(sl, k=4)
    assert ids[0].tolist() == [1, 2, 4, 7]
    assert ids[1].tolist() == [1, 2, 4, 5]
    assert ids[2].tolist() == [0, 1, 2, 3]
    assert torch.equal(w[2].view(torch.int32), torch.full((4,), 0.625).view(torch.int32))


def test_selection_keys_order():
    v = torch.tensor([[0.5, float("nan"), -0.0, 0.0, float("-inf"), 0.5, float("inf")]])
    order = torch.argsort(selection_keys(v), descending=True)[0].tolist()
    assert order == [6, 0, 5, 2, 3, 4, 1]


def test_bias_selects_but_does_not_weigh():
    sl = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])
    ids, w = router_topk(sl, k=2, bias=torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert ids.tolist() == [[3, 0]]
    s = 1 / (1 + np.exp(-np.array([-1.0, 2.0])))
    assert np.allclose(w.numpy(), s / s.sum() * 2.5, rtol=1e-6)  # from s, not s + bias


def test_weights_sum_to_scale_within_the_declared_range():
    d = gk._router_random(np.random.default_rng(5), 200)
    ids, w = router_topk(d["slices"], k=6)
    tot = w.double().sum(1).numpy()
    assert np.abs(tot - 2.5).max() < 2.5 * 16 * 2.0**-24  # six roundings each + the sum's


def test_batch_invariance_and_k_edges():
    d = gk._router_random(np.random.default_rng(6), 50)
    ids, w = router_topk(d["slices"], k=6)
    for i in (0, 17, 49):
        si, sw = router_topk(d["slices"][:, i : i + 1], k=6)
        assert torch.equal(si, ids[i : i + 1]) and torch.equal(sw.view(torch.int32), w[i : i + 1].view(torch.int32))
    for k in (1, 128):
        ik, wk = router_topk(d["slices"], k=k)
        assert ik.shape == (50, k) and ik.dtype == torch.int64 and wk.dtype == torch.float32
        ok, _, det = ref.router_check(d["slices"].numpy(), None, k, 2.5, ik.numpy(), wk.numpy().astype(np.float64),
                                      decl=router_topk_decl(k, n_slices=2))
        assert ok, det


def test_empty_rows_and_thread_count():
    ids, w = router_topk(torch.zeros(2, 0, 8), k=3)
    assert ids.shape == (0, 3) and w.shape == (0, 3)
    d = gk._router_random(np.random.default_rng(8), 300)
    n0 = torch.get_num_threads()
    outs = []
    for n in (1, 2):
        torch.set_num_threads(n)
        outs.append(router_topk(d["slices"], k=6))
    torch.set_num_threads(n0)
    assert torch.equal(outs[0].ids, outs[1].ids) and torch.equal(bits(outs[0].weights), bits(outs[1].weights))


def test_check_sees_a_misselection():
    """Planted: swapping a chosen expert for the best unchosen one is caught."""
    d = gk._router_random(np.random.default_rng(7), 20)
    ids, w = router_topk(d["slices"], k=6)
    bad = ids.clone()
    bad[3, 5] = int(torch.topk(selection_keys(torch.sigmoid(d["slices"].sum(0))), 7).indices[3, 6])
    ok, _, det = ref.router_check(d["slices"].numpy(), None, 6, 2.5, bad.numpy(), w.numpy().astype(np.float64),
                                  decl=DECL6)
    assert not ok and "1 rows with a certain misselection" in det


S = torch.zeros(2, 3, 8)


@pytest.mark.parametrize("call,match", [
    (lambda: router_topk(S.double(), k=2), "logit_slices must be fp32"),
    (lambda: router_topk(S[0], k=2), r"logit_slices must be \[K, T, E\]"),
    (lambda: router_topk(S, k=0), r"k must be an int in \[1, E=8\]; got 0"),
    (lambda: router_topk(S, k=9), r"k must be an int in \[1, E=8\]; got 9"),
    (lambda: router_topk(S, k=2, scale=float("inf")), "scale must be a finite number > 0"),
    (lambda: router_topk(S, k=2, bias=torch.zeros(7)), r"bias must be fp32 \[E=8\]"),
    (lambda: router_topk(S, k=2, bias=torch.full((8,), float("nan"))), "bias must be finite"),
])
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
