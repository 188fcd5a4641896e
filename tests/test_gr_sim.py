"""GR pool benchmark simulation: user- vs block-granular pooling."""

import pytest

from ascendstore.gr.sim import GRWorkload, format_table, run_gr_bench, sweep

SMALL = GRWorkload(users=120, requests=3000, history_blocks=(6, 20), candidate_tokens=256, seed=3)


def test_deterministic_and_accounted():
    a = run_gr_bench("block", 0.3, SMALL)
    assert a == run_gr_bench("block", 0.3, SMALL)
    assert a.prefill_tokens_saved <= a.prefill_tokens and 0 <= a.token_hit_rate <= 1
    assert a.capacity_blocks == int(a.working_set_blocks * 0.3)


def test_user_granular_wins_at_small_capacity_and_approaches_compulsory_misses():
    small_u, small_b = run_gr_bench("user", 0.1, SMALL), run_gr_bench("block", 0.1, SMALL)
    assert small_u.prefill_tokens_saved > small_b.prefill_tokens_saved
    full = run_gr_bench("user", 1.0, SMALL)
    # the whole working set fits: only each user's first request misses
    assert full.evictions == 0 and full.requests - round(full.full_hit_rate * full.requests) <= SMALL.users


def test_block_pool_writes_candidates_user_pool_never_does():
    u, b = run_gr_bench("user", 1.0, SMALL), run_gr_bench("block", 1.0, SMALL)
    assert u.writes <= SMALL.users
    assert b.writes >= SMALL.requests * (SMALL.candidate_tokens // SMALL.block_size)


def test_sweep_table_and_bad_input():
    table = format_table(sweep((0.1, 1.0), workload=SMALL))
    assert "10%" in table and "100%" in table
    with pytest.raises(ValueError, match="granularity"):
        run_gr_bench("chunk", 0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pool_capacity"):
        run_gr_bench("user", 0)


def test_tiered_inclusive_pool_smaller_than_the_device_serves_nothing_victim_admission_does():
    """The investigation behind docs/gr-mode.md: with a device cache of 20% of the
    working set in front, an inclusive pool (writes what it misses) of 10% holds only
    users the device holds too; admitting the device's victims instead serves more."""
    from ascendstore.gr.sim import GRWorkload, run_tiered

    w = GRWorkload(users=200, requests=4000, seed=3)
    for g in ("user", "block"):
        inc = run_tiered(g, 0.1, 0.2, "inclusive", w)
        vic = run_tiered(g, 0.1, 0.2, "victim", w)
        assert inc.pool_fraction < 0.01 < vic.pool_fraction
        assert vic.saved_fraction > inc.saved_fraction
