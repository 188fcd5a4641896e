"""Regions of KV blocks come from the real strides, whatever the layout."""

from __future__ import annotations

import ctypes

import pytest
import torch

from ascendstore.engine import KVLayout, LayerSpan, tensor_block_runs

# (physical order of [B, H, N, C]) as vLLM's KVCacheLayout permutations produce.
PERMS = {"BHNC": (0, 1, 2, 3), "BNHC": (0, 2, 1, 3), "HBNC": (1, 0, 2, 3), "NBHC": (2, 0, 1, 3)}


def view(perm, shape=(6, 2, 4, 8)):
    phys = [shape[i] for i in perm]
    base = torch.arange(torch.Size(phys).numel(), dtype=torch.float16).view(*phys)
    inv = [perm.index(i) for i in range(4)]
    return base.permute(*inv)


@pytest.mark.parametrize("name", list(PERMS))
def test_block_runs_cover_exactly_the_block_bytes(name):
    t = view(PERMS[name])
    span = LayerSpan.from_view("l", t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())
    for b in range(t.shape[0]):
        raw = b"".join(ctypes.string_at(r.addr, r.length) for r in span.block_regions(b))
        assert len(raw) == t[b].numel() * 2
        want = sorted(t[b].flatten().tolist())
        got = sorted(torch.frombuffer(bytearray(raw), dtype=torch.float16).tolist())
        assert got == want, f"block {b} regions do not hold exactly that block's elements"


def test_vllm_default_layout_is_one_run_per_block():
    # vLLM 0.33 LBNHC view: shape (64, 2, 16, 16) stride (512, 16, 32, 1).
    assert tensor_block_runs((64, 2, 16, 16), (512, 16, 32, 1), 2) == [(0, 1024)]
    # Layer-interleaved K/V halves ([2, B, ...] style) give several runs.
    assert len(tensor_block_runs((6, 2, 4, 8), (32, 192, 8, 1), 2)) == 2


def test_chunk_regions_merge_adjacent_blocks_and_registration_spans():
    t = view(PERMS["BHNC"])
    a = LayerSpan.from_view("a", t.data_ptr(), tuple(t.shape), tuple(t.stride()), 2)
    layout = KVLayout([a])
    regs = layout.chunk_regions([1, 2, 3])
    assert len(regs) == 1 and regs[0].length == 3 * a.block_bytes
    assert layout.registration_regions()[0].length == t.numel() * 2
    with pytest.raises(IndexError):
        a.block_regions(6)
