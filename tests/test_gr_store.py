"""GR user store over a real backend: hits, byte-exact KV, lifecycle."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from test_gr_dirbackend import DirBackend

from ascendstore.config import GRConfig
from ascendstore.contract import Region, Status
from ascendstore.gr import GRInputError, GRStats, UserStore, parse_gr_request
from ascendstore.gr.records import TokenRecord, capacity_class, class_search_order
from ascendstore.keys import KEY_VERSION, tenant_id
from ascendstore.registry import create_backend

BS = 4  # tokens per block
LAYERS = 3
BLOCK_BYTES = 48


class FakeDevice:
    """KV caches as host memory: [layer][block] -> BLOCK_BYTES bytes."""

    def __init__(self, num_blocks: int = 64, seed: int = 0) -> None:
        self.kv = np.random.default_rng(seed).integers(0, 255, (LAYERS, num_blocks, BLOCK_BYTES), dtype=np.uint8)

    def regions(self, block_ids):
        return [[Region(self.kv[layer, b].ctypes.data, BLOCK_BYTES) for b in block_ids] for layer in range(LAYERS)]

    def regions_or_none(self, block_ids):
        return [[None if b is None else Region(self.kv[layer, b].ctypes.data, BLOCK_BYTES) for b in block_ids]
                for layer in range(LAYERS)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(params=["dir", "local"])
def backend(request, tmp_path):
    """The store over the test directory backend and over the embedded ``local`` pool."""
    if request.param == "dir":
        b = DirBackend(tmp_path)
    else:
        b = create_backend("local", {"name": "grs-" + uuid.uuid4().hex[:8], "capacity": "8MiB",
                                     "page_size": "4KiB"})
    yield b
    b.close()


def make_store(backend, *, rank=0, world=1, cfg=None, clock=None, layerwise=False, model="m.1", stats=None):
    return UserStore(backend, model=model, world_size=world, worker_id=rank, block_size=BS,
                     config=cfg or GRConfig(enabled=True), num_layers=LAYERS, layerwise=layerwise,
                     clock=clock or Clock(), stats=stats)


def history(n, seed=1):
    return np.random.default_rng(seed).integers(0, 50000, n).tolist()


# -- request inputs -----------------------------------------------------------------
def test_inputs_from_extra_args_and_kv_transfer_params():
    r = parse_gr_request(None, {"uid": "u7", "candidate_num": 5}, 40)
    assert (r.uid, r.history_len, r.tenant) == ("u7", 35, "-")
    r = parse_gr_request({"uid": 12, "user_history_len": 30}, {"uid": "12"}, 40, cache_salt="acme")
    assert (r.uid, r.history_len, r.tenant) == ("12", 30, tenant_id("acme"))
    assert parse_gr_request({"other": 1}, {}, 40) is None
    assert parse_gr_request(None, None, 40) is None


@pytest.mark.parametrize(
    "ktp, extra, needle",
    [
        ({"uid": "a"}, None, "user_history_len"),
        ({"uid": "a", "user_history_len": 50}, None, "exceeds the prompt"),
        ({"uid": "a", "candidate_num": -1}, None, "candidate_num"),
        ({"uid": "a", "user_history_len": 10, "candidate_num": 5}, None, "disagree"),
        ({"uid": "a", "user_history_len": 10}, {"uid": "b"}, "given twice"),
        ({"uid": "bad uid", "user_history_len": 1}, None, "[A-Za-z0-9._:-]"),
        ({"uid": KEY_VERSION, "user_history_len": 1}, None, "reserved"),
        ({"uid": "a", "user_history_len": "x"}, None, "non-negative integer"),
    ],
)
def test_inputs_bad_values_name_the_field(ktp, extra, needle):
    with pytest.raises(GRInputError, match=None) as ei:
        parse_gr_request(ktp, extra, 40)
    assert needle in str(ei.value)


# -- records -------------------------------------------------------------------------
def test_record_roundtrip_and_size_classes():
    rec = TokenRecord(np.arange(300, dtype=np.int32), 75, 42, 1.5, 999, "t1234")
    back = TokenRecord.decode(rec.encode())
    assert back.n_tokens == 300 and (back.tokens == rec.tokens).all()
    assert (back.kv_blocks, back.generation, back.written_at, back.kv_bytes, back.tenant) == (75, 42, 1.5, 999, "t1234")
    assert capacity_class(1) == 256 and capacity_class(257) == 512
    order = class_search_order(700, 4096)
    assert order[0] == 1024 and sorted(order) == [256, 512, 1024, 2048, 4096]


# -- hits and KV ---------------------------------------------------------------------
def test_save_lookup_load_byte_exact(backend):
    dev_a, dev_b = FakeDevice(seed=1), FakeDevice(seed=2)
    hist = history(22)  # 5 full blocks + 2 tokens
    worker = make_store(backend)
    sched = make_store(backend)  # another process/instance: its own index and stats
    miss = sched.lookup("u1", hist)
    assert miss.hit_tokens == 0 and not miss.matches(20)
    src_blocks = [3, 9, 4, 10, 11]
    assert worker.save_kv("u1", hist[:20], dev_a.regions(src_blocks)) is Status.OK
    # every request of the user with rotating candidates hits the whole history
    for cand in range(3):
        hit = sched.lookup("u1", hist + history(6, seed=100 + cand))
        assert hit.hit_tokens == 20 and hit.records[0].kv_blocks == 5
    assert sched.lookup("u1", hist).matches(20)
    # swap in on "another engine" into different block ids, byte for byte
    dst_blocks = [20, 21, 22, 23, 24]
    rec = hit.records[0]
    assert worker.load_kv("u1", rec.generation, rec.kv_blocks, dev_b.regions(dst_blocks)) is Status.OK
    assert (dev_b.kv[:, dst_blocks] == dev_a.kv[:, src_blocks]).all()
    # partial device hit: the first two blocks are already there, load only the rest
    dev_c = FakeDevice(seed=3)
    before = dev_c.kv[:, [0, 1]].copy()
    st = worker.load_kv("u1", rec.generation, rec.kv_blocks, dev_c.regions_or_none([None, None, 30, 31, 32]))
    assert st is Status.OK
    assert (dev_c.kv[:, [30, 31, 32]] == dev_a.kv[:, src_blocks[2:]]).all()
    assert (dev_c.kv[:, [0, 1]] == before).all()


def test_history_shorter_than_stored_and_other_users_isolated(backend):
    dev = FakeDevice()
    s = make_store(backend)
    hist = history(40)
    s.save_kv("u1", hist, dev.regions(range(10)))
    assert s.lookup("u1", hist[:17]).hit_tokens == 16  # a prefix of the stored history
    assert s.lookup("u2", hist).hit_tokens == 0
    assert make_store(backend, model="other.2").lookup("u1", hist).hit_tokens == 0


def test_all_ranks_must_hold_the_history(backend):
    dev = FakeDevice()
    hist = history(16)
    r0, r1 = make_store(backend, rank=0, world=2), make_store(backend, rank=1, world=2)
    r0.save_kv("u1", hist, dev.regions(range(4)))
    assert r0.lookup("u1", hist).hit_tokens == 0
    r1.save_kv("u1", hist, dev.regions(range(4, 8)))
    hit = r0.lookup("u1", hist)
    assert hit.hit_tokens == 16 and hit.records[0].generation != hit.records[1].generation
    assert r1.load_kv("u1", hit.records[1].generation, 4, FakeDevice(seed=9).regions(range(4))) is Status.OK


def test_size_class_change_found_with_fallback(backend):
    dev = FakeDevice(num_blocks=200)
    s = make_store(backend)
    hist = history(600)
    s.save_kv("u1", hist[:240], dev.regions(range(60)))  # class 256
    hit = s.lookup("u1", hist)  # request class 1024: found after INVALID fallbacks
    assert hit.hit_tokens == 240


def test_rewritten_history_invalidates_stale_tail(backend):
    dev = FakeDevice()
    stats = GRStats()
    s = make_store(backend, stats=stats)
    old = history(32)
    s.save_kv("u1", old, dev.regions(range(8)))
    new = old[:13] + history(19, seed=7)  # diverges inside block 3
    hit = s.lookup("u1", new)
    assert hit.rewritten and hit.hit_tokens == 12 and stats.invalidations == 1
    # the stale tail is gone for everyone, including a request still carrying the old history
    assert make_store(backend).lookup("u1", old).hit_tokens == 12
    # the kept prefix is still loadable byte-exact (same KV object, same generation)
    rec = hit.records[0]
    out = FakeDevice(seed=5)
    blocks = [40, 41, 42] + [None] * (rec.kv_blocks - 3)
    assert s.load_kv("u1", rec.generation, rec.kv_blocks, out.regions_or_none(blocks)) is Status.OK
    assert (out.kv[:, [40, 41, 42]] == dev.kv[:, [0, 1, 2]]).all()
    # a history that differs from the first token drops the user entirely
    assert s.lookup("u1", history(32, seed=8)).hit_tokens == 0
    assert list(backend.list_keys("u1@")) == []


def test_concurrent_rewrite_detected_by_generation(backend):
    dev = FakeDevice()
    s = make_store(backend)
    hist = history(16)
    s.save_kv("u1", hist, dev.regions(range(4)))
    rec = s.lookup("u1", hist).records[0]
    s.save_kv("u1", hist, dev.regions(range(4, 8)))  # another writer replaced the object
    assert s.load_kv("u1", rec.generation, 4, FakeDevice(seed=4).regions(range(4))) is Status.CORRUPT


# -- lifecycle -------------------------------------------------------------------------
def test_ttl_expires_idle_users_and_hits_refresh(backend):
    clock = Clock()
    stats = GRStats()
    s = make_store(backend, cfg=GRConfig(enabled=True, ttl_s=100), clock=clock, stats=stats)
    dev = FakeDevice()
    hist = history(16)
    s.save_kv("u1", hist, dev.regions(range(4)))
    s.save_kv("u2", hist, dev.regions(range(4)))
    clock.t += 60
    assert s.lookup("u1", hist).hit_tokens == 16  # > ttl/2: refreshed
    clock.t += 60  # u1 used 60 s ago, u2 written 120 s ago
    assert s.lookup("u1", hist).hit_tokens == 16
    assert s.lookup("u2", hist).hit_tokens == 0 and stats.expired == 1
    assert list(backend.list_keys("u2@")) == []
    clock.t += 500
    assert s.sweep_expired() == 1 and list(backend.list_keys()) == []


def test_user_quota_keeps_leading_blocks(backend):
    stats = GRStats()
    quota = 3 * LAYERS * BLOCK_BYTES  # three blocks' worth
    s = make_store(backend, cfg=GRConfig(enabled=True, user_quota_bytes=quota), stats=stats)
    dev = FakeDevice()
    hist = history(40)
    assert s.save_kv("u1", hist, dev.regions(range(10))) is Status.OK
    hit = s.lookup("u1", hist)
    assert hit.hit_tokens == 12 and stats.quota_truncations == 1
    tiny = make_store(backend, cfg=GRConfig(enabled=True, user_quota_bytes=10))
    assert tiny.save_kv("u2", hist, dev.regions(range(10))) is Status.NO_SPACE


def test_tenant_quota_evicts_least_recently_used_users_of_that_tenant(backend):
    clock = Clock()
    per_user = 4 * LAYERS * BLOCK_BYTES
    cfg = GRConfig(enabled=True, tenant_quota_bytes=2 * per_user)
    s = make_store(backend, cfg=cfg, clock=clock)
    dev = FakeDevice()
    hist = history(16)
    for uid, tenant in (("a1", "tA"), ("a2", "tA"), ("b1", "tB")):
        clock.t += 1
        s.save_kv(uid, hist, dev.regions(range(4)), tenant=tenant)
    clock.t += 1
    assert s.lookup("a1", hist, tenant="tA").hit_tokens == 16  # a1 most recent: a2 is the tenant's LRU user
    assert s.make_room("a3", "tA", per_user)
    assert s.lookup("a2", hist, tenant="tA").hit_tokens == 0
    assert s.lookup("a1", hist, tenant="tA").hit_tokens == 16
    assert s.lookup("b1", hist, tenant="tB").hit_tokens == 16
    # protected (running) users are never evicted; then there is no room
    assert not s.make_room("a4", "tA", 2 * per_user, protect={"a1"})
    assert not s.make_room("a5", "tA", 3 * per_user)
    assert s.stats.quota_evictions == 1 and s.stats.quota_skips == 2


def test_delete_user_everywhere_leaves_others(backend):
    dev = FakeDevice()
    hist = history(16)
    m1, m2 = make_store(backend), make_store(backend, model="other.2", layerwise=True)
    m1.save_kv("u1", hist, dev.regions(range(4)))
    m2.save_kv("u1", hist, dev.regions(range(4)))
    m1.save_kv("u10", hist, dev.regions(range(4)))
    backend.put([f"{KEY_VERSION}@-@ab@h0p0c0d0@all@ff"], [[Region(dev.kv.ctypes.data, 8)]], 1)
    n = m1.delete_user("u1")
    assert n == 2 + 1 + LAYERS
    assert sorted(k.split("@")[0] for k in backend.list_keys()) == [KEY_VERSION, "u10", "u10"]
    with pytest.raises(GRInputError):
        m1.delete_user(KEY_VERSION)


def test_layerwise_objects_per_layer(backend):
    dev = FakeDevice()
    s = make_store(backend, layerwise=True)
    hist = history(12)
    s.save_kv("u1", hist, dev.regions([5, 6, 7]))
    assert sorted(backend.list_keys("u1@")) == sorted(
        [s.token_key("u1", 0)] + [f"u1@m.1@1@0@kv_cache@{layer}" for layer in range(LAYERS)]
    )
    rec = s.lookup("u1", hist).records[0]
    out = FakeDevice(seed=11)
    assert s.load_kv("u1", rec.generation, 3, out.regions([0, 1, 2]), layers=[1]) is Status.OK
    assert (out.kv[1, :3] == dev.kv[1, 5:8]).all() and not (out.kv[0, :3] == dev.kv[0, 5:8]).all()


def test_backend_failure_degrades_to_miss(tmp_path):
    backend = DirBackend(tmp_path)
    dev = FakeDevice()
    s = make_store(backend)
    hist = history(16)
    s.save_kv("u1", hist, dev.regions(range(4)))
    backend.close()
    assert s.lookup("u1", hist).hit_tokens == 0
    assert s.save_kv("u1", hist, dev.regions(range(4))) is Status.UNAVAILABLE
    assert s.load_kv("u1", 1, 4, dev.regions(range(4))) is Status.UNAVAILABLE


def test_full_pool_skips_the_write_and_leaves_no_record(tmp_path):
    backend = DirBackend(tmp_path, capacity=200)
    dev = FakeDevice()
    s = make_store(backend)
    hist = history(16)
    assert s.save_kv("u1", hist, dev.regions(range(4))) is Status.NO_SPACE
    assert s.lookup("u1", hist).hit_tokens == 0 and s.stats.save_failures == 1


def test_history_larger_than_backend_objects_keeps_leading_blocks(tmp_path, monkeypatch):
    from ascendstore.contract import Capabilities

    backend = DirBackend(tmp_path)
    monkeypatch.setattr(DirBackend, "capabilities", property(lambda self: Capabilities(
        listing=True, max_object_bytes=32 + 4 * LAYERS * BLOCK_BYTES)))
    s = make_store(backend)
    dev = FakeDevice()
    hist = history(40)
    assert s.save_kv("u1", hist, dev.regions(range(10))) is Status.OK
    assert s.lookup("u1", hist).hit_tokens == 4 * BS
    lw = make_store(backend, layerwise=True, model="lw.1")  # one object per layer: 3x the blocks fit
    assert lw.save_kv("u1", hist, dev.regions(range(10))) is Status.OK
    assert lw.lookup("u1", hist).hit_tokens == 10 * BS


def test_byte_counters(backend):
    s = make_store(backend)
    dev = FakeDevice()
    hist = history(16)
    s.save_kv("u1", hist, dev.regions(range(4)))
    rec = s.lookup("u1", hist).records[0]
    s.load_kv("u1", rec.generation, 4, FakeDevice(seed=2).regions_or_none([None, 1, 2, None]))
    assert s.stats.bytes_saved == 4 * LAYERS * BLOCK_BYTES
    assert s.stats.bytes_loaded == 2 * LAYERS * BLOCK_BYTES


# -- tenants ---------------------------------------------------------------------------
GLOBEX = tenant_id("globex")  # 17 characters, as every salted tenant


def test_user_keys_name_the_tenant_and_round_trip():
    from ascendstore.keys import UserKey, split_user_part

    k = UserKey("42", "m.1", 2, 1, "kv_cache", 3, GLOBEX)
    assert k.text() == f"{GLOBEX}~42@m.1@2@1@kv_cache@3" and UserKey.parse(k.text()) == k
    assert UserKey("42", "m.1", 2, 1, "token_id").text() == "42@m.1@2@1@token_id"  # no tenant: unchanged
    assert split_user_part(f"{GLOBEX}~4.2") == ("4.2", GLOBEX) and split_user_part("4.2") == ("4.2", "-")
    # no uid of one tenant (or of none) spells another tenant's user: '~' is not in a uid
    with pytest.raises(ValueError):
        UserKey(f"{GLOBEX}~42", "m", 1, 0, "token_id")
    for bad in ("-~42@m@1@0@token_id", "a~b~42@m@1@0@token_id", "t.x~42@m@1@0@token_id"):
        with pytest.raises(ValueError):
            UserKey.parse(bad)
    assert not k.text().startswith(UserKey.user_prefix("42"))
    assert k.text().startswith(UserKey.user_prefix("42", GLOBEX))


def test_salted_users_save_and_hit(backend):
    """A 17-character tenant id fits the record: salted users are pooled."""
    s = make_store(backend)
    dev, out = FakeDevice(seed=1), FakeDevice(seed=2)
    hist = history(16)
    assert s.save_kv("42", hist, dev.regions(range(4)), tenant=GLOBEX) is Status.OK
    hit = s.lookup("42", hist, tenant=GLOBEX)
    assert hit.hit_tokens == 16 and hit.records[0].tenant == GLOBEX
    rec = hit.records[0]
    assert s.load_kv("42", rec.generation, 4, out.regions(range(8, 12)), tenant=GLOBEX) is Status.OK
    assert (out.kv[:, 8:12] == dev.kv[:, 0:4]).all()


def test_same_uid_under_two_tenants_is_two_users(backend):
    s = make_store(backend)
    plain, salted = FakeDevice(seed=1), FakeDevice(seed=2)
    hist = history(16)
    assert s.save_kv("42", hist, plain.regions(range(4))) is Status.OK
    assert s.lookup("42", hist, tenant=GLOBEX).hit_tokens == 0, "another tenant's user was served"
    assert s.lookup("42", hist).hit_tokens == 16, "the miss must not disturb the other tenant's user"
    assert s.save_kv("42", hist, salted.regions(range(4)), tenant=GLOBEX) is Status.OK
    for tenant, dev in (("-", plain), (GLOBEX, salted)):
        rec = s.lookup("42", hist, tenant=tenant).records[0]
        out = FakeDevice(seed=9)
        assert s.load_kv("42", rec.generation, 4, out.regions(range(4)), tenant=tenant) is Status.OK
        assert (out.kv[:, 0:4] == dev.kv[:, 0:4]).all(), tenant
    # delete is per tenant: the other tenant's user stays
    assert s.delete_user("42", tenant=GLOBEX) == 2
    assert s.lookup("42", hist, tenant=GLOBEX).hit_tokens == 0 and s.lookup("42", hist).hit_tokens == 16
    s.save_kv("42", hist, salted.regions(range(4)), tenant=GLOBEX)
    assert s.delete_user("42") == 2
    assert s.lookup("42", hist).hit_tokens == 0 and s.lookup("42", hist, tenant=GLOBEX).hit_tokens == 16


def test_record_of_another_tenant_is_a_miss_and_is_kept(backend):
    s = make_store(backend)
    hist = history(16)
    s.save_kv("42", hist, FakeDevice().regions(range(4)), tenant=GLOBEX)
    key = s.token_key("42", 0, GLOBEX)
    rec = s.lookup("42", hist, tenant=GLOBEX).records[0]
    forged = TokenRecord(rec.tokens, rec.kv_blocks, rec.generation, rec.written_at, rec.kv_bytes, "-")
    buf = s._record_buffer("42", 0, forged)
    backend.remove([key], 1)
    assert backend.put([key], [[Region(buf.ctypes.data, buf.nbytes)]], 1) == [Status.OK]
    assert s.lookup("42", hist, tenant=GLOBEX).hit_tokens == 0
    assert backend.exists(s.user_keys("42", GLOBEX), 1) == [Status.OK] * 2, "nothing of it was deleted"


@pytest.mark.parametrize("damage", ["old-format", "non-ascii-tenant", "no-tenant", "truncated"])
def test_malformed_records_are_a_miss_never_a_crash(backend, damage):
    s = make_store(backend)
    hist = history(16)
    s.save_kv("42", hist, FakeDevice().regions(range(4)), tenant=GLOBEX)
    key = s.token_key("42", 0, GLOBEX)
    buf = s._record_buffer("42", 0, s.lookup("42", hist, tenant=GLOBEX).records[0])
    if damage == "old-format":
        buf[:8] = np.frombuffer(b"ASGRTOK1", dtype=np.uint8)
    elif damage == "non-ascii-tenant":
        buf[40:42] = 0xFF
    elif damage == "no-tenant":
        buf[40:72] = 0
    else:
        buf = buf[:40]
    with pytest.raises(ValueError):
        TokenRecord.decode(buf)
    backend.remove([key], 1)
    backend.put([key], [[Region(buf.ctypes.data, buf.nbytes)]], 1)
    assert s.lookup("42", hist, tenant=GLOBEX).hit_tokens == 0


def test_record_encode_checks_the_tenant_field():
    toks = np.arange(8, dtype=np.int32)
    assert TokenRecord.decode(TokenRecord(toks, 2, 1, 0.0, 8, "t" * 32).encode()).tenant == "t" * 32
    for bad in ("", "t" * 33):
        with pytest.raises(ValueError):
            TokenRecord(toks, 2, 1, 0.0, 8, bad).encode()


def test_lifecycle_knows_users_per_tenant(backend):
    clock = Clock()
    per_user = 4 * LAYERS * BLOCK_BYTES
    s = make_store(backend, cfg=GRConfig(enabled=True, ttl_s=100, tenant_quota_bytes=per_user), clock=clock)
    hist = history(16)
    s.save_kv("42", hist, FakeDevice().regions(range(4)))
    s.save_kv("42", hist, FakeDevice().regions(range(4)), tenant=GLOBEX)
    # each tenant holds one user of the quota: neither evicts the other's uid 42
    assert s.make_room("7", "-", 0) and s.make_room("42", GLOBEX, per_user)
    assert s.lookup("42", hist).hit_tokens == 16 and s.lookup("42", hist, tenant=GLOBEX).hit_tokens == 16
    fresh = make_store(backend, clock=clock)  # another process
    if backend.capabilities.listing:
        assert sorted(fresh.known_users()) == sorted([("42", "-"), ("42", GLOBEX)])
        assert fresh.rebuild_index() == 2 and fresh.index.tenant_bytes(GLOBEX) == per_user
    clock.t += 500
    assert s.sweep_expired() == 2 and list(backend.list_keys()) == []
