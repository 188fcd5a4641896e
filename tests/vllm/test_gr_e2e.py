"""GR end to end: real vLLM 0.33 scheduler + worker connector lifecycle on CPU,
the embedded ``local`` pool, the GR connector (user-granular pool + device user LRU).

The harness's fake model checks at every layer that each earlier position of a
request holds the right KV before it "attends", so a swap-in that lands wrong,
late or not at all fails the step it matters in.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from ascendstore_vllm.testing.harness import EngineHarness, EngineSpec, prompt_bytes

pytestmark = pytest.mark.vllm
BS = 16
HIST = 6 * BS
CAND = BS


def spec(pool: str, *, num_blocks: int = 128, max_model_len: int = 1024, tp_size: int = 1,
         extra: dict | None = None, **gr) -> EngineSpec:
    """An engine whose connector is CONNECTOR: the GR-only one, or AscendStoreConnector with gr.enabled."""
    if CONNECTOR[0] == "gr":
        conn = {"kv_connector": "AscendStoreGRConnector",
                "kv_transfer_kwargs": {"kv_connector_module_path": "ascendstore_vllm.gr.connector"}}
    else:
        conn = {"kv_connector": "AscendStoreConnector"}
    return EngineSpec(
        **conn,
        extra_config={
            "backend": "local",
            "backend_config": {"name": pool, "capacity": "16MiB", "page_size": "4KiB"},
            "gr": {"enabled": True, **gr},
            **(extra or {}),
        },
        num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=1024, max_model_len=max_model_len,
        tp_size=tp_size,
    )


CONNECTOR = ["gr"]


@pytest.fixture(params=["gr", "main"], autouse=True)
def connector_kind(request):
    """Every test runs on AscendStoreGRConnector and on AscendStoreConnector (gr.enabled)."""
    CONNECTOR[0] = request.param
    yield request.param
    CONNECTOR[0] = "gr"


@pytest.fixture
def pool():
    return "gr-e2e-" + uuid.uuid4().hex[:8]


@pytest.fixture
def engines():
    made: list[EngineHarness] = []

    def make(s: EngineSpec) -> EngineHarness:
        made.append(EngineHarness(s))
        return made[-1]

    yield make
    for e in reversed(made):
        e.close()


def history(uid: str, version: int = 0) -> list[int]:
    return np.random.default_rng(sum(map(ord, uid)) * 100 + version).integers(10, 900, HIST).tolist()


def candidates(seed: int) -> list[int]:
    return np.random.default_rng(5000 + seed).integers(10, 900, CAND).tolist()


def ask(engine: EngineHarness, req_id: str, uid: str, *, version: int = 0, cand: int = 0,
        max_tokens: int = 1, hist: list[int] | None = None, via: str = "extra_args") -> list[int]:
    prompt = (hist if hist is not None else history(uid, version)) + candidates(cand)
    fields = {"uid": uid, "candidate_num": CAND}
    if via == "extra_args":
        engine.add_request(req_id, prompt, max_tokens=max_tokens, extra_args=fields)
    else:
        engine.add_request(req_id, prompt, max_tokens=max_tokens,
                           kv_transfer_params={"uid": uid, "user_history_len": len(prompt) - CAND})
    return prompt


def gr_stats(engine: EngineHarness) -> dict[str, int]:
    """Scheduler-side plus worker-side GR counters of one engine."""
    sched, worker = engine.connector.gr.totals(), engine.workers[0].connector.gr.totals()
    return {k: sched[k] + worker[k] for k in sched}


def device_hit(engine: EngineHarness, prompt: list[int]) -> int:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    probe = Request("probe", prompt, SamplingParams(max_tokens=1), None, block_hasher=engine.block_hasher)
    return engine.scheduler.kv_cache_manager.get_computed_blocks(probe)[1]


def assert_kv_exact(engine: EngineHarness, req_id: str, prompt: list[int]) -> None:
    assert engine.read_errors() == []
    assert prompt_bytes(engine.prompt_kv(req_id)) == prompt_bytes(engine.expected_prompt_kv(prompt))


def test_rotating_candidates_and_cross_engine_swap_in_byte_exact(pool, engines):
    a = engines(spec(pool))
    p1 = ask(a, "a1", "u1", cand=1)
    a.run()
    assert a.first_schedule("a1") == (0, HIST + CAND)  # a miss everywhere: computed, then saved
    for k in (2, 3):  # the same user with new candidates: the device serves the history
        ask(a, f"a{k}", "u1", cand=k, via="kv_transfer_params")
        a.run()
        assert a.first_schedule(f"a{k}") == (HIST, CAND)
    sa = gr_stats(a)
    assert (sa["dram_misses"], sa["device_hits"], sa["saves"], sa.get("dram_hits", 0)) == (1, 2, 1, 0)

    b = engines(spec(pool))  # another engine on the same node: the pool serves the history
    p4 = ask(b, "b1", "u1", cand=4)
    b.run()
    assert b.first_schedule("b1") == (HIST, CAND)
    sb = gr_stats(b)
    assert (sb["dram_hits"], sb["swapin_attempts"], sb["swapin_successes"], sb["hit_tokens_pool"]) == (1, 1, 1, HIST)
    assert_kv_exact(b, "b1", p4)
    # the swapped-in history is byte-for-byte what engine A computed
    cut = [t[:HIST] for t in b.prompt_kv("b1")]
    assert prompt_bytes(cut) == prompt_bytes([t[:HIST] for t in a.prompt_kv("a1")])
    assert p1[:HIST] == p4[:HIST]


def test_device_eviction_then_swap_in_and_running_user_kept(pool, engines):
    e = engines(spec(pool, num_blocks=48, max_model_len=512, user_lru=True))
    lru = e.connector.gr.sched.lru
    assert lru is not None
    ask(e, "u1-old", "u1", version=0)
    e.run()
    ask(e, "u1-long", "u1", version=1, max_tokens=40)  # rewritten history, keeps decoding
    e.step()
    for i, uid in enumerate(["u2", "u3"]):
        ask(e, f"{uid}-1", uid, cand=i)
        while f"{uid}-1" not in e.finished:
            e.step()
    assert list(lru.users)[0] == ("-", "u1") and lru.running_users() == {("-", "u1")}  # least recent, but running
    # pressure: an ordinary long prompt needs more blocks than the unowned free ones
    pool_ = e.scheduler.kv_cache_manager.block_pool
    unowned = pool_.get_num_free_blocks() - 6 * len([u for _, u in lru.resident_users() if u != "u1"]) - 6
    filler = np.random.default_rng(1).integers(10, 900, (unowned + 2) * BS - 8).tolist()
    e.add_request("filler", filler)
    while "filler" not in e.finished:
        e.step()
    st = gr_stats(e)
    assert st["lru_evictions"] >= 1 and ("-", "u2") not in lru.resident_users()
    assert device_hit(e, history("u1", 0) + candidates(9)) == HIST  # the running user's idle history stayed
    assert "u1-long" not in e.finished
    # u2 comes back: device miss, the pool swaps its history in
    p = ask(e, "u2-2", "u2", cand=7)
    e.run()
    assert e.first_schedule("u2-2") == (HIST, CAND)
    st = gr_stats(e)
    assert st["dram_hits"] >= 1 and st["swapin_successes"] == st["swapin_attempts"] >= 1
    assert_kv_exact(e, "u2-2", p)
    assert_kv_exact(e, "u1-long", history("u1", 1) + candidates(0))


def test_rewritten_history_serves_only_the_common_prefix(pool, engines):
    a = engines(spec(pool))
    old = history("u1")
    ask(a, "a1", "u1", hist=old)
    a.run()
    new = old[:50] + np.random.default_rng(3).integers(10, 900, HIST - 50).tolist()
    b = engines(spec(pool))
    p = ask(b, "b1", "u1", hist=new, cand=2)
    b.run()
    assert b.first_schedule("b1") == (48, HIST - 48 + CAND)  # 3 whole common blocks from the pool
    sb = gr_stats(b)
    assert sb["invalidations"] == 1 and sb["saves"] == 1
    assert_kv_exact(b, "b1", p)
    # the new history replaced the old one: engine A's device has the common blocks,
    # the pool serves the rest of the rewritten history
    p2 = ask(a, "a2", "u1", hist=new, cand=3)
    a.run()
    assert a.first_schedule("a2") == (HIST, CAND)
    assert_kv_exact(a, "a2", p2)


def test_failed_swap_in_is_recomputed(pool, engines):
    a = engines(spec(pool))
    ask(a, "a1", "u1")
    a.run()
    b = engines(spec(pool))
    store = b.connector.gr.store
    real_schedule = b.scheduler.schedule

    def schedule_then_lose_kv():  # the KV object vanishes between lookup and load
        out = real_schedule()
        store.backend.remove(store.kv_keys("u1", 0))
        return out

    b.scheduler.schedule = schedule_then_lose_kv
    # vLLM drops the output of a step whose loads failed; the harness's fake model
    # must not sample for it either (it would otherwise record a token vLLM discarded)
    conn = b.workers[0].connector
    take_errors, sample = conn.get_block_ids_with_load_errors, b.sample
    failed: set[int] = set()

    def errors_seen() -> set[int]:
        out = take_errors()
        failed.update(out)
        return out

    def sample_unless_failed(work):
        if failed & set(work[2]):
            failed.clear()
            return []
        return sample(work)

    conn.get_block_ids_with_load_errors = errors_seen
    b.sample = sample_unless_failed
    p = ask(b, "b1", "u1", cand=5)
    first = b.step()
    assert first.invalid_block_ids and first.scheduled == {"b1": CAND}
    # that step's forward read the unloaded blocks (vLLM discards its output); from here on
    # every read must be right
    b.workers[0].read_errors.clear()
    b.run()
    st = gr_stats(b)
    assert (st["swapin_attempts"], st.get("swapin_successes", 0)) == (1, 0)
    assert b.records[1].scheduled == {"b1": HIST + CAND}  # vLLM recomputed the history
    assert_kv_exact(b, "b1", p)
    # the broken record was dropped: the user's next request re-saves the history
    b.scheduler.schedule = real_schedule
    ask(b, "b2", "u1", cand=6)
    b.run()
    assert gr_stats(b)["saves"] == 1
    c = engines(spec(pool))
    p3 = ask(c, "c1", "u1", cand=7)
    c.run()
    assert c.first_schedule("c1") == (HIST, CAND)
    assert_kv_exact(c, "c1", p3)


def test_ordinary_and_malformed_requests_are_plain_prefix_caching(pool, engines):
    e = engines(spec(pool))
    plain = history("x") + candidates(1)
    e.add_request("plain", plain)
    e.add_request("bad", plain, extra_args={"uid": "u1"})  # uid without a history length
    e.run()
    st = gr_stats(e)
    assert st.get("invalid_inputs") == 1 and not st.get("saves")
    # no user objects (the main connector's chunk pool may hold the plain prompt's chunks)
    assert [k for k in e.connector.gr.store.backend.backend.list_keys("") if not k.startswith("as1@")] == []


def test_delete_user_everywhere(pool, engines):
    e = engines(spec(pool, user_lru=True))
    ask(e, "a1", "u1")
    ask(e, "a2", "u2")
    e.run()
    assert device_hit(e, history("u1") + candidates(3)) == HIST
    removed = e.connector.gr.delete_user("u1")
    assert removed >= 2
    assert device_hit(e, history("u1") + candidates(3)) == 0
    keys = [k for k in e.connector.gr.store.backend.backend.list_keys("") if not k.startswith("as1@")]
    assert keys and all(k.startswith("u2@") for k in keys)
    ask(e, "a3", "u1", cand=3)
    e.run()
    assert e.first_schedule("a3") == (0, HIST + CAND)


def test_tensor_parallel_ranks_keep_their_own_user_objects(pool, engines):
    a = engines(spec(pool, tp_size=2))
    ask(a, "a1", "u1")
    a.run()
    keys = sorted(a.connector.gr.store.backend.backend.list_keys("u1@"))
    assert [k.split("@")[2:] for k in keys] == [["2", "0", "kv_cache"], ["2", "0", "token_id"],
                                                ["2", "1", "kv_cache"], ["2", "1", "token_id"]]
    b = engines(spec(pool, tp_size=2))
    p = ask(b, "b1", "u1", cand=6)
    b.run()
    assert b.first_schedule("b1") == (HIST, CAND)
    for rank in (0, 1):
        assert prompt_bytes(b.prompt_kv("b1", rank)) == prompt_bytes(b.expected_prompt_kv(p, rank))
    assert b.read_errors() == []


def test_shorter_history_window_is_served_without_rewriting(pool, engines):
    a = engines(spec(pool))
    ask(a, "a1", "u1")
    a.run()
    b = engines(spec(pool))
    p = ask(b, "b1", "u1", hist=history("u1")[: 4 * BS], cand=2)  # a shorter window of the history
    b.run()
    assert b.first_schedule("b1") == (4 * BS, CAND)
    st = gr_stats(b)
    assert (st["dram_hits"], st["saves"], st["invalidations"]) == (1, 0, 0)
    assert_kv_exact(b, "b1", p)
    c = engines(spec(pool))  # the full history is still pooled
    ask(c, "c1", "u1", cand=3)
    c.run()
    assert c.first_schedule("c1") == (HIST, CAND)


def test_pool_copy_lost_is_saved_again_from_the_device(pool, engines):
    a = engines(spec(pool))
    ask(a, "a1", "u1")
    a.run()
    a.connector.gr.store.delete_user("u1")  # e.g. evicted by the pool, or expired
    ask(a, "a2", "u1", cand=2)
    a.run()
    st = gr_stats(a)
    assert a.first_schedule("a2") == (HIST, CAND)  # the device still had it
    assert (st["device_hits"], st["saves"]) == (1, 2)
    b = engines(spec(pool))
    p = ask(b, "b1", "u1", cand=4)
    b.run()
    assert b.first_schedule("b1") == (HIST, CAND)
    assert_kv_exact(b, "b1", p)


def test_layerwise_user_objects(pool, engines):
    a = engines(spec(pool, extra={"use_layerwise": True}))
    ask(a, "a1", "u1")
    a.run()
    keys = sorted(k for k in a.connector.gr.store.backend.backend.list_keys("u1@"))
    assert [k.split("@", 4)[4] for k in keys] == ["kv_cache@0", "kv_cache@1", "token_id"]
    b = engines(spec(pool, extra={"use_layerwise": True}))
    p = ask(b, "b1", "u1", cand=2)
    b.run()
    assert b.first_schedule("b1") == (HIST, CAND)
    assert_kv_exact(b, "b1", p)


def test_salted_users_pool_and_delete_per_tenant(pool, engines):
    """A GR user is a uid of a tenant (cache_salt): salted users are saved and served
    from the pool, and delete_user(uid, cache_salt) removes that tenant's user only."""
    from ascendstore.keys import UserKey

    a = engines(spec(pool))
    fields = {"uid": "u1", "candidate_num": CAND}
    prompt = history("u1") + candidates(1)
    for rid, salt in (("plain", None), ("acme", "acme")):
        a.add_request(rid, prompt, max_tokens=1, cache_salt=salt, extra_args=fields)
    a.run()
    assert gr_stats(a)["saves"] == 2
    assert a.connector.delete_user("u1", cache_salt="acme") >= 2
    keys = [k for k in a.connector.gr.store.backend.backend.list_keys("") if not k.startswith("as1@")]
    assert keys and {UserKey.parse(k).tenant for k in keys} == {"-"}, keys
    b = engines(spec(pool))  # a fresh device: only the pool can serve
    p2 = history("u1") + candidates(2)
    for rid, salt in (("plain2", None), ("acme2", "acme"), ("globex2", "globex")):
        b.add_request(rid, p2, max_tokens=1, cache_salt=salt, extra_args=fields)
        b.run()
    assert b.first_schedule("plain2") == (HIST, CAND)
    assert b.first_schedule("acme2") == (0, HIST + CAND) and b.first_schedule("globex2") == (0, HIST + CAND)
    for rid in ("plain2", "acme2", "globex2"):
        assert_kv_exact(b, rid, p2)


