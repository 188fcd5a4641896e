"""Drive vLLM 0.33's real Scheduler and worker-side connector lifecycle on CPU.

What is real: VllmConfig/KVTransferConfig validation (plugins loaded the way
vLLM loads them), KV cache planning (get_kv_cache_configs), the KV tensors
(vllm.v1.worker.utils.allocate_kv_cache), block hashing (the engine core's
hasher), the Scheduler, KVConnectorFactory, the model-runner connector mixin
inside set_forward_context, and KVOutputAggregator across TP ranks.
What is fake: the model. Its "forward" writes deterministic KV per (token,
position, layer, head shard) into each scheduled token's slot, calling
wait_for_layer_load before and save_kv_layer after each layer like vLLM's
attention layers, and checks that every earlier position of the request holds
the right KV when the layer "attends" (so a load that lands late or wrong is
caught at the step it matters, not only at the end).

``EngineSpec(async_scheduling=True)`` drives vLLM's AsyncScheduler the way the
engine core's ``step_with_batch_queue`` does (a batch queue of two): step N+1 is
scheduled and executed before step N's output reaches ``update_from_output``, so
the connector's metadata for N+1 is built before N's load failures are known.
The sampled tokens of steps still in flight are known worker-side only (the
scheduler holds output placeholders for them), as in vLLM's model runner.

Several TP ranks run in one process: each rank has its own VllmConfig copy
(parallel_config.rank) and is made the process's KV transfer agent while it
executes, so the real mixin code runs for every rank.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from ascendstore_vllm.testing.model import make_model_dir


@dataclass
class EngineSpec:
    """Shape of one test engine. ``extra_config`` is kv_connector_extra_config."""

    extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector: str = "AscendStoreConnector"
    kv_role: str = "kv_both"
    kv_load_failure_policy: str = "recompute"
    engine_id: str | None = None
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    block_size: int = 16
    num_blocks: int = 128
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    max_model_len: int = 1024
    tp_size: int = 1
    #: TP ranks hold identical KV (as with MLA or fewer KV heads than ranks).
    replicated_kv: bool = False
    enable_prefix_caching: bool = True
    #: physical KV layout the "attention backend" supports (vLLM's default preference).
    kv_cache_layout: str = "LBNHC"
    dtype: str = "float16"
    model_dir: str | None = None
    #: extra kwargs for KVTransferConfig (e.g. kv_connector_module_path).
    kv_transfer_kwargs: dict[str, Any] = field(default_factory=dict)
    #: vLLM publishes KV events (KVEventsConfig enable_kv_cache_events, "null"
    #: publisher: tests replace ``scheduler.kv_event_publisher`` to read them).
    kv_events: bool = False
    #: vLLM's async scheduling (AsyncScheduler, schedule N+1 before update_from_output(N)).
    async_scheduling: bool = field(
        default_factory=lambda: os.environ.get("ASCENDSTORE_HARNESS_ASYNC_SCHEDULING") == "1")


class VllmAsyncRecomputeError(AssertionError):
    """vLLM scheduled positions past every token the model runner knows.

    Seen under async scheduling when a step that samples (a request's last prompt
    chunk, or a decode step) reports a failed load: vLLM's
    ``Scheduler._update_requests_with_invalid_blocks`` (0.33) truncates
    ``num_computed_tokens`` to the failed block but leaves the request's
    ``num_output_placeholders`` (set by ``AsyncScheduler._update_after_schedule``),
    so the recompute is scheduled one position per placeholder too far and a real
    runner would feed it a token it discarded (vLLM issue #45138; fixes proposed in
    vllm-project/vllm#45146, #45430, #49252). Not the connector's to work around."""


def fake_kv(token_ids: torch.Tensor, positions: torch.Tensor, layer: int, shard: int,
            num_heads: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic KV [n, heads, width] for tokens at positions (exact in fp16/bf16)."""
    t = token_ids.to(torch.int64).view(-1, 1, 1)
    p = positions.to(torch.int64).view(-1, 1, 1)
    h = torch.arange(num_heads).view(1, -1, 1)
    c = torch.arange(width).view(1, 1, -1)
    v = (t * 31 + p * 7 + layer * 131 + shard * 57 + h * 17 + c * 3) % 251
    return (v.to(torch.float32) / 8).to(dtype)


def load_plugins() -> None:
    """Load vLLM general plugins (registers AscendStoreConnector) like vLLM does."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()


def build_vllm_config(spec: EngineSpec):
    load_plugins()
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    # Same shape -> same folder, so engines in different processes share pool keys
    # (the model path is part of the key fingerprint).
    shape = f"l{spec.num_layers}h{spec.num_heads}kv{spec.num_kv_heads}d{spec.head_size}{spec.dtype}"
    model_dir = spec.model_dir or make_model_dir(
        os.path.join(tempfile.gettempdir(), f"ascendstore-test-model-{shape}"),
        num_layers=spec.num_layers, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size, dtype=spec.dtype,
    )
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype=spec.dtype,
                     max_model_len=spec.max_model_len, enforce_eager=True)
    ktc = KVTransferConfig(
        kv_connector=spec.kv_connector, kv_role=spec.kv_role,
        kv_connector_extra_config=dict(spec.extra_config), engine_id=spec.engine_id,
        kv_load_failure_policy=spec.kv_load_failure_policy, **spec.kv_transfer_kwargs,
    )
    return VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=spec.block_size, enable_prefix_caching=spec.enable_prefix_caching,
                                 num_gpu_blocks_override=spec.num_blocks),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=spec.max_num_batched_tokens,
                                         max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len,
                                         is_encoder_decoder=False),
        parallel_config=ParallelConfig(tensor_parallel_size=spec.tp_size),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=ktc,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if spec.kv_events else None,
    )


