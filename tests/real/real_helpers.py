"""Helpers of the real-model tests (tests/real)."""

from __future__ import annotations

#: Greedy token ids must be equal. Top-5 logprobs may differ by this much: the
#: model runs in fp32 on CPU and KV loaded from the pool is byte-identical, but a
#: prefill that starts after a pooled prefix runs other kernel shapes (attention
#: over cached blocks, a shorter GEMM, another batch mix) whose float sums round
#: differently; observed differences are ~1e-5.
LOGPROB_ATOL = 1e-3


def assert_same_output(got, want, what: str) -> float:
    """Greedy ids equal; top-5 logprobs within LOGPROB_ATOL. Returns the largest difference seen."""
    assert got.token_ids == want.token_ids, f"{what}: greedy tokens differ: {got.token_ids} vs {want.token_ids}"
    worst = 0.0
    for pos, (g, w) in enumerate(zip(got.top, want.top, strict=True)):
        for tok in set(g) | set(w):
            if tok in g and tok in w:
                worst = max(worst, abs(g[tok] - w[tok]))
                continue
            # in one top-5 only: allowed just at a near-tie with the 5th entry of the other
            other = w if tok in g else g
            mine = g if tok in g else w
            assert abs(mine[tok] - min(other.values())) <= LOGPROB_ATOL, (
                f"{what}: position {pos}: top-5 differ beyond a tie: {g} vs {w}")
    assert worst <= LOGPROB_ATOL, f"{what}: top-5 logprobs differ by {worst:.2e} > {LOGPROB_ATOL}"
    return worst
