"""lmtail.bench: the A-B-B-A protocol (order, gating check, ratios, wins) and the bitwise /
tolerance comparisons the benchmarks gate on. Planted variants (a slower arm, a disagreeing
arm, a flipped bit) show each check can fail. lmtail.benchmarks: the scripts ship in the
package (found without the checkout) and --markdown stamps where the figures came from."""
from __future__ import annotations

import dataclasses
import datetime
import importlib.resources
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmtail.bench import (ABBAResult, abba, assert_bitwise, assert_within, check_bitwise,
                          format_table)
from lmtail.benchmarks import cpu_info, default_bench_dir, find_benchmarks, machine_stamp


def _sleeper(seconds: float, log: list | None = None, name: str = "", value=0):
    def arm():
        if log is not None:
            log.append(name)
        time.sleep(seconds)
        return value
    return arm


def test_planted_slower_arm_is_measured_slower_and_loses():
    res = abba({"fast": _sleeper(0.002), "slow": _sleeper(0.012)}, base="fast", rounds=6,
               check=check_bitwise)
    assert res.ratio["slow"] > 2.0, res
    assert res.wins["slow"] <= 1, res
    assert res.ratio["fast"] == 1.0 and res.wins["fast"] == 0
    assert res.median_s["slow"] > res.median_s["fast"]
    # seen from the other side: the faster arm, measured against the slow base, wins
    res2 = abba({"slow": _sleeper(0.012), "fast": _sleeper(0.002)}, base="slow", rounds=6,
                check=check_bitwise)
    assert res2.ratio["fast"] < 0.5 and res2.wins["fast"] >= 5


def test_alternation_order_is_abba_after_one_checked_call_each():
    log: list[str] = []
    arms = {n: _sleeper(0.0, log, n) for n in ("A", "B", "C")}
    res = abba(arms, base="A", rounds=4, check=check_bitwise)
    assert log[:3] == ["A", "B", "C"]                        # warmup + check
    assert log[3:] == list("ABC" "CBA" "ABC" "CBA")          # timed rounds, alternating
    assert res.names == ("A", "B", "C") and res.rounds == 4
    assert all(len(res.times[n]) == 4 for n in res.names)


def test_warmup_and_number_count_calls():
    log: list[str] = []
    abba({"A": _sleeper(0.0, log, "A"), "B": _sleeper(0.0, log, "B")}, base="A", rounds=2,
         warmup=3, number=2, check=check_bitwise)
    assert log.count("A") == 3 + 2 * 2 and log.count("B") == 3 + 2 * 2


def test_disagreeing_arm_raises_before_any_timing():
    log: list[str] = []
    arms = {"A": _sleeper(0.0, log, "A", torch.tensor([1.0, 2.0])),
            "B": _sleeper(0.0, log, "B", torch.tensor([1.0, 2.0000002]))}
    with pytest.raises(AssertionError, match="1 of 2 elements differ") as ei:
        abba(arms, base="A", rounds=3, check=check_bitwise)
    assert any("nothing was timed" in n for n in ei.value.__notes__)
    assert log == ["A", "B"]                                   # only the checked call


def test_check_receives_name_out_and_base_out():
    seen = []
    abba({"A": lambda: 1, "B": lambda: 2, "C": lambda: 3}, base="B", rounds=1,
         check=lambda name, out, base_out: seen.append((name, out, base_out)))
    assert seen == [("A", 1, 2), ("C", 3, 2)]


def test_skip_check_needs_a_reason_and_none_is_refused():
    arms = {"A": lambda: 0, "B": lambda: 1}
    with pytest.raises(ValueError, match="check: expected .* got None"):
        abba(arms, base="A")
    with pytest.raises(ValueError, match="non-empty reason"):
        abba(arms, base="A", check="skip:")
    with pytest.raises(ValueError, match="skip:<reason>"):
        abba(arms, base="A", check="bitwise")
    res = abba(arms, base="A", rounds=1, check="skip:outputs are random")
    assert isinstance(res, ABBAResult)