_dist_ready = False


def _init_distributed(vllm_config: Any) -> None:
    """One-process gloo group, as vLLM's CPU worker sets up (world size 1)."""
    global _dist_ready
    if _dist_ready:
        return

    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from ascendstore.loopback import free_port

    port = free_port()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1, 1)
    _dist_ready = True


class RankWorker:
    """One TP rank: vLLM-allocated KV tensors, a worker-role connector, the fake model."""

    def __init__(self, engine: EngineHarness, rank: int, vllm_config: Any, kv_cache_config: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        self.engine = engine
        self.rank = rank
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        layout = KVCacheLayout[kv_cache_config.kv_cache_layout or "LBNHC"]
        self.kv_caches: dict[str, torch.Tensor] = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
        self.layer_names = list(self.kv_caches)
        # What the attention layers expose through the forward context.
        vllm_config.compilation_config.static_forward_context = {
            name: SimpleNamespace(kv_cache=t) for name, t in self.kv_caches.items()
        }
        self.connector = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        self.connector.register_kv_caches(self.kv_caches)
        #: (req_id, layer, position) where the fake attention read wrong KV.
        self.read_errors: list[tuple[str, int, int]] = []

    @property
    def shard(self) -> int:
        return 0 if self.engine.spec.replicated_kv else self.rank

    def expected(self, token_ids: list[int], start: int, end: int, layer: int) -> torch.Tensor:
        """What the fake model writes for positions [start, end): [n, heads, width]."""
        sample = next(iter(self.kv_caches.values()))
        t = torch.tensor(token_ids[start:end], dtype=torch.int64)
        p = torch.arange(start, end)
        return fake_kv(t, p, layer, self.shard, sample.shape[1], sample.shape[3], sample.dtype)

    def gather(self, block_ids: list[int], start: int, end: int, layer: int) -> torch.Tensor:
        """KV of positions [start, end) of a request from its blocks: [n, heads, width]."""
        t = self.kv_caches[self.layer_names[layer]]
        bs = t.shape[2]
        pos = torch.arange(start, end)
        blocks = torch.tensor([block_ids[int(i)] for i in (pos // bs)], dtype=torch.long)
        return t[blocks, :, pos % bs, :]

    def execute(self, so: Any) -> Any:
        """One model-runner step for this rank, through vLLM's connector mixin."""
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector
        assert isinstance(self.connector, KVConnectorBase_V1)
        self.connector.handle_preemptions(so.kv_connector_metadata)
        work = self.engine.work_items(so)
        attn_metadata = {name: SimpleNamespace() for name in self.layer_names} if work else None
        with (
            set_forward_context(attn_metadata, self.vllm_config),
            KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(so) as kv_out,
        ):
            if work:
                self._forward(work)
        req_ids = [w[0] for w in work]
        sampled = [self.engine.sample(w) for w in work]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )

    def _forward(self, work: list[tuple[str, list[int], list[int], int, int]]) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        conn = get_kv_transfer_group()
        poisoned: set[str] = set()
        for layer, name in enumerate(self.layer_names):
            conn.wait_for_layer_load(name)
            t = self.kv_caches[name]
            bs = t.shape[2]
            for req_id, tokens, block_ids, start, end in work:
                if start and self.engine.check_reads:
                    got = self.gather(block_ids, 0, start, layer)
                    want = self.expected(tokens, 0, start, layer)
                    bad = (got != want).flatten(1).any(1).nonzero().flatten().tolist()
                    self.read_errors.extend((req_id, layer, int(p)) for p in bad[:4])
                    if bad and self.engine.poison_stale_reads:
                        poisoned.add(req_id)
                pos = torch.arange(start, end)
                blocks = torch.tensor([block_ids[int(i)] for i in (pos // bs)], dtype=torch.long)
                kv = self.expected(tokens, start, end, layer)
                if req_id in poisoned:
                    # A real model attending to wrong KV computes wrong KV for its new
                    # positions (in this layer and every later one): so does this one,
                    # so whoever reads them later is caught too.
                    kv = kv + 0.5
                t[blocks, :, pos % bs, :] = kv
            conn.save_kv_layer(name, t, None)

    def close(self) -> None:
        self.connector.shutdown()


@dataclass
class StepRecord:
    scheduled: dict[str, int]
    computed_before: dict[str, int]
    finished: list[str]
    invalid_block_ids: set[int]
    finished_recving: set[str]
    finished_sending: set[str]
    stats: dict[str, Any]
    preempted: set[str] = field(default_factory=set)


class EngineHarness:
    """A vLLM engine core minus the model: add requests, step, inspect KV."""

    def __init__(self, spec: EngineSpec, *, check_reads: bool = True) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_request_block_hasher,
            init_none_hash,
            resolve_cache_hit_alignment_tokens,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.structured_output import StructuredOutputManager

        self.spec = spec
        self.check_reads = check_reads
        cfg = build_vllm_config(spec)
        self.vllm_config = cfg
        _init_distributed(cfg)
        dtype = getattr(torch, spec.dtype)
        kv_heads = spec.num_kv_heads if spec.replicated_kv else max(1, spec.num_kv_heads // spec.tp_size)
        layer_spec = FullAttentionSpec(
            block_size=spec.block_size, num_kv_heads=kv_heads, head_size=spec.head_size, dtype=dtype,
            max_tp_shards=1 if spec.replicated_kv else spec.tp_size,
        )
        names = [f"model.layers.{i}.self_attn.attn" for i in range(spec.num_layers)]
        specs = [self.layer_specs(cfg, names, layer_spec) for _ in range(spec.tp_size)]
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

        resolve_kv_cache_layout(cfg, [[spec.kv_cache_layout]] * spec.tp_size,
                                [s for d in specs for s in d.values()])
        groups = get_global_kv_cache_groups(cfg, specs)
        per_block = layer_spec.page_size_bytes * spec.num_layers
        kv_cfgs = get_kv_cache_configs(cfg, specs, [per_block * (spec.num_blocks + 8)] * spec.tp_size, groups)
        for c in kv_cfgs:
            c.kv_cache_layout = cfg.cache_config.kv_cache_layout
        sched_cfg = generate_scheduler_kv_cache_config(kv_cfgs)
        cfg.cache_config.num_gpu_blocks = sched_cfg.num_blocks
        sbs, hbs = resolve_kv_cache_block_sizes(sched_cfg, cfg)
        align = resolve_cache_hit_alignment_tokens(sched_cfg, cfg, sbs, hbs)
        for c in (*kv_cfgs, sched_cfg):
            c.hash_block_size = hbs
            c.cache_hit_alignment_tokens = align
        self.kv_cache_config = sched_cfg
        # What this harness drives (the config alone would say on: vLLM's CPU platform
        # turns it off only in a real server); the connector reads it from here.
        cfg.scheduler_config.async_scheduling = spec.async_scheduling
        self.scheduler = (AsyncScheduler if spec.async_scheduling else Scheduler)(
            vllm_config=cfg, kv_cache_config=sched_cfg,
            structured_output_manager=StructuredOutputManager(cfg),
            block_size=sbs, hash_block_size=hbs, log_stats=True,
        )
        #: requests whose step output vLLM discarded for failed loads (its own decision, observed)
        self._discarded: set[str] = set()
        #: (schedule count when it happened, request, frontier): vLLM rewound a request
        #: to recompute from the frontier after a failed load (its own decision, observed)
        self._rewinds: list[tuple[int, str, int]] = []
        self._sched_seq = 0
        handle = self.scheduler._handle_invalid_blocks

        def observe_invalid_blocks(*args: Any, **kwargs: Any) -> set[str]:
            reqs = self.scheduler.requests
            was = {r: q.num_computed_tokens for r, q in reqs.items()}
            skipped = handle(*args, **kwargs)
            self._discarded |= skipped
            self._rewinds.extend((self._sched_seq, r, q.num_computed_tokens) for r, q in reqs.items()
                                 if q.num_computed_tokens < was.get(r, 0))
            return skipped

        self.scheduler._handle_invalid_blocks = observe_invalid_blocks
        hash_fn = get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(hbs, hash_fn, cfg.num_hash_lookahead_tokens)
        self.workers: list[RankWorker] = []
        for r in range(spec.tp_size):
            rcfg = cfg if spec.tp_size == 1 else copy.deepcopy(cfg)
            rcfg.parallel_config.rank = r
            self.workers.append(self.worker_class(self, r, rcfg, kv_cfgs[r]))
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.aggregator = KVOutputAggregator.from_connector(self.workers[0].connector, spec.tp_size)
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.snapshots: dict[str, list[list[torch.Tensor]]] = {}  # req -> rank -> layer -> [n, H, C]
        self.records: list[StepRecord] = []
        self.finished: list[str] = []
        self._computed: dict[str, int] = {}
        #: async scheduling: steps executed whose output the scheduler has not seen
        #: yet, newest first (vLLM's batch_queue): (output, sched output, read errors
        #: per rank, computed before, schedule count)
        self.inflight: list[tuple[Any, Any, list[list[tuple[str, int, int]]], dict[str, int], int]] = []

    #: a step that read wrong KV writes wrong KV for its new positions (as a real model would)
    poison_stale_reads = True

    #: the per-rank worker (a subclass may model other attention types)
    worker_class = RankWorker

    def layer_specs(self, vllm_config: Any, names: list[str], full_spec: Any) -> dict[str, Any]:
        """Each layer's KV cache spec (one rank); a subclass may mix spec types."""
        return {n: full_spec for n in names}

    # -- requests ------------------------------------------------------------------------
    @property
    def connector(self) -> Any:
        """The scheduler-side connector."""
        return self.scheduler.connector

    def add_request(self, req_id: str, prompt: list[int], *, max_tokens: int = 1,
                    cache_salt: str | None = None, extra_args: dict | None = None,
                    kv_transfer_params: dict | None = None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args)
        if kv_transfer_params is not None:
            sp.extra_args = {**(sp.extra_args or {}), "kv_transfer_params": kv_transfer_params}
        req = Request(req_id, list(prompt), sp, None, cache_salt=cache_salt, block_hasher=self.block_hasher)
        if kv_transfer_params is not None:
            req.kv_transfer_params = kv_transfer_params
        self.tokens[req_id] = list(prompt)
        self.prompt_len[req_id] = len(prompt)
        self.scheduler.add_request(req)

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        self.finished.append(req_id)

    def work_items(self, so: Any) -> list[tuple[str, list[int], list[int], int, int]]:
        """(req, tokens, block ids, first position, end) computed this step."""
        out = []
        for r, n in so.num_scheduled_tokens.items():
            if n:
                tokens = self.worker_tokens(r)
                end = self._computed[r] + n
                if end > len(tokens):
                    raise VllmAsyncRecomputeError(
                        f"{r}: positions [{self._computed[r]}, {end}) scheduled, the runner knows {len(tokens)} "
                        f"tokens (num_output_placeholders={self.scheduler.requests[r].num_output_placeholders}; "
                        "vLLM #45138: a recompute after a failed load keeps its async output placeholders)")
                out.append((r, tokens, self.block_ids[r], self._computed[r], end))
        return out

    def worker_tokens(self, req_id: str) -> list[int]:
        """The request's tokens as the model runner knows them: the scheduler's, plus
        (async scheduling) those sampled by steps whose output it has not seen yet."""
        tokens = list(self.scheduler.requests[req_id].all_token_ids)
        for out, *_ in reversed(self.inflight):
            i = out.req_id_to_index.get(req_id)
            if i is not None:
                tokens.extend(out.sampled_token_ids[i])
        return tokens

    def sample(self, work: tuple[str, list[int], list[int], int, int]) -> list[int]:
        req_id, tokens, _, _, end = work
        if end < len(tokens):
            return []  # mid chunked prefill: nothing sampled
        return [(tokens[-1] * 7 + end) % 1000 + 3]

    def _track(self, so: Any) -> None:
        for new in so.scheduled_new_reqs:
            self.block_ids[new.req_id] = list(new.block_ids[0])
            self._computed[new.req_id] = new.num_computed_tokens
        c = so.scheduled_cached_reqs
        for i, r in enumerate(c.req_ids):
            ids = c.new_block_ids[i]
            if r in c.resumed_req_ids:
                self.block_ids[r] = list(ids[0]) if ids else []
            elif ids:
                self.block_ids[r].extend(ids[0])
            self._computed[r] = c.num_computed_tokens[i]

    # -- stepping ------------------------------------------------------------------------
    def step(self) -> StepRecord:
        if self.spec.async_scheduling:
            return self._step_async()
        so = self.scheduler.schedule()
        self._sched_seq += 1
        self._track(so)
        before = {r: self._computed.get(r, 0) for r in so.num_scheduled_tokens}
        out, errors = self._execute(so)
        return self._update(so, out, errors, before, self._sched_seq)

    def _execute(self, so: Any) -> tuple[Any, list[list[tuple[str, int, int]]]]:
        """Run one step on every rank; the wrong reads it made, per rank (kept apart
        until vLLM has accepted or discarded the step's output)."""
        marks = [len(w.read_errors) for w in self.workers]
        outs = [w.execute(so) for w in self.workers]
        errors = []
        for w, m in zip(self.workers, marks, strict=True):
            errors.append(w.read_errors[m:])
            del w.read_errors[m:]
        return (self.aggregator.aggregate(outs) if len(outs) > 1 else outs[0]), errors

    def _step_async(self) -> StepRecord:
        """One call of vLLM's EngineCore.step_with_batch_queue (batch queue of two):
        schedule and execute a new step if there is work, and feed the oldest step's
        output to the scheduler only once two are in flight (or nothing was run)."""
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            self._sched_seq += 1
            self._track(so)
            before = {r: self._computed.get(r, 0) for r in so.num_scheduled_tokens}
            out, errors = self._execute(so)
            self.inflight.insert(0, (out, so, errors, before, self._sched_seq))
            executed = so.total_num_scheduled_tokens > 0
            if len(self.inflight) < 2 and (executed or self.scheduler.has_requests()):
                return self._record({}, {}, [], None, set(), keep=False)
        elif not self.inflight:
            return self._record({}, {}, [], None, set(), keep=False)
        out, so, errors, before, seq = self.inflight.pop()
        return self._update(so, out, errors, before, seq)

    def _update(self, so: Any, out: Any, errors: list[list[tuple[str, int, int]]],
                before: dict[str, int], seq: int) -> StepRecord:
        self._discarded = set()
        # Aborted while the step was in flight (async scheduling): vLLM drops its output.
        gone = {r for r in so.num_scheduled_tokens
                if (q := self.scheduler.requests.get(r)) is None or q.is_finished()}
        self.scheduler.update_from_output(so, out)
        # What a request read in this step was never served when vLLM discarded the
        # step's output for it (a failed load hit it), or, for a step that sampled
        # nothing, when vLLM has since rewound the request to recompute from no later
        # than where this step started (async scheduling: the failed request's own
        # step in flight): its KV is written again before anything reads it. Nor
        # when the request was aborted before its output came back.
        rewound = {r for t, r, f in self._rewinds if t >= seq and f <= before.get(r, -1)}
        unserved = self._discarded | gone | {r for r in rewound
                                      if not out.sampled_token_ids[out.req_id_to_index[r]]}
        for w, errs in zip(self.workers, errors, strict=True):
            w.read_errors.extend(e for e in errs if e[0] not in unserved)
        # What vLLM accepted (a step hit by a load failure is discarded and rescheduled).
        done_now = []
        for r in so.num_scheduled_tokens:
            req = self.scheduler.requests.get(r)
            if req is not None:
                self.tokens[r] = list(req.all_token_ids)
            if (req is None or req.is_finished()) and r not in self.snapshots:
                # Blocks freed this step are not reused before the next schedule().
                self.snapshot(r)
                done_now.append(r)
        return self._record(dict(so.num_scheduled_tokens), before, done_now, out.kv_connector_output,
                            set(so.preempted_req_ids or ()))

    def _record(self, scheduled: dict[str, int], before: dict[str, int], done_now: list[str], kvo: Any,
                preempted: set[str], keep: bool = True) -> StepRecord:
        """The step's record (``keep``: a step whose output the scheduler saw)."""
        rec = StepRecord(
            scheduled=scheduled, computed_before=before, finished=done_now,
            invalid_block_ids=set(kvo.invalid_block_ids) if kvo else set(),
            finished_recving=set(kvo.finished_recving or ()) if kvo else set(),
            finished_sending=set(kvo.finished_sending or ()) if kvo else set(),
            stats=dict(kvo.kv_connector_stats.data) if kvo and kvo.kv_connector_stats else {},
            preempted=preempted,
        )
        if keep:
            self.finished.extend(done_now)
            self.records.append(rec)
        return rec

    def _prompt_len(self, req_id: str) -> int:
        return self.prompt_len[req_id]

    def run(self, max_steps: int = 10_000, timeout_s: float = 60.0) -> list[StepRecord]:
        """Step until every request is finished and freed (bounded in steps and time).

        Steps that compute nothing (waiting for transfers) pause briefly, as an
        idle engine would, instead of spinning."""
        recs = []
        deadline = time.monotonic() + timeout_s
        for _ in range(max_steps):
            if not self.scheduler.requests and not self.inflight:
                return recs
            if time.monotonic() > deadline:
                break
            rec = self.step()
            recs.append(rec)
            if not rec.scheduled:
                time.sleep(0.002)
        raise TimeoutError(f"requests still pending: {list(self.scheduler.requests)}")

    # -- KV inspection -------------------------------------------------------------------
    def snapshot(self, req_id: str) -> None:
        n = self._prompt_len(req_id)
        self.snapshots[req_id] = [
            [w.gather(self.block_ids[req_id], 0, n, layer).clone() for layer in range(len(w.layer_names))]
            for w in self.workers
        ]

    def prompt_kv(self, req_id: str, rank: int = 0) -> list[torch.Tensor]:
        """The request's prompt KV per layer as it sat in vLLM's blocks when it finished."""
        return self.snapshots[req_id][rank]

    def expected_prompt_kv(self, prompt: list[int], rank: int = 0) -> list[torch.Tensor]:
        w = self.workers[rank]
        return [w.expected(prompt, 0, len(prompt), layer) for layer in range(len(w.layer_names))]

    def read_errors(self) -> list[tuple[str, int, int]]:
        return [e for w in self.workers for e in w.read_errors]

    def first_schedule(self, req_id: str) -> tuple[int, int]:
        """(computed tokens before, tokens scheduled) at the request's first compute step."""
        for rec in self.records:
            if rec.scheduled.get(req_id):
                return rec.computed_before[req_id], rec.scheduled[req_id]
        raise KeyError(req_id)

    def stats_total(self) -> dict[str, float]:
        out: dict[str, float] = {}
        from ascendstore.engine import EngineMetrics

        for rec in self.records:
            out = EngineMetrics.merge(out, rec.stats)
        return out

    def close(self) -> None:
        for w in self.workers:
            w.close()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()


def prompt_bytes(tensors: Iterable[torch.Tensor]) -> bytes:
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


def tmp_pool_dir() -> str:
    return tempfile.mkdtemp(prefix="ascendstore-pool-", dir=os.environ.get("TMPDIR"))
