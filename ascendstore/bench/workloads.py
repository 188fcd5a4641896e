"""Benchmark workloads: deterministic request streams (same seed, same requests).

Each generator returns a :class:`Workload`: requests in arrival order, each with
its prompt token ids. Token content is derived from named *segments* (a user's
history, a document, a system prompt, a Mooncake ``hash_id``) so two requests
share a prefix exactly when they share the segments it is made of -- the
property a prefix cache and a KV pool exploit.

- ``gr``: generative recommendation. Zipf-popular users with long, stable
  histories; every request is history + a rotating candidate set.
- ``chat``: multi-round conversations; round k's prompt extends round k-1's.
- ``docqa``: many questions over a few shared long documents (Zipf-popular).
- ``trace``: replay of Mooncake's published trace format (JSON lines with
  ``timestamp`` in ms, ``input_length``, ``output_length`` and ``hash_ids``, one
  per 512-token block).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

#: token ids stay below this so any small fake model's vocabulary holds them.
DEFAULT_VOCAB = 32000
#: Mooncake's trace hashes 512-token blocks.
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class BenchRequest:
    req_id: str
    arrival_s: float
    prompt: tuple[int, ...]
    output_len: int
    #: GR: the user whose history leads the prompt, and how many tokens it spans.
    user: str | None = None
    history_len: int = 0
    #: tenant salt (vLLM ``cache_salt``); None for the shared namespace.
    tenant: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


@dataclass
class Workload:
    name: str
    requests: list[BenchRequest]
    #: the parameters it was generated with (recorded in the report).
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    def head(self, n: int) -> Workload:
        return Workload(self.name, self.requests[:n], {**self.params, "limit": n})


def _seed_of(*parts: object) -> int:
    # sha256 of the parts, never Python's hash(): identical across processes.
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def segment_tokens(seed: int, name: str, n: int, vocab: int = DEFAULT_VOCAB) -> list[int]:
    """``n`` tokens that depend only on (seed, name): a named, reusable segment."""
    rng = np.random.default_rng(_seed_of(seed, name))
    return rng.integers(1, vocab, size=n, dtype=np.int64).tolist()


def _zipf_probs(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return w / w.sum()


def _arrivals(rng: np.random.Generator, n: int, qps: float) -> np.ndarray:
    """Poisson arrivals at ``qps`` (all at t=0 when qps <= 0)."""
    if qps <= 0:
        return np.zeros(n)
    return np.cumsum(rng.exponential(1.0 / qps, size=n))


def gr(
    *,
    users: int = 64,
    requests: int = 400,
    history_tokens: int = 1024,
    candidates: int = 16,
    item_tokens: int = 8,
    catalog: int = 5000,
    zipf_s: float = 1.1,
    qps: float = 50.0,
    output_len: int = 1,
    seed: int = 0,
) -> Workload:
    """Zipf-popular users; prompt = the user's stable history + rotating candidates.

    History lengths vary per user in [history_tokens/2, 3*history_tokens/2]; the
    candidate set is ``candidates`` items drawn afresh for each request from a
    catalog of ``catalog`` items of ``item_tokens`` tokens each.
    """
    rng = np.random.default_rng(_seed_of(seed, "gr"))
    lo, hi = max(1, history_tokens // 2), max(2, history_tokens * 3 // 2)
    hist_len = rng.integers(lo, hi + 1, size=users)
    user_of = rng.choice(users, size=requests, p=_zipf_probs(users, zipf_s))
    arrivals = _arrivals(rng, requests, qps)
    reqs = []
    for i in range(requests):
        u = int(user_of[i])
        history = segment_tokens(seed, f"user{u}", int(hist_len[u]))
        items = rng.choice(catalog, size=candidates, replace=False)
        cand: list[int] = []
        for it in items:
            cand += segment_tokens(seed, f"item{int(it)}", item_tokens)
        reqs.append(
            BenchRequest(
                req_id=f"gr-{i}",
                arrival_s=float(arrivals[i]),
                prompt=tuple(history + cand),
                output_len=output_len,
                user=f"u{u}",
                history_len=len(history),
            )
        )
    params = dict(
        users=users,
        requests=requests,
        history_tokens=history_tokens,
        candidates=candidates,
        item_tokens=item_tokens,
        catalog=catalog,
        zipf_s=zipf_s,
        qps=qps,
        seed=seed,
    )
    return Workload("gr", reqs, params)


def chat(
    *,
    conversations: int = 40,
    rounds: int = 6,
    system_tokens: int = 256,
    user_tokens: int = 96,
    reply_tokens: int = 128,
    qps: float = 4.0,
    think_s: float = 5.0,
    seed: int = 0,
) -> Workload:
    """Multi-round chats behind one shared system prompt.

    Round k's prompt is round k-1's prompt + the assistant's reply (a
    deterministic stand-in for the generated text) + a new user message, so each
    round re-reads the whole conversation, as vLLM's chat API does.
    """
    rng = np.random.default_rng(_seed_of(seed, "chat"))
    system = segment_tokens(seed, "system", system_tokens)
    starts = _arrivals(rng, conversations, qps)
    reqs = []
    for c in range(conversations):
        n_rounds = int(rng.integers(max(1, rounds // 2), rounds + 1))
        prompt = list(system)
        t = float(starts[c])
        for k in range(n_rounds):
            if k:
                prompt += segment_tokens(seed, f"c{c}.reply{k - 1}", reply_tokens)
                t += float(rng.exponential(think_s))
            prompt += segment_tokens(
                seed, f"c{c}.user{k}", int(rng.integers(user_tokens // 2, user_tokens * 3 // 2 + 1))
            )
            reqs.append(BenchRequest(f"chat-{c}-{k}", t, tuple(prompt), reply_tokens))
    reqs.sort(key=lambda r: (r.arrival_s, r.req_id))
    params = dict(
        conversations=conversations,
        rounds=rounds,
        system_tokens=system_tokens,
        user_tokens=user_tokens,
        reply_tokens=reply_tokens,
        qps=qps,
        think_s=think_s,
        seed=seed,
    )
    return Workload("chat", reqs, params)


def docqa(
    *,
    documents: int = 16,
    questions: int = 300,
    doc_tokens: int = 2048,
    question_tokens: int = 48,
    system_tokens: int = 128,
    zipf_s: float = 0.9,
    qps: float = 20.0,
    output_len: int = 32,
    seed: int = 0,
) -> Workload:
    """Questions over shared long documents: prompt = system + document + question."""
    rng = np.random.default_rng(_seed_of(seed, "docqa"))
    system = segment_tokens(seed, "system", system_tokens)
    doc_len = rng.integers(doc_tokens // 2, doc_tokens * 3 // 2 + 1, size=documents)
    doc_of = rng.choice(documents, size=questions, p=_zipf_probs(documents, zipf_s))
    arrivals = _arrivals(rng, questions, qps)
    reqs = []
    for i in range(questions):
        d = int(doc_of[i])
        prompt = system + segment_tokens(seed, f"doc{d}", int(doc_len[d]))
        prompt += segment_tokens(seed, f"q{i}", question_tokens)
        reqs.append(BenchRequest(f"docqa-{i}", float(arrivals[i]), tuple(prompt), output_len))
    params = dict(
        documents=documents,
        questions=questions,
        doc_tokens=doc_tokens,
        question_tokens=question_tokens,
        system_tokens=system_tokens,
        zipf_s=zipf_s,
        qps=qps,
        output_len=output_len,
        seed=seed,
    )
    return Workload("docqa", reqs, params)


# -- Mooncake trace -----------------------------------------------------------------


def sample_trace_path() -> Path:
    """The small Mooncake-format trace shipped with AscendStore (generated by
    :func:`write_sample_trace`, not taken from Mooncake)."""
    return Path(str(resources.files("ascendstore.bench").joinpath("data/mooncake_sample.jsonl")))


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """Parse and check a Mooncake-format trace; errors name the line and field."""
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from None
            for key in ("timestamp", "input_length", "output_length", "hash_ids"):
                if key not in row:
                    raise ValueError(
                        f"{path}:{lineno}: missing field {key!r} (Mooncake trace lines need "
                        "timestamp, input_length, output_length, hash_ids)"
                    )
            need = -(-int(row["input_length"]) // MOONCAKE_BLOCK_TOKENS)
            if len(row["hash_ids"]) < need:
                raise ValueError(
                    f"{path}:{lineno}: {len(row['hash_ids'])} hash_ids cannot cover "
                    f"input_length {row['input_length']} ({need} blocks of 512 tokens)"
                )
            rows.append(row)
    return rows


def trace(
    *,
    path: str | Path | None = None,
    block_tokens: int = 64,
    limit: int | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Replay a Mooncake-format trace.

    Each ``hash_id`` becomes ``block_tokens`` deterministic tokens (512 replays
    the trace at full length; smaller values shrink every prompt by the same
    factor and keep its sharing structure, so a CPU run stays short). Lengths
    scale by ``block_tokens / 512``; timestamps (ms) by ``time_scale``.
    """
    src = Path(path) if path else sample_trace_path()
    rows = read_trace(src)[:limit]
    if not rows:
        raise ValueError(f"trace {src} has no requests")
    t0 = float(rows[0]["timestamp"])
    ratio = block_tokens / MOONCAKE_BLOCK_TOKENS
    reqs = []
    for i, row in enumerate(rows):
        n = max(1, round(int(row["input_length"]) * ratio))
        prompt: list[int] = []
        for h in row["hash_ids"]:
            if len(prompt) >= n:
                break
            prompt += segment_tokens(seed, f"h{h}", block_tokens)
        reqs.append(
            BenchRequest(
                req_id=f"trace-{i}",
                arrival_s=(float(row["timestamp"]) - t0) / 1000.0 * time_scale,
                prompt=tuple(prompt[:n]),
                output_len=max(1, round(int(row["output_length"]) * ratio)),
            )
        )
    params = dict(path=str(src), block_tokens=block_tokens, limit=limit, time_scale=time_scale, seed=seed)
    return Workload("trace", reqs, params)


