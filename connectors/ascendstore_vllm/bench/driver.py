"""Run a benchmark workload through vLLM's real scheduler and AscendStoreConnector.

The engine is :class:`ascendstore_vllm.testing.EngineHarness`: the real vLLM
0.33 Scheduler, KV cache tensors, worker-side connector lifecycle and the
model-runner connector mixin, with a fake model step that writes deterministic
KV. On top, this driver

- replays the workload on a *modeled* clock: a request is added when the clock
  reaches its arrival time; every step advances the clock by the stated prefill
  cost model (``ascendstore.bench.cost``) for the tokens it computed, plus the
  modeled load time of tokens that came from the pool;
- times every connector call (scheduler and worker side), and the scheduler's
  lookups (``get_num_new_matched_tokens``) separately, in wall time;
- records per request where its prompt KV came from (device prefix cache, pool,
  computed) and checks every pool-loaded token's KV byte for byte against what
  the fake model wrote for the same tokens (``kv_bytes_verified``).
"""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ascendstore.bench.bound import infinite_cache_hits, reusable_blocks
from ascendstore.bench.report import BenchReport, RequestRecord, build_report
from ascendstore.bench.spec import (
    BenchSpec,
    auto_device_blocks,
    connector_extra_config,
    gr_request_params,
    pool_backend_config,
)
from ascendstore.bench.workloads import Workload, make_workload

log = logging.getLogger(__name__)

#: GR counters that show the user-granular path did something.
GR_ACTIVITY = ("saves", "dram_hits", "dram_misses", "device_hits", "swapin_attempts")

#: positions the fake model accepts (prompts up to 128k tokens and more).
MAX_POSITIONS = 1 << 18

#: connector methods timed as "connector overhead" (whichever the role has).
SCHEDULER_CALLS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "take_events",
)
WORKER_CALLS = (
    "handle_preemptions",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "clear_connector_metadata",
)


@dataclass
class _Timers:
    connector_s: float = 0.0
    lookup_us: list[float] = field(default_factory=list)
    #: req -> external tokens vLLM accepted from the connector at allocation.
    external: dict[str, int] = field(default_factory=dict)


def _wrap(obj: Any, name: str, timers: _Timers, on_call: Callable[..., None] | None = None) -> None:
    fn = getattr(obj, name, None)
    if fn is None:
        return

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            timers.connector_s += dt
            if on_call is not None:
                on_call(dt, *args, **kwargs)

    setattr(obj, name, timed)


def _instrument(engine: Any, timers: _Timers) -> None:
    conn = engine.connector
    for name in SCHEDULER_CALLS:
        if name == "get_num_new_matched_tokens":
            _wrap(conn, name, timers, lambda dt, *a, **kw: timers.lookup_us.append(dt * 1e6))
        elif name == "update_state_after_alloc":

            def note(dt: float, request: Any, blocks: Any = None, num_external_tokens: int = 0) -> None:
                timers.external.setdefault(request.request_id, int(num_external_tokens))

            _wrap(conn, name, timers, note)
        else:
            _wrap(conn, name, timers)
    for w in engine.workers:
        for name in WORKER_CALLS:
            _wrap(w.connector, name, timers)


