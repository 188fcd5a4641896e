"""Hybrid lookups (groups.group_prefix_hits): the longest prefix every KV cache group can resume from.

Full-attention groups need every chunk's object up to the hit; sliding-window groups
only the objects whose blocks reach into the window at the hit's end (the pool may
have evicted earlier ones); state (Mamba / linear attention) groups only the object
of the hit's last chunk (vLLM keeps a state only at some boundaries).
"""

from __future__ import annotations

import random

from ascendstore_vllm.groups import (
    GroupedKeyBuilder,
    GroupLookup,
    GroupPlan,
    group_prefix_hits,
    needed_chunks,
)

from ascendstore.contract import Status
from ascendstore.engine import EngineMetrics
from ascendstore.keys import RankPart

BPC = 4  # blocks per chunk
BS = 16


def plan(index: int, kind: str, window: int | None = None) -> GroupPlan:
    return GroupPlan(index, kind, kind, (f"l{index}",), BS, window, kind)


FULL = plan(0, "full")
SLIDING = plan(1, "sliding", 24)  # 2 blocks: only the last chunk before the hit is needed
WIDE = plan(1, "sliding", 5 * BS)  # 5 blocks: the last two chunks
STATE = plan(1, "state")


def hits(plans, present, start=0, last_end=None) -> int:
    n = start + len(present[0])
    return group_prefix_hits(plans, present, start, BPC, n * BPC if last_end is None else last_end)


def test_full_groups_need_an_unbroken_run() -> None:
    assert hits([FULL], [[True, True, False, True]]) == 2
    assert hits([FULL], [[False, True]]) == 0
    assert hits([FULL], [[True, True]], start=3) == 5  # chunks before start are on the device


def test_sliding_groups_need_only_the_window_at_the_hit() -> None:
    # every full object present; the sliding group's early objects evicted
    full = [True] * 5
    assert hits([FULL, SLIDING], [full, [False, False, False, False, True]]) == 5
    # the window at chunk 4's end reaches back 2 blocks: chunk 4 only
    assert needed_chunks([FULL, SLIDING], SLIDING, 5, 0, BPC, 5 * BPC) == [4]
    # a 5-block window reaches into chunk 3 too
    assert needed_chunks([FULL, WIDE], WIDE, 5, 0, BPC, 5 * BPC) == [3, 4]
    assert hits([FULL, WIDE], [full, [False, False, False, False, True]]) == 0
    assert hits([FULL, WIDE], [full, [False, False, True, True, False]]) == 4
    assert hits([FULL, WIDE], [full, [False, False, True, True, True]]) == 5
    # the window's object missing: the hit stops at an earlier boundary whose window is there
    assert hits([FULL, SLIDING], [full, [True, True, True, False, False]]) == 3


def test_a_partial_tail_takes_the_window_from_its_first_block() -> None:
    # offered hashes end in a partial tail of unknown length: assume it is 1 block long,
    # so the window at its end may reach into the chunk before (read more, never less)
    full = [True] * 3
    assert needed_chunks([FULL, SLIDING], SLIDING, 3, 0, BPC, 2 * BPC + 1) == [1, 2]
    assert hits([FULL, SLIDING], [full, [False, False, True]], last_end=2 * BPC + 1) == 0
    assert hits([FULL, SLIDING], [full, [False, True, True]], last_end=2 * BPC + 1) == 3


def test_state_groups_need_the_state_at_the_hit_only() -> None:
    full = [True] * 4
    assert hits([FULL, STATE], [full, [False, True, False, False]]) == 2
    assert hits([FULL, STATE], [full, [False, False, False, True]]) == 4
    assert hits([FULL, STATE], [full, [False, False, False, False]]) == 0
    # a state past a missing full-attention object cannot be used
    assert hits([FULL, STATE], [[True, False, True, True], [False, False, False, True]]) == 0
    # a state-only model (Mamba2): any boundary with a state
    assert hits([plan(0, "state")], [[True, False, True, False]]) == 3
    # on the device already up to chunk 2: a pool state at chunk 3 extends it
    assert hits([FULL, STATE], [[True, True], [False, True]], start=2) == 4
    assert hits([FULL, STATE], [[True, True], [False, False]], start=2) == 2


