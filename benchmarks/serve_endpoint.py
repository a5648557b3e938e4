"""The ``dynemb serve`` endpoint under closed-loop load: p50/p99 latency and requests/s for 1, 4 and 16 clients.

Model: a DLRM trained by ``dynemb train`` on synthetic click logs (26 categorical columns, 13 dense, dim 16), or
the run given with ``--model``. Its tables are served by the parameter server (in-process memory store, 20% of
each table's rows cached), on a background uvicorn thread on a free loopback port, in this process. Each client is
a thread with its own keep-alive ``httpx.Client`` sending JSON infer requests of ``--rows`` rows (INT64 ids drawn
from the ids training saw, with a few unseen ones; FP32 dense values), one after another. Requests are
prebuilt, so the clients only send and parse. Latency is per request, from send to parsed reply; req/s is requests
over the wall time of the timed phase, after 20 warm-up requests per client. Concurrent requests are
batched into one forward pass by the server (``requests_per_forward``: requests answered per forward pass). Client and server share the
machine's cores, so the numbers are the whole loop on one box, not the server alone.

Run: ``python benchmarks/serve_endpoint.py [--quick] [--json PATH] [--model RUN_DIR] [--rows N] [--requests N]``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import machine_info, parser, print_table, write_json  # noqa: E402

import httpx  # noqa: E402

from dynemb.checkpoint.export_format import read_export  # noqa: E402
from dynemb.cli import main as dynemb_main  # noqa: E402
from dynemb.serving.endpoint import ServedModel, build_app, running  # noqa: E402

CLIENTS = (1, 4, 16)


def train_run(out: Path, steps: int) -> Path:
    code = dynemb_main(["train", "--out", str(out), "--steps", str(steps), "--no-progress", "--dim", "16"])
    if code != 0:
        raise SystemExit(f"dynemb train failed with status {code}")
    return out


def requests(model: ServedModel, rows: int, count: int, seed: int = 0) -> list[dict]:
    """``count`` infer bodies of ``rows`` rows: ids the tables hold (and 5% unseen), log-normal dense values."""
    g = np.random.default_rng(seed)
    prep = model.preprocessing
    _, payload = read_export(model.export)
    known = {f: payload[f]["keys"].numpy() for f in prep.categorical}  # DLRM runs: one table per column, same name
    bodies = []
    for _ in range(count):
        inputs = []
        for f in prep.categorical:
            ids = g.choice(known[f], rows)
            ids[g.random(rows) < 0.05] = g.integers(2**40, 2**41, 1)
            inputs.append({"name": f, "datatype": "INT64", "shape": [rows], "data": ids.tolist()})
        for f in prep.dense:
            inputs.append({"name": f, "datatype": "FP32", "shape": [rows],
                           "data": np.round(g.lognormal(1.0, 1.5, rows), 3).tolist()})
        bodies.append({"inputs": inputs})
    return bodies


def load(url: str, name: str, bodies: list[dict], clients: int, per_client: int, warmup: int) -> dict:
    latencies: list[list[float]] = [[] for _ in range(clients)]
    barrier = threading.Barrier(clients + 1)
    errors = []

    def client(i: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            for k in range(warmup):
                c.post(f"/v2/models/{name}/infer", json=bodies[(i * 7919 + k) % len(bodies)])
            barrier.wait()
            for k in range(per_client):
                t0 = time.perf_counter()
                r = c.post(f"/v2/models/{name}/infer", json=bodies[(i * 104729 + k) % len(bodies)])
                r.json()
                latencies[i].append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors.append(r.text)
            barrier.wait()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    barrier.wait()
    wall = time.perf_counter() - t0
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, the first: {errors[0]}")
    flat = sorted(x for lat in latencies for x in lat)
    return {"clients": clients, "requests": len(flat), "p50_ms": round(1e3 * statistics.median(flat), 2),
            "p99_ms": round(1e3 * flat[min(len(flat) - 1, int(0.99 * len(flat)))], 2),
            "req_per_s": round(len(flat) / wall, 1)}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model", metavar="RUN_DIR", help="a `dynemb train` run (default: train one on synthetic data)")
    p.add_argument("--rows", type=int, default=16, help="rows per request")
    p.add_argument("--requests", type=int, default=None, help="timed requests per client count (default 2000; "
                   "--quick: 300)")
    args = p.parse_args()
    torch.set_num_threads(1)
    total = args.requests or (300 if args.quick else 2000)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.model) if args.model else train_run(Path(tmp) / "run", 50 if args.quick else 300)
        model = ServedModel(run, name="ctr")
        bodies = requests(model, args.rows, 256)
        app = build_app(model)
        results = []
        try:
            with running(app) as url:
                for clients in CLIENTS:
                    before = app.state.batcher.forward_passes
                    r = load(url, "ctr", bodies, clients, max(1, total // clients), warmup=20)
                    # warm-up requests included: requests answered per forward pass of the model
                    passes = app.state.batcher.forward_passes - before
                    r["requests_per_forward"] = round((r["requests"] + 20 * clients) / passes, 2)
                    results.append(r)
        finally:
            model.close()
    print(f"dynemb serve, {args.rows} rows per JSON request, loopback, in-process uvicorn")
    print_table(results, ["clients", "requests", "p50_ms", "p99_ms", "req_per_s", "requests_per_forward"])
    if args.json:
        write_json(args.json, {"benchmark": "serve_endpoint", "machine": machine_info(), "rows_per_request": args.rows,
                               "results": results})


if __name__ == "__main__":
    main()
