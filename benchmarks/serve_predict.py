"""In-process ``ServedModel.predict`` of the demo model: the fused request path against the grouped and per-table ones.

Model: the DLRM ``dynemb train`` trains on the demo's synthetic click logs (26 categorical columns, 13 dense, dim 16),
or the run given with ``--model`` (it is copied: serving writes an export into the run). Its tables are served by a
parameter server (20% of each table's rows cached) with the in-process memory tier or a real ``redis-server`` on a
free loopback port. Requests of ``--rows`` rows (default 256: ids drawn from the ids training saw, 5% unseen; the
bodies of ``benchmarks/serve_endpoint.py``), already decoded; each call scores one. The three paths take turns call
by call, in a rotating order, so load hits them alike: ``fused`` (the parameter server's two numba calls writing the
DLRM's ``[B, F, D]`` input, ``ParameterServer.fused``), ``grouped`` (the same request in the grouped path's calls,
``fused = False``) and ``per_table`` (``grouped = False``); ``--paths fused`` times the fused path alone, as a
server runs it (the other paths' calls in between evict some of its cache lines: the interleaved figure is the
higher one). Reported: the median and minimum per call of this
thread's CPU time (what the call costs, unaffected by time spent descheduled on a busy machine) and of wall time,
and the paired ratios to the fused path (median of per-round ratios), after warm-up calls. ``dense_ms`` is the dense
part alone (``model(batch, pooled=...)`` on rows looked up beforehand). ``--dtype`` serves an export of that dtype
(``export_for_serving(dtype=...)``: float16, bfloat16, or the 8-bit int8, float8_e4m3fn, float8_e5m2) instead of
the run's float32 one.

Run: ``python benchmarks/serve_predict.py [--quick] [--json PATH] [--model RUN_DIR] [--rows N] [--calls N]
[--dtype DTYPE] [--paths fused,grouped,per_table]``.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "serving"))
from _common import machine_info, parser, print_table, write_json  # noqa: E402
from redis_process import RedisServer  # noqa: E402
from serve_endpoint import make_bodies, synthetic_run  # noqa: E402

from dynemb.endpoint import ServedModel  # noqa: E402
from dynemb.job.score import probabilities  # noqa: E402

PATHS = {"fused": (True, True), "grouped": (True, False), "per_table": (False, True)}  # (grouped, fused)


def dense_ms(model: ServedModel, bodies: list, calls: int) -> float:
    """Median thread CPU ms of the dense part alone on rows looked up beforehand."""
    prepared = []
    for b in bodies:
        batch = model.preprocessing.normalize(b.batch)
        pooled = {f: model.ps.lookup(model.name, model._tables[f], batch.sparse[f]) for f in model.features}
        prepared.append((batch, pooled))
    times = []
    with torch.no_grad():
        for k in range(calls):
            batch, pooled = prepared[k % len(prepared)]
            t0 = time.thread_time()
            probabilities(model.model(batch, pooled=pooled))
            times.append(time.thread_time() - t0)
    return round(1e3 * statistics.median(times), 3)


def export_dtype(run: Path, dtype: str) -> Path:
    """An export of ``run``'s tables with rows of ``dtype``, beside the run."""
    from dynemb.checkpoint import export_for_serving
    from dynemb.job import load_model

    root = run.parent / f"export-{dtype}"
    if not root.exists():
        export_for_serving(root, load_model(run)[0], dtype=getattr(torch, dtype))
    return root


def measure(run: Path, tier: str, volatile: dict, rows: int, calls: int, dtype: str = "float32",
            only: Sequence[str] = PATHS) -> dict:
    export = None if dtype == "float32" else export_dtype(run, dtype)
    model = ServedModel(run, export=export, name="ctr", volatile_db=volatile)
    try:
        bodies = make_bodies(model, rows, 32)
        paths = {name: PATHS[name] for name in only}
        cpu = {name: [] for name in paths}
        wall = {name: [] for name in paths}
        names = list(paths)
        for k in range(calls + 20):
            body = bodies[k % len(bodies)]
            for name in names[k % len(names):] + names[:k % len(names)]:
                model.ps.grouped, model.ps.fused = paths[name]
                t0, w0 = time.thread_time(), time.perf_counter()
                model.predict(body.batch)
                if k >= 20:  # warm-up: the caches fill
                    cpu[name].append(1e3 * (time.thread_time() - t0))
                    wall[name].append(1e3 * (time.perf_counter() - w0))
        model.ps.grouped = model.ps.fused = True
        out = {"tier": tier, "dtype": dtype, "rows": rows, "calls": calls}
        for name in names:
            out[f"{name}_cpu_ms"] = round(statistics.median(cpu[name]), 3)
            out[f"{name}_cpu_min_ms"] = round(min(cpu[name]), 3)
            out[f"{name}_wall_ms"] = round(statistics.median(wall[name]), 3)
        for name in names if "fused" in names else ():
            if name == "fused":
                continue
            out[f"{name}_over_fused"] = round(statistics.median(np.divide(cpu[name], cpu["fused"])), 2)
        out["dense_ms"] = dense_ms(model, bodies, min(calls, 200))
        out["hit_rate"] = round(sum(t["cache"] for t in model.ps.stats("ctr")["tables"].values())
                                / max(1, sum(t["lookups"] for t in model.ps.stats("ctr")["tables"].values())), 4)
        return out
    finally:
        model.close()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model", metavar="RUN_DIR", help="a `dynemb train` run (default: train one on synthetic data)")
    p.add_argument("--rows", type=int, default=256, help="rows per request")
    p.add_argument("--calls", type=int, default=None, help="timed calls per path (default 300; --quick: 60)")
    p.add_argument("--tiers", default="memory,redis", help="volatile stores to serve from")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "int8", "float8_e4m3fn",
                                                          "float8_e5m2"], help="rows of the served export")
    p.add_argument("--paths", default=",".join(PATHS), help="request paths to time, in turn (default all three; "
                   "`fused` alone is what a server runs: no other path's work between its calls)")
    args = p.parse_args()
    only = args.paths.split(",")
    if not only or any(name not in PATHS for name in only):
        p.error(f"--paths: a comma-separated list of {', '.join(PATHS)}, got {args.paths!r}")
    torch.set_num_threads(1)
    calls = args.calls or (60 if args.quick else 300)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        if args.model:
            shutil.copytree(args.model, run, ignore=shutil.ignore_patterns("export*"))
        else:
            synthetic_run(run, 30 if args.quick else 300)
        for tier in args.tiers.split(","):
            if tier == "memory":
                results.append(measure(run, tier, {"type": "memory"}, args.rows, calls, args.dtype, only))
                continue
            redis = RedisServer(tmp)
            redis.start()
            try:
                results.append(measure(run, tier, {"type": "redis", "address": redis.address}, args.rows, calls,
                                       args.dtype, only))
            finally:
                redis.kill()
    info = machine_info()
    print(f"ServedModel.predict in process, {args.rows} rows, 1 thread; {info['cpu_model']}")
    print_table(results, list(results[0]))
    if args.json:
        write_json(args.json, {"benchmark": "serve_predict", "machine": info, "results": results})


if __name__ == "__main__":
    main()
