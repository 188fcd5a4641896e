"""Worker-side GR hooks against a backend that never evicts by itself."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))
from ascendstore_vllm.gr.hooks import GRLoad, GRPlan, GRWorkerHooks
from test_gr_dirbackend import DirBackend
from test_gr_store import FakeDevice, history, make_store


def test_unreadable_kv_drops_the_record_so_the_history_is_saved_again(tmp_path):
    backend = DirBackend(tmp_path)
    store = make_store(backend)
    dev = FakeDevice()
    hist = history(16)
    store.save_kv("u1", hist, dev.regions(range(4)))
    rec = store.lookup("u1", np.asarray(hist)).records[0]
    backend.remove(store.kv_keys("u1", 0), 1)  # the KV object is gone, the record is not
    assert store.lookup("u1", np.asarray(hist)).hit_tokens == 16  # a non-evicting backend cannot tell

    hooks = GRWorkerHooks(store)
    out = FakeDevice(seed=3)
    hooks.block_regions = lambda ids: [[[r] for r in layer] for layer in out.regions(ids)]
    failed = hooks.load(GRPlan(loads=[GRLoad("r1", "u1", [rec.generation], 4, [10, 11, 12, 13])]))
    assert failed == {10, 11, 12, 13}
    assert (store.stats.swapin_attempts, store.stats.swapin_successes) == (1, 0)
    assert store.lookup("u1", np.asarray(hist)).hit_tokens == 0  # next request misses and re-saves
