"""Fidelity probe: the same calls against the real library and the stand-in.

Each scenario puts a client in a state both can reach on a machine without
Ascend and records what every call answers. The tests run the real library in
a child process (a wrong call can crash it) and compare the two tables; on an
Ascend host ``python -m ascendstore_memcache.fidelity real`` prints the real
table for review.

Scenarios:
  ``uninit``: a client whose init() was never called.
  ``pure``:   a pure client (init_bm=False) on a pool to which no process has
              contributed memory (only a meta service runs).
"""

from __future__ import annotations

import ctypes
import json
import sys
from collections.abc import Callable
from typing import Any

SCENARIOS = ("uninit", "pure")


def _cases(s: Any, p: int) -> dict[str, Callable[[], Any]]:
    long_key = "x" * 300
    return {
        "is_exist": lambda: s.is_exist("missing"),
        "batch_is_exist": lambda: s.batch_is_exist(["a", "b"]),
        "batch_is_exist_empty": lambda: s.batch_is_exist([]),
        "batch_is_exist_long_key": lambda: s.batch_is_exist([long_key, "a"]),
        "put_layers_h2g": lambda: s.batch_put_from_layers(["k1"], [[p]], [[64]], 3),
        "put_layers_bad_direction": lambda: s.batch_put_from_layers(["k1"], [[p]], [[64]], 1),
        "put_layers_empty": lambda: s.batch_put_from_layers([], [], [], 0),
        "put_layers_mismatch": lambda: s.batch_put_from_layers(["a", "b"], [[p]], [[64]], 0),
        "put_layers_long_key": lambda: s.batch_put_from_layers([long_key], [[p]], [[64]], 0),
        "get_layers_g2l_missing": lambda: s.batch_get_into_layers(["k1"], [[p]], [[64]], 1),
        "get_layers_g2h_missing": lambda: s.batch_get_into_layers(["k1"], [[p]], [[64]], 2),
        "get_layers_bad_direction": lambda: s.batch_get_into_layers(["k1"], [[p]], [[64]], 0),
        "remove": lambda: s.remove("k1"),
        "remove_batch": lambda: s.remove_batch(["k1", "k2"]),
        "key_info": lambda: [s.get_key_info("k1").size(), s.get_key_info("k1").gva_list()],
        "batch_key_info": lambda: [[i.size(), i.gva_list()] for i in s.batch_get_key_info(["k1", "k2"])],
        "batch_alloc": lambda: s.batch_alloc(["g1"], [64]),
        "batch_copy_gva0": lambda: s.batch_copy([0], [p], [64], 0),
        "batch_write_finish": lambda: s.batch_write_finish(["g1"], [0]),
        "batch_add_lease": lambda: s.batch_add_lease(["g1"]),
        "batch_remove_lease": lambda: s.batch_remove_lease(["g1"]),
        "local_service_id": lambda: s.get_local_service_id(),
    }


def probe(module: Any, scenario: str) -> dict[str, Any]:
    """Run every case on a fresh client of ``module`` in ``scenario``.

    For ``pure`` the caller provides the environment (MMC_LOCAL_CONFIG_PATH
    naming a running meta service for the real library)."""
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario {scenario!r}: choose from {SCENARIOS}")
    store = module.DistributedObjectStore()
    results: dict[str, Any] = {}
    if scenario == "pure":
        results["init"] = store.init(0, False)
    buf = ctypes.create_string_buffer(64)
    for name, case in _cases(store, ctypes.addressof(buf)).items():
        results[name] = case()
    results["close"] = store.close()
    return results


def main(argv: list[str]) -> None:
    """``fidelity real|standin SCENARIO [STANDIN_PATH]`` prints the JSON table."""
    which, scenario = argv[0], argv[1]
    if which == "real":
        import memcache_hybrid as module
    else:
        from ascendstore_memcache.standin import StandinModule

        module = StandinModule(argv[2])
    print(json.dumps(probe(module, scenario), sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1:])
