"""``ascendstore doctor``: is this configuration going to work, and if not, why?

Each check prints one line (ok / FAIL + what to do); the exit status is 1 if
any check failed. The round trip writes one small object under a unique
``doctor.`` key, reads it back into different memory, compares the bytes and
removes it again.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from ascendstore.cli.common import CallTimeout, backend_context, bounded, close_quietly, console
from ascendstore.config import AscendStoreConfig
from ascendstore.contract import Backend, Region, Status, StoreNotFound
from ascendstore.engine.health import read_states, state_dir
from ascendstore.handoff import describe, halt_polling, round_trip_us
from ascendstore.registry import create_backend, installed_backends, load_backend_class

#: what a status usually means for an operator.
HINTS = {
    Status.NOT_FOUND: "the object is not there (written to a different pool or instance_id, or evicted at once)",
    Status.NO_SPACE: "the pool is full or too small for the test object: raise the backend's capacity",
    Status.TIMEOUT: "the backend did not answer in time: check the service, or raise timeout_ms",
    Status.UNAVAILABLE: "the backend's service is unreachable or the client is closed: is the server running?",
    Status.CORRUPT: "the object failed its checksum: storage or transfer corrupts data",
    Status.INVALID: "the backend rejected the request (key or sizes): a backend bug or unsupported key",
}


@dataclass
class Checks:
    failed: list[str] = field(default_factory=list)

    def ok(self, what: str, detail: str = "") -> None:
        console.print(f"[green]ok  [/] {what}" + (f": {detail}" if detail else ""), highlight=False)

    def fail(self, what: str, why: str) -> None:
        console.print(f"[bold red]FAIL[/] {what}: {why}", highlight=False)
        self.failed.append(f"{what}: {why}")

    def note(self, text: str) -> None:
        console.print(f"     {text}", highlight=False)


def _status_text(statuses: list[Status]) -> str:
    bad = next((s for s in statuses if s is not Status.OK), Status.OK)
    return f"{bad.name} - {HINTS.get(bad, '')}"


def check_backends(checks: Checks, chosen: str) -> None:
    available = installed_backends()
    names = []
    for name in sorted(available):
        try:
            load_backend_class(name)
            names.append(name)
        except Exception as exc:
            if name == chosen:
                checks.fail(f"backend {name!r} import", str(exc))
            else:
                checks.note(f"backend {name!r} is installed but does not import here: {exc}")
    checks.ok("installed backends", ", ".join(names) or "none")
    if chosen not in available:
        checks.fail(
            "chosen backend",
            f"{chosen!r} is not installed (installed: {', '.join(sorted(available)) or 'none'})",
        )


def round_trip(checks: Checks, backend: Backend, timeout_s: float, size: int = 64 << 10) -> bool:
    """put / exists / get / compare / remove of one object, each step bounded."""
    # Stay within what the backend declares it can hold (a small pool's largest object).
    size = max(2, min(size, backend.capabilities.max_object_bytes))
    key = f"doctor.{os.getpid()}.{uuid.uuid4().hex[:12]}"
    rng = np.random.default_rng()
    src = rng.integers(0, 256, size=size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    half = size // 2
    # Two regions per key: the object is their concatenation, as the contract says.
    src_regions = [Region(src.ctypes.data, half), Region(src.ctypes.data + half, size - half)]
    dst_regions = [Region(dst.ctypes.data, half), Region(dst.ctypes.data + half, size - half)]
    guard = timeout_s + 5.0

    def step(what: str, fn, *args):  # type: ignore[no-untyped-def]
        try:
            return bounded(fn, *args, timeout_s=guard, what=what)
        except CallTimeout as exc:
            checks.fail(what, f"{exc}: the backend ignores its timeout")
        except Exception as exc:
            checks.fail(
                what, f"raised {type(exc).__name__}: {exc} (the contract wants a status, not an exception)"
            )
        return None

    caps = backend.capabilities
    if caps.needs_registration:
        st = step("register", backend.register, src_regions + dst_regions)
        if st is None:
            return False
        if Status(st) is not Status.OK:
            checks.fail("register", _status_text([Status(st)]))
            return False
    try:
        res = step("put", backend.put, [key], [src_regions], timeout_s)
        if res is None:
            return False
        if Status(res[0]) is not Status.OK:
            checks.fail("put", _status_text([Status(res[0])]))
            return False
        checks.ok("put", f"{size} bytes under {key}")
        res = step("exists", backend.exists, [key], timeout_s)
        if res is None:
            return False
        if Status(res[0]) is not Status.OK:
            checks.fail("exists", _status_text([Status(res[0])]))
            return False
        checks.ok("exists")
        res = step("get", backend.get, [key], [dst_regions], timeout_s)
        if res is None:
            return False
        if Status(res[0]) is not Status.OK:
            checks.fail("get", _status_text([Status(res[0])]))
            return False
        if not np.array_equal(src, dst):
            diff = int(np.count_nonzero(src != dst))
            checks.fail("get", f"read back {diff} of {size} bytes different from what was written")
            return False
        checks.ok("get", "bytes read back equal bytes written")
        return True
    finally:
        res = step("remove", backend.remove, [key], timeout_s)
        if res is not None and Status(res[0]) not in (Status.OK, Status.NOT_FOUND):
            checks.fail("remove", _status_text([Status(res[0])]))
        if caps.needs_registration:
            step("unregister", backend.unregister, src_regions + dst_regions)


def check_engine_health(checks: Checks, cfg: AscendStoreConfig) -> None:
    """Health monitors of AscendStore processes running on this host (each
    scheduler and worker publishes its state on every transition)."""
    if cfg.health_failure_threshold:
        checks.ok(
            "degraded mode",
            f"after {cfg.health_failure_threshold} failed backend calls in a row; probes every "
            f"{cfg.health_probe_interval_ms} ms, {cfg.health_recovery_probes} good probes resume",
        )
    else:
        checks.note("degraded mode is off (health_failure_threshold: 0)")
    states = read_states(instance_id=cfg.instance_id)
    live = [(p, st) for p, st, alive in states if alive]
    for path, _st, alive in states:
        if not alive:
            checks.note(f"stale health file of a dead process: {path}")
    if not live:
        checks.note(f"no running AscendStore process publishes its health in {state_dir()}")
        return
    for _path, st in live:
        what = f"engine health {st.get('process', '?')} (pid {st.get('pid')}, backend {st.get('backend')!r})"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(st.get("since", 0))))
        history = f"{st.get('degraded_count', 0)} degraded / {st.get('recovered_count', 0)} recovered"
        if st.get("state") == "degraded":
            checks.fail(
                what,
                f"DEGRADED since {since} ({st.get('last_failure') or 'no detail'}); lookups answer 0 and "
                f"saves stop until {st.get('recovery_probes_needed')} probes pass; {history}",
            )
        else:
            checks.ok(what, f"healthy since {since}; {history}")


def check_gr(checks: Checks, cfg: AscendStoreConfig) -> None:
    """GR mode: on with which device-side user LRU, or off (and what that means for GR traffic)."""
    gr = cfg.gr
    if gr.enabled:
        lru = (
            f"user LRU on (max_resident_users={gr.max_resident_users or 'unlimited'}, "
            f"min_free_blocks={gr.min_free_blocks})" if gr.user_lru else "user LRU off"
        )
        checks.ok("GR mode", f"on (AscendStoreConnector): user-granular pool for requests with a uid; {lru}")
    else:
        checks.note(
            "GR mode is off (gr.enabled=false): requests carrying uid / user_history_len are pooled "
            "block-wise by the chunk pool, candidates included (AscendStoreGRConnector is always GR); "
            "set gr.enabled=true for the user-granular pool (docs/gr-mode.md)"
        )


def check_handoff(checks: Checks) -> None:
    """What a thread hand-off costs here (the engine's transfer threads, Mooncake's
    synchronous gets): a few us on bare metal, far more in a VM that halts idle vCPUs."""
    what, advice = describe(round_trip_us(), halt_polling())
    checks.ok("thread hand-off", what)
    if advice:
        checks.note(advice)


def run_doctor(cfg: AscendStoreConfig) -> int:
    checks = Checks()
    checks.ok(
        "configuration",
        f"backend={cfg.backend!r}, timeout_ms={cfg.timeout_ms}"
        + (f", config_file={cfg.config_file!r}" if cfg.config_file else ""),
    )
    check_engine_health(checks, cfg)
    check_gr(checks, cfg)
    check_backends(checks, cfg.backend)
    if checks.failed:
        return _summary(checks)
    try:
        cls = load_backend_class(cfg.backend)
        cls.Options.model_validate(cfg.backend_config)
    except Exception as exc:
        checks.fail("backend_config", str(exc))
        return _summary(checks)
    checks.ok("backend_config", "valid for " + cls.__name__)
    ctx = backend_context(cfg)
    backend = None

    def connect(existing_only: bool) -> Backend:
        c = backend_context(cfg, existing_only=existing_only)
        return bounded(create_backend, cfg.backend, cfg.backend_config, c,
                       timeout_s=max(10.0, 2 * c.timeout_s), what="connect")

    try:
        made_here = ""
        try:
            # The store as its engines made it, where it exists (a local pool under other
            # options than the ones given is not refused); else one made for the checks.
            try:
                backend = connect(existing_only=True)
            except StoreNotFound as exc:
                made_here = str(exc)
                backend = connect(existing_only=False)
        except Exception as exc:
            checks.fail(f"connect to {cfg.backend!r}", f"{type(exc).__name__}: {exc}")
            return _summary(checks)
        caps = backend.capabilities
        shown = [
            k
            for k in (
                "zero_copy",
                "shared_across_processes",
                "shared_across_nodes",
                "persistent",
                "evicts",
                "listing",
            )
            if getattr(caps, k)
        ]
        checks.ok(f"connect to {cfg.backend!r}", "capabilities: " + (", ".join(shown) or "none declared"))
        if made_here:
            checks.note(f"the checks run on a store made for them: {made_here}")
        try:
            health = bounded(backend.health, ctx.timeout_s, timeout_s=ctx.timeout_s + 5, what="health")
            if health.ok:
                checks.ok("health", ", ".join(f"{k}={v}" for k, v in list(health.detail.items())[:6]))
            else:
                checks.fail(
                    "health", f"{health.status.name} {health.detail or ''} - {HINTS.get(health.status, '')}"
                )
        except Exception as exc:
            checks.fail("health", f"{type(exc).__name__}: {exc}")
        round_trip(checks, backend, ctx.timeout_s)
        pages = getattr(backend, "dram_pages", None)  # the local pool's page size (large gets)
        if callable(pages):
            checks.note("DRAM tier in " + pages().describe())
        check_handoff(checks)
    finally:
        close_quietly(backend)
    return _summary(checks)


def _summary(checks: Checks) -> int:
    if checks.failed:
        console.print(f"[bold red]{len(checks.failed)} problem(s):[/]", highlight=False)
        for line in checks.failed:
            console.print(f"  - {line}", highlight=False)
        return 1
    console.print("[bold green]all checks passed[/]")
    return 0
