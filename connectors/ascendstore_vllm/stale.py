"""Device blocks whose bytes are not the KV vLLM believes they hold, after a failed load.

vLLM (0.30 to 0.33, ``kv_load_failure_policy: recompute``) handles a failed
synchronous or layerwise load by truncating the first request that holds a failed
block to it; every other request of the step holding the same block keeps it as
computed, trusting the first one to recompute it in place in its next step. When
that request is aborted or preempted first (or not scheduled, under the token
budget), nobody rewrites the block and the others attend to stale bytes.

The scheduler side tracks such blocks itself: a block is stale from the failure
until a write covers it (a step computing its positions, in a request that read
nothing stale itself, or a load), as a first stale offset per block. A request
scheduled to read a stale position gets that block reported as a load error of
that step (``AscendStoreMetadata.stale_blocks``, reported by every worker), so
vLLM discards the step's output for it and recomputes the block: vLLM's own
recovery path, now taken by the request that needs the bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class Scheduled:
    """A request computing this step: its blocks, tokens computed before, tokens scheduled."""

    block_ids: list[int]
    computed: int
    num_new: int


class StaleBlocks:
    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        #: block id -> first stale offset in the block (positions before it were rewritten)
        self._from: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self._from)

    def __len__(self) -> int:
        return len(self._from)

    def failed(self, block_ids: Iterable[int]) -> None:
        """These blocks hold nothing valid (a failed load, or computed over one)."""
        for b in block_ids:
            if b >= 0:
                self._from[b] = 0

    def loaded(self, block_ids: Iterable[int]) -> None:
        """A load writes these blocks whole (a failure is reported and marks them again)."""
        for b in block_ids:
            self._from.pop(b, None)

    def forget_free(self, ref_cnt) -> None:
        """Blocks back in vLLM's free list are reallocated fresh (written before read)."""
        for b in [b for b in self._from if ref_cnt(b) == 0]:
            del self._from[b]

    def _first_stale_read(self, r: Scheduled) -> int | None:
        """Index in ``r.block_ids`` of the first block r reads a stale position of."""
        bs, c = self.bs, r.computed
        for i, b in enumerate(r.block_ids[: (c + bs - 1) // bs]):
            s = self._from.get(b)
            if s is not None and i * bs + s < c:
                return i
        return None

    def _write(self, r: Scheduled) -> None:
        bs, lo, hi = self.bs, r.computed, r.computed + r.num_new
        for i in range(lo // bs, min((hi + bs - 1) // bs, len(r.block_ids))):
            b = r.block_ids[i]
            s = self._from.get(b)
            if s is None:
                continue
            start, end = max(lo - i * bs, 0), min(hi - i * bs, bs)
            if start <= s < end:
                s = end
            if s >= bs:
                del self._from[b]
            else:
                self._from[b] = s

    def step(self, scheduled: dict[str, Scheduled]) -> dict[str, int]:
        """Apply this step's writes; return the requests that would read stale bytes
        (request -> the block to report as failed). Within a layer a step writes its
        new KV before attending, so a block rewritten this step reads fresh."""
        dirty = set(scheduled)
        while True:
            clean = [r for r in dirty if self._first_stale_read(scheduled[r]) is None]
            if not clean:
                break
            for r in clean:
                self._write(scheduled[r])
            dirty.difference_update(clean)
        out = {}
        for r in dirty:
            sc = scheduled[r]
            i = self._first_stale_read(sc)
            assert i is not None
            out[r] = sc.block_ids[i]
            # Its own writes this step are computed over stale KV: stale too.
            self.failed(sc.block_ids[i:])
        return out