def test_device_lru_keeps_tenants_apart(pool, engines):
    """The device-side user LRU keys users by (tenant, uid): deleting user u1 of one
    tenant drops that tenant's device copy only; u1 of the other tenant stays cached."""
    e = engines(spec(pool))  # the user LRU is on by default
    lru = e.connector.gr.sched.lru
    assert lru is not None
    fields = {"uid": "u1", "candidate_num": CAND}
    prompt = history("u1") + candidates(1)
    for rid, salt in (("plain", None), ("acme", "acme")):
        e.add_request(rid, prompt, max_tokens=1, cache_salt=salt, extra_args=fields)
    e.run()
    acme = next(t for t, u in lru.resident_users() if t != "-")
    assert sorted(lru.resident_users()) == sorted([("-", "u1"), (acme, "u1")])
    e.connector.delete_user("u1", cache_salt="acme")
    assert lru.resident_users() == [("-", "u1")]
    assert device_hit(e, prompt) == HIST  # the unsalted user's history is still on the device
    # the salted user's history is gone from the device and from the pool: a miss
    p = ask(e, "acme2", "u1", cand=2)
    e.run()
    e.add_request("acme3", prompt[:HIST] + candidates(3), max_tokens=1, cache_salt="acme", extra_args=fields)
    e.run()
    assert e.first_schedule("acme3") == (0, HIST + CAND)
    assert e.first_schedule("acme2") == (HIST, CAND)
    assert_kv_exact(e, "acme2", p)


