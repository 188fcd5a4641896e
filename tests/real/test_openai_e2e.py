"""Token-identical outputs through the real OpenAI server, with and without the pool.

One tiny Llama (GQA, fp32), greedy decoding, top-5 logprobs, a device cache of
96 blocks. The no-connector server gives the reference outputs; pool servers
must reproduce them when cold (everything computed, KV saved), warm after
``/reset_prefix_cache`` (the device cache is empty, the pool serves the prompt),
in a second server process that shares the pool (async loads), and with GR
fields in the request body: a small trace of users (history + fresh candidates)
through GR mode with the device-side user LRU on, cold, LRU-evicted and warm,
with exactly each user's history in the pool.
"""

from __future__ import annotations

import os
import random
import struct
import time
import uuid

import numpy as np
import pytest
from ascendstore_vllm.testing.openai_server import BLOCK_SIZE, Completion, VllmServer
from real_helpers import assert_same_output

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 8
#: KV bytes of one token of the tiny Llama: 4 layers x (K + V) x 2 KV heads x 64 x fp32
KV_PER_TOKEN = 4 * 2 * 2 * 64 * 4

#: GR users (uid, cache_salt, history tokens); requests are history + CANDIDATES fresh
#: tokens. Histories end inside a block, so the block holding the first candidates is
#: partly history: it must not be pooled. The last user is uid "gr-a" of another tenant.
GR_USERS = [("gr-a", None, 200), ("gr-b", None, 265), ("gr-c", None, 330), ("gr-a", "tenant-x", 170)]
CANDIDATES = 40
GR_ROUNDS = 3


def gr_prompt(user: int, rnd: int) -> list[int]:
    """User ``user``'s request of round ``rnd``: its history, then candidates of that round."""
    uid, salt, hist = GR_USERS[user]
    h = random.Random(f"history-{uid}-{salt}")
    c = random.Random(f"candidates-{user}-{rnd}")
    return [h.randrange(10, 500) for _ in range(hist)] + [c.randrange(10, 500) for _ in range(CANDIDATES)]
#: the pool at its default capacity (1 GiB) and options: not prefaulted, so memory is
#: taken as saves fill it, and a thread of one of its processes makes it 2 MiB pages
POOL = {"backend": "local", "backend_config": {"name": f"real-{uuid.uuid4().hex[:8]}"}}


def pool_config(port: int, **extra: object) -> dict:
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {**POOL, "lookup_rpc_port": port, **extra}}


def pooled(prompt_tokens: int) -> int:
    """Prompt tokens a pool can serve: whole blocks, never the last prompt token."""
    return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def wait_saved(server: VllmServer, timeout_s: float = 30.0) -> dict[str, float]:
    """Metrics once the pool's save counter stops moving (saves finish after a request does)."""
    last, deadline = -1.0, time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        now = m.get("vllm:ascendstore_save_bytes_total", 0.0)
        if now > 0 and now == last:
            return m
        if time.monotonic() > deadline:
            return m
        last = now
        time.sleep(0.5)


@pytest.fixture(scope="module")
def start(llama_model, servers, logdir):
    def make(name: str, ktc: dict | None) -> VllmServer:
        s = VllmServer(llama_model, log_path=logdir / f"{name}.log", kv_transfer_config=ktc)
        servers.append(s)
        s.start()
        print(f"\n[{name}] healthy after {s.started_s:.1f} s")
        return s
    return make


@pytest.fixture(scope="module")
def pd_documents(documents) -> list[str]:
    """Documents no server sees before the PD test (so only its prefill can put them in the pool)."""
    from ascendstore_vllm.testing.tiny_models import CORPUS

    lines = [ln for ln in CORPUS.read_text().splitlines() if ln.strip()]
    rng = random.Random(7)
    return [f"PD request {i}.\n" + "\n".join(rng.sample(lines, len(lines))[:16]) + "\nAnswer:" for i in range(3)]


