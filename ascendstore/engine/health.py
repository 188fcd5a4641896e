"""Backend health: stop talking to a sick backend, probe it, resume by itself.

Every backend call of a process goes through its :class:`BackendGuard`; the
guard reports each call's statuses to a :class:`HealthMonitor`. After
``failure_threshold`` calls in a row failed (timeouts, unavailable, a client
that raised or overran), the monitor turns **degraded**: the guard answers
keyed calls (exists, get, put, remove) with UNAVAILABLE at once, lookups answer
0, saves are skipped, loads fail fast and are recomputed. No step waits on the
sick backend, so none is slower than ``timeout_ms``.

While degraded a background thread probes every ``probe_interval_s``: the
backend's ``health()`` and an ``exists`` of one small key, both bounded by the
guard. After ``recovery_probes`` good probes in a row the monitor resumes.
A lying health check (OK while the store fails) does not end degraded mode:
the probe's exists must answer too.

While healthy the same thread asks ``health()`` every ``WATCH_FACTOR`` probe
intervals; a backend that reports itself sick is believed at once. Some
stores fail quietly where the engine looks (a Mooncake client whose master is
dead answers ``exists`` with "absent", not an error), so call outcomes alone
would leave a lookup-only process (the scheduler) talking to a dead master.

Flapping backends (up, down, up...) would turn every flap into two transitions;
a backend that fails again shortly after it resumed needs twice as many good
probes next time (up to ``MAX_RECOVERY_PROBES``), so transitions stay few.

Each process (the scheduler, every worker) has its own guard and its own
monitor: they judge the backend from their own calls and may disagree for a
moment. One log line per transition, never per call; transitions and state are
counted in :class:`EngineMetrics` (``degraded`` gauge, ``health_degraded`` and
``health_recovered`` counters) and, when ``state_path`` is set, written to a
small JSON file that ``ascendstore doctor`` reads.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import psutil

from ascendstore.contract import Status

if TYPE_CHECKING:
    from ascendstore.config import AscendStoreConfig
    from ascendstore.engine.guard import BackendGuard
    from ascendstore.engine.metrics import EngineMetrics

log = logging.getLogger(__name__)

#: statuses that say the backend itself is sick (not the key: NOT_FOUND, NO_SPACE,
#: CORRUPT and INVALID are answers of a working backend).
SICK = frozenset({Status.TIMEOUT, Status.UNAVAILABLE})
#: a call fails when at least this share of its keys is sick.
FAILED_SHARE = 0.5
#: cap on the good probes a flapping backend must pass before it is used again.
MAX_RECOVERY_PROBES = 32
#: key of the probe's exists (never written; NOT_FOUND is a good answer).
PROBE_KEY = "ascendstore.health-probe"
#: while healthy, health() is asked every this many probe intervals.
WATCH_FACTOR = 5
STATE_FILE_PREFIX = "ascendstore-health-"


class HealthState(enum.Enum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"


@dataclass
class HealthSnapshot:
    """What the monitor knows, for logs, doctor and tests."""

    state: str
    since: float  # wall-clock time of the last transition
    consecutive_failures: int
    last_failure: str
    degraded_count: int
    recovered_count: int
    probes: int
    recovery_probes_needed: int
    process: str
    backend: str
    pid: int
    #: the process's start time (psutil's create_time): a pid alone names a
    #: different process once the kernel reuses it, and a long-lived host's
    #: temp dir keeps health files of engines that died without cleaning up.
    started: float = 0.0
    #: the same start as the kernel counts it, "<boot id>:<clock ticks since boot>":
    #: unlike ``started`` it never moves while the process runs (psutil adds the
    #: boot time from /proc/stat, whole seconds that NTP shifts), so it decides.
    start_mark: str = ""


Probe = Callable[[], tuple[bool, str]]


def guard_watch(guard: BackendGuard) -> Probe:
    """health() alone (the check while healthy: no keyed traffic)."""

    def watch() -> tuple[bool, str]:
        health = guard.health()
        return health.ok, f"health {health.status.name} {dict(health.detail) or ''}".strip()

    return watch


def guard_probe(guard: BackendGuard, timeout_s: float) -> Probe:
    """health() and a one-key exists through the guard, bypassing the degraded gate."""

    def probe() -> tuple[bool, str]:
        health = guard.health()
        if not health.ok:
            return False, f"health {health.status.name}"
        st = guard.exists([PROBE_KEY], timeout_s, gated=False)
        if not st or st[0] not in (Status.OK, Status.NOT_FOUND):
            return False, f"exists {st[0].name if st else 'no answer'}"
        return True, "ok"

    return probe


def state_dir() -> str:
    """Where processes publish their health (beside the lookup IPC sockets)."""
    return os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()


def state_path_for(instance_id: str, process: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{instance_id}-{process}")
    return os.path.join(state_dir(), f"{STATE_FILE_PREFIX}{safe}.json")


class HealthMonitor:
    def __init__(
        self,
        probe: Probe,
        *,
        watch: Probe | None = None,
        failure_threshold: int = 5,
        probe_interval_s: float = 1.0,
        recovery_probes: int = 2,
        metrics: EngineMetrics | None = None,
        process: str = "",
        backend: str = "",
        state_path: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1 or recovery_probes < 1 or probe_interval_s <= 0:
            raise ValueError("failure_threshold and recovery_probes must be >= 1, probe_interval_s > 0")
        self._probe = probe
        self._watch = watch
        self.failure_threshold = failure_threshold
        self.probe_interval_s = probe_interval_s
        self.base_recovery_probes = recovery_probes
        self.metrics = metrics
        self.process = process
        self.backend = backend
        self.state_path = state_path
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        #: read without the lock on every call (a bool is atomic in CPython).
        self.degraded = False
        self._failures = 0
        self._last_failure = ""
        self._since_wall = time.time()
        self._since = clock()
        self._resumed_at: float | None = None
        self._recovery_needed = recovery_probes
        self._good_probes = 0
        self._probes = 0
        self._degraded_count = 0
        self._recovered_count = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        if metrics is not None:
            metrics.set_state(degraded=0)
        self._publish()
        if watch is not None:
            self._start_thread()

    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="ascendstore-health", daemon=True)
            self._thread.start()

    # -- what the guard calls ---------------------------------------------------------
    def record(self, op: str, statuses: Sequence[Status]) -> None:
        """One backend call's outcome (probes report through ``_run_probe``)."""
        if not statuses or self.degraded:
            return
        if not self._failures and (statuses.count(Status.OK) == len(statuses)
                                   or statuses.count(Status.NOT_FOUND) == len(statuses)):
            return  # healthy and all OK, or all absent (a save's exists): nothing to reset
        sick = sum(s in SICK for s in statuses)
        failed = sick and sick >= FAILED_SHARE * len(statuses)
        with self._lock:
            if not failed:
                self._failures = 0
                return
            self._failures += 1
            bad = next(s for s in statuses if s in SICK)
            self._last_failure = f"{op}: {bad.name}"
            if self._failures >= self.failure_threshold and not self.degraded and not self._closed:
                self._degrade_locked()

    def allows(self) -> bool:
        return not self.degraded

    def degrade(self, reason: str) -> None:
        """Switch to degraded mode now (planned maintenance, tests); probes resume it."""
        with self._lock:
            if not self.degraded and not self._closed:
                self._last_failure = reason
                self._degrade_locked()

    # -- transitions ------------------------------------------------------------------
    def _degrade_locked(self) -> None:
        now = self._clock()
        # Failed again soon after resuming: a flapping backend; ask for more proof next time.
        if self._resumed_at is not None and now - self._resumed_at < 10 * self.probe_interval_s * self._recovery_needed:
            self._recovery_needed = min(MAX_RECOVERY_PROBES, self._recovery_needed * 2)
        else:
            self._recovery_needed = self.base_recovery_probes
        self.degraded = True
        self._since, self._since_wall = now, time.time()
        self._good_probes = 0
        self._degraded_count += 1
        if self.metrics is not None:
            self.metrics.set_state(degraded=1)
            self.metrics.add(health_degraded=1)
        log.warning(
            "AscendStore %s: backend %r degraded after %d failed calls in a row (last %s); lookups answer 0, "
            "saves stop, loads are recomputed; probing every %.1f s, %d good probes resume",
            self.process or "process", self.backend, self._failures, self._last_failure,
            self.probe_interval_s, self._recovery_needed,
        )
        self._publish()
        if not self._closed:
            self._start_thread()
        self._wake.notify_all()

    def _recover_locked(self) -> None:
        now = self._clock()
        down_s = now - self._since
        self.degraded = False
        self._failures = 0
        self._resumed_at = now
        self._since, self._since_wall = now, time.time()
        self._recovered_count += 1
        if self.metrics is not None:
            self.metrics.set_state(degraded=0)
            self.metrics.add(health_recovered=1)
        log.warning(
            "AscendStore %s: backend %r healthy again after %.1f s degraded (%d good probes); traffic resumes",
            self.process or "process", self.backend, down_s, self._good_probes,
        )
        self._publish()

    # -- probing ----------------------------------------------------------------------
    def _loop(self) -> None:
        """Probe while degraded; while healthy, watch health() (or stop, without a watch)."""
        while True:
            with self._lock:
                if self._closed or (not self.degraded and self._watch is None):
                    return
                was_degraded = self.degraded
                self._wake.wait(self.probe_interval_s * (1 if was_degraded else WATCH_FACTOR))
                if self._closed:
                    return
                degraded = self.degraded
            if degraded and was_degraded:
                self.probe_now()
            elif not degraded and not was_degraded:
                self.watch_now()

    def watch_now(self) -> bool:
        """One health check while healthy: a backend that says it is sick is believed."""
        if self._watch is None:
            return True
        try:
            ok, why = self._watch()
        except Exception as exc:
            ok, why = False, f"health raised {exc!r}"
        if not ok:
            self.degrade(f"watch: {why}")
        return ok

    def probe_now(self) -> bool:
        """One probe (the background thread's step; tests call it directly)."""
        try:
            ok, why = self._probe()
        except Exception as exc:  # a probe must never kill the thread
            ok, why = False, f"probe raised {exc!r}"
        if self.metrics is not None:
            self.metrics.add(health_probes=1)
        with self._lock:
            self._probes += 1
            if not self.degraded:
                return ok
            if ok:
                self._good_probes += 1
                if self._good_probes >= self._recovery_needed:
                    self._recover_locked()
            else:
                self._good_probes = 0
                self._last_failure = f"probe: {why}"
        return ok

    # -- reporting --------------------------------------------------------------------
    def snapshot(self) -> HealthSnapshot:
        with self._lock:
            return self._snap()

    def _snap(self) -> HealthSnapshot:
        return HealthSnapshot(
            state=(HealthState.DEGRADED if self.degraded else HealthState.HEALTHY).value,
            since=self._since_wall,
            consecutive_failures=self._failures,
            last_failure=self._last_failure,
            degraded_count=self._degraded_count,
            recovered_count=self._recovered_count,
            probes=self._probes,
            recovery_probes_needed=self._recovery_needed,
            process=self.process,
            backend=self.backend,
            pid=os.getpid(),
            started=_own_start_time(os.getpid()),
            start_mark=_own_start_mark(os.getpid()),
        )

    def _publish(self) -> None:
        """Write the state file atomically (at start and on transitions; never per call)."""
        if not self.state_path:
            return
        tmp = f"{self.state_path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(asdict(self._snap()), f)
            os.replace(tmp, self.state_path)
        except OSError as exc:
            log.debug("cannot write health state %s: %s", self.state_path, exc)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(2.0)
        if self.state_path:
            try:
                os.unlink(self.state_path)
            except OSError:
                pass


