"""Engine runs that tests execute in a separate (spawned) process: "engine B"."""

from __future__ import annotations

from typing import Any


def serve(spec: dict[str, Any], requests: list[tuple[str, list[int]]], *, steps_before_add: int = 0) -> dict[str, Any]:
    """Serve requests on a fresh engine; report scheduling, KV bytes, errors, stats."""
    from ascendstore_vllm.testing import EngineHarness, EngineSpec, prompt_bytes

    eng = EngineHarness(EngineSpec(**spec))
    try:
        for req_id, prompt in requests:
            eng.add_request(req_id, prompt)
        eng.run()
        out: dict[str, Any] = {"read_errors": eng.read_errors(), "stats": eng.stats_total(), "reqs": {}}
        for req_id, prompt in requests:
            out["reqs"][req_id] = {
                "first": eng.first_schedule(req_id),
                "kv": [[prompt_bytes([t]) for t in eng.prompt_kv(req_id, r)] for r in range(spec.get("tp_size", 1))],
                "exact": all(
                    all(bool((a == b).all()) for a, b in zip(eng.prompt_kv(req_id, r), eng.expected_prompt_kv(prompt, r),
                                                            strict=True))
                    for r in range(spec.get("tp_size", 1))
                ),
                "invalid_blocks": sorted(b for rec in eng.records for b in rec.invalid_block_ids),
            }
        out["load_order"] = [list(w.connector.worker.engine.load_order) for w in eng.workers]
        return out
    finally:
        eng.close()


def registration_when_vllm_ascend_registers_first() -> dict[str, dict[str, str]]:
    """Fresh process: 'vllm-ascend' registers the plain name before our plugin runs."""
    import os

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    KVConnectorFactory.register_connector("AscendStoreConnector", "fake_vllm_ascend", "AscendStoreConnector")
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # runs ascendstore_vllm.plugin:register through the entry point
    out = {}
    for owner in ("ascendstore", "vllm-ascend", "auto"):
        os.environ["ASCENDSTORE_CONNECTOR_OWNER"] = owner
        plain = KVConnectorFactory.get_connector_class_by_name("AscendStoreConnector")
        alias = KVConnectorFactory.get_connector_class_by_name("AscendStorePoolConnector")
        out[owner] = {"plain": plain.__module__, "alias": alias.__module__}
    return out