@pytest.fixture(scope="module")
def no_connector(start, documents, pd_documents) -> dict:
    """Outputs of the server without a connector (stopped afterwards: 2 cores): ``docs`` holds
    ``documents`` first, then ``pd_documents``; ``gr`` the GR trace by (user, round)."""
    s = start("no-connector", None)
    try:
        docs = [s.complete(d, MAX_TOKENS) for d in documents + pd_documents]
        gr = {(u, r): s.complete(gr_prompt(u, r), MAX_TOKENS, cache_salt=GR_USERS[u][1])
              for r in range(GR_ROUNDS) for u in range(len(GR_USERS))}
        return {"docs": docs, "gr": gr}
    finally:
        s.stop()


@pytest.fixture(scope="module")
def reference(no_connector) -> list[Completion]:
    return no_connector["docs"]


@pytest.fixture(scope="module")
def pool_a(start, reference) -> VllmServer:
    # GR mode with the device-side user LRU on (the default), at most one resident
    # user: every GR request that ends evicts the user before it from the device.
    return start("pool-a", pool_config(1, gr={"enabled": True, "max_resident_users": 1}))


def test_cold_pool_matches_no_connector(pool_a, reference, documents) -> None:
    worst = 0.0
    for i, doc in enumerate(documents):
        out = pool_a.complete(doc, MAX_TOKENS)
        worst = max(worst, assert_same_output(out, reference[i], f"cold pool, document {i}"))
        assert out.cached_tokens == 0, "an empty pool and an empty device cache serve nothing"
    m = wait_saved(pool_a)
    assert m.get("vllm:ascendstore_lookup_hit_tokens_total", 0) == 0
    assert m.get("vllm:ascendstore_save_bytes_total", 0) > 0, "the cold pass saved nothing"
    print(f"cold: largest top-5 logprob difference {worst:.2e}")


def _pool_mappings() -> dict[int, tuple[int, int]]:
    """(resident bytes, bytes in 2 MiB pages) of the pool's segment in each process mapping it."""
    from ascendstore.local.pages import mapped_pages

    path = "/dev/shm/ascendstore-pool." + POOL["backend_config"]["name"]
    out = {}
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
        try:
            with open(f"/proc/{pid}/maps") as f:
                if path not in f.read():
                    continue
        except OSError:
            continue  # gone, or not ours to read
        out[pid] = mapped_pages(path, f"/proc/{pid}/smaps")
    return out


def test_the_pool_takes_memory_as_it_fills_in_2_mib_pages_under_the_server(pool_a) -> None:
    """lazy_huge_pages (the default) under vLLM's own processes: the pool is 1 GiB, but the
    server's processes hold about what was saved, not the capacity; and on a /dev/shm
    mounted huge=never (the usual mount) where the kernel makes 2 MiB pages on request,
    the thread of one of them made what was saved 2 MiB pages. The warm test after this
    one then reads those pages back: its outputs must equal the no-connector server's."""
    from ascendstore.local.pages import collapse_works, tmpfs_huge

    saved = wait_saved(pool_a)["vllm:ascendstore_save_bytes_total"]
    expect_huge = tmpfs_huge("/dev/shm") == "never" and collapse_works()
    deadline = time.monotonic() + 30.0
    while True:  # the thread catches up with the fill within a second or so of the last save
        maps = _pool_mappings()
        huge = max((h for _, h in maps.values()), default=0)
        if not expect_huge or huge >= 2 << 20 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert maps, "no process of the server maps the pool"
    resident = max(r for r, _ in maps.values())
    print(f"pool: {saved / 2**20:.1f} MiB saved; in {len(maps)} processes, at most {resident / 2**20:.1f} MiB "
          f"resident, {huge / 2**20:.0f} MiB in 2 MiB pages")
    # (a 1 GiB pool; its index and headers and the partly filled 2 MiB stretch on top of the saves)
    assert resident <= saved + 64 * 2**20, maps
    if expect_huge:
        assert huge >= 2 << 20, maps