def read_states(directory: str | None = None, instance_id: str | None = None) -> list[tuple[str, dict, bool]]:
    """(path, state, process alive) of the health files published on this host."""
    d = directory or state_dir()
    out = []
    try:
        names = sorted(n for n in os.listdir(d) if n.startswith(STATE_FILE_PREFIX) and n.endswith(".json"))
    except OSError:
        return []
    for n in names:
        if instance_id and not n.startswith(f"{STATE_FILE_PREFIX}{instance_id}-"):
            continue
        path = os.path.join(d, n)
        try:
            with open(path, encoding="utf-8") as f:
                state = json.load(f)
        except (OSError, ValueError):
            continue
        out.append((path, state, _alive(int(state.get("pid", 0)), float(state.get("started", 0.0)),
                                        str(state.get("start_mark", "")))))
    return out


#: two wall-clock readings of one process's start time (psutil's create_time)
#: differ by less than this: whole seconds of boot time, moved by NTP; only
#: files without a ``start_mark`` are judged by it. A reused pid belongs to a
#: process started after the first one died.
START_TIME_SLACK_S = 1.5


# Both cached by pid: a process forked after the first reading (vLLM may fork its
# workers) is another process, with a start of its own.
@functools.cache
def _own_start_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


@functools.cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_mark(pid: int) -> str:
    """``"<boot id>:<start in clock ticks since boot>"`` of a process, "" where
    /proc cannot tell (then the wall-clock start decides)."""
    boot = _boot_id()
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # Field 22; the command name (field 2) may hold spaces and parentheses.
        ticks = int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return ""
    return f"{boot}:{ticks}" if boot else ""


