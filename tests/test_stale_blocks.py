"""The stale-block bookkeeping of failed loads (connectors/ascendstore_vllm/stale.py),
without vLLM: which requests of a step would read stale bytes, and when a block is
clean again. (Through the real vLLM lifecycle: tests/vllm/test_failed_load_prefix_cache.py.)"""

from ascendstore_vllm.stale import Scheduled, StaleBlocks

BS = 4


def test_a_reader_of_a_failed_block_is_reported_and_its_new_blocks_turn_stale():
    st = StaleBlocks(BS)
    st.failed([10, 11])
    # y trusts blocks 10, 11 as computed (8 tokens) and computes 2 more into block 12.
    out = st.step({"y": Scheduled([10, 11, 12], 8, 2)})
    assert out == {"y": 10}
    assert len(st) == 3  # 12 was computed over stale KV


def test_a_rewrite_in_the_same_step_is_read_fresh():
    st = StaleBlocks(BS)
    st.failed([10, 11])
    # x recomputes blocks 10, 11 from token 0; y reads them in the same step (written first).
    out = st.step({"y": Scheduled([10, 11, 13], 8, 1), "x": Scheduled([10, 11, 12], 0, 10)})
    assert out == {} and not st


def test_a_partial_rewrite_leaves_the_rest_stale():
    st = StaleBlocks(BS)
    st.failed([10])
    assert st.step({"x": Scheduled([10], 0, 2)}) == {}  # positions 0-1 rewritten
    assert st.step({"x": Scheduled([10], 2, 1)}) == {}  # reads 0-1 (fresh), writes 2
    assert st.step({"z": Scheduled([10, 20], 4, 1)}) == {"z": 10}  # reads position 3: stale
    st2 = StaleBlocks(BS)
    st2.failed([10])
    st2.step({"x": Scheduled([10], 0, 4)})
    assert not st2


def test_loads_and_freed_blocks_are_clean():
    st = StaleBlocks(BS)
    st.failed([1, 2, 3])
    st.loaded([1])
    st.forget_free(lambda b: 0 if b == 2 else 1)
    assert st.step({"r": Scheduled([1, 2], 8, 1)}) == {}
    assert st.step({"r": Scheduled([3], 4, 1)}) == {"r": 3}
