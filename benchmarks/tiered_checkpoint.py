"""Checkpoint save and load of a tiered table (5% fast tier) against the same table untiered: seconds and the peak
memory each needs beyond the table.

One table of ``N`` rows, dim 64, with a 64-wide optimizer slot (528 bytes a row), saved with
``dynemb.checkpoint.save`` and loaded into a fresh table of the same kind with ``load``. Implementations:

- ``untiered``: ``DynamicEmbedding(64)``: its save writes views of its columns, its load reads the whole file.
- ``tiered-host``: ``Tiers(fast_capacity=N // 20, slow="host")``: streamed a chunk at a time.
- ``tiered-disk``: ``Tiers(fast_capacity=N // 20, slow=<tmp dir>)``: streamed, slow tier in row files.

Each round runs each implementation in a fresh process (rounds interleaved, medians), after a small save and load
that compiles the kernels. ``extra``: the peak anonymous resident memory (``RssAnon``, sampled every millisecond)
during the call above its level before the call; file pages (the slow tier's row files, the page cache) are not
counted, since the kernel reclaims them. The table's own growth during a load counts (an untiered or host-tier
table's rows are anonymous memory), so ``extra`` of a load is compared with the rows' bytes.

Run: ``.venv/bin/python benchmarks/tiered_checkpoint.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, parser, print_table, write_json  # noqa: E402

IMPLS = ("untiered", "tiered-host", "tiered-disk")
DIM = 64


def _anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) << 10
    return 0


def measured(call) -> tuple[float, int]:
    """``(seconds, peak extra RssAnon bytes)`` of ``call()``."""
    before, peak, done = _anon(), [0], threading.Event()

    def sample():
        while not done.wait(0.001):
            peak[0] = max(peak[0], _anon())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    return seconds, max(peak[0], _anon()) - before


def child(impl: str, rows: int, where: str) -> dict:
    """One implementation's save and load, in this (fresh) process."""
    import dynemb
    from dynemb.checkpoint import load, save
    from dynemb.table import Tiers

    torch.set_num_threads(1)

    def table(n: int, tag: str):
        tiers = None if impl == "untiered" else Tiers(fast_capacity=max(1, n // 20),
                                                      slow="host" if impl == "tiered-host" else f"{where}/{tag}")
        emb = dynemb.DynamicEmbedding(DIM, seed=0, tiers=tiers)
        emb.table.add_slot("m", DIM)
        return emb

    def round_trip(n: int, tag: str) -> tuple:
        emb = table(n, tag)
        for start in range(0, n, 20_000):
            keys = torch.arange(start, min(n, start + 20_000)) * 7 - n
            emb.table.insert_or_assign(keys, torch.randn(keys.numel(), DIM))
        saving = measured(functools.partial(save, f"{where}/ckpt-{tag}", emb, step=1))
        del emb
        fresh = table(n, tag + "-loaded")
        loading = measured(lambda: load(f"{where}/ckpt-{tag}", fresh))
        assert fresh.table.size() == n
        return saving, loading

    round_trip(2_000, "warm")
    (save_s, save_extra), (load_s, load_extra) = round_trip(rows, "main")
    return {"save_s": save_s, "save_extra": save_extra, "load_s": load_s, "load_extra": load_extra}


def main(argv=None) -> None:
    if argv is None and len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
        return
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=None, help="rows of the table (default 200k quick, 2M full)")
    args = p.parse_args(argv)
    rows = args.rows or (200_000 if args.quick else 2_000_000)
    repeat = args.repeat or (1 if args.quick else 3)
    table_bytes = rows * (DIM * 4 * 2 + 16)
    print(f"{rows} rows of dim {DIM} with a {DIM}-wide slot ({table_bytes / 2**20:.0f} MiB of rows); fast tier 5%; "
          f"{repeat} rounds, each implementation in a fresh process", flush=True)
    results = {impl: [] for impl in IMPLS}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(repeat):
        for impl in IMPLS:
            with tempfile.TemporaryDirectory() as where:
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", impl, str(rows), where],
                                     env=env, capture_output=True, text=True, check=True)
            results[impl].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {impl: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for impl, runs in results.items()}
    table = [{"implementation": impl, "save s": f"{m['save_s']:.2f}", "load s": f"{m['load_s']:.2f}",
              "save extra MiB": f"{m['save_extra'] / 2**20:.1f}", "load extra MiB": f"{m['load_extra'] / 2**20:.1f}",
              "save x untiered": f"{m['save_s'] / med['untiered']['save_s']:.2f}",
              "load x untiered": f"{m['load_s'] / med['untiered']['load_s']:.2f}"} for impl, m in med.items()]
    print_table(table, list(table[0]))
    if args.json:
        write_json(args.json, {"benchmark": "tiered_checkpoint", "rows": rows, "dim": DIM, "repeat": repeat,
                               "table_bytes": table_bytes, "machine": machine_info(), "median": med,
                               "runs": results})


if __name__ == "__main__":
    main()
