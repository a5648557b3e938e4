"""Micro-benchmark of the row stores: one batched ``get`` of 65,536 keys of dim 64, in keys/s.

Baseline: what a user would write without dynemb, a redis-py pipeline of ``MGET`` over ``"table:key"`` string keys
in chunks, rows joined into one tensor. Runs are interleaved and the median of the repeats is reported.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python tests/serving/bench_stores.py [--keys 65536 --dim 64 --repeats 9]``
(not collected by pytest; it starts its own redis-server like the test fixture).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from redis_process import RedisServer  # noqa: E402

from dynemb.serving.stores import make_store  # noqa: E402


def plain_mget(client, names: list, dim: int, chunk: int = 4096) -> torch.Tensor:
    """The baseline: pipelined MGET of binary rows, missing rows left as zeros."""
    pipe = client.pipeline(transaction=False)
    for start in range(0, len(names), chunk):
        pipe.mget(names[start : start + chunk])
    blobs = [blob if blob is not None else bytes(4 * dim) for reply in pipe.execute() for blob in reply]
    return torch.from_numpy(np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(-1, dim).copy())


def keys_per_second(fn, n: int) -> float:
    start = time.perf_counter()
    fn()
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=65_536)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    keys = torch.randint(-(2**63), 2**63 - 1, (args.keys,), generator=gen)
    values = torch.randn(args.keys, args.dim, generator=gen)
    probe = keys[torch.randperm(args.keys, generator=gen)]
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(tmp)
        server.start()
        try:
            stores = {
                "memory": make_store({"type": "memory"}),
                "redis": make_store({"type": "redis", "address": server.address}),
                "rocksdb": make_store({"type": "rocksdb", "path": f"{tmp}/rocksdb"}),
                "lmdb": make_store({"type": "lmdb", "path": f"{tmp}/lmdb"}),
            }
            for store in stores.values():
                store.create_table("emb", dim=args.dim)
                store.put("emb", keys, values)
            client = server.client()
            names = [f"emb:{k}" for k in keys.tolist()]
            client.mset(dict(zip(names, (row.tobytes() for row in values.numpy()))))
            probe_names = [f"emb:{k}" for k in probe.tolist()]
            runs = {name: [] for name in [*stores, "plain redis-py MGET"]}
            for _ in range(args.repeats):
                for name, store in stores.items():
                    runs[name].append(keys_per_second(lambda s=store: s.get("emb", probe), args.keys))
                runs["plain redis-py MGET"].append(
                    keys_per_second(lambda: plain_mget(client, probe_names, args.dim), args.keys)
                )
            for store in stores.values():
                store.close()
        finally:
            server.kill()
    baseline = statistics.median(runs["plain redis-py MGET"])
    print(f"get of {args.keys} keys, dim {args.dim}, median of {args.repeats} (keys/s, ratio to plain MGET)")
    for name, samples in runs.items():
        median = statistics.median(samples)
        print(f"  {name:22s} {median:14,.0f}  {median / baseline:6.2f}x")


if __name__ == "__main__":
    main()
