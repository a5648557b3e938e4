"""Measure a ParameterServer under power-law traffic: latency percentiles, QPS and cache hit rate.

Used by ``dynemb serve-bench``, the demo and ``benchmarks/serving.py``.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Iterator, Mapping, Optional

import torch

from ..checkpoint.export_format import is_run_directory, read_chain
from ..checks import check_int
from ..data.traces import zipf_ranks
from .ps import ParameterServer
from .ps.updates import replay

__all__ = ["serve_bench", "summary_table", "zipf_ranks", "traffic", "warm_up", "hit_rate"]

WARMUP_GROUP = 16  # requests sent as one lookup per table while warming up: same keys, fewer calls


def traffic(keys: torch.Tensor, batch_size: int, alpha: float, seed: int = 0):
    """Endless batches of keys drawn by a power law over a random ordering of ``keys``; empty batches when there
    are no keys (a table exported without rows gets no traffic, and the other tables are measured as usual)."""
    g = torch.Generator().manual_seed(seed)
    order = keys[torch.randperm(keys.numel(), generator=g)]
    while True:
        yield order.index_select(0, zipf_ranks(order.numel(), batch_size, alpha, g)) if order.numel() else order


def warm_up(ps: ParameterServer, model: str, streams: Mapping[str, Iterator[torch.Tensor]], batch_size: int,
            max_requests: int = 20_000, tolerance: float = 1e-3) -> int:
    """Send traffic until the caches of ``model`` are warm, then flush write-backs and reset the statistics.

    Requests go in windows of about one turnover of the largest cache (its rows over ``batch_size`` requests),
    ``WARMUP_GROUP`` requests per lookup (``max_batch_size`` must allow ``WARMUP_GROUP * batch_size`` ids). Warm
    means every cache is full (an LRU cache's hit rate is steady from then on), or no window of the last three beat
    the hit rate of the windows before by ``tolerance`` (tables cached whole may never see every key).

    Args:
        ps: a server with ``model`` loaded.
        model: the model to warm up.
        streams: per table, the batches its traffic will send (see :func:`traffic`).
        batch_size: ids per batch of the streams.
        max_requests: stop after this many requests in any case.
        tolerance: the hit-rate rise over three windows below which the caches count as warm.

    Returns:
        The number of requests sent.
    """
    largest = max(t["cache_capacity"] for t in ps.stats(model)["tables"].values())
    lookups = max(1, math.ceil(largest / (batch_size * WARMUP_GROUP)))  # grouped lookups per table and window
    sent, rates = 0, []
    while sent < max_requests:
        ps.reset_stats(model)
        for _ in range(lookups):
            ps.lookup_many(model, {name: torch.cat([next(stream) for _ in range(WARMUP_GROUP)])
                                   for name, stream in streams.items()})
        sent += lookups * WARMUP_GROUP
        stats = ps.stats(model)
        rates.append(hit_rate(stats))
        stalled = len(rates) > 3 and max(rates[-3:]) < max(rates[:-3]) + tolerance
        if stalled or all(t["cache_rows"] >= t["cache_capacity"] for t in stats["tables"].values()):
            break
    ps.flush()
    ps.reset_stats(model)
    return sent


def serve_bench(export, *, volatile: str = "memory", redis_address: str = "127.0.0.1:6379",
                persistent: str = "lmdb", persistent_path: Optional[str] = None, cache_fraction: float = 0.2,
                batch_size: int = 1024, batches: int = 200, alpha: float = 1.2, warmup: Optional[int] = None,
                tables: Optional[list] = None, progress: bool = False) -> dict:
    """Load ``export`` into a ParameterServer and time requests of ``batch_size`` ids per table (one
    :meth:`~ParameterServer.lookup_many` over every table per request).

    Returns p50/p99 request latency (ms), requests/s, keys/s and the cache hit rate after ``warmup`` requests
    (default: :func:`warm_up`, until the caches are warm), plus the hit rate after each request in
    ``hit_rate_curve`` and the number of warm-up requests in ``warmup_requests``.
    """
    check_int(batch_size, "batch_size (ids per table per request)", minimum=1)
    check_int(batches, "batches (timed requests)", minimum=1)
    if isinstance(cache_fraction, bool) or not isinstance(cache_fraction, (int, float)) or \
            not 0 < cache_fraction <= 1:
        raise ValueError(f"cache_fraction must be a number in (0, 1], got {cache_fraction!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha (the traffic's power-law exponent) must be a finite number >= 0, got {alpha!r}")
    if is_run_directory(export):
        raise ValueError(f"{export} is a `dynemb train` run directory, not a serving export; write one with "
                         f"`dynemb export --model {export} --out EXPORT_DIR` and time that")
    chain = read_chain(export)  # the latest export and, when it is a delta, the ones it builds on
    manifest = chain[-1][0]
    names = tables or sorted(manifest["tables"])
    dims = [manifest["tables"][n]["dim"] for n in names]
    keys = {n: replay(chain, n)[0] for n in names}
    del chain  # the values are read again by the server; holding them twice would double peak memory
    with tempfile.TemporaryDirectory(prefix="dynemb-serve-bench-") as tmp:
        volatile_db = {"type": "memory"} if volatile == "memory" else {"type": "redis", "address": redis_address}
        persistent_db = None
        if persistent != "none":
            persistent_db = {"type": persistent, "path": persistent_path or str(Path(tmp) / persistent)}
        ps = ParameterServer.from_config({
            "models": [{"model": "bench", "sparse_files": [str(export)], "embedding_table_names": names,
                        "embedding_vecsize_per_table": dims, "cache_fraction": cache_fraction,
                        "max_batch_size": max(batch_size, 1) * WARMUP_GROUP}],
            "volatile_db": volatile_db, "persistent_db": persistent_db})
        try:
            ps.load("bench", progress=progress)
            streams = {n: traffic(keys[n], batch_size, alpha, seed=i) for i, n in enumerate(names)}
            if warmup is None:
                warmup = warm_up(ps, "bench", streams, batch_size)
            else:
                for _ in range(warmup):
                    ps.lookup_many("bench", {name: next(stream) for name, stream in streams.items()})
                ps.flush()
                ps.reset_stats("bench")
            latencies, curve, sent = [], [], 0
            for _ in range(batches):
                request = {name: next(stream) for name, stream in streams.items()}
                start = time.perf_counter()
                ps.lookup_many("bench", request)
                latencies.append(time.perf_counter() - start)
                curve.append(hit_rate(ps.stats("bench")))
                sent += sum(ids.numel() for ids in request.values())
            stats = ps.stats("bench")
        finally:
            ps.close()
    lat = torch.tensor(latencies, dtype=torch.float64)
    total = float(lat.sum())
    return {"requests": len(latencies), "tables": len(names), "batch_size": batch_size, "alpha": alpha,
            "cache_fraction": cache_fraction, "volatile": volatile, "persistent": persistent,
            "p50_ms": float(lat.quantile(0.5)) * 1e3, "p99_ms": float(lat.quantile(0.99)) * 1e3,
            "qps": len(latencies) / total, "keys_per_s": sent / total,
            "hit_rate": hit_rate(stats), "hit_rate_curve": curve, "warmup_requests": warmup,
            "errors": stats["errors"]}


def hit_rate(stats: dict) -> float:
    """The cache hit rate over every table of ``ParameterServer.stats(model)``, weighted by traffic."""
    tables = stats["tables"].values()
    return sum(t["cache"] for t in tables) / max(sum(t["lookups"] for t in tables), 1)


def summary_table(r: dict) -> str:
    """A short table of a :func:`serve_bench` result, one line per figure."""
    rows = [("requests", f"{r['requests']} x {r['tables']} tables x {r['batch_size']} ids "
                         f"(after {r['warmup_requests']} warm-up)"),
            ("stores", f"cache {r['cache_fraction']:.0%} -> {r['volatile']} -> {r['persistent']}"),
            ("latency p50 / p99", f"{r['p50_ms']:.2f} ms / {r['p99_ms']:.2f} ms"),
            ("requests/s", f"{r['qps']:,.1f}"), ("keys/s", f"{r['keys_per_s']:,.0f}"),
            ("cache hit rate", f"{r['hit_rate']:.2%}"), ("errors", str(r["errors"]))]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
