"""Hybrid lookups (groups.group_prefix_hits): the longest prefix every KV cache group can resume from.

Full-attention groups need every chunk's object up to the hit; sliding-window groups
only the objects whose blocks reach into the window at the hit's end (the pool may
have evicted earlier ones); state (Mamba / linear attention) groups only the object
of the hit's last chunk (vLLM keeps a state only at some boundaries).
"""

from __future__ import annotations

from ascendstore_vllm.groups import GroupPlan, group_prefix_hits, needed_chunks

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
