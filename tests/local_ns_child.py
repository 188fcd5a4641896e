"""A process of a local-pool test that may run in another PID namespace.

Run as ``python tests/local_ns_child.py '<json>'`` (typically under
``unshare --pid --fork``, as a container sharing /dev/shm would be). It prints
one JSON line per report on stdout; ``{"ready": true}`` once the pool is open.
Roles:

- ``stall``: reserve ``size`` bytes for a put of ``key`` and stall ``secs``.
- ``put_stats``: put one ``size``-byte object, report its status and the stats.
- ``put``: put ``key`` (``size`` bytes, a self-describing value of writer 5),
  stalling ``secs`` between reserving and copying in; report its status.
- ``stress``: for ``seconds``, put and get self-describing values of ``size``
  bytes (puts stall a random time between reserving and copying when ``stall``
  is given; ``put_ratio`` of the calls are puts, the rest gets) and count torn
  reads (0 expected: checksums are off).
- ``hold``: put ``keys`` (with ``wait``: once a line comes on stdin), then
  wait until stdin closes, then read them back.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import sys
import time

import numpy as np

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions

HEADER = struct.Struct("<QIIQ")  # key hash, writer, seq, payload digest


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def make_value(key: str, size: int, writer: int, seq: int) -> np.ndarray:
    payload = np.random.default_rng([writer, seq]).integers(0, 256, size - HEADER.size, dtype=np.uint8)
    digest = int.from_bytes(hashlib.blake2b(payload.tobytes(), digest_size=8).digest(), "little")
    return np.concatenate([np.frombuffer(HEADER.pack(key_hash(key), writer, seq, digest), np.uint8), payload])


def value_ok(key: str, buf: np.ndarray) -> bool:
    """The bytes are exactly one writer's value of this key (never a mix)."""
    kh, _writer, _seq, digest = HEADER.unpack(buf[: HEADER.size].tobytes())
    payload = buf[HEADER.size :].tobytes()
    return kh == key_hash(key) and digest == int.from_bytes(
        hashlib.blake2b(payload, digest_size=8).digest(), "little"
    )


def regions(buf: np.ndarray) -> list[Region]:
    return [Region(buf.ctypes.data, len(buf))]


def main(cfg: dict) -> None:
    be = LocalBackend.create(LocalOptions(**cfg["opts"]), BackendContext())
    hooks = be.test_hooks()
    say(ready=True)
    role = cfg["role"]
    if role == "stall":
        say(status=hooks.stall_put(cfg["key"], cfg["size"], cfg["secs"]).name)
    elif role == "put_stats":
        v = make_value("ns/put", cfg["size"], 7, 1)
        st = be.put(["ns/put"], [regions(v)], 5.0)
        say(status=st[0].name, stats=dict(be.stats()))
    elif role == "put":
        hooks.stall_puts(cfg["secs"])
        v = make_value(cfg["key"], cfg["size"], 5, 1)
        say(status=be.put([cfg["key"]], [regions(v)], cfg["secs"] + 10.0)[0].name)
    elif role == "stress":
        if cfg.get("wait"):
            sys.stdin.readline()  # "go": every stress process starts together
        rng = random.Random(cfg["writer"])
        writer, size, n_keys = cfg["writer"], cfg["size"], cfg["n_keys"]
        counts = {"put_ok": 0, "put_other": 0, "get_ok": 0, "miss": 0, "torn": 0, "get_other": 0}
        seq = 0
        end = time.monotonic() + cfg["seconds"]
        while time.monotonic() < end:
            key = f"stress/{rng.randrange(n_keys)}"
            if rng.random() < cfg.get("put_ratio", 0.5):
                seq += 1
                if cfg.get("stall"):
                    hooks.stall_puts(rng.uniform(*cfg["stall"]) if rng.random() < 0.5 else 0)
                value = make_value(key, size, writer, seq)  # kept alive: regions are raw addresses
                st = be.put([key], [regions(value)], 5.0)[0]
                counts["put_ok" if st is Status.OK else "put_other"] += 1
                if st is not Status.OK:
                    counts[f"put_{st.name}"] = counts.get(f"put_{st.name}", 0) + 1
            else:
                out = np.zeros(size, np.uint8)
                st = be.get([key], [regions(out)], 5.0)[0]
                if st is Status.OK:
                    counts["get_ok"] += 1
                    counts["torn"] += not value_ok(key, out)
                elif st is Status.NOT_FOUND:
                    counts["miss"] += 1
                else:
                    counts["get_other"] += 1
                    counts[f"get_{st.name}"] = counts.get(f"get_{st.name}", 0) + 1
        say(counts=counts, stats=dict(be.stats()))
    elif role == "hold":
        keys, size = cfg["keys"], cfg["size"]
        if cfg.get("wait"):
            sys.stdin.readline()  # "go"
        values = [make_value(k, size, 3, i) for i, k in enumerate(keys)]
        st = be.put(keys, [regions(v) for v in values], 5.0)
        say(put=[s.name for s in st])
        sys.stdin.read()  # until the test closes our stdin
        outs = [np.zeros(size, np.uint8) for _ in keys]
        st = be.get(keys, [regions(o) for o in outs], 5.0)
        say(get=[s.name for s in st], intact=[bool(value_ok(k, o)) for k, o in zip(keys, outs, strict=True)])
    else:
        raise SystemExit(f"unknown role {role!r}")
    be.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