def write_sample_trace(
    path: str | Path,
    *,
    requests: int = 240,
    prefixes: int = 12,
    seed: int = 7,
) -> None:
    """Write a synthetic trace in Mooncake's format: Zipf-popular shared prefixes
    (system prompts / documents), multi-turn continuations and unique suffixes."""
    rng = np.random.default_rng(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    prefix_ids = [fresh(int(rng.integers(2, 17))) for _ in range(prefixes)]
    probs = _zipf_probs(prefixes, 1.0)
    sessions: list[list[int]] = []
    t = 0.0
    with open(path, "w") as f:
        for _ in range(requests):
            t += float(rng.exponential(250.0))
            if sessions and rng.random() < 0.35:  # a later turn of an open session
                s = int(rng.integers(len(sessions)))
                ids = sessions[s] + fresh(int(rng.integers(1, 3)))
                sessions[s] = ids
            else:
                ids = prefix_ids[int(rng.choice(prefixes, p=probs))] + fresh(int(rng.integers(1, 5)))
                sessions.append(ids)
                sessions = sessions[-16:]
            tail = int(rng.integers(1, MOONCAKE_BLOCK_TOKENS + 1))
            row = {
                "timestamp": int(t),
                "input_length": (len(ids) - 1) * MOONCAKE_BLOCK_TOKENS + tail,
                "output_length": int(rng.integers(16, 512)),
                "hash_ids": ids,
            }
            f.write(json.dumps(row) + "\n")


#: name -> generator taking keyword parameters.
WORKLOADS: dict[str, Callable[..., Workload]] = {"gr": gr, "chat": chat, "docqa": docqa, "trace": trace}


def make_workload(name: str, **params: Any) -> Workload:
    """Build a workload by name; unknown names and parameters are clear errors."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}")
    gen = WORKLOADS[name]
    allowed = [p for p in inspect.signature(gen).parameters]
    bad = [k for k in params if k not in allowed]
    if bad:
        raise ValueError(
            f"workload {name!r} has no parameter {bad[0]!r}; its parameters: {', '.join(allowed)}"
        )
    return gen(**params)
