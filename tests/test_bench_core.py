"""The vLLM-free half of the benchmark: workloads, bound, cost model, report, plots."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from ascendstore.bench.bound import (
    block_hashes,
    cacheable_blocks,
    infinite_cache_hits,
    reusable_blocks,
    working_set_blocks,
)
from ascendstore.bench.cost import PrefillCostModel
from ascendstore.bench.display import report_table, write_plots, write_sweep_plot
from ascendstore.bench.report import BenchReport, RequestRecord, build_report, report_schema
from ascendstore.bench.workloads import (
    BenchRequest,
    chat,
    docqa,
    gr,
    make_workload,
    read_trace,
    sample_trace_path,
    trace,
    write_sample_trace,
)


def _req(i: int, prompt: list[int], tenant: str | None = None) -> BenchRequest:
    return BenchRequest(f"r{i}", float(i), tuple(prompt), 1, tenant=tenant)


# -- workloads -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gr", "chat", "docqa", "trace"])
def test_workloads_are_deterministic_per_seed(name):
    small = {
        "gr": dict(users=8, requests=30),
        "chat": dict(conversations=5),
        "docqa": dict(questions=20),
        "trace": dict(limit=30),
    }[name]
    a = make_workload(name, seed=1, **small)
    b = make_workload(name, seed=1, **small)
    c = make_workload(name, seed=2, **small)
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
    assert [r.prompt for r in a.requests] != [r.prompt for r in c.requests]
    assert all(r.prompt_len > 0 for r in a.requests)
    arrivals = [r.arrival_s for r in a.requests]
    assert arrivals == sorted(arrivals)


def test_gr_users_keep_their_history_and_rotate_candidates():
    w = gr(users=6, requests=80, history_tokens=64, candidates=4, item_tokens=4, seed=3)
    by_user: dict[str, list[BenchRequest]] = {}
    for r in w.requests:
        by_user.setdefault(r.user, []).append(r)
    counts = sorted((len(v) for v in by_user.values()), reverse=True)
    assert counts[0] > counts[-1]  # Zipf: a popular head
    for reqs in by_user.values():
        h = reqs[0].history_len
        assert 32 <= h <= 96
        assert all(r.history_len == h and r.prompt[:h] == reqs[0].prompt[:h] for r in reqs)
        assert all(r.prompt_len == h + 16 for r in reqs)
        if len(reqs) > 2:
            assert len({r.prompt[h:] for r in reqs}) > 1  # candidates rotate


def test_chat_rounds_extend_the_previous_round():
    w = chat(conversations=3, rounds=4, seed=0)
    convs: dict[str, list[BenchRequest]] = {}
    for r in w.requests:
        convs.setdefault(r.req_id.rsplit("-", 1)[0], []).append(r)
    for reqs in convs.values():
        reqs.sort(key=lambda r: int(r.req_id.rsplit("-", 1)[1]))
        for prev, cur in zip(reqs, reqs[1:], strict=False):
            assert cur.prompt[: prev.prompt_len] == prev.prompt and cur.prompt_len > prev.prompt_len
    system = w.requests[0].prompt[:256]
    assert all(r.prompt[:256] == system for r in w.requests)


def test_docqa_questions_share_documents():
    w = docqa(documents=3, questions=30, doc_tokens=200, question_tokens=10, system_tokens=20, seed=0)
    heads = {r.prompt[: r.prompt_len - 10] for r in w.requests}
    assert len(heads) <= 3
    assert len({r.prompt[-10:] for r in w.requests}) == 30


def test_trace_replay_follows_hash_ids(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 700, "output_length": 512, "hash_ids": [1, 4]},
        {"timestamp": 2500, "input_length": 512, "output_length": 5, "hash_ids": [9]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = trace(path=path, block_tokens=64)
    a, b, c = w.requests
    assert [r.prompt_len for r in w.requests] == [round(1100 / 8), round(700 / 8), 64]
    assert a.prompt[:64] == b.prompt[:64] and a.prompt[64:87] != b.prompt[64:87]
    assert c.prompt[:64] != a.prompt[:64]
    assert [r.arrival_s for r in w.requests] == [0.0, 0.5, 1.5]
    assert b.output_len == 64
    full = trace(path=path, block_tokens=512)
    assert full.requests[0].prompt_len == 1100


def test_trace_errors_name_line_and_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 2}\n'
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing field 'input_length'"):
        read_trace(bad)
    short = tmp_path / "short.jsonl"
    short.write_text('{"timestamp": 1, "input_length": 1500, "output_length": 1, "hash_ids": [1, 2]}\n')
    with pytest.raises(ValueError, match="cannot cover input_length 1500"):
        read_trace(short)


def test_shipped_sample_trace_is_what_the_generator_writes(tmp_path):
    rows = read_trace(sample_trace_path())
    assert len(rows) >= 200
    regenerated = tmp_path / "s.jsonl"
    write_sample_trace(regenerated)
    assert regenerated.read_text() == sample_trace_path().read_text()


def test_unknown_workload_or_parameter_is_a_clear_error():
    with pytest.raises(ValueError, match="choose one of: gr, chat, docqa, trace"):
        make_workload("nope")
    with pytest.raises(ValueError, match="has no parameter 'userz'.*users"):
        make_workload("gr", userz=3)


# -- infinite-cache bound ---------------------------------------------------------------


def test_block_hashes_chain_the_prefix():
    x = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    y = block_hashes([9, 2, 3, 4, 5, 6], 2)
    assert len(x) == 3 and len(y) == 3
    assert x[1] != y[1]  # same tokens in block 1, different prefix
    assert block_hashes([1, 2], 2, salt="a") != block_hashes([1, 2], 2, salt="b")


def test_infinite_cache_bound_by_hand():
    bs = 4
    base = list(range(100, 112))  # 3 full blocks
    reqs = [
        _req(0, base),  # cold: nothing
        _req(1, base),  # same 12 tokens: last token must be computed -> 2 blocks
        _req(2, base + [1, 2, 3, 4, 5]),  # 17 tokens: 3 blocks cached, 4th is new
        _req(3, base[:4] + [0] * 8),  # shares only the first block
        _req(4, base, tenant="other"),  # another tenant shares nothing
        _req(5, [7, 7, 7]),  # shorter than a block
    ]
    assert infinite_cache_hits(reqs, bs) == [0, 8, 12, 4, 0, 0]
    assert cacheable_blocks(12, 4) == 2 and cacheable_blocks(13, 4) == 3
    assert working_set_blocks(reqs, bs) == 3 + 1 + 2 + 3
    assert reusable_blocks(reqs, bs) == 3  # only the shared base blocks are worth pooling


# -- cost model ------------------------------------------------------------------------


def test_cost_model_arithmetic():
    m = PrefillCostModel(
        step_overhead_s=0.0,
        per_token_s=1e-3,
        per_token_pair_s=1e-6,
        kv_bytes_per_token=100,
        load_bytes_per_s=1e6,
    )
    assert m.prefill_s(100) == pytest.approx(0.1 + 100 * 50 * 1e-6)
    assert m.prefill_s(10, cached_tokens=90) == pytest.approx(0.01 + 10 * 95 * 1e-6)
    assert m.load_s(90) == pytest.approx(9e-3)
    full = m.request_ttft_s(100)
    assert m.request_ttft_s(100, pool_hit=90) < full
    assert m.request_ttft_s(100, device_hit=90) < m.request_ttft_s(100, pool_hit=90)


# -- report ----------------------------------------------------------------------------


def _records() -> list[RequestRecord]:
    m = PrefillCostModel()
    out = []
    for i, (p, d, q, b) in enumerate(
        [(100, 0, 0, 0), (100, 32, 48, 96), (200, 0, 160, 192), (50, 16, 0, 32)]
    ):
        out.append(
            RequestRecord(
                req_id=f"r{i}",
                arrival_s=i,
                scheduled_s=i + 0.1,
                prompt_tokens=p,
                device_hit=d,
                pool_hit=q,
                bound_hit=b,
                modeled_ttft_s=m.request_ttft_s(p, d, q),
            )
        )
    return out


def _report(**over) -> BenchReport:
    kw = dict(
        workload="gr",
        backend="local",
        records=_records(),
        block_size=16,
        chunk_size=16,
        lookup_latency_us=[float(x) for x in range(1, 101)],
        bytes_loaded=2_000_000,
        bytes_saved=3_000_000,
        load_wall_s=0.001,
        save_wall_s=0.003,
        kv_bytes_verified=2_000_000,
        kv_mismatches=0,
        connector_s=0.05,
        wall_s=1.5,
        cost_model=PrefillCostModel(),
    )
    kw.update(over)
    return build_report(**kw)


def test_build_report_aggregates():
    r = _report()
    assert r.requests == 4 and r.prompt_tokens == 450
    assert (r.hit_tokens.device, r.hit_tokens.pool) == (48, 208)
    assert r.prefill_tokens_saved == 256
    assert r.prefill_tokens_saved_ratio == pytest.approx(256 / 450)
    assert r.infinite_cache_bound_ratio == pytest.approx(320 / 450)
    assert r.bound_efficiency == pytest.approx(256 / 320)
    assert r.lookup_latency_us.p50 == pytest.approx(50.5) and r.lookup_latency_us.p99 == pytest.approx(99.01)
    assert r.load_gbps == pytest.approx(2.0) and r.save_gbps == pytest.approx(1.0)
    assert r.modeled.ttft_speedup > 1.0
    assert r.connector_overhead_ratio == pytest.approx(0.05 / r.modeled.ttft_no_cache_s)


def test_report_json_round_trip_and_required_fields(tmp_path):
    r = _report()
    path = tmp_path / "out" / "r.json"
    r.to_json(path)
    data = json.loads(path.read_text())
    for key in (
        "workload",
        "backend",
        "requests",
        "prompt_tokens",
        "hit_tokens",
        "prefill_tokens_saved_ratio",
        "infinite_cache_bound_ratio",
        "lookup_latency_us",
        "bytes_loaded",
        "bytes_saved",
        "kv_bytes_verified",
    ):
        assert key in data, key
    assert set(data["hit_tokens"]) == {"device", "pool"}
    assert {"p50", "p99"} <= set(data["lookup_latency_us"])
    assert BenchReport.from_json(path) == r
    schema = report_schema()
    assert "kv_bytes_verified" in schema["required"] or "kv_bytes_verified" in schema["properties"]


def test_table_and_plots(tmp_path):
    r = _report(pool_capacity_fraction=0.5, pool_capacity_bytes=1 << 20)
    console = Console(width=200, record=True)
    console.print(report_table(r))
    text = console.export_text()
    for needle in (
        "hit tokens: pool",
        "208",
        "infinite-cache bound",
        "71.1%",
        "p50 / p99",
        "50 / 99 us",
        "50.0% of working set",
    ):
        assert needle in text, needle
    paths = write_plots(r, tmp_path)
    assert [p.name for p in paths] == ["hit_rate.png", "tiers.png", "lookup_cdf.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    sweep = write_sweep_plot([r, _report(granularity="user", pool_capacity_fraction=0.5)], tmp_path)
    assert sweep.read_bytes()[:4] == b"\x89PNG"


# -- run spec -> connector config ----------------------------------------------------------


def test_spec_maps_granularity_and_capacity_to_connector_config():
    from ascendstore.bench.spec import (
        BenchSpec,
        connector_extra_config,
        gr_request_params,
        pool_backend_config,
    )
    from ascendstore.config import load_config
    from ascendstore.gr.inputs import parse_gr_request

    spec = BenchSpec(
        granularity="user",
        capacity_fraction=0.25,
        chunk_size=32,
        backend_config={"name": "x"},
        extra_config={"timeout_ms": 700},
    )
    chunk_bytes = 32 * spec.kv_bytes_per_token()  # 32 tokens * 2 layers * 2 heads * 2 * 16 * 2 B = 8 KiB
    assert chunk_bytes == 8192
    opts, cap = pool_backend_config(spec, working_set_chunks=1000, chunk_bytes=chunk_bytes)
    assert opts == {"name": "x", "page_size": 8192, "capacity": 250 * 8192} and cap == 250 * 8192
    extra = connector_extra_config(spec, opts)
    cfg = load_config(extra)  # what the connector will validate
    assert cfg.gr.enabled and cfg.chunk_size == 32 and cfg.timeout_ms == 700 and cfg.backend == "local"
    block = connector_extra_config(spec.model_copy(update={"granularity": "block"}), opts)
    assert load_config(block).gr.enabled is False
    # The request fields are the ones the GR input parser reads.
    gr = parse_gr_request(gr_request_params("u7", 96), None, 120)
    assert gr is not None and gr.uid == "u7" and gr.history_len == 96
    assert gr_request_params(None, 0) is None
    # No capacity asked: the backend's own setting stays; unknown backends are refused clearly.
    assert pool_backend_config(BenchSpec(), 10, 4096) == ({}, None)
    with pytest.raises(ValueError, match="capacity option of backend 'mooncake'"):
        pool_backend_config(BenchSpec(backend="mooncake", capacity_fraction=0.5), 10, 4096)