class _StatsTap:
    """Every connector's stats as each role hands them out, summed.

    vLLM's scheduler folds its connector's counters (e.g. GR three-level hits)
    into the workers' stats object of a step only when the workers reported some
    in that step; otherwise they go to the scheduler's own stats (Prometheus)
    and never reach the model output the harness records. Tapping both roles
    counts each number once."""

    def __init__(self, eng: Any) -> None:
        from ascendstore.engine import EngineMetrics

        self._merge = EngineMetrics.merge
        self.total: dict[str, float] = {}
        for conn in [eng.connector, *(w.connector for w in eng.workers)]:
            self._tap(conn)

    def add(self, data: dict[str, Any]) -> None:
        self.total = self._merge(self.total, {k: float(v) for k, v in data.items()})

    def _tap(self, conn: Any) -> None:
        fn = conn.get_kv_connector_stats

        @functools.wraps(fn)
        def tapped(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if out is not None and out.data:
                self.add(dict(out.data))  # copied now: vLLM aggregates into this object later
            return out

        conn.get_kv_connector_stats = tapped


def quiet_vllm_logs() -> None:
    """Only errors from vLLM's loggers (it configures them on import)."""
    import vllm.logger  # noqa: F401

    logging.getLogger("vllm").setLevel(logging.ERROR)


def _model_dir(spec: BenchSpec) -> str:
    """A config-only model folder at a stable path per shape: the pool's keys carry
    the model path, so runs (and processes) with the same fake model share KV."""
    from ascendstore_vllm.testing import make_model_dir

    name = f"L{spec.num_layers}-H{spec.num_kv_heads}-D{spec.head_size}"
    path = Path(tempfile.gettempdir()) / "ascendstore-bench-models" / name
    if not (path / "config.json").is_file():
        tmp = path.with_name(f".{name}.{uuid.uuid4().hex[:8]}")
        make_model_dir(
            tmp,
            num_layers=spec.num_layers,
            num_heads=2 * spec.num_kv_heads,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            vocab_size=32000,
            max_position_embeddings=MAX_POSITIONS,
        )
        try:
            tmp.rename(path)  # atomic: concurrent runs never see a half-written folder
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another run made it first
    return str(path)


@dataclass
class _Pending:
    """A request between its first compute step and the check of its loaded KV."""

    local: int
    pool: int
    errors: int


class BenchDriver:
    #: a run fails (rather than spinning forever) after this long without progress.
    stall_timeout_s: float = 60.0

    def __init__(self, spec: BenchSpec, workload: Workload | None = None) -> None:
        self.spec = spec
        self.workload = workload or make_workload(spec.workload, **spec.workload_params)
        if not self.workload.requests:
            raise ValueError(f"workload {self.workload.name!r} has no requests")
        bs = spec.block_size
        self.chunk_size = spec.effective_chunk_size
        if self.chunk_size % bs:
            raise ValueError(f"chunk_size {self.chunk_size} must be a multiple of block_size {bs}")
        self.bound = infinite_cache_hits(self.workload.requests, bs)
        chunk_bytes = self.chunk_size * spec.kv_bytes_per_token()
        # Pool capacity is a fraction of the *reusable* set: chunks more than one request uses.
        self.working_set_chunks = max(1, reusable_blocks(self.workload.requests, self.chunk_size))
        self.working_set_bytes = self.working_set_chunks * chunk_bytes
        opts = dict(spec.backend_config)
        if spec.backend == "local":
            # A pool of its own per run, so runs never see each other's KV.
            opts.setdefault("name", f"bench-{uuid.uuid4().hex[:10]}")
        self.backend_config, self.capacity = pool_backend_config(
            spec.model_copy(update={"backend_config": opts}), self.working_set_chunks, chunk_bytes
        )
        self.extra_config = connector_extra_config(spec, self.backend_config)
        longest = max(r.prompt_len + r.output_len for r in self.workload.requests)
        self.device_blocks = spec.device_blocks or auto_device_blocks(
            spec, reusable_blocks(self.workload.requests, bs), longest
        )

    def _engine(self) -> Any:
        from ascendstore_vllm.testing import EngineHarness, EngineSpec

        s = self.spec
        longest = max(r.prompt_len + r.output_len for r in self.workload.requests)
        max_len = -(-(longest + s.block_size) // s.block_size) * s.block_size
        if self.device_blocks * s.block_size < longest + s.block_size:
            raise ValueError(
                f"--device-blocks {self.device_blocks} cannot hold the longest request "
                f"({longest} tokens in {s.block_size}-token blocks)"
            )
        es = EngineSpec(
            extra_config=self.extra_config,
            kv_connector=s.kv_connector,
            num_layers=s.num_layers,
            num_heads=2 * s.num_kv_heads,
            num_kv_heads=s.num_kv_heads,
            head_size=s.head_size,
            block_size=s.block_size,
            num_blocks=self.device_blocks,
            max_num_batched_tokens=max(s.max_num_batched_tokens, s.block_size),
            max_num_seqs=s.max_num_seqs,
            max_model_len=max_len,
            model_dir=_model_dir(s),
        )
        return EngineHarness(es, check_reads=False)

    def run(self, progress: Callable[[int, int], None] | None = None) -> BenchReport:
        s, cm = self.spec, self.spec.cost_model
        reqs = self.workload.requests
        by_id = {r.req_id: (i, r) for i, r in enumerate(reqs)}
        wall0 = time.perf_counter()
        eng = self._engine()
        timers = _Timers()
        _instrument(eng, timers)
        counted = _StatsTap(eng)
        clock = reqs[0].arrival_s
        nxt = 0
        records: dict[str, RequestRecord] = {}
        pending: dict[str, _Pending] = {}
        verified = mismatches = 0
        bs = s.block_size
        try:
            # Idle steps (waiting for async loads or delayed frees) spin fast; bound the
            # run by time without progress instead of by a step count.
            last_progress = time.monotonic()
            idle_s = 0.0
            while True:
                while nxt < len(reqs) and (reqs[nxt].arrival_s <= clock or not eng.scheduler.requests):
                    r = reqs[nxt]
                    clock = max(clock, r.arrival_s)
                    params = gr_request_params(r.user, r.history_len) if s.granularity == "user" else None
                    eng.add_request(
                        r.req_id,
                        list(r.prompt),
                        max_tokens=r.output_len,
                        cache_salt=r.tenant,
                        kv_transfer_params=params,
                    )
                    nxt += 1
                if not eng.scheduler.requests:
                    break
                t_step = time.monotonic()
                rec = eng.step()
                now = time.monotonic()
                if rec.scheduled or rec.finished or rec.finished_sending or rec.finished_recving:
                    last_progress = now
                else:
                    if now - last_progress > self.stall_timeout_s:
                        raise TimeoutError(self._stall_report(eng))
                    time.sleep(0.001)  # let transfer threads run
                    idle_s += time.monotonic() - t_step
                step_s = cm.step_overhead_s if rec.scheduled else 0.0
                for req_id, n in rec.scheduled.items():
                    before = rec.computed_before[req_id]
                    step_s += cm.prefill_s(n, before)
                    if req_id in records:
                        continue
                    # First compute step of this request: its cache hits are now known.
                    i, br = by_id[req_id]
                    pool = timers.external.get(req_id, 0)
                    local = before - pool
                    errors = 0
                    if rec.invalid_block_ids:
                        bad = [k for k, b in enumerate(eng.block_ids[req_id]) if b in rec.invalid_block_ids]
                        if bad:
                            good_end = max(local, min(bad) * bs)
                            errors, pool = local + pool - good_end, good_end - local
                    step_s += cm.load_s(pool)
                    records[req_id] = RequestRecord(
                        req_id=req_id,
                        arrival_s=br.arrival_s,
                        scheduled_s=clock,
                        prompt_tokens=br.prompt_len,
                        device_hit=local,
                        pool_hit=pool,
                        bound_hit=self.bound[i],
                        load_errors=errors,
                        modeled_ttft_s=cm.request_ttft_s(br.prompt_len, local, pool),
                    )
                    if s.verify and pool > 0:
                        pending[req_id] = _Pending(local, pool, errors)
                clock += step_s
                # Check loaded KV while it is still in the request's blocks (or its snapshot).
                for req_id in list(pending):
                    p = pending.pop(req_id)
                    v, bad = self._verify(eng, req_id, p.local, p.local + p.pool)
                    verified += v
                    mismatches += bad
                for r in rec.finished:
                    eng.snapshots.pop(r, None)  # the harness keeps them for tests; not needed here
                if progress is not None:
                    progress(len(eng.finished), len(reqs))
            tail = eng.connector.get_kv_connector_stats()  # what the scheduler side still holds
            if tail is not None and tail.data:
                counted.add(tail.data)
            stats = counted.total
            backend_stats = self._backend_stats()
        finally:
            eng.close()
        wall = time.perf_counter() - wall0
        notes = []
        gr_active = any(v for k, v in stats.items() if k.removeprefix("gr_") in GR_ACTIVITY)
        if s.granularity == "user" and not gr_active:
            notes.append(
                "granularity=user was requested (gr.enabled, uid + user_history_len on every request) "
                f"but {s.kv_connector} reported no GR activity: these numbers are its chunk pool's"
            )
        if idle_s > 1.0:
            notes.append(
                f"{idle_s:.1f} s of wall time went to steps that waited on the connector "
                "(async transfers or delayed frees) with nothing to schedule"
            )
        if stats.get("gr_bytes_loaded") or stats.get("gr_bytes_saved"):
            notes.append(
                "load/save GB/s cover the chunk pool only: the GR user store reports bytes, not time"
            )
        ordered = [records[r.req_id] for r in reqs if r.req_id in records]
        return build_report(
            workload=self.workload.name,
            backend=s.backend,
            records=ordered,
            block_size=bs,
            chunk_size=self.chunk_size,
            lookup_latency_us=timers.lookup_us,
            # Chunk pool and GR user store report their traffic separately.
            bytes_loaded=int(stats.get("load_bytes", 0) + stats.get("gr_bytes_loaded", 0)),
            bytes_saved=int(stats.get("save_bytes", 0) + stats.get("gr_bytes_saved", 0)),
            load_rate_bytes=int(stats.get("load_bytes", 0)),
            save_rate_bytes=int(stats.get("save_bytes", 0)),
            load_wall_s=float(stats.get("load_time_s", 0.0)),
            save_wall_s=float(stats.get("save_time_s", 0.0)),
            kv_bytes_verified=verified,
            kv_mismatches=mismatches,
            connector_s=timers.connector_s,
            wall_s=wall,
            cost_model=s.cost_model,
            granularity=s.granularity,
            pool_capacity_bytes=self.capacity,
            pool_capacity_fraction=s.capacity_fraction,
            working_set_bytes=self.working_set_bytes,
            workload_params=self.workload.params,
            config=self.extra_config,
            connector_stats={k: float(v) for k, v in stats.items()},
            backend_stats=backend_stats,
            notes=notes,
        )

    def _stall_report(self, eng: Any) -> str:
        pending = list(eng.scheduler.requests.items())[:8]
        desc = ", ".join(f"{rid}: {getattr(r.status, 'name', r.status)}" for rid, r in pending)
        return (
            f"no progress for {self.stall_timeout_s:.0f} s with {len(eng.scheduler.requests)} request(s) "
            f"still in the scheduler ({desc}); the connector never reported their transfers done"
        )

    def _backend_stats(self) -> dict[str, float]:
        """The pool's own counters (tiers, evictions), read through a second client
        while the engine still holds the pool open; empty if the backend has none."""
        from ascendstore.contract import BackendContext
        from ascendstore.registry import create_backend

        try:
            be = create_backend(self.spec.backend, self.backend_config, BackendContext(role="tool"))
        except Exception as exc:
            log.info("no backend stats: %s", exc)
            return {}
        try:
            return {k: float(v) for k, v in dict(be.stats()).items() if isinstance(v, int | float)}
        except Exception as exc:
            log.info("no backend stats: %s", exc)
            return {}
        finally:
            be.close()

    @staticmethod
    def _verify(eng: Any, req_id: str, start: int, end: int) -> tuple[int, int]:
        """Bytes of positions [start, end) compared with the fake model's KV, and how many differ."""
        tokens = eng.tokens[req_id]
        checked = bad = 0
        for rank, w in enumerate(eng.workers):
            snap = eng.snapshots.get(req_id)
            for layer in range(len(w.layer_names)):
                if snap is not None:
                    got = snap[rank][layer][start:end]
                else:
                    got = w.gather(eng.block_ids[req_id], start, end, layer)
                want = w.expected(tokens, start, end, layer)
                g = got.contiguous().view(torch.uint8)
                e = want.contiguous().view(torch.uint8)
                checked += g.numel()
                bad += int((g != e).sum())
        return checked, bad


def run_bench(
    spec: BenchSpec, progress: Callable[[int, int], None] | None = None, workload: Workload | None = None
) -> BenchReport:
    return BenchDriver(spec, workload).run(progress)
