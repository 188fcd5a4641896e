"""bench/harness.py: the interleaving and statistics every microbenchmark uses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402


def test_interleave_rotates_order_and_drops_warmup():
    calls: list[str] = []
    cases = {n: (lambda n=n: calls.append(n) or float(len(calls))) for n in "abc"}
    out = harness.interleave(cases, rounds=3, warmup=1)
    assert calls == list("abc" "bca" "cab" "abc")  # round r starts at case r % 3
    assert {k: len(v) for k, v in out.items()} == {"a": 3, "b": 3, "c": 3}
    assert out["a"] == [6.0, 8.0, 10.0]  # the warm-up round's samples (1, 2, 3) are dropped


def test_stat_and_per_round_ratios():
    s = harness.stat([3.0, 1.0, 2.0])
    assert (s.median, s.min, s.max, s.n) == (2.0, 1.0, 3.0, 3)
    assert s.spread == pytest.approx(1.0)
    r = harness.ratios([2.0, 4.0, 9.0], [1.0, 2.0, 3.0])  # per round: 2, 2, 3
    assert (r.median, r.min, r.max) == (2.0, 2.0, 3.0)
    with pytest.raises(ValueError):
        harness.stat([])


def test_agree_flags_ratios_more_than_10_percent_apart(tmp_path):
    a = {"x": {"ratio": {"put": {"median": 1.0}, "get": {"median": 0.8}}, "gbps": {"median": 5.0}}}
    b = {"x": {"ratio": {"put": {"median": 1.05}, "get": {"median": 0.6}}, "gbps": {"median": 1.0}}}
    rows = {p: d for p, _, _, d in harness.agree(a, b)}
    assert set(rows) == {"/x/ratio/put", "/x/ratio/get"}  # only ratios are compared
    assert rows["/x/ratio/put"] < 0.1 < rows["/x/ratio/get"]
    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    fa.write_text(json.dumps(a))
    fb.write_text(json.dumps(b))
    cmd = [sys.executable, str(ROOT / "bench" / "harness.py"), "agree", str(fa), str(fb)]
    assert subprocess.run(cmd, capture_output=True).returncode == 1
    fb.write_text(json.dumps(a))
    assert subprocess.run(cmd, capture_output=True).returncode == 0
