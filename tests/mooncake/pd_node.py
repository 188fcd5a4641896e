"""One vLLM 0.33 engine per OS process, for the prefill/decode split proof.

Each node runs vLLM's real ``Scheduler`` (which creates the scheduler-side
connector), the real worker-side connector created by
``ensure_kv_transfer_initialized`` and driven by the real model-runner mixin
(``KVConnectorModelRunnerMixin``), and KV caches allocated by vLLM's own
``allocate_kv_cache`` in the layout the connectors ask for. Only the model is
a stand-in: a deterministic function writes each token's K/V (derived from the
token prefix) into its slot, so any engine can tell what a token's KV must be
and whether a connector delivered it byte for byte.

Like vLLM's engine core, a node keeps stepping while its scheduler has work
(a prefill node must keep stepping after its request finished, until the
decode node has pulled the KV). The parent talks to it over a pipe.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from ascendstore.loopback import free_port

EOS = 2
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 16
#: CPU_ATTN (vLLM's CPU attention backend) only accepts multiples of 32.
BLOCK_SIZE = 32

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_SIZE,
    "num_hidden_layers": NUM_LAYERS,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "torch_dtype": "float16",
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": EOS,
}
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


# -- the stand-in model ---------------------------------------------------------
def _prefix_digests(tokens: list[int]) -> list[bytes]:
    out, h = [], b"pd-split"
    for t in tokens:
        h = hashlib.blake2b(h + int(t).to_bytes(4, "little"), digest_size=16).digest()
        out.append(h)
    return out


def token_kv(tokens: list[int], start: int, end: int) -> np.ndarray:
    """K|V of positions [start, end): float16 [layers, end-start, heads, 2*head]."""
    digests = _prefix_digests(tokens[:end])
    out = np.empty((NUM_LAYERS, end - start, NUM_KV_HEADS, 2 * HEAD_SIZE), np.float16)
    for p in range(start, end):
        for layer in range(NUM_LAYERS):
            seed = int.from_bytes(digests[p][:8], "little") ^ (layer * 0x9E3779B97F4A7C15 % (1 << 64))
            rng = np.random.default_rng(seed)
            out[layer, p - start] = rng.standard_normal((NUM_KV_HEADS, 2 * HEAD_SIZE)).astype(np.float16)
    return out


def next_token(tokens: list[int]) -> int:
    d = _prefix_digests(tokens)[-1]
    return 3 + int.from_bytes(d[:4], "little") % 990  # never EOS


# -- messages -------------------------------------------------------------------
@dataclass
class Result:
    req_id: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    #: prompt positions this engine's model computed itself (the rest came from a connector)
    computed_positions: list[int] = field(default_factory=list)
    #: this engine's KV of the whole prompt, read right after the prompt was complete
    prompt_kv: bytes = b""


class Node:
    """Parent-side handle of one engine process."""

    def __init__(self, name: str, kv_transfer_config: dict[str, Any], model_dir: str,
                 env: dict[str, str] | None = None, num_blocks: int = 64) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_node_main,
            args=(child, name, kv_transfer_config, model_dir, dict(env or {}), num_blocks),
            name=f"pd-{name}",
            daemon=True,
        )
        self._proc.start()
        self._results: dict[str, Result] = {}
        self._replies: list[Any] = []
        ready = self._recv(timeout=180)
        if ready[0] != "ready":
            self.close()
            raise RuntimeError(f"{name} failed to start:\n{ready[1]}")
        self.info: dict[str, Any] = ready[1]

    def _recv(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if not self._proc.is_alive():
                raise RuntimeError(f"node {self.name} died (exit code {self._proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {self.name}: no message within {timeout}s")
        msg = self._conn.recv()
        if msg[0] == "crash":
            raise RuntimeError(f"node {self.name} crashed:\n{msg[1]}")
        return msg

    def submit(self, req_id: str, prompt: list[int], max_tokens: int,
               kv_transfer_params: dict[str, Any] | None = None) -> None:
        self._conn.send(("submit", req_id, list(prompt), max_tokens, kv_transfer_params))

    def result(self, req_id: str, timeout: float = 60) -> Result:
        deadline = time.monotonic() + timeout
        while req_id not in self._results:
            msg = self._recv(max(0.0, deadline - time.monotonic()))
            if msg[0] == "result":
                self._results[msg[1].req_id] = msg[1]
            else:
                self._replies.append(msg)
        return self._results.pop(req_id)

    def call(self, what: str, timeout: float = 60) -> Any:
        """A query answered by the node between steps ("state", ...)."""
        self._conn.send((what,))
        deadline = time.monotonic() + timeout
        while True:
            for i, m in enumerate(self._replies):
                if m[0] == what:
                    return self._replies.pop(i)[1]
            msg = self._recv(max(0.0, deadline - time.monotonic()))
            if msg[0] == "result":
                self._results[msg[1].req_id] = msg[1]
            else:
                self._replies.append(msg)

    def wait_idle(self, timeout: float = 60) -> dict[str, Any]:
        """Until the scheduler holds no request (P: after D pulled the KV)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.call("state", timeout)
            if not st["requests"] or time.monotonic() > deadline:
                return st
            time.sleep(0.05)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("stop",))
                self._proc.join(20)
            except (BrokenPipeError, OSError):
                pass
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


