"""bench/bench_staging.py runs and reports every figure it promises (speed itself is
never asserted: the numbers are for people to read); it checks on its own that the
staged copies and the reference per-region copies fill the buffer alike."""

from conftest import run_bench


def test_bench_staging_reports_every_figure():
    res = run_bench("bench_staging.py", "--rounds", "1")
    rows = res["rows"]
    assert [(r["block_size"], r["blocks_per_chunk"], r["scattered"]) for r in rows] == [
        (16, 1, False), (16, 16, False), (16, 16, True), (128, 1, False)]
    # Consecutive blocks of a layer are one region; scattered ones one each.
    assert rows[2]["regions"] == 16 * rows[1]["regions"]
    for r in rows:
        for d in ("save", "load"):
            for case in ("one copy", "staged", "per region"):
                g = r["gbps"][f"{d} {case}"]
                assert 0 < g["min"] <= g["median"] <= g["max"], (r, d, case)
            for q in ("staged", "per region", "staged vs per region"):
                assert r["ratio"][f"{d} {q}"]["median"] > 0
