"""The embedded ``local`` backend: a node-wide DRAM pool in POSIX shared memory,
with LRU eviction, an optional disk tier and optional checksums (see docs/local-backend.md)."""
