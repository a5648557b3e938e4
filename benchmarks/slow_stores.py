"""Which on-disk store to use for a tiered table's slow tier: memory-mapped row files with their own index (the
``SlowStore`` a ``TieredTable`` uses) against RocksDB (``rocksdict``) and LMDB, for row-sized values.

One round moves a batch of rows the way a tiered table does: it reads (and removes) ``B`` rows that come back to
the fast tier and writes ``B`` rows that leave it. Rows are ``dim`` float32 values, an Adagrad slot of ``dim``
float32, a score and a version stamp (``8 * dim + 16`` bytes; 528 for ``dim=64``). The embedded stores get each
row as one value under an 8-byte key, in one write batch / transaction and one multi-get per round. Timings are
medians of interleaved rounds.

    python benchmarks/slow_stores.py --quick --json /tmp/slow_stores.json
"""

from __future__ import annotations

import os
import sys
import tempfile

import lmdb
import numpy as np
import rocksdict
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine_info, median_times, parser, print_table, write_json  # noqa: E402

from dynemb.table import KeyValueTable, Rows  # noqa: E402
from dynemb.table.slow import SlowStore  # noqa: E402


def _row_bytes(dim: int) -> int:
    return 8 * dim + 16


class RowFiles:
    """The tiered table's slow store on disk: mapped column files, index in RAM."""

    def __init__(self, path: str, dim: int) -> None:
        table = KeyValueTable(dim)
        table.add_slot("sum", dim)
        self.store = SlowStore(table, path)

    def put(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        dim = (rows.shape[1] - 4) // 2  # float32 columns: value, slot, then score and version as 2 x 2 floats
        packed = rows.view(torch.float32)
        meta = packed[:, 2 * dim :].contiguous().view(torch.int64)
        self.store.put(Rows(keys, packed[:, :dim], meta[:, 0], {"sum": packed[:, dim : 2 * dim]}), meta[:, 1])

    def take(self, keys: torch.Tensor) -> torch.Tensor:
        rows, versions = self.store.take(keys)
        return torch.cat([rows.values, rows.slots["sum"], torch.stack([rows.scores, versions], 1).view(torch.float32)],
                         1)


def _key_bytes(keys: torch.Tensor) -> list[bytes]:
    raw = keys.numpy().astype(">i8").tobytes()
    return [raw[i : i + 8] for i in range(0, len(raw), 8)]


def _row_list(rows: torch.Tensor) -> list[bytes]:
    raw = rows.numpy().tobytes()
    width = rows.shape[1] * 4
    return [raw[i : i + width] for i in range(0, len(raw), width)]


def _rows_from(values: list[bytes], width: int) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(b"".join(values), dtype=np.float32).reshape(-1, width).copy())


class Rocks:
    def __init__(self, path: str, dim: int) -> None:
        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(True)
        self.db = rocksdict.Rdict(os.path.join(path, "rocks"), options)
        self.width = 2 * dim + 4

    def put(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        batch = rocksdict.WriteBatch(raw_mode=True)
        for k, v in zip(_key_bytes(keys), _row_list(rows)):
            batch.put(k, v)
        self.db.write(batch)

    def take(self, keys: torch.Tensor) -> torch.Tensor:
        names = _key_bytes(keys)
        values = self.db.get(names)
        batch = rocksdict.WriteBatch(raw_mode=True)
        for k in names:
            batch.delete(k)
        self.db.write(batch)
        return _rows_from(values, self.width)


class Lmdb:
    def __init__(self, path: str, dim: int) -> None:
        self.env = lmdb.open(os.path.join(path, "lmdb"), map_size=8 << 30, sync=False, metasync=False,
                             writemap=True)
        self.width = 2 * dim + 4

    def put(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti(list(zip(_key_bytes(keys), _row_list(rows))))

    def take(self, keys: torch.Tensor) -> torch.Tensor:
        names = _key_bytes(keys)
        with self.env.begin(write=True) as txn:
            values = [txn.pop(k) for k in names]
        return _rows_from(values, self.width)


STORES = {"row files (mmap)": RowFiles, "rocksdb": Rocks, "lmdb": Lmdb}


def main(argv=None) -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=None, help="rows held by each store")
    p.add_argument("--batch", type=int, default=4096, help="rows moved each way per round")
    p.add_argument("--dim", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    n = args.rows or (50_000 if args.quick else 400_000)
    repeat = args.repeat or (5 if args.quick else 15)
    dim, batch = args.dim, args.batch
    g = torch.Generator().manual_seed(0)
    keys = torch.randperm(4 * n, generator=g)[:n]
    rows = torch.randn(n, 2 * dim + 4, generator=g)
    with tempfile.TemporaryDirectory() as tmp:
        stores = {}
        for name, cls in STORES.items():
            os.makedirs(os.path.join(tmp, name), exist_ok=True)
            store = stores[name] = cls(os.path.join(tmp, name), dim)
            for start in range(0, n, 50_000):
                store.put(keys[start : start + 50_000], rows[start : start + 50_000])
        # Every store holds the same rows; each round takes B random held rows and puts them back (their slots
        # freed in the fast tier would be someone else's, but the bytes moved are the same).
        state = {"held": keys.clone()}

        def round_of(store):
            def run():
                pick = torch.randint(0, n, (batch,), generator=g)
                pick = torch.unique(pick)
                chosen = state["held"][pick]
                got = store.take(chosen)
                store.put(chosen, got)
            return run

        times = median_times({name: round_of(s) for name, s in stores.items()}, repeat=repeat, warmup=1)
        check = keys[:64]
        results = {name: s.take(check) for name, s in stores.items()}
        same = all(torch.equal(r, results["row files (mmap)"]) for r in results.values())
    base = times["row files (mmap)"]
    table = [{"store": name, "rows/s (each way)": f"{batch / t:,.0f}", "ms/round": f"{t * 1e3:.2f}",
              "x vs row files": f"{t / base:.1f}"} for name, t in times.items()]
    print(f"{n:,} rows of {_row_bytes(dim)} bytes held; {batch} rows read+removed and written per round")
    print_table(table, ["store", "rows/s (each way)", "ms/round", "x vs row files"])
    print(f"all stores return the same rows: {same}")
    if args.json:
        write_json(args.json, {"machine": machine_info(), "rows": n, "batch": batch, "row_bytes": _row_bytes(dim),
                               "seconds_per_round": times, "same_rows": same,
                               "slowdown_vs_row_files": {k: t / base for k, t in times.items()}})


if __name__ == "__main__":
    main()