# -- child side -------------------------------------------------------------------
def _node_main(conn: Any, name: str, ktc: dict[str, Any], model_dir: str, env: dict[str, str],
               num_blocks: int) -> None:
    os.environ.update(env)
    try:
        engine = _Engine(name, ktc, model_dir, num_blocks)
    except BaseException:
        conn.send(("ready-failed", traceback.format_exc()))
        return
    conn.send(("ready", engine.info()))
    inbox: queue.Queue[Any] = queue.Queue()

    def reader() -> None:
        while True:
            try:
                inbox.put(conn.recv())
            except (EOFError, OSError):
                inbox.put(("stop",))
                return

    threading.Thread(target=reader, daemon=True).start()
    try:
        while True:
            busy = engine.has_work()
            try:
                msg = inbox.get(timeout=0.0 if busy else 0.01)
            except queue.Empty:
                msg = None
            if msg is not None:
                if msg[0] == "stop":
                    break
                if msg[0] == "submit":
                    engine.add(*msg[1:])
                elif msg[0] == "state":
                    conn.send(("state", engine.state()))
                elif msg[0] == "reset_prefix_cache":
                    # vLLM's own reset (device prefix cache only; the pool keeps its entries)
                    conn.send(("reset_prefix_cache", engine.sched.reset_prefix_cache()))
                continue
            if busy:
                for res in engine.step():
                    conn.send(("result", res))
    except BaseException:
        conn.send(("crash", traceback.format_exc()))
    finally:
        engine.shutdown()


