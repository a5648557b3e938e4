"""Table operations benchmark: insert, find, find+gather, upsert and remove throughput of KeyValueTable.

Each operation handles one batch of distinct keys against a table that holds N keys (float32 values, int64 keys,
created with ``init_capacity=N``: for N a power of two its index is at load 0.40), timed round-robin with the
baselines:

- dense: a static ``[N, dim]`` tensor: ``torch.index_select(dense, 0, idx, out=buf)`` for find+gather (the floor
  of any lookup) and ``dense.index_copy_`` for upsert;
- dict: a Python dict from key to row of a dense value tensor (conversions to and from lists included);
- tf: ``tf.lookup.experimental.MutableHashTable``, when tensorflow is importable;
- torch path: the same table with its index kept off the numba kernels (``use_backend("torch")``): what runs on
  CUDA or without numba. Only measured when the kernels are in use.

"insert" inserts the batch into the table minus that batch (removed untimed before each run), so the table
neither grows nor rehashes while timed: ``insert_or_assign`` with given values, ``find_or_insert`` with the
default initializer. Memory is measured in a fresh process that fills a default-constructed table (growing from
its default capacity) and compares ``nbytes()`` and the RSS increase with the raw bytes, N * (8 + 4 * dim).

Run: ``python benchmarks/table_ops.py [--quick] [--json PATH]``; ``--help`` for the rest.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import CLOCKS, Case, fmt_rate, machine_info, median_times, parser, print_table, rss_bytes  # noqa: E402
from _common import thread_settings, using_threads, write_json  # noqa: E402

from dynemb.kernels import Backend, resolve_backend, use_backend  # noqa: E402
from dynemb.table import KeyValueTable  # noqa: E402
from dynemb.table.hashing import mix64  # noqa: E402

OPS = ["insert", "find_or_insert", "find", "find+gather", "upsert", "remove"]
TARGETS = {"find+gather vs index_select": 0.7, "insert keys/s": 5e6, "find_or_insert keys/s": 5e6, "memory vs raw": 1.5}


def distinct_keys(start: int, n: int) -> torch.Tensor:
    """``n`` distinct pseudo-random int64 keys (mix64 is a bijection), reproducible from ``start``."""
    return mix64(torch.arange(start, start + n, dtype=torch.int64))


def filled_table(keys: torch.Tensor, dim: int, batch: int, **kwargs) -> KeyValueTable:
    table = KeyValueTable(dim, **kwargs)
    for part in keys.split(batch):
        table.insert_or_assign(part, torch.randn(part.numel(), dim, device=part.device))
    return table


# ---------------------------------------------------------------------------------------------- implementations
def dynemb_cases(table: KeyValueTable, batch_keys: torch.Tensor, vals: torch.Tensor, buf: torch.Tensor) -> dict:
    def insert() -> None:
        table.insert_or_assign(batch_keys, vals)

    def remove() -> None:
        table.erase(batch_keys)

    return {
        "insert": Case(insert, setup=remove),
        "find_or_insert": Case(lambda: table.find_or_insert(batch_keys), setup=remove),
        "find": lambda: table.find_rows(batch_keys),
        "find+gather": lambda: table.find(batch_keys, out=buf),
        "upsert": insert,
        "remove": Case(remove, teardown=insert),
    }


def on_torch_path(case: Case | Callable[[], object]) -> Case:
    """The same call with the index on its torch path."""
    case = case if isinstance(case, Case) else Case(case)

    def run() -> None:
        with use_backend("torch"):
            case.run()

    return case._replace(run=run)


def dense_cases(dense: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, buf: torch.Tensor) -> dict:
    return {
        "find+gather": lambda: torch.index_select(dense, 0, idx, out=buf),
        "upsert": lambda: dense.index_copy_(0, idx, vals),
    }


def dict_cases(index: dict, dense: torch.Tensor, batch_keys: torch.Tensor, vals: torch.Tensor, buf) -> dict:
    """A dict from key to row of ``dense``: the plain-Python way to a growable table."""
    rows = [index[k] for k in batch_keys.tolist()]

    def find() -> torch.Tensor:
        return torch.tensor([index.get(k, -1) for k in batch_keys.tolist()])

    def insert() -> None:
        index.update(zip(batch_keys.tolist(), rows))
        dense.index_copy_(0, torch.tensor(rows), vals)

    def remove() -> None:
        for k in batch_keys.tolist():
            index.pop(k, None)

    def upsert() -> None:
        dense.index_copy_(0, torch.tensor([index[k] for k in batch_keys.tolist()]), vals)

    restore = lambda: index.update(zip(batch_keys.tolist(), rows))  # noqa: E731
    return {
        "insert": Case(insert, setup=remove),
        "find": find,
        "find+gather": lambda: torch.index_select(dense, 0, find(), out=buf),
        "upsert": upsert,
        "remove": Case(remove, teardown=restore),
    }


def tf_cases(keys: torch.Tensor, batch_keys: torch.Tensor, vals: torch.Tensor, dim: int) -> dict:
    """``tf.lookup.experimental.MutableHashTable`` holding the same keys; {} when tensorflow is not importable."""
    try:
        import tensorflow as tf
    except ImportError:
        return {}
    table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, default_value=tf.zeros(dim))
    for part in keys.split(1 << 16):
        table.insert(tf.constant(part.numpy()), tf.random.normal((part.numel(), dim)))
    k, v = tf.constant(batch_keys.numpy()), tf.constant(vals.numpy())
    return {
        "insert": Case(lambda: table.insert(k, v), setup=lambda: table.remove(k)),
        "find+gather": lambda: table.lookup(k).numpy(),
        "upsert": lambda: table.insert(k, v),
        "remove": Case(lambda: table.remove(k), teardown=lambda: table.insert(k, v)),
    }


# ---------------------------------------------------------------------------------------------- measurement
def measure(n: int, dim: int, batch: int, repeat: int, clock: Callable[[], float], dict_max: int,
            device: torch.device) -> list[dict]:
    """One row per operation: keys/s of each implementation at the current thread count."""
    gen = torch.Generator().manual_seed(n)
    pick = torch.randperm(n, generator=gen)[:batch].to(device)
    keys = distinct_keys(0, n).to(device)
    batch_keys, vals = keys[pick], torch.randn(batch, dim, generator=gen).to(device)
    buf = torch.empty(batch, dim, device=device)
    table = filled_table(keys, dim, batch, init_capacity=n, device=device)
    dense = torch.randn(n, dim, generator=gen).to(device)
    impls = {"dynemb": dynemb_cases(table, batch_keys, vals, buf), "dense": dense_cases(dense, pick, vals, buf)}
    if resolve_backend(None, device) is Backend.NUMBA:
        impls["torch path"] = {op: on_torch_path(case) for op, case in impls["dynemb"].items()}
    if device.type == "cpu":
        impls["tf"] = tf_cases(keys, batch_keys, vals, dim)
    if device.type == "cpu" and n <= dict_max:
        index = dict(zip(keys.tolist(), range(n)))
        impls["dict"] = dict_cases(index, dense, batch_keys, vals, buf)
    rows = []
    for op in OPS:
        cases = {impl: c[op] for impl, c in impls.items() if op in c}
        seconds = median_times(cases, repeat=repeat, warmup=2, clock=clock)
        row = {"threads": torch.get_num_threads(), "keys": n, "op": op}
        row.update({impl: batch / s for impl, s in seconds.items()})
        rows.append(row)
    return rows


def memory_probe(n: int, dim: int, batch: int, device: torch.device) -> dict:
    """Fill a default-constructed table in this (fresh) process; report its bytes and the resident memory it added
    (RSS on CPU, allocated device memory on CUDA)."""
    resident = rss_bytes if device.type == "cpu" else lambda: torch.cuda.memory_allocated(device)
    filled_table(distinct_keys(-batch, batch).to(device), dim, batch, device=device)  # loads code paths untimed
    gc.collect()
    before = resident()
    table = KeyValueTable(dim, device=device)
    for i in range(0, n, batch):
        part = distinct_keys(i, min(batch, n - i)).to(device)
        table.insert_or_assign(part, torch.randn(part.numel(), dim, device=device))
    gc.collect()
    added = resident() - before
    raw = n * (8 + 4 * dim)
    nbytes = table.nbytes()
    return {"keys": n, "raw_bytes": raw, "nbytes": nbytes, "resident_bytes": added, "nbytes_vs_raw": nbytes / raw,
            "resident_vs_raw": added / raw, "capacity": table.capacity, "index_load": table.stats()["index_load"]}


def memory(n: int, dim: int, batch: int, device: torch.device) -> dict:
    """:func:`memory_probe` in a fresh interpreter, so that nothing else allocated here blurs the RSS."""
    args = ["--memory-probe", str(n), "--dim", str(dim), "--batch", str(batch), "--device", str(device)]
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- report
def report_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        ours = r["dynemb"]
        ratio = {name: f"{ours / r[name]:.2f}x" if r.get(name) else "n/a" for name in ("dense", "dict", "tf")}
        out.append({
            "threads": r["threads"], "keys": f"{r['keys'] / 2**20:g}M", "op": r["op"], "dynemb": fmt_rate(ours),
            **{name: fmt_rate(r.get(name)) for name in ("torch path", "dense", "dict", "tf")},
            **{f"vs {name}": value for name, value in ratio.items()},
            "numba gain": f"{ours / r['torch path']:.2f}x" if r.get("torch path") else "n/a",
        })
    return out


def check_targets(rows: list[dict], mem: list[dict], n: int, device: torch.device) -> list[dict]:
    """The issue's targets at 1 thread and N = ``n`` keys (on CUDA: find+gather within 4x of index_select)."""
    at = {r["op"]: r for r in rows if r["threads"] == 1 and r["keys"] == n}
    m = next(x for x in mem if x["keys"] == n)
    gather = at["find+gather"]["dynemb"] / at["find+gather"]["dense"]
    if device.type == "cuda":
        return [_verdict("find+gather vs index_select (cuda)", gather, ">=", 0.25)]
    checks = [
        ("find+gather vs index_select", gather, ">="),
        ("insert keys/s", at["insert"]["dynemb"], ">="),
        ("find_or_insert keys/s", at["find_or_insert"]["dynemb"], ">="),
        ("memory vs raw", max(m["nbytes_vs_raw"], m["resident_vs_raw"]), "<="),
    ]
    if at["insert"].get("tf"):
        checks += [("insert vs tf", at["insert"]["dynemb"] / at["insert"]["tf"], ">="),
                   ("find+gather vs tf", at["find+gather"]["dynemb"] / at["find+gather"]["tf"], ">=")]
    return [_verdict(name, value, sense, TARGETS.get(name, 10.0)) for name, value, sense in checks]


