"""Pins on Mooncake (real master, real clients): a pin renews the master's read
lease on exactly the keys a lookup counted, so eviction pressure between lookup
and load cannot take them; through the real vLLM scheduler/worker lifecycle the
same pressure costs no load with pins and a recompute per chunk without."""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest
import torch
from conftest import backend_config

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.registry import create_backend

pytestmark = pytest.mark.mooncake

OBJ = 512 << 10
SMALL = 16 << 20  # Mooncake's smallest segment: 32 objects


def _client(master, **over):
    cfg = backend_config(master, global_segment_size=SMALL, **over)
    return create_backend("mooncake", cfg, BackendContext(role="worker"))


def _pressure(b, n: int = 200) -> int:
    """Write n objects (200: six times a segment); returns how many went in."""
    buf = np.full(OBJ, 3, np.uint8)
    region = [[Region(buf.ctypes.data, OBJ)]]
    ok = 0
    for i in range(n):
        st = b.put([f"pressure-{uuid.uuid4().hex}-{i}"], region, 5.0)[0]
        assert st in (Status.OK, Status.NO_SPACE), st
        ok += st is Status.OK
        if st is Status.NO_SPACE:
            time.sleep(0.05)  # the master evicts asynchronously, a few % per cycle
    return ok


@pytest.fixture
def clean_env(monkeypatch):
    for var in [v for v in os.environ if v.startswith("MOONCAKE_")]:
        monkeypatch.delenv(var)


def test_pin_renews_the_lease_of_exactly_the_counted_keys(master_factory, clean_env):
    """Eight objects written (a put leases nothing), four pinned, then six times
    the segment written by the same client: the pinned four survive byte-exact,
    the other four are evicted."""
    m = master_factory()
    b = _client(m)
    try:
        assert b.capabilities.pins
        buf = np.arange(OBJ // 8, dtype=np.uint64).view(np.uint8).copy()
        keys = [f"pin-{uuid.uuid4().hex[:8]}-{i}" for i in range(8)]
        assert b.put(keys, [[Region(buf.ctypes.data, OBJ)]] * 8, 5.0) == [Status.OK] * 8
        # An exists() answer from the cache renews nothing; pin() always asks the master.
        assert b.exists(keys[:4], 5.0) == [Status.OK] * 4
        hits0 = b.stats()["exists_cache_hits"]
        assert b.pin(keys[:4] + ["pin-absent"], 30.0, 5.0) == [Status.OK] * 4 + [Status.NOT_FOUND]
        assert b.stats()["exists_cache_hits"] == hits0, "a pin was answered from the exists cache"
        assert _pressure(b) > 32  # the master evicted to make room
        # one look at the end (it leases what it finds, so never during the pressure)
        assert list(b._store.batch_is_exist(keys)) == [1, 1, 1, 1, 0, 0, 0, 0]
        out = np.zeros(OBJ, np.uint8)
        for k in keys[:4]:
            assert b.get([k], [[Region(out.ctypes.data, OBJ)]], 5.0) == [Status.OK]
            assert np.array_equal(out, buf)
        assert b.unpin(keys[:4], 5.0) == [Status.OK] * 4  # no call: the lease lapses by itself
    finally:
        b.close()


def test_lease_pins_can_be_turned_off(master_factory, clean_env):
    b = _client(master_factory(), lease_pins=False)
    try:
        assert not b.capabilities.pins
    finally:
        b.close()


@pytest.mark.vllm
def test_connector_eviction_between_lookup_and_load(master_factory, clean_env):
    """Pressure from another client between the scheduler's lookup and the
    worker's load: every counted chunk loads. (Without pins Mooncake 0.3's own
    lookup lease does much the same for the master's TTL, so no "without" case
    here: see docs/backends/mooncake.md.)"""
    pytest.importorskip("vllm")
    from ascendstore_vllm.testing import EngineHarness, EngineSpec

    m = master_factory()
    extra = {
        "backend": "mooncake",
        "backend_config": backend_config(m, global_segment_size=SMALL, exists_cache_ttl_s=0),
        "pin_lease_ms": 10_000,
    }
    prompt = [(13 * i + 5) % 911 for i in range(100)]  # 6 chunks
    eng = EngineHarness(EngineSpec(extra_config=extra))
    other = _client(m)  # another engine's client: its writes push the pool over its watermark
    try:
        eng.add_request("fill", prompt)
        eng.run()
        assert eng.scheduler.reset_prefix_cache()
        conn, fired = eng.connector, []
        orig = conn.update_state_after_alloc

        def hooked(request, blocks, n):
            orig(request, blocks, n)
            if n > 0 and not fired:
                fired.append(_pressure(other, 120))

        conn.update_state_after_alloc = hooked
        eng.add_request("again", prompt)
        eng.run()
        assert fired, "the lookup found nothing to load"
        s = eng.stats_total()
        assert all(torch.equal(x, y) for x, y in zip(eng.prompt_kv("again"), eng.expected_prompt_kv(prompt),
                                                     strict=True))
        assert s.get("lookup_load_misses", 0) == 0 and s["load_ops"] == 6, s
        assert eng.connector.scheduler.pinned_requests() == set()
    finally:
        eng.close()
        other.close()