@pytest.mark.parametrize("kwargs, match", [
    (dict(base="Z"), "base: expected one of"),
    (dict(base="A", rounds=0), "rounds: expected an int >= 1"),
    (dict(base="A", warmup=0), "warmup: expected an int >= 1"),
    (dict(base="A", number=0), "number: expected an int >= 1"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
    called = []
    with pytest.raises(ValueError, match=match):
        abba({"A": lambda: called.append(1)}, check=check_bitwise, **kwargs)
    assert called == []


def test_bad_arms_raise_value_error():
    with pytest.raises(ValueError, match="arms: expected a non-empty mapping"):
        abba({}, base="A", check=check_bitwise)
    with pytest.raises(ValueError, match="non-callable arm"):
        abba({"A": 3}, base="A", check=check_bitwise)


def test_result_is_frozen_and_format_table_lists_every_arm():
    res = abba({"A": lambda: 0, "B": lambda: 0}, base="A", rounds=3, check=check_bitwise)
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.rounds = 9
    table = format_table({"case 1": res, "case 2": res}, title="T")
    lines = table.splitlines()
    assert lines[0] == "### T"
    assert lines[2].startswith("| case | arm | median | ratio vs base | rounds won |")
    assert sum(l.startswith("| case 1 |") for l in lines) == 2
    assert "| case 2 | B |" in table and f"{res.wins['B']}/3 |" in table and "1 (base)" in table


# ---------------------------------------------------------------- assert_bitwise

@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_assert_bitwise_catches_one_flipped_bit(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(7, 13, generator=g).to(dtype)
    assert_bitwise(a, a.clone())
    b = a.clone()
    ints = b.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[b.element_size()])
    i = int(torch.randint(0, a.numel(), (1,), generator=g))
    ints.view(-1)[i] ^= 1                                   # planted: lowest mantissa bit
    with pytest.raises(AssertionError, match="1 of 91 elements differ"):
        assert_bitwise(a, b)


def test_assert_bitwise_sees_signed_zero_nan_payload_and_non_contiguous():
    z = torch.tensor([0.0, 1.0])
    with pytest.raises(AssertionError):
        assert_bitwise(z, torch.tensor([-0.0, 1.0]))
    nan1 = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    nan2 = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert_bitwise(nan1, nan1.clone())                      # NaN equals itself bitwise
    with pytest.raises(AssertionError):
        assert_bitwise(nan1, nan2)
    with pytest.raises(AssertionError):
        assert_bitwise(torch.tensor([float("inf")]), torch.tensor([float("-inf")]))
    m = torch.randn(5, 6)
    assert_bitwise(m.t(), m.t().contiguous())
    assert_bitwise(torch.empty(0, 3), torch.empty(0, 3))


def test_assert_bitwise_dtype_shape_and_type_mismatches():
    with pytest.raises(AssertionError, match="torch.float32.*torch.float64"):
        assert_bitwise(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(AssertionError, match=r"\[2\].*\[1, 2\]"):
        assert_bitwise(torch.zeros(2), torch.zeros(1, 2))
    with pytest.raises(AssertionError, match="tensor vs int"):
        assert_bitwise(torch.zeros(1), 0)
    with pytest.raises(AssertionError):
        assert_bitwise(torch.tensor([True, False]), torch.tensor([True, True]))
    with pytest.raises(AssertionError):
        assert_bitwise(torch.tensor([1, 2]), torch.tensor([1, 3]))


@dataclasses.dataclass(frozen=True)
class _Out:
    tokens: torch.Tensor
    logits: torch.Tensor | None
    extra: dict


def test_assert_bitwise_walks_tuples_dicts_dataclasses_and_names_the_path():
    t = torch.arange(6, dtype=torch.int64)
    lg = torch.randn(2, 3)
    a = (_Out(t, lg, {"lse": lg.sum(1)}), [1, 2.5])
    b = (_Out(t.clone(), lg.clone(), {"lse": lg.sum(1)}), [1, 2.5])
    assert_bitwise(a, b)
    bad = lg.clone()
    bad[1, 2] = torch.nextafter(bad[1, 2], torch.tensor(float("inf")))
    with pytest.raises(AssertionError, match=r"value\[0\]\.logits: 1 of 6 elements differ; first at index \(1, 2\)"):
        assert_bitwise(a, (_Out(t, bad, {"lse": lg.sum(1)}), [1, 2.5]))
    with pytest.raises(AssertionError, match=r"\[0\]\.extra\['lse'\]"):
        assert_bitwise(a, (_Out(t, lg, {"lse": lg.sum(1) + 1}), [1, 2.5]))
    with pytest.raises(AssertionError, match=r"value\[1\]\[1\]"):
        assert_bitwise(a, (b[0], [1, -2.5]))
    with pytest.raises(AssertionError, match="keys"):
        assert_bitwise({"a": t}, {"b": t})
    with pytest.raises(AssertionError, match="length"):
        assert_bitwise((t,), (t, t))
    with pytest.raises(AssertionError):
        assert_bitwise(0.0, -0.0)
    with pytest.raises(AssertionError):
        assert_bitwise(_Out(t, None, {}), _Out(t, lg, {}))


# ---------------------------------------------------------------- assert_within

def test_assert_within_uses_the_stated_tolerance():
    ref = torch.tensor([1.0, -2.0, 100.0], dtype=torch.float64)
    got = (ref * (1 + 1e-6)).float()
    assert_within(got, ref, atol=0.0, rtol=2e-6)
    with pytest.raises(AssertionError, match="exceeds atol=0 \\+ rtol=1e-07"):
        assert_within(got, ref, atol=0.0, rtol=1e-7)           # planted: tolerance too tight
    assert_within(got, ref, atol=1e-3, rtol=0.0)


def test_assert_within_special_values():
    ref = torch.tensor([float("nan"), float("inf"), 1.0], dtype=torch.float64)
    assert_within(ref.float(), ref, atol=0.0, rtol=0.0)
    with pytest.raises(AssertionError, match="NaN positions"):
        assert_within(torch.tensor([0.0, float("inf"), 1.0]), ref, atol=1.0, rtol=1.0)
    with pytest.raises(AssertionError, match="infinities"):
        assert_within(torch.tensor([float("nan"), float("-inf"), 1.0]), ref, atol=1.0, rtol=1.0)
    with pytest.raises(AssertionError, match="infinities"):
        assert_within(torch.tensor([float("nan"), float("inf"), float("inf")]), ref, atol=1.0, rtol=1.0)
    with pytest.raises(AssertionError, match="shape"):
        assert_within(torch.zeros(2), torch.zeros(3), atol=1.0, rtol=1.0)
    with pytest.raises(TypeError, match="expected tensors"):
        assert_within([1.0], torch.zeros(1), atol=1.0, rtol=1.0)


def test_timer_measures_what_it_is_given():
    calls = []

    def fake_timer(fn):
        fn()
        calls.append(1)
        return 2.0 if len(calls) % 2 else 1.0      # rounds alternate A B, B A: A gets 2, 1, ...

    res = abba({"A": lambda: 0, "B": lambda: 0}, base="A", rounds=2, number=4, timer=fake_timer,
               check=check_bitwise)
    assert res.times == {"A": [0.5, 0.25], "B": [0.25, 0.5]} and res.wins["B"] == 1


def test_assert_within_per_element_tolerance():
    ref = torch.tensor([1.0, 1000.0], dtype=torch.float64)
    got = ref + torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert_within(got, ref, atol=torch.tensor([0.6, 0.6]), rtol=0.0)
    with pytest.raises(AssertionError, match=r"atol=\(per element\)"):
        assert_within(got, ref, atol=torch.tensor([0.4, 1.0]), rtol=0.0)


# ---------------------------------------------------------------- `lmtail bench`: shipped scripts, stamped figures

REPO = Path(__file__).resolve().parents[1]


def test_every_benchmark_ships_in_the_package():
    """lmtail.benchmarks is the one home of the benchmarks (what a wheel installs, found through
    importlib.resources): the checkout's benchmarks/ holds only peers/ (a bench_*.py written
    there would be missing from `lmtail bench` and the wheel), and `lmtail bench` finds every
    shipped script."""
    shipped = {p.name for p in importlib.resources.files("lmtail.benchmarks").iterdir()
               if p.name.startswith("bench_") and p.name.endswith(".py")}
    assert sorted(p.name for p in (REPO / "benchmarks").iterdir() if not p.name.startswith(".")) == ["peers"]
    assert shipped and set(find_benchmarks(default_bench_dir())) == {n[len("bench_"):-len(".py")] for n in shipped}


def test_bench_lists_every_benchmark_without_the_checkout(tmp_path):
    """A copy of the package alone (no checkout around it, as in site-packages): `lmtail bench
    --list` finds every shipped benchmark inside that copy."""
    site = tmp_path / "site"
    shutil.copytree(REPO / "src" / "lmtail", site / "lmtail",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-m", "lmtail.cli", "bench", "--list"], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    listed = dict(line.split(None, 1) for line in r.stdout.splitlines())
    assert set(listed) == set(find_benchmarks(default_bench_dir())) and len(listed) >= 7
    assert all(Path(p).parent == site / "lmtail" / "benchmarks" for p in listed.values()), listed


CPUINFO = """processor\t: 0
model name\t: Planted CPU 9000
flags\t\t: fpu sse2 avx2 fma avx512f amx_tile
"""


def test_cpu_info_and_stamp_name_flags_present_and_absent():
    model, flags = cpu_info(CPUINFO)
    assert model == "Planted CPU 9000"
    assert flags == {"avx2": True, "fma": True, "avx512f": True, "avx512_bf16": False, "amx_tile": True,
                     "amx_bf16": False}
    when = datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc)
    stamp = machine_stamp(threads=3, torch_version="9.9", when=when, cpuinfo=CPUINFO)
    assert ("Measured on Planted CPU 9000; ISA flags: avx2 fma avx512f amx_tile (absent: avx512_bf16 amx_bf16); "
            "3 torch threads") in stamp
    assert "torch 9.9; 2026-12-01 (UTC)" in stamp and "run `make bench` for your machine's" in stamp
    planted = machine_stamp(threads=3, torch_version="9.9", when=when, cpuinfo=CPUINFO.replace(" avx512f", ""))
    assert "(absent: avx512f avx512_bf16 amx_bf16)" in planted  # a CPU without AVX-512 says so


def test_markdown_stamps_each_benchmark(tmp_path, capfd):
    """`lmtail bench --markdown` on a tiny benchmark: a heading, this machine's stamp, then the
    script's own table."""
    from lmtail import cli

    (tmp_path / "bench_tiny.py").write_text("print('| arm | ratio |\\n|---|---|\\n| a | 1.00 |')\n")
    assert cli.main(["bench", "--dir", str(tmp_path), "--markdown"]) == 0
    out = capfd.readouterr().out
    model, _ = cpu_info()
    stamp = f"_Measured on {model}; ISA flags: "
    assert out.startswith("### tiny\n\n" + stamp), out
    assert f"{torch.get_num_threads()} torch threads" in out and f"torch {torch.__version__};" in out
    assert f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d} (UTC)" in out
    assert "run `make bench` for your machine's" in out and out.rstrip().endswith("| a | 1.00 |")
    assert cli.main(["bench", "--dir", str(tmp_path)]) == 0
    assert stamp not in capfd.readouterr().out  # only with --markdown


def quick_flags_missing(name: str, script_text: str) -> list[str]:
    """The flags `lmtail bench --quick` passes this script that its source never declares."""
    from lmtail.benchmarks import QUICK_ARGS

    flags = [a for a in QUICK_ARGS.get(name, ("--quick",)) if a.startswith("--")]
    return [f for f in flags if f'"{f}"' not in script_text]


def test_quick_args_name_flags_each_script_has():
    """`lmtail bench --quick` passes every shipped script flags it declares. Planted: a script
    without --quick is caught."""
    found = find_benchmarks(default_bench_dir())
    assert {n: quick_flags_missing(n, p.read_text()) for n, p in found.items()} == {n: [] for n in found}
    assert quick_flags_missing("planted", "ap.add_argument('--rounds')") == ["--quick"]


def test_a_shipped_script_runs_as_a_module():
    """`python -m lmtail.benchmarks.bench_tail --help` runs the shipped script (its own options
    and description)."""
    r = subprocess.run([sys.executable, "-m", "lmtail.benchmarks.bench_tail", "--help"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "--rounds" in r.stdout and "--quick" in r.stdout


@pytest.mark.parametrize("exchange", ["candidates", "mirror"])
def test_tail_stages_are_decode_tail_call_for_call(exchange):
    """bench_tail --stages times decode_tail's own stages: the staged call's outputs equal
    decode_tail's bit for bit (every field), one time per stage of STAGES[exchange];
    planted: another gemm_order in the staged call must differ in the logits."""
    from lmtail.benchmarks import bench_tail as bt
    from lmtail.tail.config import TailConfig
    from lmtail.tail.sampler import SamplingParams, sampling_tensor
    from lmtail.tail.compose import decode_tail
    g = torch.Generator().manual_seed(3)
    x, gamma = torch.randn(3, 96, generator=g), 1 + 0.1 * torch.randn(96, generator=g)
    w = (0.05 * torch.randn(96, 300, generator=g)).to(torch.bfloat16)
    sp = sampling_tensor([SamplingParams(top_k=5, temperature=0.8, seed=i) for i in range(3)], positions=[1, 2, 3])
    cfg = TailConfig(k=8, exchange=exchange)
    times, out = bt.tail_stages(x, gamma, w, sp, cfg)
    assert len(times) == len(bt.STAGES[exchange]) and all(t >= 0 for t in times)
    want = decode_tail(x, gamma, w, sampling_params=sp, config=cfg)
    for f in ("topk_values", "topk_indices", "tokens", "logprobs", "truncated", "logits"):
        assert_bitwise(getattr(out, f), getattr(want, f), what=f)
    _, other = bt.tail_stages(x, gamma, w, sp, TailConfig(k=8, exchange=exchange, gemm_order="chain"))
    with pytest.raises(AssertionError):
        assert_bitwise(other.logits, want.logits)


PEER_ONLY = {"vllm", "llama_cpp", "transformers", "accelerate"}  # installed only in the peers' venvs


def peer_import_problems(root: Path) -> list[str]:
    """Imports in the peer scripts under `root` that name nothing: an lmtail module (or one of
    its attributes) that does not exist, or a top-level module that is neither the stdlib, this
    venv's, a peer-only package nor a script beside them (benchmarks/peers/*.py)."""
    import ast
    import importlib.util
    local = {p.stem for p in root.rglob("*.py")}
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [(node.module, a.name) for a in node.names]
            else:
                continue
            for mod, attr in names:
                top = mod.split(".")[0]
                if top in PEER_ONLY or top in local or top == "__future__":
                    continue
                try:
                    found = importlib.util.find_spec(mod) is not None
                    if found and attr and top == "lmtail":
                        m = importlib.import_module(mod)
                        found = hasattr(m, attr) or importlib.util.find_spec(f"{mod}.{attr}") is not None
                except ImportError:
                    found = False
                if not found:
                    bad.append(f"{path.relative_to(root)}:{node.lineno}: {mod}" + (f".{attr}" if attr else ""))
    return bad


def test_peer_scripts_import_what_exists(tmp_path):
    """`make bench-peers` runs scripts no default test imports (they need the peers' venvs): every
    import they make names an existing module; planted: the pre-relayout import of the root
    benchmarks/ row maker goes red."""
    assert peer_import_problems(REPO / "benchmarks" / "peers") == []
    planted = tmp_path / "peers"
    shutil.copytree(REPO / "benchmarks" / "peers", planted, ignore=shutil.ignore_patterns(".venv*", "__pycache__"))
    f = planted / "vllm" / "bench.py"
    f.write_text(f.read_text().replace("from lmtail.benchmarks import bench_rows_tail as brt",
                                       "import bench_rows_tail as brt"))
    assert any("bench_rows_tail" in p for p in peer_import_problems(planted))


def test_peer_table_measures_bq32_where_amx_is(monkeypatch):
    """The peer table's default bodies: generate()'s default alone on a CPU without AMX, then
    bq32 beside it where gemm_bq has its hardware amx path (the body made for the tiles).
    Planted: a CPU whose gemm_bq lists only emu-amx (the tile model, not hardware) adds
    nothing."""
    import lmtail.kernels.quant.gemm_bq as kbq
    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "peers"))
    import lmtail_arm

    monkeypatch.setattr(kbq, "available_backends", lambda: ("avx512", "avx2", "c"))
    assert lmtail_arm.table_bodies() == [lmtail_arm.default_body()] == ["q32"]
    monkeypatch.setattr(kbq, "available_backends", lambda: ("amx", "avx512", "avx2", "c"))
    assert lmtail_arm.table_bodies() == ["q32", "bq32"]
    monkeypatch.setattr(kbq, "available_backends", lambda: ("avx512", "c", "emu-amx"))
    assert lmtail_arm.table_bodies() == ["q32"]
