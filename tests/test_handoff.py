"""ascendstore.handoff: the guest's halt polling as sysfs shows it, the measured
round trip, and what doctor says of them."""

from __future__ import annotations

import math
import threading

import pytest

from ascendstore.handoff import (
    DEFAULT_POLL_NS,
    SLOW_ROUND_TRIP_US,
    HaltPolling,
    describe,
    halt_polling,
    round_trip_us,
)


def _sysfs(root, driver: str | None, poll_ns: str | None):
    if driver is not None:
        d = root / "devices/system/cpu/cpuidle"
        d.mkdir(parents=True)
        (d / "current_driver").write_text(driver + "\n")
    if poll_ns is not None:
        p = root / "module/haltpoll/parameters"
        p.mkdir(parents=True)
        (p / "guest_halt_poll_ns").write_text(poll_ns + "\n")
    return root


@pytest.mark.parametrize(
    ("driver", "poll_ns", "want", "off"),
    [
        ("haltpoll", "0", HaltPolling("haltpoll", 0), True),
        ("haltpoll", "200000", HaltPolling("haltpoll", 200_000), False),
        ("intel_idle", None, HaltPolling("intel_idle", None), False),  # bare metal
        # the module loaded but another driver in charge: its window governs nothing
        ("acpi_idle", "0", HaltPolling("acpi_idle", 0), False),
        (None, None, HaltPolling(None, None), False),  # no sysfs (a container without it)
        ("haltpoll", "junk", HaltPolling("haltpoll", None), False),
    ],
)
def test_halt_polling_reads_sysfs(tmp_path, driver, poll_ns, want, off):
    got = halt_polling(_sysfs(tmp_path, driver, poll_ns))
    assert got == want
    assert got.off is off
    assert got.as_dict() == {"cpuidle_driver": want.driver, "guest_halt_poll_ns": want.poll_ns}


def test_this_hosts_halt_polling_is_read():
    hp = halt_polling()
    assert hp.driver is None or hp.driver.strip() == hp.driver != ""


def test_round_trip_is_measured_and_leaves_no_thread():
    before = {t.ident for t in threading.enumerate()}
    rt = round_trip_us(trips=50, warmup=5)
    assert math.isfinite(rt) and rt > 0
    # the probe's worker has exited: doctor runs it once and must not leave a thread behind
    assert not [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]


def test_describe_advises_only_a_guest_that_halts_at_once():
    off, on, metal = HaltPolling("haltpoll", 0), HaltPolling("haltpoll", DEFAULT_POLL_NS), HaltPolling("intel_idle", None)
    what, advice = describe(80.0, off)
    assert what.startswith("80 us per round trip") and "guest_halt_poll_ns=0" in what
    assert advice is not None and f"echo {DEFAULT_POLL_NS} > /sys/module/haltpoll/parameters/guest_halt_poll_ns" in advice
    # polling off but the hand-off cheap anyway (a busy host): nothing to fix
    assert describe(SLOW_ROUND_TRIP_US / 2, off)[1] is None
    what, advice = describe(10.0, on)
    assert advice is None and "guest halt polling 200 us" in what
    what, advice = describe(6.0, metal)
    assert advice is None and what == "6 us per round trip to another thread (two wake-ups)"