class HostAllocs:
    """Bytes of new CPU tensors created by torch factory ops inside ``with`` (this thread)."""

    FACTORIES = ("empty", "zeros", "ones", "full", "new_", "_pin_memory", "clone", "_to_copy")

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch

                out = func(*args, **(kwargs or {}))
                name = func.overloadpacket.__name__
                if name.startswith(outer.FACTORIES) and isinstance(out, torch.Tensor) and out.device.type == "cpu":
                    outer.bytes += out.untyped_storage().nbytes()
                return out

        self.bytes = 0
        self.mode = Mode

    def wrap(self, obj, name: str) -> None:
        fn = getattr(obj, name)

        def counted(*a, **kw):
            with self.mode():
                return fn(*a, **kw)

        setattr(obj, name, counted)


def test_gr_staging_is_bounded_while_the_kv_cache_is_many_times_larger(pool, engines, monkeypatch):
    """A backend that cannot read device memory gets user objects through bounded host
    staging (staging_buffer_bytes per direction), not a host copy of the whole KV cache."""
    from ascendstore_vllm.gr import wiring
    from ascendstore_vllm.worker import AscendStoreWorker

    # the device path, on CPU KV
    monkeypatch.setattr(wiring.GRAttachment, "treat_kv_as_device", True)
    monkeypatch.setattr(AscendStoreWorker, "treat_kv_as_device", True)
    staging = 32 << 10
    allocs = HostAllocs()
    real_register = wiring.GRAttachment.register_kv_caches

    def register(self, kv_caches, **kw):
        with allocs.mode():
            real_register(self, kv_caches, **kw)
        for name in ("start_load", "save", "get_finished"):
            allocs.wrap(self, name)

    monkeypatch.setattr(wiring.GRAttachment, "register_kv_caches", register)
    s = spec(pool, num_blocks=2048, extra={"staging_buffer_bytes": staging})
    a = engines(s)
    kv_bytes = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in a.workers[0].kv_caches.values()}.values())
    assert kv_bytes >= 64 * 2 * staging
    assert a.workers[0].connector.gr.staging is not None
    ask(a, "a1", "u1", cand=1)
    a.run()
    b = engines(s)  # a fresh device: the pool swaps the history in through the staging
    p = ask(b, "b1", "u1", cand=2)
    b.run()
    assert b.first_schedule("b1") == (HIST, CAND)
    assert_kv_exact(b, "b1", p)
    st = gr_stats(b)
    assert (st["swapin_attempts"], st["swapin_successes"]) == (1, 1)
    # two engines, each: two staging buffers and two gather buffers (no larger than one;
    # device memory on a device, host memory here), plus small per-transfer scratch
    assert 0 < allocs.bytes <= 2 * (4 * staging) + (64 << 10), (allocs.bytes, kv_bytes)