def test_state_layer_caches_become_one_layer_per_state_tensor() -> None:
    """vLLM hands a state layer's cache as a list of views into one padded page per
    block (conv state, SSM state; the conv state may be a transposed view): each is
    registered on its own and a block's object holds exactly the state bytes."""
    import torch
    from ascendstore_vllm.groups import expand_state_caches

    from ascendstore.engine import LayerSpan

    blocks, page = 6, 4096  # bytes per block (padded)
    raw = torch.zeros(blocks * page, dtype=torch.uint8)
    conv = raw.view(blocks, page)[:, :3 * 96 * 2].view(torch.bfloat16).view(blocks, 3, 96).transpose(1, 2)
    ssm = raw.view(blocks, page)[:, 1024:1024 + 2 * 8 * 8 * 4].view(torch.float32).view(blocks, 2, 8, 8)
    attn = torch.zeros(blocks, 2, 16, 8)
    flat, names = expand_state_caches({"attn": attn, "gdn": [conv, ssm]})
    assert names == {"attn": ("attn",), "gdn": ("gdn#0", "gdn#1")}
    assert flat["gdn#0"] is conv and flat["gdn#1"] is ssm
    spans = {n: LayerSpan.from_view(n, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())
             for n, t in flat.items()}
    assert spans["gdn#0"].block_bytes == 3 * 96 * 2 and spans["gdn#0"].block_stride == page
    assert spans["gdn#1"].runs == ((0, 2 * 8 * 8 * 4),) and spans["gdn#1"].base == raw.data_ptr() + 1024


# -- the fast forms against the plain definitions they replaced ------------------------
def _needed_by_definition(group, hit, start, bpc, end_block):
    if group.kind == "full":
        return list(range(start, hit))
    first, _ = group.needed_blocks(end_block)
    return [j for j in range(start, hit) if j == hit - 1 or (j + 1) * bpc > first]


def _hits_by_definition(plans, present, start, bpc, last_end):
    n = start + len(present[0])
    for hit in range(n, start, -1):
        end_block = last_end if hit == n else hit * bpc
        if all(present[p.index][j - start] for p in plans
               for j in _needed_by_definition(p, hit, start, bpc, end_block)):
            return hit
    return start


def test_needed_chunks_and_hits_agree_with_their_definition_on_random_cases() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        bpc = rng.choice([1, 2, 4, 8])
        plans = [plan(0, "full")] + [
            plan(i, kind, None if kind == "state" else rng.randrange(1, 12) * BS)
            for i, kind in enumerate(rng.choices(["sliding", "state", "full"], k=rng.randrange(0, 3)), start=1)
        ]
        n, start = rng.randrange(1, 12), rng.randrange(0, 4)
        tail = rng.random() < 0.3  # the last chunk a partial one
        last_end = (start + n - 1) * bpc + (rng.randrange(1, bpc) if tail and bpc > 1 else bpc)
        density = rng.random()
        present = [[rng.random() < density or (p.kind == "full" and rng.random() < 0.7) for _ in range(n)]
                   for p in plans]
        for p in plans:
            for hit in range(start + 1, start + n + 1):
                end_block = last_end if hit == start + n else hit * bpc
                assert list(needed_chunks(plans, p, hit, start, bpc, end_block)) == \
                    _needed_by_definition(p, hit, start, bpc, end_block), (p, hit, start, bpc, end_block)
        assert group_prefix_hits(plans, present, start, bpc, last_end) == \
            _hits_by_definition(plans, present, start, bpc, last_end), (plans, present, start, bpc, last_end)


def test_group_lookup_needs_each_groups_object_on_every_rank() -> None:
    # Two groups, two ranks: a chunk of a group is present when both ranks have its
    # object. Answers are planted per key, in the order the lookup asks.
    class Planted:
        def __init__(self) -> None:
            self.missing: set[str] = set()
            self.metrics = EngineMetrics()
            self.monitor = None

        def exists(self, keys, timeout_s):
            return [Status.NOT_FOUND if k in self.missing else Status.OK for k in keys]

    kb = GroupedKeyBuilder("fp0", RankPart(0), all_ranks=(RankPart(0), RankPart(1)), group_fingerprints=("fp0", "fp1"))
    guard = Planted()
    plans = [plan(0, "full"), plan(1, "sliding", 2 * BS)]  # the window: the hit's last chunk only (BPC 4)
    lk = GroupLookup(guard, kb, plans, BPC, 1.0, partial_tail=False)
    hashes = [f"h{i}" for i in range(6)]
    assert lk.prefix_hits("-", hashes) == 6
    # rank 1's sliding object of chunk 5 gone: chunk 5 cannot be resumed; chunk 4's window is whole
    guard.missing = {kb.group_lookup_prefixes("-", 1)[1] + "h5"}
    assert lk.prefix_hits("-", hashes) == 5
    # rank 0's full object of chunk 2 gone too: the run ends before it
    guard.missing.add(kb.group_lookup_prefixes("-", 0)[0] + "h2")
    assert lk.prefix_hits("-", hashes) == 2
    # only the early sliding objects gone: not needed, the whole prompt hits
    guard.missing = {kb.group_lookup_prefixes("-", 1)[r] + f"h{j}" for r in (0, 1) for j in range(4)}
    assert lk.prefix_hits("-", hashes) == 6
    assert lk.prefix_hits("-", hashes, start=2) == 6