def test_warm_pool_after_reset_serves_prompts_from_the_pool(pool_a, reference, documents) -> None:
    before = wait_saved(pool_a)
    pool_a.reset_prefix_cache()
    served = 0
    worst = 0.0
    for i, doc in enumerate(documents):
        out = pool_a.complete(doc, MAX_TOKENS)
        worst = max(worst, assert_same_output(out, reference[i], f"warm pool, document {i}"))
        # The device cache was emptied: every cached prompt token came from the pool.
        assert out.cached_tokens == pooled(out.prompt_tokens), (out.cached_tokens, out.prompt_tokens)
        served += out.cached_tokens
    after = pool_a.metrics()
    hit = after["vllm:ascendstore_lookup_hit_tokens_total"] - before.get("vllm:ascendstore_lookup_hit_tokens_total", 0)
    loaded = after["vllm:ascendstore_load_bytes_total"] - before.get("vllm:ascendstore_load_bytes_total", 0)
    assert hit == served > 0
    # 4 layers x (K + V) x 2 KV heads x 64 x fp32 = 4 KiB of KV per token, all of it loaded
    assert loaded == served * 4 * 2 * 2 * 64 * 4
    print(f"warm: {served} prompt tokens from the pool; largest top-5 logprob difference {worst:.2e}")


def test_gr_fields_in_the_request_body_reach_the_connector(pool_a, reference, documents) -> None:
    """``kv_transfer_params`` with GR fields: a miss that saves the user's history, then a pool hit."""
    doc = documents[0]
    prompt_tokens = reference[0].prompt_tokens or pool_a.complete(doc, 1, logprobs=0).prompt_tokens
    params = {"uid": "user-7", "user_history_len": prompt_tokens - 5}
    m0 = pool_a.metrics()
    pool_a.reset_prefix_cache()
    first = pool_a.complete(doc, MAX_TOKENS, kv_transfer_params=params)
    assert_same_output(first, reference[0], "GR miss")
    time.sleep(1.0)
    m1 = pool_a.metrics()
    assert m1.get("vllm:ascendstore_gr_dram_misses_total", 0) == m0.get("vllm:ascendstore_gr_dram_misses_total", 0) + 1
    pool_a.reset_prefix_cache()
    second = pool_a.complete(doc, MAX_TOKENS, kv_transfer_params=params)
    assert_same_output(second, reference[0], "GR pool hit")
    m2 = pool_a.metrics()
    assert m2.get("vllm:ascendstore_gr_dram_hits_total", 0) == m1.get("vllm:ascendstore_gr_dram_hits_total", 0) + 1
    assert second.cached_tokens == (prompt_tokens - 5) // BLOCK_SIZE * BLOCK_SIZE


