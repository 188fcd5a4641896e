"""An in-process memory backend for engine unit tests (no vLLM, no cross-process need)."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence

from ascendstore.contract import Backend, BackendContext, BackendOptions, Capabilities, Health, Region, Status


class MemBackend(Backend):
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.calls: list[tuple[str, list[str]]] = []
        self.fail_keys: set[str] = set()
        self.fail_puts: set[str] = set()
        self.delay_s = 0.0
        self.raise_on: set[str] = set()
        self.lock = threading.Lock()
        self.inflight = 0
        self.max_inflight = 0

    @classmethod
    def create(cls, options: BackendOptions, ctx: BackendContext) -> MemBackend:
        return cls()

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities()

    def _enter(self, op: str, keys: Sequence[str]) -> None:
        with self.lock:
            self.calls.append((op, list(keys)))
        if op in self.raise_on:
            raise RuntimeError(f"planted {op} bug")
        if self.delay_s:
            time.sleep(self.delay_s)

    def exists(self, keys, timeout_s):
        self._enter("exists", keys)
        return [Status.OK if k in self.data else Status.NOT_FOUND for k in keys]

    def put(self, keys, regions: Sequence[Sequence[Region]], timeout_s):
        self._enter("put", keys)
        for k, regs in zip(keys, regions, strict=True):
            if k in self.fail_puts:
                continue
            self.data[k] = b"".join(ctypes.string_at(r.addr, r.length) for r in regs)
        return [Status.UNAVAILABLE if k in self.fail_puts else Status.OK for k in keys]

    def get(self, keys, regions, timeout_s):
        self._enter("get", keys)
        out = []
        for k, regs in zip(keys, regions, strict=True):
            if k in self.fail_keys:
                out.append(Status.UNAVAILABLE)
                continue
            if k not in self.data:
                out.append(Status.NOT_FOUND)
                continue
            buf, pos = self.data[k], 0
            for r in regs:
                ctypes.memmove(r.addr, buf[pos : pos + r.length], r.length)
                pos += r.length
            out.append(Status.OK)
        return out

    def remove(self, keys, timeout_s):
        return [Status.OK if self.data.pop(k, None) is not None else Status.NOT_FOUND for k in keys]

    def health(self, timeout_s):
        return Health(Status.OK)

    def close(self):
        pass


def run_threads(work: Callable[[int], object], n: int) -> list[BaseException]:
    """``work(0)`` .. ``work(n - 1)`` on ``n`` threads at once; returns what they
    raised, for the test to report."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # pragma: no cover - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def look_then_keep_or_release(lookup, req_id: str, hashes: Sequence[str], start: int, rng, keep_most: int,
                              release_p: float) -> None:
    """A pin thread test's step: ``req_id`` looks ``hashes`` up from ``start`` (and so
    pins what it counts), waits up to 2 ms, then may keep its first 0..``keep_most``
    chunks (3 times in 10) and may let go of all (``release_p``)."""
    lookup.prefix_hits("", hashes, start, req_id)
    time.sleep(rng.random() * 0.002)
    if rng.random() < 0.3:
        lookup.pins.keep(req_id, rng.randint(0, keep_most))
    if rng.random() < release_p:
        lookup.pins.release(req_id)
