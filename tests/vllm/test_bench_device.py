"""bench/bench_device.py, the check of device KV staging and landing for a lent
device, run here on the CPU (speed is never asserted): every check passes, the
staged bytes go through a real local pool, and every figure is reported; its
checks fail when a copy does the wrong thing."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from ascendstore_vllm.device import DeviceLanding, HostStaging
from conftest import run_bench

BENCH = Path(__file__).parents[2] / "bench"


def test_bench_device_checks_and_reports_every_figure():
    res = run_bench("bench_device.py", "--quick", "--device", "cpu")
    assert res["device"] == "cpu" and res["failed"] == []
    assert len(res["checks"]) == 2
    for checks in res["checks"].values():
        assert "note" not in checks, checks["note"]  # the round trip went through the local pool
        # staging and landing, batched and region by region, then GR
        assert sum(k.endswith("(batched)") for k in checks) == sum(k.endswith("(per region)") for k in checks) == 4
        assert [v for k, v in checks.items()] == [True] * 11
    for row in res["shapes"]:
        assert row["regions"] == 8 * row["objects"]  # 4 layers x K and V
        assert row["gather_bytes"] == 64 << 20
        for k in ("staged save / one copy", "staged load / one copy", "landing commit / one copy",
                  "per-region save / one copy", "per-region load / one copy", "per-region commit / one copy"):
            assert row["ratio"][k]["median"] > 0


def test_bench_device_checks_see_a_wrong_copy(monkeypatch):
    sys.path.insert(0, str(BENCH))
    try:
        import bench_device
    finally:
        sys.path.remove(str(BENCH))

    def ignores_ok(self, ops, ok):  # copies every object, arrived or not
        HostStaging.commit_in(self, ops, [True] * len(ok))

    monkeypatch.setattr(DeviceLanding, "commit_in", ignores_ok)
    res = bench_device.check(torch.device("cpu"), 2, 10, 1024, 1)
    for mode in ("batched", "per region"):
        assert res[f"landing: ok objects copied, the others untouched ({mode})"] is False
        assert res[f"staged load: device KV == before ({mode})"] is True


def test_bench_device_checks_see_a_batched_copy_that_misplaces_regions(monkeypatch):
    sys.path.insert(0, str(BENCH))
    try:
        import bench_device
    finally:
        sys.path.remove(str(BENCH))

    def rotated(self, dst, src, disjoint):  # each region gets its neighbour's bytes (all are one size here)
        src = list(src)
        for d, s in zip(dst, src[1:] + src[:1], strict=True):
            d.copy_(s)

    monkeypatch.setattr(HostStaging, "_fused_copy", rotated)
    res = bench_device.check(torch.device("cpu"), 2, 10, 1024, 1)
    assert res["staged load: device KV == before (batched)"] is False
    assert res["staged load: device KV == before (per region)"] is True


def test_bench_device_gr_check_sees_a_wrong_copy(monkeypatch):
    sys.path.insert(0, str(BENCH))
    try:
        import bench_device
    finally:
        sys.path.remove(str(BENCH))
    from ascendstore_vllm.gr.staging import GRStaging

    from ascendstore.contract import Status

    class CopiesBackEverything(GRStaging):  # takes every object for arrived
        def transfer(self, op, regions, call):
            def all_ok(staged, buf):
                statuses, running = call(staged, buf)
                return [Status.OK] * len(statuses), running

            return super().transfer(op, regions, all_ok)

    monkeypatch.setattr(bench_device, "GRStaging", CopiesBackEverything)
    res = bench_device.check(torch.device("cpu"), 2, 10, 1024, 1)
    assert res["GR get: arrived objects back whole, the others untouched"] is False
    assert res["GR put: buffer == header + device KV"] is True