def _wait_metrics(server: VllmServer, want: dict[str, float], timeout_s: float = 30.0) -> dict[str, float]:
    """Metrics once every counter in ``want`` reached its value (Prometheus is
    updated when the engine's step outputs reach the API server), or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if all(m.get(k, 0.0) >= v for k, v in want.items()) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def _user_part(uid: str, salt: str | None) -> str:
    from ascendstore.keys import tenant_id

    return f"{tenant_id(salt)}~{uid}" if salt else uid


def test_gr_users_with_the_user_lru_outputs_equal_and_only_histories_stored(pool_a, no_connector) -> None:
    """GR requests through the OpenAI server (uid, user_history_len and a tenant's
    cache_salt in the body), user LRU on: round 0 cold (each user a miss, its
    history saved), round 1 right after (each user was evicted from the device by
    the next one's request: the pool serves it), round 2 after /reset_prefix_cache
    (the pool serves). Greedy outputs equal the no-connector server's. Then the
    pool holds, per user, exactly its history: one KV object of its whole blocks
    (all layers of the one rank, as the key layout stores them) and its token
    record; no candidate token and no chunk-pool object was written."""
    from ascendstore.gr.records import KV_HEADER_BYTES, TokenRecord, capacity_class, token_object_bytes
    from ascendstore.registry import create_backend

    ref = no_connector["gr"]
    names = {k: f"vllm:ascendstore_gr_{k}_total" for k in
             ("dram_hits", "dram_misses", "device_hits", "lru_evictions", "saves", "bytes_saved",
              "swapin_successes")}
    pool = create_backend("local", POOL["backend_config"])
    try:
        keys_before = set(pool.list_keys("", limit=1 << 20))
        pool_a.reset_prefix_cache()
        m0 = pool_a.metrics()
        m = m0
        worst = 0.0
        n_users = len(GR_USERS)
        for rnd in range(GR_ROUNDS):
            if rnd == 2:
                pool_a.reset_prefix_cache()
            before = m
            for u, (uid, salt, hist) in enumerate(GR_USERS):
                params = {"uid": uid, "user_history_len": hist}
                out = pool_a.complete(gr_prompt(u, rnd), MAX_TOKENS, kv_transfer_params=params, cache_salt=salt)
                worst = max(worst, assert_same_output(out, ref[(u, rnd)], f"GR round {rnd}, user {u}"))
                # round 0: nothing anywhere; later rounds: the pool served the whole
                # pooled history (the device had lost it: user LRU or reset)
                assert out.cached_tokens == (0 if rnd == 0 else pooled(hist + 1)), (rnd, u, out.cached_tokens)
            want = ({"saves": n_users, "lru_evictions": n_users - 1} if rnd == 0 else
                    {"swapin_successes": n_users, "lru_evictions": n_users if rnd == 1 else 0})
            m = _wait_metrics(pool_a, {names[k]: before.get(names[k], 0) + v for k, v in want.items()})
            time.sleep(0.3)  # nothing more may come (an extra eviction or save would show now)
            m = pool_a.metrics()
            d = {k: m.get(n, 0) - before.get(n, 0) for k, n in names.items()}
            print(f"GR round {rnd}: {d}")
            if rnd == 0:
                assert d["dram_misses"] == n_users and d["saves"] == n_users, d
                assert d["lru_evictions"] == n_users - 1, d  # each request's end evicts the user before
            else:
                assert d["dram_hits"] == n_users and d["swapin_successes"] == n_users, d
                assert d["device_hits"] == 0 and d["saves"] == 0, d
            if rnd == 1:
                assert d["lru_evictions"] == n_users, d  # (round 0's last user included)
        # the pool: per user, exactly its history's KV and its token record
        expect_bytes = 0
        for u, (uid, salt, hist) in enumerate(GR_USERS):
            part = _user_part(uid, salt)
            keys = sorted(pool.list_keys(f"{part}@", limit=100))
            n_tok = pooled(hist + 1)  # whole history blocks (the prompt goes on past the history)
            assert [k.rsplit("@", 1)[1] for k in keys] == ["kv_cache", "token_id"], keys
            kv = np.empty(KV_HEADER_BYTES + n_tok * KV_PER_TOKEN, dtype=np.uint8)
            # the contract reads an object only into regions of its exact size: OK means
            # the stored object is exactly the header and this many tokens' KV
            assert pool.get([keys[0]], [[_region(kv)]], 5.0)[0].name == "OK", f"user {u}: KV object size"
            _, _, n_blocks, layer = struct.unpack_from("<8sQIi", kv, 0)
            assert (n_blocks, layer) == (n_tok // BLOCK_SIZE, -1)
            rec_buf = np.empty(token_object_bytes(capacity_class(n_tok)), dtype=np.uint8)
            assert pool.get([keys[1]], [[_region(rec_buf)]], 5.0)[0].name == "OK"
            rec = TokenRecord.decode(rec_buf)
            assert rec.tokens.tolist() == gr_prompt(u, 0)[:n_tok], f"user {u}: stored tokens are not its history"
            assert rec.kv_bytes == n_tok * KV_PER_TOKEN
            expect_bytes += rec.kv_bytes
        new = set(pool.list_keys("", limit=1 << 20)) - keys_before
        parts = tuple(f"{_user_part(uid, salt)}@" for uid, salt, _ in GR_USERS)
        assert all(k.startswith(parts) for k in new), f"not a GR user object: {sorted(new)[:5]}"
        assert len(new) == 2 * len(GR_USERS)
        assert m.get(names["bytes_saved"], 0) - m0.get(names["bytes_saved"], 0) == expect_bytes
        print(f"GR: {len(GR_USERS)} users, {expect_bytes} history KV bytes stored; "
              f"largest top-5 logprob difference {worst:.2e}")
    finally:
        pool.close()


def _region(buf: np.ndarray):
    from ascendstore.contract import Region

    return Region(buf.ctypes.data, buf.nbytes)


def test_second_server_process_shares_the_pool_with_async_loads(start, pool_a, reference, documents) -> None:
    """A second server process (load_async: loads on a transfer thread, the request
    waits in the scheduler) reads what pool-a wrote. Layerwise mode stores other
    objects (one per layer), so it is proven on its own pool: tests/real/mooncake."""
    wait_saved(pool_a)
    other = start("pool-async", pool_config(2, load_async=True))
    try:
        for i, doc in enumerate(documents):
            out = other.complete(doc, MAX_TOKENS)
            assert_same_output(out, reference[i], f"async server, document {i}")
            # A fresh process: its device cache is empty, so the pool served these.
            assert out.cached_tokens == pooled(out.prompt_tokens), (out.cached_tokens, out.prompt_tokens)
        m = other.metrics()
        assert m["vllm:ascendstore_lookup_hit_tokens_total"] > 0
    finally:
        other.stop()


def pd_complete(prefill: VllmServer, decode: VllmServer, prompt: str, max_tokens: int) -> tuple[Completion, Completion]:
    """The PD proxy: the prompt to the prefill server with max_tokens 1, then to the decode server.
    With the pool as the hand-off nothing else travels (no kv_transfer_params): the prefill
    node's saves of the prompt are in the pool when its response ends (the local pool saves
    on the forward thread, inline_save_bytes), and the decode node looks the prompt up."""
    first = prefill.complete(prompt, 1, logprobs=0)
    return first, decode.complete(prompt, max_tokens)


def test_pd_split_through_the_pool_alone(start, pool_a, reference, documents, pd_documents) -> None:
    """PD split without a P2P connector (vLLM's MooncakeConnector cannot start on a CPU-only
    torch, docs/real-models.md): prefill is pool-a (kv_both), decode a server whose
    MultiConnector holds only AscendStoreConnector as kv_consumer with consumer_is_to_load
    (``ascendstore config pd --role decode --p2p none``). Decode takes every whole block of
    the prompt from the pool and its outputs equal a single server's; a prompt no prefill
    node saw is computed on decode (nothing in the pool), and decode saves nothing."""
    from ascendstore.pd import build_pd_config

    ref = reference[len(documents):]
    decode = start("pd-decode", build_pd_config("decode", p2p="none", backend="local",
                                                backend_config=POOL["backend_config"], instance=3))
    try:
        for i, doc in enumerate(pd_documents[:2]):
            first, out = pd_complete(pool_a, decode, doc, MAX_TOKENS)
            assert first.cached_tokens == 0, "a PD document reached the pool before its prefill"
            assert_same_output(out, ref[i], f"PD split, document {i}")
            assert out.cached_tokens == pooled(out.prompt_tokens), (out.cached_tokens, out.prompt_tokens)
        alone = decode.complete(pd_documents[2], MAX_TOKENS)  # not prefilled: nothing to load
        assert_same_output(alone, ref[2], "decode without prefill")
        assert alone.cached_tokens == 0
        m = decode.metrics()
        served = sum(pooled(r.prompt_tokens) for r in ref[:2])
        assert m["vllm:ascendstore_lookup_hit_tokens_total"] == served
        assert m.get("vllm:ascendstore_save_bytes_total", 0) == 0, "a decode node without consumer_is_to_put saved"
    finally:
        decode.stop()
