"""Measure a ParameterServer under power-law traffic: latency percentiles, QPS and cache hit rate.

Used by ``dynemb serve-bench``, the demo and ``benchmarks/serving.py``.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from .ps import ParameterServer, read_export

__all__ = ["serve_bench", "zipf_ranks", "traffic"]


def zipf_ranks(n: int, size: int, alpha: float, generator: torch.Generator) -> torch.Tensor:
    """``size`` ranks in ``[0, n)`` with P(rank r) ~ (r + 1) ** -alpha (inverse-CDF of the continuous law)."""
    u = torch.rand(size, generator=generator, dtype=torch.float64)
    if abs(alpha - 1.0) < 1e-9:
        ranks = torch.exp(u * torch.log(torch.tensor(float(n) + 1))) - 1
    else:
        a = 1.0 - alpha
        ranks = ((float(n + 1) ** a - 1) * u + 1) ** (1 / a) - 1
    return ranks.long().clamp_(0, n - 1)


def traffic(keys: torch.Tensor, batch_size: int, alpha: float, seed: int = 0):
    """Endless batches of keys drawn by a power law over a random ordering of ``keys``."""
    g = torch.Generator().manual_seed(seed)
    order = keys[torch.randperm(keys.numel(), generator=g)]
    while True:
        yield order.index_select(0, zipf_ranks(order.numel(), batch_size, alpha, g))


def serve_bench(export, *, volatile: str = "memory", redis_address: str = "127.0.0.1:6379",
                persistent: str = "lmdb", persistent_path: Optional[str] = None, cache_fraction: float = 0.2,
                batch_size: int = 1024, batches: int = 200, alpha: float = 1.2, warmup: Optional[int] = None,
                tables: Optional[list] = None, progress: bool = False) -> dict:
    """Load ``export`` into a ParameterServer and time requests of ``batch_size`` ids per table.

    Returns p50/p99 request latency (ms), requests/s, keys/s and the cache hit rate after ``warmup`` requests
    (default: a quarter of ``batches``), plus the hit rate after each request in ``hit_rate_curve``.
    """
    manifest, payload = read_export(export)
    names = tables or sorted(manifest["tables"])
    dims = [manifest["tables"][n]["dim"] for n in names]
    with tempfile.TemporaryDirectory(prefix="dynemb-serve-bench-") as tmp:
        volatile_db = {"type": "memory"} if volatile == "memory" else {"type": "redis", "address": redis_address}
        persistent_db = None
        if persistent != "none":
            persistent_db = {"type": persistent, "path": persistent_path or str(Path(tmp) / persistent)}
        ps = ParameterServer.from_config({
            "models": [{"model": "bench", "sparse_files": [str(export)], "embedding_table_names": names,
                        "embedding_vecsize_per_table": dims, "cache_fraction": cache_fraction,
                        "max_batch_size": max(batch_size, 1)}],
            "volatile_db": volatile_db, "persistent_db": persistent_db})
        try:
            ps.load("bench", progress=progress)
            streams = [traffic(payload[n]["keys"].to(torch.int64), batch_size, alpha, seed=i)
                       for i, n in enumerate(names)]
            warmup = batches // 4 if warmup is None else warmup
            latencies, curve = [], []
            for i in range(warmup + batches):
                if i == warmup:
                    ps.flush()
                    ps.reset_stats("bench")
                requests = [next(s) for s in streams]
                start = time.perf_counter()
                for name, keys in zip(names, requests):
                    ps.lookup("bench", name, keys)
                if i >= warmup:
                    latencies.append(time.perf_counter() - start)
                    curve.append(_hit_rate(ps.stats("bench")))
            stats = ps.stats("bench")
        finally:
            ps.close()
    lat = torch.tensor(latencies, dtype=torch.float64)
    total = float(lat.sum())
    return {"requests": len(latencies), "tables": len(names), "batch_size": batch_size, "alpha": alpha,
            "cache_fraction": cache_fraction, "volatile": volatile, "persistent": persistent,
            "p50_ms": float(lat.quantile(0.5)) * 1e3, "p99_ms": float(lat.quantile(0.99)) * 1e3,
            "qps": len(latencies) / total, "keys_per_s": len(latencies) * batch_size * len(names) / total,
            "hit_rate": _hit_rate(stats), "hit_rate_curve": curve, "errors": stats["errors"]}


def _hit_rate(stats: dict) -> float:
    tables = stats["tables"].values()
    return sum(t["cache"] for t in tables) / max(sum(t["lookups"] for t in tables), 1)
