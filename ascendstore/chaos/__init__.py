"""Fault injection and resource hygiene for the chaos suite (never used in serving).

* :mod:`ascendstore.chaos.faulty` — the ``faulty`` backend: wraps any backend by
  name and config and injects delays, hangs, errors, exceptions, corruption and a
  byte quota, per operation, at seeded rates, switchable at run time.
* :mod:`ascendstore.chaos.hygiene` — what a process holds (threads, open files,
  sockets, /dev/shm segments, RSS), to check release on shutdown and growth
  under a soak.
"""

from ascendstore.chaos.faulty import FaultyBackend, FaultyOptions, live_backends
from ascendstore.chaos.hygiene import ResourceSnapshot, shm_entries, snapshot

__all__ = ["FaultyBackend", "FaultyOptions", "ResourceSnapshot", "live_backends", "shm_entries", "snapshot"]