class _Engine:
    def __init__(self, name: str, ktc: dict[str, Any], model_dir: str, num_blocks: int) -> None:
        import torch

        if not hasattr(torch, "_pd_accel_shim") and not torch.accelerator.is_available():
            # STAND-IN (the only one on the P2P path): vLLM's MooncakeConnectorWorker
            # starts with torch.accelerator.current_device_index(), which a CPU-only
            # torch build refuses ("Cannot access accelerator device when none is
            # available"). On CPU the device index is 0 (CpuPlatform.set_device(0)
            # is a no-op); everything after that line runs unmodified.
            torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment]
            torch._pd_accel_shim = True  # type: ignore[attr-defined]

        from vllm import SamplingParams
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
            set_current_vllm_config,
        )
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_initialized
        from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
        from vllm.plugins import load_general_plugins
        from vllm.utils.hashing import sha256
        from vllm.v1.attention.backends.utils import KVCacheLayout
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        # As in every vLLM process: general plugins first (ours registers the
        # connector names and the PD composition check).
        load_general_plugins()
        self.name = name
        self._Request, self._SamplingParams = Request, SamplingParams
        mc = ModelConfig(model=model_dir, dtype="float16", seed=0, skip_tokenizer_init=True)
        sc = SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=2048, is_encoder_decoder=False,
            enable_chunked_prefill=True, disable_hybrid_kv_cache_manager=True,
        )
        cc = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
        self.vc = vc = VllmConfig(
            model_config=mc, scheduler_config=sc, cache_config=cc,
            kv_transfer_config=KVTransferConfig(**ktc), device_config=DeviceConfig("cpu"),
        )
        # vLLM resolves the KV layout the connectors require before creating them.
        connector_cls = KVConnectorFactory.get_connector_class(vc.kv_transfer_config)
        self.layout = connector_cls.get_required_kvcache_layout(vc) or "LBNHC"
        cc.kv_cache_layout = self.layout
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                                 dtype=torch.float16)
        page = spec.page_size_bytes
        self.kcc = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page * num_blocks * NUM_LAYERS, layers=LAYERS,
                                            layer_stride=page * num_blocks, block_stride=page)],
            kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
            kv_cache_layout=self.layout,
        )
        cc.num_gpu_blocks = num_blocks
        with set_current_vllm_config(vc):
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{free_port()}", 0, "gloo")
            initialize_model_parallel(1, 1)
            ensure_kv_transfer_initialized(vc, self.kcc)
            self.worker = get_kv_transfer_group()
            self.caches = allocate_kv_cache(self.kcc, torch.device("cpu"), KVCacheLayout[self.layout])
            # Poison: a slot nobody wrote (no load, no compute) can never look right.
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            for t in self.caches.values():
                t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
            self.worker.register_kv_caches(self.caches)
            self.sched = Scheduler(vc, self.kcc, StructuredOutputManager(vc), BLOCK_SIZE, log_stats=True)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self._results: dict[str, Result] = {}
        self._prompt_len: dict[str, int] = {}

    def info(self) -> dict[str, Any]:
        ktc = self.vc.kv_transfer_config
        return {"engine_id": ktc.engine_id, "layout": self.layout, "pid": os.getpid()}

    # -- requests -------------------------------------------------------------
    def add(self, req_id: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> None:
        sp = self._SamplingParams(max_tokens=max_tokens)
        sp.update_from_generation_config({}, EOS)
        req = self._Request(req_id, prompt, sp, None, block_hasher=self._hasher)
        req.kv_transfer_params = dict(params) if params else None
        self._results[req_id] = Result(req_id)
        self._prompt_len[req_id] = len(prompt)
        self.sched.add_request(req)

    def has_work(self) -> bool:
        return self.sched.has_requests()

    def state(self) -> dict[str, Any]:
        bp = self.sched.kv_cache_manager.block_pool
        return {
            "requests": sorted(self.sched.requests),
            "free_blocks": bp.get_num_free_blocks(),
            "num_blocks": bp.num_gpu_blocks,
        }

    # -- one engine step, as EngineCore.step + GPUModelRunner.execute_model ------
    def step(self) -> list[Result]:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as Mixin

        so = self.sched.schedule()
        with set_current_vllm_config(self.vc):
            if so.total_num_scheduled_tokens == 0:
                out = Mixin.kv_connector_no_forward(so, self.vc)
            else:
                attn = {name: SimpleNamespace(slot_mapping=torch.empty(0, dtype=torch.long)) for name in LAYERS}
                sampled: dict[str, list[int]] = {}
                with set_forward_context(attn, self.vc, num_tokens=so.total_num_scheduled_tokens), \
                        Mixin.maybe_get_kv_connector_output(so) as kv_out:
                    plan = self._plan(so)
                    for li, layer in enumerate(LAYERS):
                        self.worker.wait_for_layer_load(layer)
                        for _, tokens, start, end, blocks in plan:
                            self._write(li, tokens, start, end, blocks)
                        self.worker.save_kv_layer(layer, self.caches[layer], attn[layer])
                    for req_id, tokens, start, end, _ in plan:
                        self._results[req_id].computed_positions.extend(
                            p for p in range(start, end) if p < self._prompt_len[req_id])
                        # Sample only when the step reached the end of the known tokens.
                        sampled[req_id] = [next_token(tokens)] if end == len(tokens) else []
                ids = list(sampled)
                out = ModelRunnerOutput(
                    req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                    sampled_token_ids=[sampled[r] for r in ids], kv_connector_output=kv_out,
                )
                for req_id, _, start, end, blocks in plan:
                    if start < self._prompt_len[req_id] <= end:
                        self._results[req_id].prompt_kv = self._read_prompt(req_id, blocks)
            eco = self.sched.update_from_output(so, out)
        done = []
        for outs in eco.values():
            for o in outs.outputs:
                res = self._results.get(o.request_id)
                if res is None:
                    continue
                res.tokens.extend(o.new_token_ids)
                if o.kv_transfer_params is not None:
                    res.kv_transfer_params = o.kv_transfer_params
                if o.finish_reason is not None:
                    res.finish_reason = str(o.finish_reason)
                    done.append(self._results.pop(o.request_id))
        return done

    def _plan(self, so: Any) -> list[tuple[str, list[int], int, int, list[int]]]:
        plan = []
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            end = req.num_computed_tokens  # the scheduler already advanced it by n
            blocks = self.sched.kv_cache_manager.get_block_ids(req_id)[0]
            plan.append((req_id, list(req.all_token_ids), end - n, end, list(blocks)))
        return plan

    def _view(self, layer: int) -> Any:
        return self.caches[LAYERS[layer]]  # logical [blocks, heads, block_size, K|V]

    def _write(self, layer: int, tokens: list[int], start: int, end: int, blocks: list[int]) -> None:
        import torch

        kv = torch.from_numpy(token_kv(tokens, start, end)[layer])
        view = self._view(layer)
        for i, p in enumerate(range(start, end)):
            view[blocks[p // BLOCK_SIZE], :, p % BLOCK_SIZE, :] = kv[i]

    def _read_prompt(self, req_id: str, blocks: list[int]) -> bytes:
        # The step that computes the last prompt token completes the prompt's KV
        # (vLLM always recomputes at least that token, whatever was loaded).
        n = self._prompt_len[req_id]
        arr = np.empty((NUM_LAYERS, n, NUM_KV_HEADS, 2 * HEAD_SIZE), np.float16)
        for li in range(NUM_LAYERS):
            view = self._view(li)
            for p in range(n):
                arr[li, p] = view[blocks[p // BLOCK_SIZE], :, p % BLOCK_SIZE, :].numpy()
        return arr.tobytes()

    def shutdown(self) -> None:
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        try:
            conn = self.sched.get_kv_connector()
            if conn is not None:
                conn.shutdown()
        except Exception:
            pass
        try:
            ensure_kv_transfer_shutdown()
        except Exception:
            pass