def _verdict(name: str, value: float, sense: str, target: float) -> dict:
    met = value >= target if sense == ">=" else value <= target
    return {"target": f"{name} {sense} {target:g}", "measured": f"{value:.3g}", "met": "yes" if met else "NO"}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=None, help="table sizes N (default 2^20 2^22)")
    p.add_argument("--batch", type=int, default=None, help="keys per call (default 65536)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--threads", type=int, nargs="+", default=None, help="torch thread counts (default: 1 and all)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (on cuda: no dict/tf baselines)")
    p.add_argument("--dict-max", type=int, default=1 << 22, help="skip the dict baseline above this many keys")
    p.add_argument("--memory-probe", type=int, default=None, help=argparse.SUPPRESS)  # internal: see memory()
    args = p.parse_args()
    device = torch.device(args.device)
    if args.memory_probe is not None:
        print(json.dumps(memory_probe(args.memory_probe, args.dim, args.batch, device)))
        return
    sizes = args.sizes or ([1 << 18] if args.quick else [1 << 20, 1 << 22])
    batch = args.batch or (1 << 14 if args.quick else 1 << 16)
    repeat = args.repeat or (3 if args.quick else 9)
    threads = args.threads or (thread_settings() if device.type == "cpu" else [torch.get_num_threads()])
    rows = []
    for t in threads:
        with using_threads(t):
            for n in sizes:
                rows += measure(n, args.dim, batch, repeat, clock_for(args.clock, t, device), args.dict_max, device)
                print(f"done: {t} thread(s), {n} keys", file=sys.stderr, flush=True)
    mem = [memory(n, args.dim, batch, device) for n in sizes]
    print(f"{device}, batch {batch}, dim {args.dim}, float32 values, int64 keys: keys/s, median of {repeat} "
          f"({args.clock} clock at 1 thread); baselines as in the module docstring")
    columns = ["threads", "keys", "op", "dynemb", "torch path", "dense", "dict", "tf", "vs dense", "vs dict", "vs tf",
               "numba gain"]
    print_table(report_rows(rows), columns)
    print()
    print_table([memory_row(m) for m in mem], list(memory_row(mem[0])))
    targets = check_targets(rows, mem, 1 << 20, device) if 1 << 20 in sizes and 1 in threads else []
    print()
    if targets:
        print_table(targets, ["target", "measured", "met"])
    else:
        print("targets are checked at 1 thread and 2^20 keys (include 1048576 in --sizes; not in --quick)")
    if args.json:
        write_json(args.json, {"benchmark": "table_ops", "machine": machine_info(), "device": str(device),
                               "batch": batch, "dim": args.dim, "repeat": repeat, "clock": args.clock,
                               "results": rows, "memory": mem, "targets": targets})


def clock_for(name: str, threads: int, device: torch.device) -> Callable[[], float]:
    """The timer: CPU time is per process, so with more threads (or a GPU) only wall time reads as elapsed."""
    if device.type == "cuda":
        return lambda: (torch.cuda.synchronize(device), time.perf_counter())[1]
    return CLOCKS[name if threads == 1 else "wall"]


def memory_row(m: dict) -> dict:
    return {"keys": f"{m['keys'] / 2**20:g}M", "raw B/key": f"{m['raw_bytes'] / m['keys']:.0f}",
            "B/key": f"{m['nbytes'] / m['keys']:.0f}", "nbytes/raw": f"{m['nbytes_vs_raw']:.2f}",
            "resident/raw": f"{m['resident_vs_raw']:.2f}", "index load": f"{m['index_load']:.2f}"}


if __name__ == "__main__":
    main()
