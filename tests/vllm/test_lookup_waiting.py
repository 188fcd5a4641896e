"""A waiting request's repeated lookups, through vLLM's scheduler-side connector.

vLLM asks ``get_num_new_matched_tokens`` for a waiting request every step; the
connector keeps the request's chunk hashes between those calls instead of picking
every chunk's hash out of the block hashes again. The kept list must follow the
request: a request with more blocks (it decoded before it was preempted) or another
request under the same id is looked up by its own hashes, and nothing is kept once
a request is scheduled or finished."""

from __future__ import annotations

import uuid

import pytest
from ascendstore_vllm.testing import EngineHarness, EngineSpec
from conftest import local_pool_config
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from ascendstore.local import _shmpool

LONG = [(13 * i + 5) % 900 for i in range(170)]


@pytest.fixture
def engine():
    name = "lw-" + uuid.uuid4().hex[:10]
    eng = EngineHarness(EngineSpec(extra_config=local_pool_config(name)))
    yield eng
    eng.close()
    _shmpool.unlink(name)


def _request(eng: EngineHarness, rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=1), None, block_hasher=eng.block_hasher)


def _fresh(eng: EngineHarness, tokens: list[int]) -> int:
    """What a request never looked up before gets for these tokens."""
    conn = eng.connector
    req = _request(eng, "fresh-" + uuid.uuid4().hex[:6], tokens)
    got = conn.get_num_new_matched_tokens(req, 0)[0]
    conn.request_finished(req, [])
    return got


def test_a_waiting_requests_lookups_follow_its_blocks_and_its_identity(engine):
    eng, conn = engine, engine.connector
    sched = conn.scheduler
    eng.add_request("saver", LONG)
    eng.run()  # the pool now holds LONG's chunks
    waiting = _request(eng, "w", LONG[:100])
    first = conn.get_num_new_matched_tokens(waiting, 0)[0]
    assert first == _fresh(eng, LONG[:100]) > 0
    assert conn.get_num_new_matched_tokens(waiting, 0)[0] == first  # asked again, next step
    # it decoded 50 tokens (then was preempted): more blocks, so more chunks to find
    waiting.append_output_token_ids(LONG[100:150])
    grown = conn.get_num_new_matched_tokens(waiting, 0)[0]
    assert grown == _fresh(eng, LONG[:150]) > first
    # another request under the same id, whose prompt the pool does not have
    other = _request(eng, "w", [(17 * i + 1) % 900 for i in range(150)])
    assert conn.get_num_new_matched_tokens(other, 0) == (0, False)
    conn.request_finished(other, [])
    assert not sched._chunk_hashes  # nothing kept for a finished request
    # a scheduled request keeps nothing either (it is not looked up again unless preempted)
    assert eng.scheduler.reset_prefix_cache()  # (else vLLM's own cache has it all: no lookup)
    eng.add_request("again", LONG[:120], max_tokens=4)
    eng.step()
    assert eng.records[-1].stats["hit_tokens/pool_host"] == 112  # looked up, and loaded from the pool
    assert "again" in eng.scheduler.requests and not sched._chunk_hashes
    eng.run()
