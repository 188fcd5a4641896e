"""What handing work to another thread costs on this host, and why.

The engine hands transfers to its save and load threads, and the Mooncake
backend hands every get from vLLM's forward thread (synchronous loads) to a
worker of its own, so that a client blocking for 30-60 s cannot stall the
forward pass. Each hand-off is two wake-ups: the worker's, then the caller's.

On bare metal a wake-up costs a few microseconds. In a KVM guest a vCPU with
nothing to run halts, and waking a halted vCPU is an interrupt through the
hypervisor (a VM exit and entry): tens of microseconds. The guest's
``cpuidle-haltpoll`` driver hides that by polling a while before it halts
(``guest_halt_poll_ns``, 200 us as the kernel ships it); a guest booted with
it set to 0 pays the full price on every wake-up. Measured on a 2-vCPU
Firecracker guest booted that way, polling off and on minutes apart
(docs/benchmarking.md, "Thread wake-ups in a VM"): the guard's hand-off of an
empty call 78-83 us against 10-11 us, and the raw Mooncake client, whose
transfer engine wakes threads of its own, moving 32 x 64 KiB objects at
4.1 / 5.9 GB/s (put / get) against 6.0-6.5 / 8.0-8.4.

``ascendstore doctor`` reports the measured round trip and, where polling is
off, how to turn it on; the benchmarks record the setting with their figures.
"""

from __future__ import annotations

import _thread
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

#: the guest's halt-polling window as the kernel ships it (drivers/cpuidle/cpuidle-haltpoll.c)
DEFAULT_POLL_NS = 200_000
#: a round trip above this is worth telling an operator about (bare metal: a few us)
SLOW_ROUND_TRIP_US = 30.0


@dataclass(frozen=True)
class HaltPolling:
    """The guest's idle polling, as sysfs shows it."""

    #: the cpuidle driver ("haltpoll" in a KVM guest that has it, "intel_idle",
    #: "acpi_idle", ...); None where sysfs does not say.
    driver: str | None
    #: ``guest_halt_poll_ns`` of the haltpoll driver; None where that driver is not loaded.
    poll_ns: int | None

    @property
    def off(self) -> bool:
        """A KVM guest that halts its idle vCPUs at once: every wake-up is a VM exit."""
        return self.driver == "haltpoll" and self.poll_ns == 0

    def as_dict(self) -> dict[str, object]:
        return {"cpuidle_driver": self.driver, "guest_halt_poll_ns": self.poll_ns}


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def halt_polling(sys_root: str | Path = "/sys") -> HaltPolling:
    root = Path(sys_root)
    driver = _read(root / "devices/system/cpu/cpuidle/current_driver")
    raw = _read(root / "module/haltpoll/parameters/guest_halt_poll_ns")
    try:
        poll_ns = int(raw) if raw is not None else None
    except ValueError:
        poll_ns = None
    return HaltPolling(driver or None, poll_ns)


def round_trip_us(trips: int = 200, warmup: int = 20) -> float:
    """Median wall time of handing an empty call to another thread and waiting for
    it, made as the Mooncake backend's guard makes one (raw locks, the caller
    blocked while the worker runs): two wake-ups per trip."""
    go, back = _thread.allocate_lock(), _thread.allocate_lock()
    go.acquire()
    back.acquire()
    stop = False

    def worker() -> None:
        while True:
            go.acquire()
            if stop:
                back.release()
                return
            back.release()

    t = threading.Thread(target=worker, name="ascendstore-handoff-probe", daemon=True)
    t.start()
    samples = []
    try:
        for i in range(warmup + trips):
            t0 = time.perf_counter_ns()
            go.release()
            back.acquire()
            if i >= warmup:
                samples.append((time.perf_counter_ns() - t0) / 1e3)
    finally:
        stop = True
        go.release()
        back.acquire(timeout=5.0)
        t.join(5.0)
    return statistics.median(samples)


def describe(rt_us: float, polling: HaltPolling) -> tuple[str, str | None]:
    """(the figure, advice or None) for ``ascendstore doctor``."""
    what = f"{rt_us:.0f} us per round trip to another thread (two wake-ups)"
    if polling.off:
        what += "; this KVM guest halts idle vCPUs at once (haltpoll guest_halt_poll_ns=0)"
        if rt_us >= SLOW_ROUND_TRIP_US:
            return what, (
                "each wake-up of another thread goes through the hypervisor here: the Mooncake client "
                "(threads of its own) and every call handed to a worker (a synchronous load's get) pay it. "
                f"Polling before halting hides it: echo {DEFAULT_POLL_NS} > "
                "/sys/module/haltpoll/parameters/guest_halt_poll_ns (root; the kernel's default; "
                "docs/backends/mooncake.md, \"Thread wake-ups in a VM\")"
            )
        return what, None
    if polling.poll_ns is not None:
        what += f"; guest halt polling {polling.poll_ns // 1000} us"
    return what, None