def test_a_device_memory_backend_is_handed_only_memory_it_can_address(pool, engines, monkeypatch):
    """KV on a device and a backend that reads device memory, and registered memory
    only, with calls that may outlive their deadline (Mooncake over rdma, MemCache's
    device pool). A user object is a host header plus KV blocks, its token record
    host memory: handed over as they are, RDMA fails on the unregistered host
    memory and a device-memory copy takes host addresses for device ones. Every
    object must reach the backend in a buffer the connector owns, on the KV's
    device and registered. ``faulty``'s ``registered_only`` refuses, and counts,
    any transfer touching other memory (CPU tensors stand in for the device)."""
    from ascendstore_vllm.device import DeviceBuffers
    from ascendstore_vllm.gr import wiring
    from ascendstore_vllm.worker import AscendStoreWorker

    from ascendstore.chaos import live_backends

    monkeypatch.setattr(wiring.GRAttachment, "treat_kv_as_device", True)
    monkeypatch.setattr(AscendStoreWorker, "treat_kv_as_device", True)
    inner = {"backend": "local", "backend_config": {"name": pool, "capacity": "16MiB", "page_size": "4KiB"}}
    s = spec(pool, extra={"backend": "faulty", "backend_config": {
        **inner, "device_memory": True, "registered_only": True, "detaches": True}})
    a = engines(s)
    ask(a, "a1", "u1", cand=1)
    a.run()
    b = engines(s)  # a fresh device: the history comes from the pool
    p = ask(b, "b1", "u1", cand=2)
    b.run()
    refused = sum(x.injected["unregistered"] for x in live_backends())
    assert refused == 0, f"{refused} transfers touched memory the backend cannot address"
    assert b.first_schedule("b1") == (HIST, CAND)
    assert_kv_exact(b, "b1", p)
    st = gr_stats(b)
    assert (st["swapin_attempts"], st["swapin_successes"]) == (1, 1)
    for e in (a, b):
        staging = e.workers[0].connector.gr.staging
        assert staging is not None and type(staging.buffers) is DeviceBuffers


