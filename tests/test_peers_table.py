"""The pure-Python parts of benchmarks/peers/table.py (the peer table's driver): ratio math,
A-B-B-A order, flag reduction, alone-vs-batch divergence, table formatting, the JSON-lines
worker protocol. No peer, model or venv needed."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))

import table  # noqa: E402


def test_paired_ratio_is_median_of_per_round_ratios():
    # rounds: 2/1, 3/1, 8/2 -> ratios 2, 3, 4 -> median 3 (the ratio of medians would be 3/1 = 3 too,
    # so a second case where they differ)
    assert table.paired_ratio([2.0, 3.0, 8.0], [1.0, 1.0, 2.0]) == 3.0
    # per-round ratios 1, 1, 10 -> 1; ratio of medians 2/1 = 2: the pairing is what is reported
    assert table.paired_ratio([1.0, 2.0, 10.0], [1.0, 2.0, 1.0]) == 1.0


def test_paired_ratio_planted_unpaired_variant_differs():
    arm, base = [1.0, 2.0, 10.0], [1.0, 2.0, 1.0]
    unpaired = sorted(arm)[1] / sorted(base)[1]  # the wrong variant: ratio of medians
    assert table.paired_ratio(arm, base) != unpaired


def test_paired_ratio_rejects_bad_input():
    with pytest.raises(ValueError, match="equal-length non-empty"):
        table.paired_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="equal-length non-empty"):
        table.paired_ratio([], [])
    with pytest.raises(ValueError, match="must be > 0"):
        table.paired_ratio([1.0], [0.0])


def test_abba_order_alternates():
    assert table.abba_order(["a", "b", "c"], 3) == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert table.abba_order(["a"], 2) == ["a", "a"]


def test_reduce_flags_keeps_simd_flags_only():
    line = "flags\t\t: fpu vme sse2 avx avx2 fma f16c avx512f avx512_bf16 amx_tile amx_bf16 sha_ni"
    assert table.reduce_flags(line) == "amx_bf16 amx_tile avx2 avx512_bf16 avx512f f16c fma"
    assert table.reduce_flags("flags : fpu sse2 avx") == "(none of avx2/avx512/amx)"


def test_first_divergence():
    assert table.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert table.first_divergence([1, 2, 3], [1, 5, 3]) == 2
    assert table.first_divergence([1, 2, 3], [9, 2, 3]) == 1
    assert table.first_divergence([1, 2, 3], [1, 2]) == 3  # a shorter row moved at its end


def test_divergence_cell():
    assert table.divergence_cell([[1, 2], [3, 4]], [[1, 2], [3, 4]]) == "identical: 2/2 requests x 2 tokens"
    assert table.divergence_cell([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == "1/2 identical; first move: req 1 @ step 2"
    assert table.divergence_cell([[1]], None, "no batch API") == "- (no batch API)"


def test_markdown_table_shape_checked():
    out = table.markdown_table(["row", "a"], [["x", "1"]])
    assert out.splitlines() == ["| row | a |", "|---|---:|", "| x | 1 |"]
    with pytest.raises(ValueError, match="every row must have 2 cells"):
        table.markdown_table(["row", "a"], [["x"]])


def test_timed_cells_rates_and_ratios():
    t = table.Timed(times={"lm": [1.0, 2.0, 1.0], "peer": [2.0, 2.0, 3.0]})
    vals, ratios = table.timed_cells(t, ["lm", "peer"], ["lm", "peer", "other"], work=10.0)
    assert vals == ["10.0", "5.0", "-"]  # 10 / median s
    assert ratios == ["2.00x", "-"]  # median(2, 1, 3)
    failed = table.Timed(failed="check failed: x")
    assert table.timed_cells(failed, ["lm"], ["lm", "peer"], 1.0) == (["-", "-"], ["-"])


def test_worker_protocol_roundtrip(tmp_path):
    """A toy worker on worker_proto.serve: answers, reports errors, and its prints never reach the channel."""
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(PEERS)!r})
        from worker_proto import protocol_channel, serve
        chan = protocol_channel()
        print("engine log line that must not reach the protocol")
        def add(a, b):
            return {{"s": a + b}}
        def boom():
            raise ValueError("planted")
        serve({{"add": add, "boom": boom}}, chan)
    """))
    reqs = [{"op": "add", "a": 1, "b": 2}, {"op": "boom"}, {"op": "nope"}, {"op": "quit"}]
    p = subprocess.run([sys.executable, str(script)], input="".join(json.dumps(r) + "\n" for r in reqs),
                       capture_output=True, text=True, timeout=60)
    outs = [json.loads(x) for x in p.stdout.splitlines()]
    assert outs[0] == {"ok": True, "s": 3}
    assert outs[1]["ok"] is False and "planted" in outs[1]["error"]
    assert outs[2]["ok"] is False and "op must be one of" in outs[2]["error"]
    assert "engine log line" in p.stderr


def _toy_worker(tmp_path, body: str) -> table.Worker:
    script = tmp_path / "toy.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(PEERS)!r})\n" + textwrap.dedent(body))
    w = table.Worker("toy", [sys.executable, str(script)], tmp_path / "toy.log", start_timeout_s=60)
    w.start()
    return w


def test_worker_skip_line_becomes_skip_reason(tmp_path):
    w = _toy_worker(tmp_path, """
        from worker_proto import protocol_channel, say
        say(protocol_channel(), "SKIP: planted: engine missing")
    """)
    assert not w.ready()
    assert w.skip == "SKIP: planted: engine missing"


def test_worker_ready_and_call(tmp_path):
    w = _toy_worker(tmp_path, """
        from worker_proto import protocol_channel, serve
        chan = protocol_channel()
        serve({"info": lambda: {"engine": "toy"}, "decode": lambda n: {"s": 0.5 * n}}, chan)
    """)
    try:
        assert w.ready() and w.info == {"engine": "toy"}
        assert w.call("decode", n=4) == {"s": 2.0}
        with pytest.raises(table.WorkerError, match="op must be one of"):
            w.call("prefill")
    finally:
        w.close()
    assert w.proc.returncode == 0


def test_worker_protocol_breach_is_reported(tmp_path):
    w = _toy_worker(tmp_path, """
        import sys
        sys.stdin.readline()
        print("a log line on the protocol channel", flush=True)
    """)
    assert not w.ready()
    assert "broke the protocol" in w.skip
