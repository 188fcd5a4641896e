"""Device-side user-level LRU on the real vLLM 0.33 scheduler and KV cache manager."""

from __future__ import annotations

import numpy as np
import pytest
from ascendstore_vllm.gr.testing import build_scheduler
from ascendstore_vllm.gr.user_lru import UnsupportedVLLMError, UserKVLRU

pytestmark = pytest.mark.vllm
BS = 16
HIST = 6 * BS  # six history blocks per user
CAND = BS  # one block of candidates


def uids(users) -> list[str]:
    """The uids of (tenant, uid) pairs, in order."""
    return [u for _, u in users]


def hist_of(uid: str, version: int = 0) -> list[int]:
    seed = sum(map(ord, uid)) * 100 + version
    return np.random.default_rng(seed).integers(1000, 40000, HIST).tolist()


def gr_req(rig, uid, *, version=0, cand_seed=0, max_tokens=1):
    cands = np.random.default_rng(10_000 + cand_seed).integers(1000, 40000, CAND).tolist()
    return rig.request(hist_of(uid, version) + cands, max_tokens=max_tokens,
                       extra_args={"uid": uid, "candidate_num": CAND})


def filler(rig, n_blocks, seed=99):
    return rig.request(np.random.default_rng(seed).integers(1000, 40000, n_blocks * BS).tolist())


def device_hit(rig, uid, version=0) -> int:
    """Tokens of the user's history vLLM's prefix cache would serve right now."""
    probe = gr_req(rig, uid, version=version, cand_seed=77)
    _, n, _ = rig.kv_cache_manager.get_computed_blocks(probe)
    return n


def warm_users(rig, uids):
    for i, uid in enumerate(uids):
        rig.run(gr_req(rig, uid, cand_seed=i))


def test_whole_users_evicted_where_vllm_alone_nibbles_histories():
    users = ["u1", "u2", "u3", "u4"]
    plain = build_scheduler(block_size=BS, num_blocks=40)
    warm_users(plain, users)
    plain.run(filler(plain, 20))
    # vLLM's block LRU took all of u1 and the tail of u2's history
    assert device_hit(plain, "u1") == 0 and device_hit(plain, "u2") < HIST

    rig = build_scheduler(block_size=BS, num_blocks=40)
    lru = UserKVLRU().install(rig.kv_cache_manager)
    warm_users(rig, users)
    assert uids(lru.resident_users()) == users
    assert all(len(lru.device_blocks(u)) == 6 for u in users)
    rig.run(filler(rig, 20))
    assert lru.stats.lru_evictions == 1 and uids(lru.resident_users()) == ["u2", "u3", "u4"]
    assert device_hit(rig, "u1") == 0
    assert [device_hit(rig, u) for u in ("u2", "u3", "u4")] == [HIST] * 3


def test_rotating_candidates_hit_the_device_and_refresh_lru_order():
    rig = build_scheduler(block_size=BS, num_blocks=64)
    lru = UserKVLRU().install(rig.kv_cache_manager)
    warm_users(rig, ["a", "b"])
    for k in range(3):  # a's next requests: new candidates each time, same history
        req = gr_req(rig, "a", cand_seed=100 + k)
        rig.add(req)
        out = rig.step()
        assert out.num_scheduled_tokens[req.request_id] == CAND  # history served by the device
        rig.run()
    assert uids(lru.resident_users()) == ["b", "a"]


def test_running_user_is_never_evicted_even_when_least_recent():
    rig = build_scheduler(block_size=BS, num_blocks=48)
    lru = UserKVLRU().install(rig.kv_cache_manager)
    rig.run(gr_req(rig, "u1", version=0))  # u1's first history: resident, idle blocks
    long = gr_req(rig, "u1", version=1, max_tokens=100)  # rewritten history, keeps running
    rig.add(long)
    rig.step()
    warm_users(rig, ["u2", "u3"])
    assert uids(lru.users) == ["u1", "u2", "u3"] and lru.running_users() == {("-", "u1")}
    rig.run(filler(rig, 24))
    assert lru.stats.lru_evictions == 1
    assert device_hit(rig, "u2") == 0  # the least recent *idle* user went
    assert device_hit(rig, "u1", version=0) == HIST  # u1 is older, but running: untouched
    assert device_hit(rig, "u3") == HIST
    assert long.request_id not in rig.finished


