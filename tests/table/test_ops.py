"""gather_rows and copy_rows: bit-exact row moves for every dtype, chunked or not."""

from __future__ import annotations

import pytest
import torch

from dynemb.table import ops
from dynemb.table.ops import copy_rows, gather_rows


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bfloat16])
def test_gather_rows_is_bit_exact(dtype, device):
    src = torch.arange(-20, 20, device=device).to(dtype).view(10, 4)
    if dtype == torch.int64:
        src[0, 0] = torch.iinfo(torch.int64).min  # bit patterns that are NaN as float64 must survive
    index = torch.tensor([9, 0, 0, 3], device=device)
    assert torch.equal(gather_rows(src, index), src[index])
    out = torch.empty(4, 4, dtype=dtype, device=device)
    assert gather_rows(src, index, out=out) is out and torch.equal(out, src[index])


@pytest.mark.parametrize("chunk", [1 << 18, 8])  # one step, and many small CPU chunks
def test_copy_rows_matches_indexing(chunk, device, monkeypatch):
    monkeypatch.setattr(ops, "_CPU_CHUNK_ELEMENTS", chunk)
    gen = torch.Generator().manual_seed(1)
    dst = torch.randn(50, 3, generator=gen).to(device)
    src = torch.randn(30, 3, generator=gen).to(device)
    dst_index = torch.randperm(50, generator=gen)[:20].to(device)
    src_index = torch.randint(0, 30, (20,), generator=gen).to(device)
    expected = dst.clone()
    expected[dst_index] = src[src_index]
    copy_rows(dst, dst_index, src, src_index)
    assert torch.equal(dst, expected)


def test_copy_rows_within_one_tensor(device, monkeypatch):
    monkeypatch.setattr(ops, "_CPU_CHUNK_ELEMENTS", 2)
    col = torch.arange(10, device=device)
    copy_rows(col, torch.tensor([0, 2], device=device), col, torch.tensor([9, 8], device=device))
    assert col.tolist() == [9, 1, 8, 3, 4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16, torch.int32])
def test_copy_rows_of_large_batches_is_bit_exact(dtype, device):
    """Batches large enough for the CPU kernel (rows moved as raw words), within one tensor and between two."""
    gen = torch.Generator().manual_seed(2)
    col = torch.randint(-2**30, 2**30, (5000, 8), generator=gen).to(dtype).to(device)
    if dtype == torch.int64:
        col[0, 0] = torch.iinfo(torch.int64).min  # NaN as float64: its bits must survive
    rows = torch.randperm(5000, generator=gen).to(device)
    expected = col.clone()
    expected[rows[:2000]] = col[rows[2000:4000]]
    copy_rows(col, rows[:2000], col, rows[2000:4000])  # disjoint rows of one tensor: a compaction
    assert torch.equal(col, expected)
    other = torch.zeros(100, 8, dtype=dtype, device=device)
    copy_rows(other, torch.arange(100, device=device), col, rows[:100])
    assert torch.equal(other, col[rows[:100]])
