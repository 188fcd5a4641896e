"""Memory regions of KV blocks, derived from the real tensor views.

vLLM hands the connector one strided view per layer, ``[num_blocks, ...]``,
whose per-block slice need not be contiguous in logical order (e.g. vLLM
0.33's default LBNHC layout has strides (512, 16, 32, 1) for shape
(64, 2, 16, 16)). What matters for copying is which *bytes* a block owns: we
sort the slice's dims by stride and merge the ones that tile memory densely,
giving the fewest (offset, length) runs that cover the block exactly. No torch
import: the connector passes pointers, shapes, strides and item sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ascendstore.contract import Region


def tensor_block_runs(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> list[tuple[int, int]]:
    """Byte runs (offset, length) covering one block (the slice at dim 0 = 0)."""
    dims = [(st, sz) for sz, st in zip(shape[1:], strides[1:], strict=False) if sz != 1]
    if not dims:
        return [(0, itemsize)]
    dims.sort(key=lambda d: d[0])
    # Merge from the innermost dim outwards while the dims tile memory densely.
    run_elems = 1
    i = 0
    if dims[0][0] == 1:
        run_elems = dims[0][1]
        i = 1
        while i < len(dims) and dims[i][0] == run_elems:
            run_elems *= dims[i][1]
            i += 1
    # Remaining dims enumerate runs of run_elems elements.
    offsets = [0]
    for st, sz in dims[i:]:
        offsets = [o + k * st for k in range(sz) for o in offsets]
    offsets.sort()
    return [(o * itemsize, run_elems * itemsize) for o in offsets]


@dataclass(frozen=True)
class LayerSpan:
    """One layer's cache: base address, block stride and the runs of a block."""

    name: str
    base: int
    num_blocks: int
    block_stride: int  # bytes
    runs: tuple[tuple[int, int], ...]  # (offset, length) within a block

    @property
    def block_bytes(self) -> int:
        return sum(n for _, n in self.runs)

    @classmethod
    def from_view(
        cls, name: str, data_ptr: int, shape: Sequence[int], strides: Sequence[int], itemsize: int
    ) -> LayerSpan:
        runs = tensor_block_runs(shape, strides, itemsize)
        return cls(name, data_ptr, int(shape[0]), int(strides[0]) * itemsize, tuple(runs))

    def block_regions(self, block_id: int) -> list[Region]:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} outside layer {self.name} ({self.num_blocks} blocks)")
        start = self.base + block_id * self.block_stride
        return [Region(start + off, n) for off, n in self.runs]

    def extent(self) -> Region:
        """The whole span of this layer's blocks (for backend registration)."""
        lo = min(off for off, _ in self.runs)
        hi = max(off + n for off, n in self.runs)
        return Region(self.base + lo, (self.num_blocks - 1) * self.block_stride + hi - lo)


def _merge(regions: list[Region]) -> list[Region]:
    out: list[Region] = []
    for r in regions:
        if out and out[-1].addr + out[-1].length == r.addr:
            out[-1] = Region(out[-1].addr, out[-1].length + r.length)
        else:
            out.append(r)
    return out


class KVLayout:
    """All layers of one worker; builds the regions of a chunk object."""

    def __init__(self, layers: Sequence[LayerSpan]) -> None:
        if not layers:
            raise ValueError("no KV cache layers to register")
        self.layers = list(layers)
        self.index = {layer.name: i for i, layer in enumerate(self.layers)}

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def block_bytes(self, layer: int | None = None) -> int:
        if layer is not None:
            return self.layers[layer].block_bytes
        return sum(lay.block_bytes for lay in self.layers)

    def chunk_regions(self, block_ids: Sequence[int], layer: int | None = None) -> list[Region]:
        """Regions of a chunk object: every layer (or one), each block in order."""
        layers = self.layers if layer is None else [self.layers[layer]]
        regions: list[Region] = []
        for lay in layers:
            for b in block_ids:
                regions.extend(lay.block_regions(b))
        return _merge(regions)

    def registration_regions(self) -> list[Region]:
        """Non-overlapping spans covering every layer (views may share one buffer)."""
        spans = sorted((lay.extent() for lay in self.layers), key=lambda r: r.addr)
        out: list[Region] = []
        for r in spans:
            if out and r.addr <= out[-1].addr + out[-1].length:
                end = max(out[-1].addr + out[-1].length, r.addr + r.length)
                out[-1] = Region(out[-1].addr, end - out[-1].addr)
            else:
                out.append(r)
        return out
