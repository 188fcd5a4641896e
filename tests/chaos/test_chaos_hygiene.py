"""Shutdown releases what the core took: shared memory, threads, descriptors.
Repeated open/use/close cycles leave the process as it was (bounded growth)."""

from __future__ import annotations

import gc
import time

import numpy as np
from chaos_helpers import MiB, faulty_config, local_config, pool_name, report

from ascendstore.chaos import shm_entries, snapshot
from ascendstore.chaos.hygiene import wait_for_threads
from ascendstore.contract import BackendContext, Region
from ascendstore.engine import BackendGuard, ChunkOp, TransferEngine
from ascendstore.registry import create_backend


def cycle(name: str, hang: bool = False) -> None:
    faults = {"hang_s": {"put": 0.5}} if hang else {}
    be = create_backend("faulty", faulty_config(local_config(name, capacity=2 * MiB), **faults),
                        BackendContext(timeout_s=0.2))
    guard = BackendGuard(be, 0.2)
    eng = TransferEngine(guard, name="hyg")
    buf = np.arange(64 << 10, dtype=np.uint8)
    ops = [ChunkOp(f"k{i}", [Region(buf.ctypes.data + i * 4096, 4096)], [i], i) for i in range(16)]
    eng.submit_save("r", ops)
    eng.wait("save", ["r"], 2)
    eng.load_now("r", ops)
    eng.shutdown(timeout_s=1)
    guard.close(timeout_s=1)
    if hang:
        time.sleep(0.6)  # the abandoned call finishes; the pool's last close unlinks it


def test_shutdown_releases_shm_threads_and_fds():
    name = pool_name("hyg")
    cycle(name)  # warm-up: imports, lazily created module state
    gc.collect()
    before = snapshot(shm_prefix="ascendstore")
    for _ in range(10):
        cycle(name)
    left = wait_for_threads("hyg-", 5) + wait_for_threads("ascendstore-io", 5)
    gc.collect()
    after = snapshot(shm_prefix="ascendstore")
    growth = before.growth(after)
    report("hygiene_cycles", cycles=10, before=before.summary(), after=after.summary(), growth=growth)
    assert not left, f"threads left running after shutdown: {left}"
    assert not [s for s in shm_entries() if name in s], "the pool's shared memory outlived its last client"
    assert growth["fds"] <= 0 and growth["shm_maps"] <= 0, growth
    assert growth["threads"] <= 0, (growth, before.new_threads(after))
    assert growth["rss_bytes"] < 32 * MiB


def test_shutdown_with_a_hung_call_is_bounded_and_cleans_up():
    name = pool_name("hyg")
    before = snapshot()
    t0 = time.monotonic()
    cycle(name, hang=True)
    took = time.monotonic() - t0
    left = wait_for_threads("hyg-", 3) + wait_for_threads("ascendstore-io", 3)
    after = snapshot()
    report("hygiene_hung_shutdown", took_s=round(took, 2), threads_left=left, growth=before.growth(after))
    assert took < 5, "shutdown waited on a hung backend call"
    assert not left
    assert not [s for s in shm_entries() if name in s]
