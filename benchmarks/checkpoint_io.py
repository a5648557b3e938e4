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

``--background`` measures ``save(..., blocking=False)`` instead, against a blocking save in the same run: a training
loop (a batch of 4096 ids, 1/64 of them new, looked up, inserted, updated with their two slots and stamped, plus a
dense MLP's forward and backward, on one torch thread) runs while a background save is written, then as many steps
again without a save. Reported: the median step in the save window over the median of the steps right after it
(the median over repeats of that paired ratio; target <= 1.1x; "step CPU": the same of the training thread's CPU
time, which on a machine without an idle core shows the interference apart from sharing the cores), the save's
write rate (bytes / seconds from the
call until the files are published) over a blocking save's (target >= 0.9x), the pause of the call itself (the
snapshot: a memory copy of the rows, on the caller's thread) and the snapshot's bytes; at nice 0 and at +10 (what
dynemb uses) for the save's threads.

Run: ``python benchmarks/checkpoint_io.py [--quick] [--json PATH] [--repeat R] [--keys N] [--threads T] [--dir D]
[--background]``.
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
from dynemb.checkpoint import background as background_module  # noqa: E402
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


def read_into_cache(path: Path) -> None:
    """Read ``path``'s files once, so that a warm load finds them in the page cache (saves write with O_DIRECT)."""
    for file in (p for p in path.rglob("*") if p.is_file()):
        with open(file, "rb") as f:
            while f.read(32 << 20):
                pass


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
    interleaved([("load (warm)", lambda: load(ckpt, emb), lambda: read_into_cache(ckpt)),
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


BATCH, HIDDEN = 4096, 512


class Stepper:
    """A training step on the table being saved: ids looked up and inserted (1/64 new), rows and both slots
    updated Adam-like and stamped, and a dense MLP's forward and backward (the share of a step that is not the
    table's)."""

    def __init__(self, emb: dynemb.DynamicEmbedding, seed: int) -> None:
        self.emb, self.g = emb, torch.Generator().manual_seed(seed)
        self.next_new = emb.table.size()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                       torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))

    def __call__(self) -> tuple[float, float]:
        """``(wall seconds, this thread's CPU seconds)`` of one step."""
        start, start_cpu = time.perf_counter(), time.thread_time()
        t = self.emb.table
        old = torch.randint(0, self.next_new, (BATCH - BATCH // 64,), generator=self.g)
        new = torch.arange(self.next_new, self.next_new + BATCH // 64)
        self.next_new += new.numel()
        keys = torch.cat([old, new]) * _GOLDEN
        rows = torch.unique(t.find_or_insert(keys)[0])
        x = t.values[rows].requires_grad_()
        self.mlp(x).sum().backward()
        with torch.no_grad():
            grad = x.grad
            m = t.slot("exp_avg")[rows] * 0.9 + 0.1 * grad
            v = t.slot("exp_avg_sq")[rows] * 0.999 + 0.001 * grad * grad
            t.slot("exp_avg")[rows], t.slot("exp_avg_sq")[rows] = m, v
            t.values[rows] -= 0.01 * m / (v.sqrt() + 1e-8)
            t.mark_updated(rows)
            self.mlp.zero_grad()
        return time.perf_counter() - start, time.thread_time() - start_cpu


NICENESS = (0, 10)  # the background save's threads at the caller's priority, then at dynemb's default
IDLE = "idle"  # a background save at the default niceness while the caller only waits: the machine's share


def background_repeat(emb, work: Path, rep: int, stepper: Stepper, steps: int) -> dict:
    """``steps`` steps without a save, one blocking save, one background save per niceness with steps until it
    is written, and one with no steps (the caller waits); the order of the saves rotates between repeats."""
    out: dict = {}

    def blocking():
        out["blocking s"], out["blocking cpu s"] = timed(lambda: save(work, emb, step=10 * rep))

    def background(nice, train: bool = True):
        def run():
            background_module.NICENESS = 10 if nice == IDLE else nice
            start, start_cpu = time.perf_counter(), time.process_time()
            handle = save(work, emb, step=10 * rep + 1 + (5 if nice == IDLE else nice), blocking=False)
            out[f"pause s @{nice}"] = time.perf_counter() - start
            during = []
            while train and not handle.done():
                during.append(stepper())
            handle.wait()
            out[f"background s @{nice}"] = time.perf_counter() - start
            # the save's CPU: the process's, less the training thread's steps
            out[f"save cpu s @{nice}"] = time.process_time() - start_cpu - sum(c for _, c in during)
            out[f"steps during @{nice}"] = during
            # as many steps right after, without a save: the pair sees the same table size and machine load
            out[f"steps after @{nice}"] = [stepper() for _ in range(max(len(during), 5) if train else 0)]
        return run

    out["steps without"] = [stepper() for _ in range(steps)]
    runs = [blocking] + [background(nice) for nice in NICENESS] + [background(IDLE, train=False)]
    for fn in runs[rep % len(runs):] + runs[: rep % len(runs)]:
        fn()
    background_module.NICENESS = NICENESS[-1]
    shutil.rmtree(work)
    work.mkdir()
    return out


def run_background(emb, work: Path, repeat: int, warmup: int, nbytes: int) -> tuple[list[dict], dict]:
    stepper = Stepper(emb, seed=2)
    samples = [background_repeat(emb, work, rep, stepper, steps=30) for rep in range(warmup + repeat)][warmup:]
    without = statistics.median(t for s in samples for t, _ in s["steps without"])
    blocking = statistics.median(s["blocking s"] for s in samples)
    rows = [{"save": "none", "median step ms": round(without * 1e3, 2)},
            {"save": "blocking", "MB/s": round(nbytes / 1e6 / blocking),
             "save CPU s": round(statistics.median(s["blocking cpu s"] for s in samples), 2)}]
    for nice in NICENESS + (IDLE,):
        background = statistics.median(s[f"background s @{nice}"] for s in samples)
        row = {"save": f"background, nice +{nice}" if nice != IDLE else "background, nice +10, training idle",
               "MB/s": round(nbytes / 1e6 / background), "MB/s / blocking": round(blocking / background, 3),
               "pause ms": round(statistics.median(s[f"pause s @{nice}"] for s in samples) * 1e3, 1),
               "save CPU s": round(statistics.median(s[f"save cpu s @{nice}"] for s in samples), 2),
               "snapshot MB": round(nbytes / 1e6)}
        if nice != IDLE:
            def paired(i: int, nice: int = nice) -> float:  # 0: wall time, 1: the training thread's CPU time
                return statistics.median(statistics.median(x[i] for x in s[f"steps during @{nice}"]) /
                                         statistics.median(x[i] for x in s[f"steps after @{nice}"]) for s in samples)
            row.update({"median step ms": round(statistics.median(
                t for s in samples for t, _ in s[f"steps during @{nice}"]) * 1e3, 2),
                "step / no save": round(paired(0), 3), "step CPU / no save": round(paired(1), 3),
                "steps in window": statistics.median(len(s[f"steps during @{nice}"]) for s in samples)})
        rows.append(row)
    for s in samples:
        for k, v in s.items():
            if isinstance(v, list):
                s[k] = [[round(t, 5) for t in x] for x in v]
    return rows, {"results": rows, "samples": samples}


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
    p.add_argument("--background", action="store_true", help="measure save(blocking=False) during training steps")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n = args.keys or (1 << 20 if args.quick else 4 << 20)
    repeat = args.repeat or (2 if args.quick else 3)
    warmup = 0 if args.quick else 1
    work = Path(tempfile.mkdtemp(prefix="dynemb-ckpt-bench-", dir=args.dir))
    try:
        emb = build_table(n)
        nbytes = sum(a.nbytes for a in live_columns(emb.table))
        if args.background:
            rows, result = run_background(emb, work, repeat, warmup, nbytes)
        else:
            g = torch.Generator().manual_seed(1)
            samples = [one_repeat(emb, work, rep, g, cold=not args.quick) for rep in range(warmup + repeat)][warmup:]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.background:
        print(f"table: {n} keys x dim {DIM}, 2 slots: {nbytes / 1e6:.0f} MB; {args.threads} torch threads; "
              f"batch {BATCH}, MLP {DIM}-{HIDDEN}-{HIDDEN}-1; median of {repeat}")
        print_table(rows, ["save", "median step ms", "step / no save", "step CPU / no save", "steps in window",
                           "MB/s", "MB/s / blocking", "pause ms", "save CPU s", "snapshot MB"])
        print("targets: step / no save <= 1.1, MB/s / blocking >= 0.9; nice +10 is what save(blocking=False) uses")
        if args.json:
            write_json(args.json, {"benchmark": "checkpoint_io --background", "keys": n, "dim": DIM, "bytes": nbytes,
                                   "threads": args.threads, "repeat": repeat, "machine": machine_info(), **result})
        return
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
