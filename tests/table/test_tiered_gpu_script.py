"""``benchmarks/tiered_gpu.py`` (the GPU slot of ``benchmarks/gpu_lease.sh`` for tiered tables) runs every line but
the device's on CPU at small sizes: the script a lent GPU runs is checked here, on every commit."""

from __future__ import annotations

import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


@pytest.mark.slow
def test_the_gpu_tiered_benchmark_runs_on_cpu(tmp_path):
    sys.path.insert(0, BENCHMARKS)
    try:
        import tiered_gpu
    finally:
        sys.path.remove(BENCHMARKS)
    result = tiered_gpu.main(["--device", "cpu", "--tables", "2", "--rows", "4000", "--batch", "512",
                              "--steps", "2", "--prefetch", "--json", str(tmp_path / "r.json")])
    assert result["ratio"] > 0 and result["bytes_moved_per_step"] > 0 and result["move_s_per_step"] > 0
    assert result["pinned_h2d_gbps"] == 0.0 and result["move_vs_h2d"] is None  # no CUDA: no bandwidth to compare
    assert 0 < result["fast_hit_rate"] < 1 and (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_the_gpu_tiered_benchmark_runs_three_levels_on_cpu(tmp_path):
    sys.path.insert(0, BENCHMARKS)
    try:
        import tiered_gpu
    finally:
        sys.path.remove(BENCHMARKS)
    result = tiered_gpu.main(["--device", "cpu", "--tables", "2", "--rows", "4000", "--batch", "512", "--steps", "2",
                              "--prefetch", "--host-share", "0.2", "--rows-dir", str(tmp_path / "rows")])
    assert result["levels"] == 3 and result["ratio"] > 0 and result["bytes_moved_per_step"] > 0
    assert 0 < result["disk_hit_rate"] < 1
