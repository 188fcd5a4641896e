"""GRStaging on its own: what the backend is handed, when a buffer is retired
and let go (registration included), and what a get copies back.

CPU tensors stand in for device KV; the "backend" here is the ``call`` a
UserStore would make, so each test decides what the call does and whether it
is still running."""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from ascendstore_vllm.device import HostStaging
from ascendstore_vllm.gr import staging as staging_mod
from ascendstore_vllm.gr.staging import MAX_RETIRED, GRStaging

from ascendstore.contract import Region, Status


class Registry:
    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def register(self, regions: list[Region]) -> Status:
        for r in regions:
            self.live[r.addr] = r.length
            self.calls.append(("register", r.addr))
        return Status.OK

    def unregister(self, regions: list[Region]) -> Status:
        for r in regions:
            del self.live[r.addr]
            self.calls.append(("unregister", r.addr))
        return Status.OK

    def holds(self, r: Region) -> bool:
        return any(a <= r.addr and r.addr + r.length <= a + n for a, n in self.live.items())


def _setup(capacity: int = 4096):
    g = torch.Generator().manual_seed(3)
    kv = {"l0": torch.randint(0, 256, (2, 8, 256), dtype=torch.uint8, generator=g)}
    reg = Registry()
    st = GRStaging(HostStaging(kv, capacity), reg.register, reg.unregister)
    header = np.arange(64, dtype=np.uint8)
    blocks = [Region(kv["l0"][h, b].data_ptr(), 256) for h in (0, 1) for b in (2, 3)]
    return kv, reg, st, header, [Region(header.ctypes.data, 64), *blocks]


def _bytes(kv, header, regions) -> bytes:
    flat = kv["l0"].reshape(-1)
    base = flat.data_ptr()
    out = header.tobytes()
    for r in regions[1:]:
        out += flat[r.addr - base : r.addr - base + r.length].numpy().tobytes()
    return out


def test_put_hands_only_registered_buffer_bytes_and_a_get_copies_back_what_arrived():
    kv, reg, st, header, obj = _setup()
    want = _bytes(kv, header, obj)
    seen: dict[str, bytes] = {}

    def put(staged, buf):
        assert all(reg.holds(r) for rs in staged for r in rs), "handed memory never registered"
        (r,) = staged[0]
        seen["obj"] = ctypes.string_at(r.addr, r.length)
        return [Status.OK], None

    assert st.transfer("put", [obj], put) == ([Status.OK], None)
    assert seen["obj"] == want
    kv["l0"].zero_()
    header[:] = 0

    def get(status):
        def call(staged, buf):
            (r,) = staged[0]
            ctypes.memmove(r.addr, seen["obj"], r.length)
            return [status], None
        return call

    st.transfer("get", [obj], get(Status.NOT_FOUND))
    assert _bytes(kv, header, obj) == bytes(len(want)), "an object that did not arrive was copied back"
    st.transfer("get", [obj], get(Status.OK))
    assert _bytes(kv, header, obj) == want


def test_a_buffer_under_a_late_call_is_retired_then_let_go_and_transfers_fail_fast_past_the_bound():
    _, reg, st, _, obj = _setup()
    running = {"ended": False}
    used: list[int] = []

    def late(staged, buf):
        used.append(buf.data_ptr())
        return [Status.TIMEOUT], lambda: running["ended"]

    for _ in range(MAX_RETIRED):
        assert st.transfer("get", [obj], late)[0] == [Status.TIMEOUT]
    assert len(set(used)) == MAX_RETIRED, "a retired buffer was handed out again while its call ran"
    assert st.retired() == MAX_RETIRED
    assert all(u in reg.live for u in used), "a retired buffer was unregistered while its call ran"
    calls = len(used)
    assert st.transfer("get", [obj], late)[0] == [Status.TIMEOUT]
    assert len(used) == calls, "past the bound, a transfer must fail without a call"
    running["ended"] = True
    assert st.retired() == 0
    assert not any(u in reg.live for u in used), "a retired buffer was never unregistered"
    assert st.transfer("get", [obj], lambda s, b: ([Status.OK], None))[0] == [Status.OK]


def test_an_object_larger_than_the_buffer_goes_through_a_temporary_one(caplog):
    kv, reg, st, header, obj = _setup(capacity=512)
    before = dict(reg.live)
    handed: list[int] = []

    def put(staged, buf):
        handed.append(buf.numel())
        assert all(reg.holds(r) for rs in staged for r in rs)
        return [Status.OK], None

    with caplog.at_level("WARNING", logger=staging_mod.__name__):
        assert st.transfer("put", [obj], put)[0] == [Status.OK]
    assert handed == [64 + 4 * 256]
    assert reg.live == before, "the temporary buffer stayed registered"
    assert "exceed the 512-byte staging buffer" in caplog.text