def test_adapter_and_multimodal_identity_are_part_of_the_user_keys(pool, engines):
    """KV computed under a LoRA adapter or with images is keyed by them too: the same
    uid and token ids under another adapter (or none, or another image) miss, the same
    adapter hits and swaps in byte-exact."""
    from types import SimpleNamespace

    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from ascendstore.keys import UserKey

    fields = {"uid": "u1", "candidate_num": CAND}

    def req(e, rid: str, cand: int, **kw) -> Request:
        prompt = history("u1") + candidates(cand)
        r = Request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True, extra_args=fields), None,
                    block_hasher=e.block_hasher, **kw)
        e.tokens[rid], e.prompt_len[rid] = list(prompt), len(prompt)
        return r

    ad1 = LoRARequest("ad1", 1, "/adapters/ad1")
    a = engines(spec(pool))
    a.scheduler.add_request(req(a, "a1", 1, lora_request=ad1))
    a.run()
    keys = [k for k in a.connector.gr.store.backend.backend.list_keys("") if not k.startswith("as1@")]
    assert keys and all(UserKey.parse(k).model.endswith("+" + keys[0].split("+")[1].split("@")[0]) for k in keys)

    b = engines(spec(pool))  # a fresh device: only the pool could serve
    sched = b.connector.gr.sched
    plain = req(b, "p", 2)
    other = req(b, "o", 2, lora_request=LoRARequest("ad2", 2, "/adapters/ad2"))
    moved = req(b, "m", 2, lora_request=LoRARequest("ad1", 1, "/adapters/ad1-retrained"))
    image = req(b, "i", 2, lora_request=ad1)
    image.mm_features = [SimpleNamespace(identifier="img-7", mm_position=SimpleNamespace(offset=4))]
    for r in (plain, other, moved, image):
        assert sched.get_num_new_matched_tokens(r, 0) == (0, False), r.request_id
    b.scheduler.add_request(req(b, "b1", 3, lora_request=ad1))
    b.run()
    assert b.first_schedule("b1") == (HIST, CAND)
    assert_kv_exact(b, "b1", history("u1") + candidates(3))
    assert gr_stats(b)["dram_hits"] == 1


