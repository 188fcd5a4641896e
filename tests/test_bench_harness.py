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


def test_interleave_drops_warmup_and_runs_the_williams_orders():
    calls: list[str] = []
    cases = {n: (lambda n=n: calls.append(n) or float(len(calls))) for n in "abc"}
    out = harness.interleave(cases, rounds=6, warmup=1)
    # the warm-up round in the order given, then round_orders(3)'s six orders
    assert calls == list("abc" "abc" "bca" "cab" "cba" "acb" "bac")
    assert {k: len(v) for k, v in out.items()} == {"a": 6, "b": 6, "c": 6}
    assert out["a"][:3] == [4.0, 9.0, 11.0]  # the warm-up round's samples (1, 2, 3) are dropped


@pytest.mark.parametrize("n", range(1, 10))
def test_round_orders_balance_positions_and_predecessors(n):
    from collections import Counter
    from itertools import pairwise

    orders = harness.round_orders(n)
    assert len(orders) == (n if n % 2 == 0 or n == 1 else 2 * n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert orders[0][:2] == list(range(min(n, 2)))
    positions = Counter((x, i) for o in orders for i, x in enumerate(o))
    assert len(positions) == n * n and len(set(positions.values())) == 1  # every case in every place alike
    follows = Counter(pair for o in orders for pair in pairwise(o))
    # every case directly after every other alike: none always inherits one case's caches
    assert len(follows) == n * (n - 1) and len(set(follows.values())) <= 1


def test_interleave_no_case_always_follows_the_same_one():
    calls: list[str] = []
    cases = {n: (lambda n=n: calls.append(n) or 1.0) for n in "abcd"}
    harness.interleave(cases, rounds=4, warmup=0)
    before = {c: {calls[i - 1] for i in range(1, len(calls)) if calls[i] == c and i % 4} for c in "abcd"}
    assert all(len(v) == 3 for v in before.values()), before  # a rotation gave each case one predecessor


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
    rows = {p: d for p, _, _, d, _ in harness.agree(a, b)}
    assert set(rows) == {"/x/ratio/put", "/x/ratio/get"}  # only ratios are compared
    assert rows["/x/ratio/put"] < 0.1 < rows["/x/ratio/get"]
    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    fa.write_text(json.dumps(a))
    fb.write_text(json.dumps(b))
    cmd = [sys.executable, str(ROOT / "bench" / "harness.py"), "agree", str(fa), str(fb)]
    assert subprocess.run(cmd, capture_output=True).returncode == 1
    fb.write_text(json.dumps(a))
    assert subprocess.run(cmd, capture_output=True).returncode == 0


def test_agree_names_the_side_of_a_ratio_that_moved(tmp_path):
    # The pool held at 20 GB/s, its memcpy baseline went from 13 to 17: the ratio is 23%
    # apart because of the baseline, and agree says so; the host's state is no figure.
    def run(memcpy: float, load: float) -> dict:
        return {"x": {"gbps": {"pool": {"median": 20.0}, "memcpy": {"median": memcpy}},
                      "ratio": {"pool / memcpy": {"median": 20.0 / memcpy}}},
                "env_before": {"loadavg": {"median": load}}}

    figs = {p: d for p, _, _, d in harness.moved(run(13.0, 0.5), run(17.0, 2.0))}
    assert set(figs) == {"/x/gbps/pool", "/x/gbps/memcpy"}  # no ratio, no env_*
    assert figs["/x/gbps/pool"] == 0 and figs["/x/gbps/memcpy"] == pytest.approx(4 / 17)
    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    cmd = [sys.executable, str(ROOT / "bench" / "harness.py"), "agree", str(fa), str(fb)]
    fa.write_text(json.dumps(run(13.0, 0.5)))
    fb.write_text(json.dumps(run(17.0, 0.5)))
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 1  # a moved baseline still fails the pair: only explained
    moved_lines = [ln for ln in out.stdout.splitlines() if ln.startswith("MOVED")]
    assert len(moved_lines) == 1 and moved_lines[0].endswith("/x/gbps/memcpy")
    assert "2 absolute figures (rates, times), 1 moved by more than 10%" in out.stdout
    fb.write_text(json.dumps(run(13.5, 0.5)))  # within 10%: nothing to explain
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0 and "MOVED" not in out.stdout


def test_interleave_probes_the_host_level_around_each_round(monkeypatch):
    probes = iter([10.0, 12.0, 30.0, 11.0, 31.0, 29.0])  # warm-up round unprobed after; then before/after
    monkeypatch.setattr(harness, "host_level_us", lambda: next(probes))
    out = harness.interleave({"a": lambda: 1.0, "b": lambda: 2.0}, rounds=2, warmup=1, level=True)
    assert out["a"] == [1.0, 1.0] and out["b"] == [2.0, 2.0]
    # round 1: probes 12 and 30; round 2: 11 and 31 (the warm-up's probe, 10, is dropped with it)
    assert out[harness.LEVEL_LO] == [12.0, 11.0]
    assert out[harness.LEVEL_HI] == [30.0, 31.0]
    assert harness.host_level_us() == 29.0  # the real probe is a plain timing in µs
    monkeypatch.undo()
    assert 0 < harness.host_level_us() < 10_000


def _run(levels: list[tuple[float, float]], ratios: list[float]) -> dict:
    return {harness.LEVEL_LO: [lo for lo, _ in levels], harness.LEVEL_HI: [hi for _, hi in levels], "r": ratios}


def test_split_by_level_pools_rounds_per_level_against_the_fastest_probe():
    fast_run = _run([(10, 11), (10, 12), (10, 20), (20, 22)], [1.0, 1.1, 9.0, 1.5])
    slow_run = _run([(21, 24), (22, 23)], [1.6, 1.4])  # all slow: judged against the other run's 10
    got = harness.split_by_level([fast_run, slow_run], ["r"])
    assert got["rounds"] == {"fast": 2, "slow": 3, "mixed": 1}  # (10, 20) straddles 13: mixed, dropped
    assert got["fast_level_us"] == 10
    assert (got["fast"]["r"]["median"], got["fast"]["r"]["n"]) == (pytest.approx(1.05), 2)
    assert (got["slow"]["r"]["median"], got["slow"]["r"]["n"]) == (1.5, 3)
    alone = harness.split_by_level([slow_run], ["r"])  # alone, its own fastest probe sets the bar
    assert alone["rounds"] == {"fast": 2, "slow": 0, "mixed": 0} and "slow" not in alone
    # one lucky probe does not set the bar: the fast level is the median of those near the fastest
    lucky = _run([(18.5, 19), (22, 23.5), (22.5, 24), (23, 24.5), (33, 35), (34, 36)], [1.0] * 4 + [2.0] * 2)
    got = harness.split_by_level([lucky], ["r"])
    assert got["fast_level_us"] == pytest.approx(22.25)  # of 18.5, 22, 22.5, 23 (within 1.3x of 18.5)
    assert got["rounds"] == {"fast": 4, "slow": 2, "mixed": 0}
    assert (got["fast"]["r"]["median"], got["slow"]["r"]["median"]) == (1.0, 2.0)


def test_agree_holds_per_level_figures_and_shows_the_mixed_ones():
    def result(mixed: float, fast: float, slow: float, slow_rounds: int) -> dict:
        return {"row": {"ratio": {"x": {"median": mixed}},
                        "ratio_by_level": {"fast": {"x": {"median": fast}}, "slow": {"x": {"median": slow}},
                                           "rounds": {"fast": 9, "slow": slow_rounds, "mixed": 0}}}}

    rows = {p: (d, note) for p, _, _, d, note in harness.agree(result(1.0, 1.0, 1.5, 9), result(1.4, 1.02, 1.52, 9))}
    assert rows["/row/ratio/x"][1] == "mix" and rows["/row/ratio/x"][0] > 0.1  # shown, not held to 10%
    assert rows["/row/ratio_by_level/fast/x"] == (pytest.approx(0.02 / 1.02), "")
    assert rows["/row/ratio_by_level/slow/x"][1] == ""
    # a level with too few rounds in either run is shown only
    rows = {p: note for p, *_, note in harness.agree(result(1.0, 1.0, 1.5, 9), result(1.0, 1.0, 2.5, 3))}
    assert rows["/row/ratio_by_level/slow/x"] == "few"


def test_agree_command_fails_on_a_level_apart_not_on_the_mix(tmp_path):
    def result(mixed: float, fast: float) -> dict:
        return {"ratio": {"median": mixed},
                "ratio_by_level": {"fast": {"ratio": {"median": fast}}, "rounds": {"fast": 7, "slow": 0, "mixed": 0}}}

    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    cmd = [sys.executable, str(ROOT / "bench" / "harness.py"), "agree", str(fa), str(fb)]
    fa.write_text(json.dumps(result(1.0, 1.0)))
    fb.write_text(json.dumps(result(1.3, 1.05)))  # the mix moved 23%, the fast level 5%
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 0 and "MIX" in run.stdout
    fb.write_text(json.dumps(result(1.0, 1.3)))
    assert subprocess.run(cmd, capture_output=True).returncode == 1


def test_env_records_halt_polling_and_says_when_it_is_off():
    env = harness.env_info()
    assert {"loadavg", "cpus", "clock", "cpuidle_driver", "guest_halt_poll_ns"} <= set(env)
    off = {"loadavg": [1.0, 1.0, 1.0], "cpuidle_driver": "haltpoll", "guest_halt_poll_ns": 0}
    on = {**off, "guest_halt_poll_ns": 200_000}
    metal = {"loadavg": [0.5, 0.5, 0.5], "cpuidle_driver": "intel_idle", "guest_halt_poll_ns": None}
    assert "guest_halt_poll_ns=0" in harness.env_line(off, on)
    for env in (on, metal):
        assert harness.env_line(env, env) == f"load average before {env['loadavg']}, after {env['loadavg']}"