def test_max_resident_users():
    rig = build_scheduler(block_size=BS, num_blocks=64)
    lru = UserKVLRU(max_resident_users=2).install(rig.kv_cache_manager)
    warm_users(rig, ["a", "b", "c"])
    assert uids(lru.resident_users()) == ["b", "c"] and lru.stats.lru_evictions == 1
    assert device_hit(rig, "a") == 0 and device_hit(rig, "c") == HIST


@pytest.mark.parametrize("min_free, evicted", [(0, 0), (10, 1)])
def test_min_free_blocks_evicts_ahead_of_need(min_free, evicted):
    rig = build_scheduler(block_size=BS, num_blocks=40)
    lru = UserKVLRU(min_free_blocks=min_free).install(rig.kv_cache_manager)
    warm_users(rig, ["a", "b", "c", "d", "e"])
    # 39 usable blocks, 6 per resident history: the 5th user's 8 blocks fit among the 15
    # unprotected ones, but not with 10 more kept free
    assert lru.stats.lru_evictions == evicted
    assert ("a" in uids(lru.resident_users())) == (evicted == 0)


def test_delete_user_drops_device_copy_even_while_running():
    rig = build_scheduler(block_size=BS, num_blocks=64)
    lru = UserKVLRU().install(rig.kv_cache_manager)
    warm_users(rig, ["a", "b"])
    assert lru.evict_user("a") and device_hit(rig, "a") == 0
    running = gr_req(rig, "b", max_tokens=5)
    rig.add(running)
    rig.step()
    assert lru.evict_user("b")
    rig.run()
    assert running.request_id in rig.finished and device_hit(rig, "b") == 0
    assert lru.stats.lru_evictions == 0  # deletes are not LRU evictions


def test_ordinary_requests_untouched_and_uninstall_restores():
    rig = build_scheduler(block_size=BS, num_blocks=64)
    lru = UserKVLRU().install(rig.kv_cache_manager)
    rig.run(filler(rig, 4, seed=1))
    assert lru.users == {}
    assert "allocate_slots" in vars(rig.kv_cache_manager)
    lru.uninstall()
    assert "allocate_slots" not in vars(rig.kv_cache_manager)
    assert "get_new_blocks" not in vars(rig.kv_cache_manager.block_pool)
    rig.run(gr_req(rig, "a"))


def test_unsupported_vllm_is_refused_clearly(monkeypatch):
    import vllm

    rig = build_scheduler(block_size=BS, num_blocks=16)
    monkeypatch.setattr(vllm, "__version__", "0.34.1")
    with pytest.raises(UnsupportedVLLMError, match=r"supports vLLM >=0\.30,<0\.34; this is vLLM 0\.34\.1.*gr\.user_lru=false"):
        UserKVLRU().install(rig.kv_cache_manager)
    monkeypatch.setattr(vllm, "__version__", "0.29.2")
    with pytest.raises(UnsupportedVLLMError, match=r"this is vLLM 0\.29\.2"):
        UserKVLRU().install(rig.kv_cache_manager)
    for version in ("0.30.0", "0.32.0", "0.33.0rc1"):  # the lines whose internals it wraps
        monkeypatch.setattr(vllm, "__version__", version)
        UserKVLRU().install(rig.kv_cache_manager).uninstall()
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    monkeypatch.delattr(type(rig.kv_cache_manager.block_pool.free_block_queue), "prepend_n")
    with pytest.raises(UnsupportedVLLMError, match="free_block_queue.prepend_n"):
        UserKVLRU().install(rig.kv_cache_manager)


def test_preemption_keeps_the_bookkeeping_consistent():
    # two users decoding long enough that the pool runs dry: vLLM preempts one of them
    rig = build_scheduler(block_size=BS, num_blocks=20, max_model_len=512)
    lru = UserKVLRU().install(rig.kv_cache_manager)
    reqs = [gr_req(rig, "a", max_tokens=120), gr_req(rig, "b", max_tokens=120)]
    rig.run(*reqs, max_steps=600)
    assert any(r.num_preemptions for r in reqs)
    assert lru.running_users() == set() and lru._req == {}
    assert lru.resident_users()
    for _, uid in lru.resident_users():  # what it believes resident really is in vLLM's prefix cache
        assert len(lru.device_blocks(uid)) == 6 and device_hit(rig, uid) == HIST