def test_gr_fields_without_gr_mode_are_reported_once(pool, engines, caplog, connector_kind):
    if connector_kind == "gr":
        pytest.skip("AscendStoreGRConnector is always in GR mode")
    s = spec(pool)
    s.extra_config["gr"] = {"enabled": False}
    e = engines(s)
    with caplog.at_level("WARNING", logger="ascendstore_vllm.gr.wiring"):
        for k in range(3):
            ask(e, f"r{k}", "u1", cand=k)
            e.run()
    lines = [r for r in caplog.records if "gr.enabled is off" in r.getMessage()]
    assert len(lines) == 1 and "candidates included" in lines[0].getMessage()


class GatedGets:
    """Holds the worker's KV-object reads until ``open()``; notes the threads they ran on."""

    def __init__(self, guard, delay_s: float = 0.0) -> None:
        import random
        import threading

        self.gate = threading.Event()
        self.threads: list[str] = []
        self.real = guard.get
        self.delay_s = delay_s
        self.rng = random.Random()

        def get(keys, regions, timeout_s=None, *a, **kw):
            if any("@kv_cache" in k for k in keys):
                self.threads.append(threading.current_thread().name)
                if threading.current_thread() is not threading.main_thread():
                    assert self.gate.wait(30), "gate never opened"
                if self.delay_s:
                    import time

                    time.sleep(self.rng.uniform(0, self.delay_s))
            return self.real(keys, regions, timeout_s, *a, **kw)

        guard.get = get

    def open(self) -> None:
        self.gate.set()