@functools.cache
def _own_start_mark(pid: int) -> str:
    return _start_mark(pid)


def _alive(pid: int, started: float = 0.0, start_mark: str = "") -> bool:
    """Whether the process that wrote a health file still runs: its pid
    exists and, when the file recorded it, started at the same time: by the
    kernel's clock-tick count where the file has it, else by wall-clock time
    within ``START_TIME_SLACK_S`` (files written before ``started`` existed are
    judged by the pid alone)."""
    if pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        if start_mark:
            now = _start_mark(pid)
            if now:
                return now == start_mark
        if started and abs(proc.create_time() - started) > START_TIME_SLACK_S:
            return False
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
    return True


def attach_health(
    guard: BackendGuard, config: AscendStoreConfig, *, process: str, instance_id: str | None = None
) -> HealthMonitor | None:
    """Give a guard its process's monitor, thresholds from the configuration
    (None when ``health_failure_threshold`` is 0: the guard alone bounds calls)."""
    if config.health_failure_threshold <= 0:
        return None
    interval = config.health_probe_interval_ms / 1000
    monitor = HealthMonitor(
        guard_probe(guard, min(guard.timeout_s, interval)),
        watch=guard_watch(guard),
        failure_threshold=config.health_failure_threshold,
        probe_interval_s=interval,
        recovery_probes=config.health_recovery_probes,
        metrics=guard.metrics,
        process=process,
        backend=config.backend,
        state_path=state_path_for(instance_id, process) if instance_id else None,
    )
    guard.monitor = monitor
    return monitor
