"""GR pool benchmark: user-granular vs block-granular pooling at a given capacity.

A trace-driven cache simulation of the two pool policies on GR traffic:
Zipf-popular users, each request = the user's stable history + fresh candidate
tokens. Capacity is a fraction of the working set (every user's block-aligned
history); both pools evict least-recently-used objects.

* ``block``: the ordinary chunk pool. Every full block of the prompt is an
  object keyed by its chained hash (it cannot tell history from candidates,
  so candidate blocks are written too); a lookup serves the longest prefix of
  present blocks; eviction is per block.
* ``user``: the GR user store. A user's history is one object (all or
  nothing); candidates are never written; eviction is per user.

Prefill tokens saved = history tokens served by the pool. The simulation
models the pool tier only (no device prefix cache in front of it) so the two
policies are compared on equal terms; ``ascendstore bench --workload gr``
prints its results.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

Granularity = Literal["user", "block"]


@dataclass(frozen=True)
class GRWorkload:
    users: int = 500
    requests: int = 20_000
    zipf_s: float = 1.0
    block_size: int = 128  # vllm-ascend's block size with prefix caching on
    history_blocks: tuple[int, int] = (8, 32)  # per user, uniform
    candidate_tokens: int = 256
    seed: int = 0


@dataclass(frozen=True)
class GRBenchResult:
    granularity: str
    pool_capacity: float  # fraction of the working set
    capacity_blocks: int
    working_set_blocks: int
    requests: int
    request_hit_rate: float  # requests served any history from the pool
    full_hit_rate: float  # requests served their whole history
    token_hit_rate: float  # history tokens served / history tokens
    prefill_tokens: int  # prompt tokens of all requests
    prefill_tokens_saved: int
    saved_fraction: float  # prefill_tokens_saved / prefill_tokens
    evictions: int  # objects evicted (blocks or users)
    writes: int  # objects written

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def _zipf_cdf(n: int, s: float) -> list[float]:
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    total = sum(weights)
    acc, out = 0.0, []
    for w in weights:
        acc += w / total
        out.append(acc)
    return out


def _trace(w: GRWorkload) -> tuple[list[int], list[int]]:
    """(history blocks per user, user of each request); users are shuffled so
    popularity is independent of history length."""
    rng = random.Random(w.seed)
    lo, hi = w.history_blocks
    hist = [rng.randint(lo, hi) for _ in range(w.users)]
    cdf = _zipf_cdf(w.users, w.zipf_s)
    rank_to_user = list(range(w.users))
    rng.shuffle(rank_to_user)
    import bisect

    reqs = [rank_to_user[min(bisect.bisect_left(cdf, rng.random()), w.users - 1)] for _ in range(w.requests)]
    return hist, reqs


class _LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.items: OrderedDict[object, int] = OrderedDict()
        self.evictions = 0
        self.writes = 0

    def touch(self, key: object) -> bool:
        if key in self.items:
            self.items.move_to_end(key)
            return True
        return False

    def put(self, key: object, size: int) -> bool:
        if size > self.capacity:
            return False  # can never fit: skip the write
        if key in self.items:
            self.items.move_to_end(key)
            return True
        while self.used + size > self.capacity:
            _, s = self.items.popitem(last=False)
            self.used -= s
            self.evictions += 1
        self.items[key] = size
        self.used += size
        self.writes += 1
        return True


def run_gr_bench(granularity: Granularity, pool_capacity: float, workload: GRWorkload | None = None) -> GRBenchResult:
    """Simulate one pool policy at ``pool_capacity`` (fraction of the working set)."""
    if granularity not in ("user", "block"):
        raise ValueError(f"granularity must be 'user' or 'block', not {granularity!r}")
    if not 0 < pool_capacity <= 10:
        raise ValueError(f"pool_capacity must be a fraction of the working set in (0, 10], not {pool_capacity}")
    w = workload or GRWorkload()
    hist, reqs = _trace(w)
    bs = w.block_size
    working_set = sum(hist)
    cap = max(1, int(working_set * pool_capacity))
    lru = _LRU(cap)
    cand_blocks = w.candidate_tokens // bs  # full candidate blocks a chunk pool would write
    hits = full = 0
    saved = total = hist_tokens = 0
    rng = random.Random(w.seed + 1)
    for uid in reqs:
        n = hist[uid]
        total += n * bs + w.candidate_tokens
        hist_tokens += n * bs
        if granularity == "user":
            if lru.touch(uid):
                got = n
            else:
                got = 0
                lru.put(uid, n)
        else:
            got = 0
            while got < n and lru.touch((uid, got)):
                got += 1
            for b in range(got, n):
                lru.put((uid, b), 1)
            # candidate blocks: new content every request, keyed under this prefix
            salt = rng.getrandbits(48)
            for c in range(cand_blocks):
                lru.put((uid, "c", salt, c), 1)
        hits += got > 0
        full += got == n
        saved += got * bs
    return GRBenchResult(
        granularity=granularity, pool_capacity=pool_capacity, capacity_blocks=cap, working_set_blocks=working_set,
        requests=len(reqs), request_hit_rate=hits / len(reqs), full_hit_rate=full / len(reqs),
        token_hit_rate=saved / hist_tokens, prefill_tokens=total, prefill_tokens_saved=saved,
        saved_fraction=saved / total, evictions=lru.evictions, writes=lru.writes,
    )


DEFAULT_CAPACITIES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def sweep(
    capacities: Sequence[float] = DEFAULT_CAPACITIES,
    granularities: Iterable[Granularity] = ("user", "block"),
    workload: GRWorkload | None = None,
) -> list[GRBenchResult]:
    return [run_gr_bench(g, c, workload) for c in capacities for g in granularities]


def format_table(results: Sequence[GRBenchResult]) -> str:
    """Side-by-side table: capacity, then token hit rate and tokens saved per granularity."""
    by_cap: dict[float, dict[str, GRBenchResult]] = {}
    for r in results:
        by_cap.setdefault(r.pool_capacity, {})[r.granularity] = r
    lines = ["capacity  user:hit  user:saved  block:hit  block:saved  user/block saved"]
    for cap in sorted(by_cap):
        u, b = by_cap[cap].get("user"), by_cap[cap].get("block")
        ratio = (u.prefill_tokens_saved / b.prefill_tokens_saved) if u and b and b.prefill_tokens_saved else float("nan")
        lines.append(
            f"{cap:7.0%}  {u.token_hit_rate if u else float('nan'):8.3f}  {u.saved_fraction if u else float('nan'):10.3f}"
            f"  {b.token_hit_rate if b else float('nan'):9.3f}  {b.saved_fraction if b else float('nan'):11.3f}"
            f"  {ratio:16.2f}"
        )
    return "\n".join(lines)


# -- two tiers: a device prefix cache in front of the pool (the investigation of
#    docs/gr-mode.md "why user beats block by under a point at small capacities") ----
Admission = Literal["inclusive", "victim"]


@dataclass(frozen=True)
class TieredResult:
    granularity: str
    admission: str
    pool_capacity: float  # fraction of the working set
    device_capacity: float  # fraction of the working set
    saved_fraction: float  # (device + pool) history tokens served / prompt tokens
    device_fraction: float
    pool_fraction: float
    partial_pool_hits: int  # requests the pool served only part of the missing history
    pool_writes: int
    pool_evictions: int


def run_tiered(
    granularity: Granularity,
    pool_capacity: float,
    device_capacity: float = 0.2,
    admission: Admission = "inclusive",
    workload: GRWorkload | None = None,
) -> TieredResult:
    """A device cache (LRU; whole users with the user LRU in user mode, blocks
    with vLLM's block LRU in block mode, candidates included) in front of the
    pool. ``inclusive``: the pool takes every history it misses (what the
    connectors do); ``victim``: the pool takes only what the device evicts."""
    w = workload or GRWorkload()
    hist, reqs = _trace(w)
    bs = w.block_size
    ws = sum(hist)
    dev = _LRU(max(1, int(ws * device_capacity)))
    pool = _LRU(max(1, int(ws * pool_capacity)))
    cand = w.candidate_tokens // bs
    rng = random.Random(w.seed + 1)
    total = dev_tok = pool_tok = partial = 0

    def dev_put(key: object, size: int) -> None:
        before = dict(dev.items)
        dev.put(key, size)
        if admission == "victim":
            for k, s in before.items():
                if k not in dev.items and not (isinstance(k, tuple) and len(k) == 4):  # candidates never
                    pool.put(k, s)

    for uid in reqs:
        n = hist[uid]
        total += n * bs + w.candidate_tokens
        if granularity == "user":
            if dev.touch(uid):
                dev_tok += n * bs
                continue
            if pool.touch(uid):
                pool_tok += n * bs
            elif admission == "inclusive":
                pool.put(uid, n)
            dev_put(uid, n)
            continue
        d = 0
        while d < n and dev.touch((uid, d)):
            d += 1
        p = d
        while p < n and pool.touch((uid, p)):
            p += 1
        dev_tok += d * bs
        pool_tok += (p - d) * bs
        partial += d < p < n
        for b in range(d, n):
            dev_put((uid, b), 1)
            if admission == "inclusive" and b >= p:
                pool.put((uid, b), 1)
        salt = rng.getrandbits(48)
        for c in range(cand):
            dev_put((uid, "c", salt, c), 1)
            if admission == "inclusive":
                pool.put((uid, "c", salt, c), 1)
    return TieredResult(
        granularity=granularity, admission=admission, pool_capacity=pool_capacity,
        device_capacity=device_capacity, saved_fraction=(dev_tok + pool_tok) / total,
        device_fraction=dev_tok / total, pool_fraction=pool_tok / total, partial_pool_hits=partial,
        pool_writes=pool.writes, pool_evictions=pool.evictions,
    )