def test_async_swap_in_overlaps_the_forward(pool, engines):
    """With load_async the swap-in runs on a transfer thread: the step goes on (other
    requests compute) while the pool read is held, the GR request waits in
    WAITING_FOR_REMOTE_KVS, and its KV lands byte-exact once the read completes."""
    from vllm.v1.request import RequestStatus

    s = spec(pool, extra={"load_async": True})
    a = engines(s)
    ask(a, "a1", "u1", cand=1)
    a.run()
    b = engines(s)
    gate = GatedGets(b.workers[0].connector.gr.store.backend)
    p = ask(b, "b1", "u1", cand=2)
    other = ask(b, "b2", "u2", cand=3)  # a miss: computes while u1's history is in flight
    for _ in range(3):
        b.step()
    assert b.scheduler.requests["b1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert "b2" in b.finished  # the engine kept computing while the swap-in was held
    assert gate.threads and "MainThread" not in gate.threads, gate.threads
    gate.open()
    b.run()
    assert b.first_schedule("b1") == (HIST, CAND)
    assert_kv_exact(b, "b1", p)
    assert_kv_exact(b, "b2", other)
    st = gr_stats(b)
    assert (st["dram_hits"], st["swapin_attempts"], st["swapin_successes"]) == (1, 1, 1)


def test_async_swap_in_aborted_while_loading_keeps_its_blocks(pool, engines):
    """An aborted request's blocks stay allocated until its swap-in has stopped
    writing them (finished_sending), so no later request reads bytes it landed."""
    s = spec(pool, num_blocks=40, max_model_len=256, extra={"load_async": True})
    a = engines(s)
    ask(a, "a1", "u1", cand=1)
    a.run()
    b = engines(s)
    gate = GatedGets(b.workers[0].connector.gr.store.backend)
    ask(b, "b1", "u1", cand=2)
    b.step()
    held = b.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    b.abort("b1")
    for _ in range(3):
        b.step()
    assert b.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == held  # not freed yet
    gate.open()
    b.run()
    # the blocks came back; other users fill the device and read only their own KV
    for k, uid in enumerate(["u2", "u3", "u4"]):
        p = ask(b, f"c{k}", uid, cand=k)
        b.run()
        assert_kv_exact(b, f"c{k}", p)


@pytest.mark.parametrize("seed", range(4))
def test_async_swap_ins_under_random_delays(pool, engines, seed):
    """Many users, async swap-ins with random pool delays: every history byte-exact."""
    s = spec(pool, num_blocks=96, extra={"load_async": True})
    a = engines(s)
    users = [f"u{i}" for i in range(6)]
    for i, uid in enumerate(users):
        ask(a, f"a{i}", uid, cand=i)
    a.run()
    b = engines(s)
    gate = GatedGets(b.workers[0].connector.gr.store.backend, delay_s=0.01)
    gate.open()
    rng = np.random.default_rng(seed)
    prompts = {}
    for k in range(12):
        uid = users[int(rng.integers(len(users)))]
        prompts[f"b{k}"] = ask(b, f"b{k}", uid, cand=100 + k)
        if rng.random() < 0.5:
            b.step()
    b.run()
    for rid, p in prompts.items():
        assert_kv_exact(b, rid, p)
    st = gr_stats(b)
    assert st["swapin_successes"] == st["swapin_attempts"] >= 1
