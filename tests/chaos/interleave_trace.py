"""Debug aid for the interleaving test (ASCENDSTORE_INTERLEAVE_TRACE=1): a history
per pool key of every backend call under the ``faulty`` wrapper (digest and first
bytes of what was put or got, status, thread, time; gets and puts that answered
after their timeout) and of every load the transfer engines finished (request,
blocks, digest of the bytes that landed), dumped with the tokens the fake KV of
positions 0-15 encodes for each request that read wrong KV.

This is how the pins-on "wrong KV read" was found: the key's get read the bytes
its put stored, answered 0.199 s into a 0.15 s timeout (inside the guard's
grace), and the load landed a5a5a5a5: the ``faulty`` late_garbage get scribbled
and still answered OK (fixed there: it answers TIMEOUT).
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
import time
from collections import defaultdict, deque
from typing import Any

EVENTS: dict[str, deque] = defaultdict(lambda: deque(maxlen=64))
LOADS: deque = deque(maxlen=20000)
T0 = time.monotonic()
_lock = threading.Lock()


def _digest(regions) -> str:
    h = hashlib.blake2b(digest_size=6)
    first = None
    for r in regions:
        if r.length:
            b = ctypes.string_at(r.addr, r.length)
            if first is None:
                first = b[:4].hex()
            h.update(b)
    return f"{h.hexdigest()}:{first}"


def _rec(key: str, **kw: Any) -> None:
    kw["t"] = round(time.monotonic() - T0, 4)
    kw["thr"] = threading.current_thread().name
    with _lock:
        EVENTS[key].append(kw)


class _Traced:
    def __init__(self, inner: Any, tag: str) -> None:
        self._inner, self._tag = inner, tag

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def put(self, keys, regions, timeout_s):
        digs = [_digest(r) for r in regions]
        t = time.monotonic()
        out = self._inner.put(keys, regions, timeout_s)
        for k, d, s in zip(keys, digs, out, strict=False):
            _rec(k, op="put", who=self._tag, st=str(s), dig=d, dt=round(time.monotonic() - t, 4))
        return out

    def get(self, keys, regions, timeout_s):
        out = self._inner.get(keys, regions, timeout_s)
        for k, r, s in zip(keys, regions, out, strict=False):
            _rec(k, op="get", who=self._tag, st=str(s), dig=_digest(r))
        return out

    def _simple(self, op, keys, *a):
        out = getattr(self._inner, op)(keys, *a)
        for k, s in zip(keys, out, strict=False):
            _rec(k, op=op, who=self._tag, st=str(s))
        return out

    def exists(self, keys, timeout_s):
        return self._simple("exists", keys, timeout_s)

    def remove(self, keys, timeout_s):
        return self._simple("remove", keys, timeout_s)

    def pin(self, keys, lease_s, timeout_s):
        return self._simple("pin", keys, lease_s, timeout_s)

    def unpin(self, keys, timeout_s):
        return self._simple("unpin", keys, timeout_s)


def install() -> None:
    from ascendstore.chaos import faulty
    from ascendstore.engine import transfer

    orig_init = faulty.FaultyBackend.__init__

    def init(self, inner, options, ctx):
        orig_init(self, inner, options, ctx)
        self.inner = _Traced(inner, f"{ctx.role}{ctx.rank}@{id(self) % 10000}")

    faulty.FaultyBackend.__init__ = init

    orig_keyed = faulty.FaultyBackend._keyed

    def keyed(self, op, keys, regions, timeout_s, call=None):
        t = time.monotonic()
        out = orig_keyed(self, op, keys, regions, timeout_s, call)
        dt = time.monotonic() - t
        if op in ("get", "put") and dt > timeout_s:
            for k in keys:
                _rec(k, op=f"{op}-late", who=getattr(self.inner, "_tag", "?"), dt=round(dt, 4),
                     timeout=round(timeout_s, 4), st=[str(s) for s in out][:1])
        return out

    faulty.FaultyBackend._keyed = keyed

    orig_done = transfer.TransferEngine._load_done

    def load_done(self, task, batch, statuses, dt, nbytes=0):
        for op, s in zip(batch, statuses, strict=False):
            regs = op.regions if op.build is None else op.materialize()
            _rec(op.key, op="load_done", req=task.req_id, st=str(s), blocks=list(op.block_ids), layer=op.layer,
                 dig=_digest(regs) if s.name == "OK" else "")
        orig_done(self, task, batch, statuses, dt, nbytes)

    transfer.TransferEngine._load_done = load_done


def dump(keys: list[str]) -> str:
    lines = []
    with _lock:
        for k in keys:
            lines.append(f"== {k}")
            for e in EVENTS.get(k, ()):
                lines.append("   " + " ".join(f"{a}={b}" for a, b in e.items()))
    return "\n".join(lines)


def keys_of(eng: Any, prompt: list[int], layer: int | None = None) -> list[str]:
    """Pool keys of the prompt's full chunks, as the worker builds them."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from ascendstore.keys import block_hash_hex

    w = eng.workers[0].connector.worker
    req = Request("trace", list(prompt), SamplingParams(max_tokens=1), None, block_hasher=eng.block_hasher)
    bpc = w.ctx.blocks_per_chunk
    hashes = [block_hash_hex(req.block_hashes[i]) for i in range(bpc - 1, len(req.block_hashes), bpc)]
    from ascendstore.keys import NO_TENANT

    return [w.keys.prefix(NO_TENANT, layer) + h for h in hashes]


def decode_tokens(eng: Any, req_id: str, n: int) -> list[int]:
    """Tokens (mod 251) whose fake KV sits at positions 0..n-1 of the request's snapshot (layer 0, head 0, c 0)."""
    kv = eng.prompt_kv(req_id)[0]
    inv31 = pow(31, -1, 251)
    out = []
    for p in range(min(n, kv.shape[0])):
        v = int(round(float(kv[p, 0, 0]) * 8))
        out.append(((v - p * 7) * inv31) % 251)
    return out
