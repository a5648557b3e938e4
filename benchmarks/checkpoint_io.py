"""Checkpoint I/O: save/load throughput of a dynamic table with Adam-like slots, against plain numpy I/O of the
same bytes in the same run, and the time of an incremental save after touching 1% of the rows against a full save.

The table has N int64 keys, dim 64 float32 values, int64 scores and two [N, 64] float32 slots (784 bytes per row).
Each repeat runs every measurement once, ours and raw in turn (alternating which goes first), so machine noise
hits them alike; medians are reported, of wall seconds and of CPU seconds (all threads; steadier than wall time
on a busy machine, and the cost that an idle core would hide).

* save: ``dynemb.checkpoint.save`` (streamed safetensors, sha256 on the fly, fsync, rename) vs ``np.save`` of the
  same columns into one file, with and without ``fsync`` (a durable checkpoint needs the fsync).
* load: ``dynemb.checkpoint.load`` (read, sha256 check, rebuild the hash index, replace the table) vs ``np.load``,
  from the page cache ("warm") and after dropping these files from it with ``posix_fadvise`` ("cold"). "of which
  table.replace" is the table's own part of a load (index rebuild, uniqueness check, copy into the columns).
  ``--quick`` (1M keys) skips the cold loads and this breakdown.
* incremental: ``save(incremental=True)`` after 1% of rows were updated (and, second case, 0.1% erased, which
  adds the key order to the delta) vs the full save.

Run: ``python benchmarks/checkpoint_io.py [--quick] [--json PATH] [--repeat R] [--keys N] [--threads T] [--dir D]``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, parser, print_table, write_json  # noqa: E402

import dynemb  # noqa: E402
from dynemb.checkpoint import load, save  # noqa: E402
from dynemb.checkpoint.tensorfile import read_tensors  # noqa: E402
from dynemb.table import Rows  # noqa: E402

DIM = 64
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: an odd multiplier, so keys stay unique


def build_table(n: int) -> dynemb.DynamicEmbedding:
    emb = dynemb.DynamicEmbedding(DIM, initializer="zeros", init_capacity=n, seed=0)
    keys = torch.arange(n, dtype=torch.int64) * _GOLDEN
    for start in range(0, n, 1 << 20):
        emb.table.find_or_insert(keys[start : start + (1 << 20)])
    emb.table.add_slot("exp_avg", DIM)
    emb.table.add_slot("exp_avg_sq", DIM)
    g = torch.Generator().manual_seed(0)
    for col in (emb.table.values, emb.table.slot("exp_avg"), emb.table.slot("exp_avg_sq")):
        col[:n].normal_(generator=g)
    return emb


def live_columns(table) -> list[np.ndarray]:
    n = table.size()
    cols = [table.row_keys[:n], table.values[:n], table.scores[:n]]
    return [c.numpy() for c in cols + [table.slot(s)[:n] for s in table.slot_names]]


def raw_save(arrays: list[np.ndarray], path: Path, fsync: bool) -> None:
    with open(path, "wb") as f:
        for a in arrays:
            np.save(f, a)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def raw_load(path: Path, count: int) -> list[np.ndarray]:
    with open(path, "rb") as f:
        return [np.load(f) for _ in range(count)]


def drop_from_cache(*paths: Path) -> None:
    """Evict these (fsynced, hence clean) files from the page cache, and nothing else on the machine."""
    for path in paths:
        for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn, before=None) -> tuple[float, float]:
    """``(wall seconds, CPU seconds of all threads)`` of one call; ``before`` runs untimed first."""
    if before is not None:
        before()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def interleaved(group: list, samples: dict, flip: bool) -> None:
    """Time ``(name, fn, before)`` entries one after the other, in reverse order when ``flip`` (so that neither
    side always runs first, right after the other's I/O)."""
    for name, fn, before in reversed(group) if flip else group:
        samples[name] = timed(fn, before)


def time_replace(table, ckpt: Path) -> tuple[float, float]:
    """The table's own share of a load: ``replace`` (index rebuild, uniqueness check, copy) of the saved rows."""
    cols, _ = read_tensors(next((ckpt / "tables").glob("*.safetensors")))
    rows = Rows(cols["keys"], cols["values"], cols["scores"], {s: cols["slot." + s] for s in table.slot_names})
    return timed(lambda: table.replace(rows))


def touch(emb: dynemb.DynamicEmbedding, fraction: float, g: torch.Generator) -> None:
    """Update ``fraction`` of the rows like an optimizer step: values and both slots, stamped as written."""
    t = emb.table
    rows = torch.randperm(t.size(), generator=g)[: int(t.size() * fraction)]
    for col in (t.values, t.slot("exp_avg"), t.slot("exp_avg_sq")):
        col[rows] = col[rows] * 0.9 + 0.1
    t.clock += 1
    t.mark_updated(rows)


def one_repeat(emb, work: Path, rep: int, g: torch.Generator, cold: bool) -> dict:
    """Every measurement once, ours and raw in turn; returns ``(wall, cpu)`` seconds by name. ``cold=False``
    skips the cold loads and the replace breakdown (``--quick``)."""
    arrays = live_columns(emb.table)
    raw_file, ckpt = work / "raw.npy", work / f"step-{10 * rep:08d}"
    samples: dict = {}
    flip = rep % 2 == 1
    interleaved([("save", lambda: save(work, emb, step=10 * rep), None),
                 ("raw save + fsync", lambda: raw_save(arrays, raw_file, fsync=True), None)], samples, flip)
    samples["raw save (no fsync)"] = timed(lambda: raw_save(arrays, raw_file, fsync=False))
    with open(raw_file, "rb+") as f:  # flushed now, so that its writeback does not slow the loads below
        os.fsync(f.fileno())
    interleaved([("load (warm)", lambda: load(ckpt, emb), None),
                 ("raw load (warm)", lambda: raw_load(raw_file, len(arrays)), None)], samples, flip)
    if cold:
        samples["of which table.replace"] = time_replace(emb.table, ckpt)
        interleaved([("load (cold)", lambda: load(ckpt, emb), lambda: drop_from_cache(ckpt)),
                     ("raw load (cold)", lambda: raw_load(raw_file, len(arrays)), lambda: drop_from_cache(raw_file))],
                    samples, flip)
    touch(emb, 0.01, g)
    samples["incremental, 1% updated"] = timed(lambda: save(work, emb, step=10 * rep + 1, incremental=True))
    touch(emb, 0.01, g)
    t = emb.table
    erased = t.row_keys[torch.randperm(t.size(), generator=g)[: t.size() // 1000]].clone()
    t.erase(erased)
    samples["incremental, 1% updated + 0.1% erased"] = timed(
        lambda: save(work, emb, step=10 * rep + 2, incremental=True))
    t.find_or_insert(erased)  # back to N rows for the next repeat
    shutil.rmtree(work)
    work.mkdir()
    return samples


_ORDER = ["save", "raw save + fsync", "raw save (no fsync)", "load (warm)", "raw load (warm)",
          "of which table.replace", "load (cold)", "raw load (cold)", "incremental, 1% updated",
          "incremental, 1% updated + 0.1% erased"]
_BASELINES = {
    "save": ("raw save + fsync", "raw save (no fsync)"),
    "load (warm)": ("raw load (warm)",),
    "load (cold)": ("raw load (cold)",),
}


def summarize(samples: list[dict], nbytes: int) -> list[dict]:
    names = [name for name in _ORDER if name in samples[0]]
    median = {name: statistics.median(s[name][0] for s in samples) for name in names}
    cpu = {name: statistics.median(s[name][1] for s in samples) for name in names}
    rows = []
    for name, seconds in median.items():
        row = {"operation": name, "seconds": round(seconds, 3), "cpu s": round(cpu[name], 2),
               "MB/s": round(nbytes / 1e6 / seconds)}
        for i, base in enumerate(_BASELINES.get(name, ())):
            row[f"x raw{'' if i == 0 else ' (no fsync)'}"] = round(median[base] / seconds, 2)
        if name.startswith("incremental"):
            row["% of full save"] = round(100 * seconds / median["save"], 2)
            del row["MB/s"]
        if name == "of which table.replace":
            row["% of warm load"] = round(100 * seconds / median["load (warm)"], 1)
            del row["MB/s"]
        rows.append(row)
    return rows


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=None, help="rows in the table (default 4M, 1M with --quick)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed at the end)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n = args.keys or (1 << 20 if args.quick else 4 << 20)
    repeat = args.repeat or (2 if args.quick else 3)
    warmup = 0 if args.quick else 1
    work = Path(tempfile.mkdtemp(prefix="dynemb-ckpt-bench-", dir=args.dir))
    try:
        emb = build_table(n)
        nbytes = sum(a.nbytes for a in live_columns(emb.table))
        g = torch.Generator().manual_seed(1)
        samples = [one_repeat(emb, work, rep, g, cold=not args.quick) for rep in range(warmup + repeat)][warmup:]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = summarize(samples, nbytes)
    print(f"table: {n} keys x dim {DIM}, 2 slots: {nbytes / 1e6:.0f} MB; {args.threads} threads; "
          f"median of {repeat}")
    columns = ["operation", "seconds", "cpu s", "MB/s", "x raw", "x raw (no fsync)", "% of full save", "% of warm load"]
    print_table(rows, columns)
    if args.json:
        write_json(args.json, {"benchmark": "checkpoint_io", "keys": n, "dim": DIM, "bytes": nbytes,
                               "threads": args.threads, "repeat": repeat, "machine": machine_info(),
                               "results": rows, "samples": samples})


if __name__ == "__main__":
    main()
