"""Serving exports from N ranks: peak extra memory (RSS) per rank while it writes its rows, against those rows.

    python benchmarks/export_memory.py [--quick] [--json PATH] [--rows-per-rank N] [--world W] [--dir D]

Each of ``--world`` gloo ranks (default 2) holds a row-sharded dynamic table of dim 128 float32 with ``--rows-per-rank``
rows (default 2.1M: 1.08 GB of values, 1.09 GB with the keys; ``--quick``: 200k) and calls ``export_for_serving``
(a full export, float32). Every rank writes its own shard file, streamed ``CHUNK_ROWS`` rows at a time, and rank 0
the manifest. The peak RSS of the call is read from the kernel (``VmHWM`` after resetting it through
``/proc/self/clear_refs``), so short peaks count; "extra" is that peak minus the RSS before the call (after
``malloc_trim``, so that the allocator cannot hide an allocation in memory it kept); "largest chunk" is the biggest
piece the export made. The target: at
most 1/10 of the rank's exported bytes (keys + values). Before per-rank exports, rank 0 gathered every rank's rows
(world x its own), so its extra memory was above the rows of the whole model.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, parser, print_table, write_json  # noqa: E402

from dynemb import DistributedEmbeddingCollection, FeatureConfig, TableConfig  # noqa: E402
from dynemb.checkpoint import export_for_serving  # noqa: E402
from dynemb.checkpoint.tiered_stream import largest_chunk  # noqa: E402
from dynemb.distributed.launch import spawn  # noqa: E402

DIM = 128


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rank_main(rank: int, world: int, rows: int, root: str, out: str) -> None:
    ec = DistributedEmbeddingCollection([TableConfig(name="t", dim=DIM, seed=0, initializer="zeros")],
                                        [FeatureConfig(name="f", table="t")], timeout=600)
    table = ec.embeddings["t"].table
    # keys this rank owns (key % world == rank), filled straight into its shard, a million at a time
    g = torch.Generator().manual_seed(rank)
    for start in range(0, rows, 1 << 20):
        n = min(1 << 20, rows - start)
        keys = (torch.arange(start, start + n, dtype=torch.int64) * world + rank)
        table.insert_or_assign(keys, torch.randn(n, DIM, generator=g))
    own = table.size() * (DIM * 4 + 8)
    del keys
    dist.barrier()
    # Hand the heap's free memory (the insert's temporaries) back to the kernel first: an allocation during the
    # export that reused it would not show in RSS.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    largest_chunk(reset=True)
    exact = _reset_peak()
    before = _status("VmRSS")
    start = time.perf_counter()
    export_for_serving(root, ec)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") if exact else _status("VmRSS")
    stats = [{"rank": rank, "rows": table.size(), "row_bytes": own, "extra_rss": max(peak - before, 0),
              "seconds": seconds, "exact_peak": exact, "largest_chunk": largest_chunk()}]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, json.dumps(stats))  # tiny: one dict per rank
    if rank == 0:
        with open(out, "w") as f:
            json.dump([json.loads(s)[0] for s in everyone], f)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rows-per-rank", type=int, default=None, help="rows per rank (default 2.1M; --quick 200k)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write the export (default: a temp dir)")
    args = p.parse_args()
    rows = args.rows_per_rank or (200_000 if args.quick else 2_100_000)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        out = os.path.join(tmp, "stats.json")
        spawn(_rank_main, args.world, rows, os.path.join(tmp, "export"), out, threads=1)
        with open(out) as f:
            stats = json.load(f)
    table = [{"rank": s["rank"], "rows": s["rows"], "rows GB": round(s["row_bytes"] / 1e9, 3),
              "peak extra RSS MB": round(s["extra_rss"] / 1e6, 1),
              "extra / rows": round(s["extra_rss"] / s["row_bytes"], 4),
              "largest chunk MB": round(s["largest_chunk"] / 1e6, 2),
              "write MB/s": round(s["row_bytes"] / s["seconds"] / 1e6, 1)} for s in stats]
    print_table(table, list(table[0]))
    worst = max(r["extra / rows"] for r in table)
    print(f"\nworst rank: peak extra RSS = {worst:.4f} x its rows (target <= 0.1); peak from "
          f"{'VmHWM (reset before the call)' if all(s['exact_peak'] for s in stats) else 'VmRSS after the call'}")
    if args.json:
        write_json(args.json, {"machine": machine_info(), "world": args.world, "rows_per_rank": rows, "rows": table,
                               "worst_extra_over_rows": worst, "date": time.strftime("%Y-%m-%d")})


if __name__ == "__main__":
    main()
