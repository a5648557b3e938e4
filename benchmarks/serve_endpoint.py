"""The ``dynemb serve`` endpoint: latency under closed-loop load, freshness of published versions, updates under load.

Model: a DLRM trained by ``dynemb train`` on synthetic click logs (26 categorical columns, 13 dense, dim 16), or the run
given with ``--model``. Its tables are served by the parameter server (20% of each table's rows cached) with the
in-process memory store or a real ``redis-server`` on a free loopback port, by a ``dynemb serve`` process on 127.0.0.1
(as deployed: its own process and GIL). Clients are threads, each with its own keep-alive ``geventhttpclient``
connection (the HTTP client under ``tritonclient.http``), sending infer requests of ``--rows`` rows (default 256: INT64
ids drawn from the ids training saw, 5% unseen; FP32 dense values) one after another: JSON bodies, and (``binary``) the
KServe binary tensor extension tritonclient uses; ``grpc``: a ``ModelInferRequest`` with ``raw_input_contents`` (what
``tritonclient.grpc`` sends) on the server's ``--grpc-port``, over a grpcio channel. Bodies are encoded beforehand; a
client sends one and parses the reply (JSON; gRPC: the response message and its raw output tensor). Latency is per
request, send to parsed reply; req/s is requests over the wall time of the timed phase, after warm-up requests.
``inproc_p50_ms`` is ``ServedModel.predict`` on the same (already decoded) batches in this thread;
``added_p50_ms`` (1 client) the median of (request latency - in-process call) over pairs timed back to back, one pair
per body, so that a busy machine slows both alike; ``added_cpu_ms`` the same in CPU time (the client's CPU per request
plus the server process's, against the in-process call's: what the endpoint costs, unaffected by time spent
descheduled; ``client_cpu_ms`` and ``server_cpu_ms`` its two parts). ``--interleave`` times the paired rows of all
encodings in one loop, their order rotating (one after the other, the first encoding timed ran slower on a busy
machine), and for each encoding the in-process call first in half of its pairs.
``requests_per_forward`` comes from the server's statistics route (``execution_count``). The freshness run
below serves from a uvicorn thread of this process, to compare each reply with the training model's own predictions.

Freshness and updates under load: a second run trains while it publishes (``--publish-every 2``: a full export,
then 20 deltas) into the export a server follows with ``--watch`` at its default interval, while 4 clients send
requests without pause. Freshness is the time from a version's publish (its ``latest`` pointer in place) to the
first response that carries it or a later version. Each response is checked against what the training model of
the version it names predicts on its rows (atol 1e-5): a response of mixed versions would match none.

Run: ``python benchmarks/serve_endpoint.py [--quick] [--json PATH] [--model RUN_DIR] [--rows N] [--requests N]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import grpc
import orjson
import torch
from geventhttpclient import HTTPClient
from tritonclient.grpc import service_pb2 as pb

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "serving"))
from _common import machine_info, parser, print_table, write_json  # noqa: E402
from redis_process import RedisServer  # noqa: E402

from dynemb.checkpoint.export_format import read_export  # noqa: E402
from dynemb.distributed.launch import free_port  # noqa: E402
from dynemb.job import RunSpec, read_card, train_run  # noqa: E402
from dynemb.endpoint import ServedModel, build_app, running  # noqa: E402
from dynemb.endpoint.command import WATCH_INTERVAL_S  # noqa: E402
from dynemb.endpoint.inference_protocol import decode_request  # noqa: E402
from dynemb.endpoint.wire import parse_body  # noqa: E402
from dynemb.endpoint.watch import ExportWatcher  # noqa: E402
from dynemb.train import TrainConfig  # noqa: E402

CLIENTS, UPDATES, UPDATE_CLIENTS = (1, 4, 16), 20, 4
# The paired latency rows run the server and this process on one CPU (--no-pin: the scheduler decides). On this
# VM one CPU is at times ~1.5x slower than the other (the same forward pass: 9 vs 14 ms), so a request served on
# one CPU and its in-process reference run on the other differed by +-2 ms from that alone.
PIN = hasattr(os, "sched_setaffinity")


@contextlib.contextmanager
def one_cpu(pid: int) -> Iterator[None]:
    """Every thread of process ``pid`` and of this process on this process's current CPU, then as before."""
    if not PIN:
        yield
        return
    cpu = {min(os.sched_getaffinity(0))}
    before = {}
    for t in (int(t) for p in (pid, os.getpid()) for t in os.listdir(f"/proc/{p}/task")):
        try:  # grpcio starts and ends threads of its own: one listed may be gone already
            before[t] = os.sched_getaffinity(t)
            os.sched_setaffinity(t, cpu)
        except ProcessLookupError:
            before.pop(t, None)
    try:
        yield
    finally:
        for t, mask in before.items():
            try:
                os.sched_setaffinity(t, mask)
            except OSError:  # the thread has ended
                pass
NAME, INFER = "ctr", "/v2/models/ctr/infer"
ENCODINGS = ("json", "binary", "grpc")


@dataclasses.dataclass
class Body:
    """One request, encoded each way, and its decoded batch (for the in-process reference)."""
    json: bytes
    binary: bytes
    header_length: int
    grpc: bytes  # a serialized ModelInferRequest
    batch: object


def synthetic_run(out: Path, steps: int, publish_every: int = 0, on_publish=None) -> dict:
    spec = RunSpec(out=str(out), batch_size=512, publish_every=publish_every)
    return train_run(spec, TrainConfig(steps=steps, dim=16, eval_every=10**6), progress=False,
                     on_publish=on_publish, echo=lambda *a, **k: None)


def make_bodies(model: ServedModel, rows: int, count: int, seed: int = 0) -> list[Body]:
    """``count`` requests of ``rows`` rows: ids the tables hold (and 5% unseen), log-normal dense values."""
    g = np.random.default_rng(seed)
    prep = model.preprocessing
    _, payload = read_export(model.export)
    known = {f: payload[f]["keys"].numpy() for f in prep.categorical}  # DLRM runs: one table per column, same name
    out = []
    for _ in range(count):
        arrays = {}
        for f in prep.categorical:
            ids = g.choice(known[f], rows)
            ids[g.random(rows) < 0.05] = g.integers(2**40, 2**41, 1)
            arrays[f] = ("INT64", ids.astype("<i8"))
        for f in prep.dense:
            arrays[f] = ("FP32", np.round(g.lognormal(1.0, 1.5, rows), 3).astype("<f4"))
        text = json.dumps({"inputs": [{"name": f, "datatype": d, "shape": [rows], "data": a.tolist()}
                                      for f, (d, a) in arrays.items()]}).encode()
        head = json.dumps({"inputs": [{"name": f, "datatype": d, "shape": [rows],
                                       "parameters": {"binary_data_size": a.nbytes}}
                                      for f, (d, a) in arrays.items()]}).encode()
        binary = head + b"".join(a.tobytes() for _, a in arrays.values())
        request = pb.ModelInferRequest(model_name=NAME)
        for f, (d, a) in arrays.items():
            request.inputs.add(name=f, datatype=d, shape=[rows])
            request.raw_input_contents.append(a.tobytes())
        out.append(Body(text, binary, len(head), request.SerializeToString(),
                        decode_request(parse_body(text), prep, 1 << 20)))
    return out


class Client:
    """A keep-alive HTTP/1.1 connection: geventhttpclient's (what ``tritonclient.http`` sends with; C parser)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = HTTPClient(host, int(port), connection_timeout=60, network_timeout=60, concurrency=1)

    def infer(self, body: Body, binary: bool) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        if binary:
            headers = {"Content-Type": "application/octet-stream",
                       "Inference-Header-Content-Length": str(body.header_length)}
        response = self.conn.post(INFER, body.binary if binary else body.json, headers)
        return response.status_code, orjson.loads(response.read())

    def close(self) -> None:
        self.conn.close()


class GrpcClient:
    """A gRPC channel to the server's ``--grpc-port`` sending serialized ``ModelInferRequest`` s (grpcio, the
    transport under ``tritonclient.grpc``); the reply as the JSON one reads: ``(200, {"model_version", "outputs"})``,
    or ``(status code name, {"error": ...})``."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 1 << 30),
                                                               ("grpc.max_send_message_length", 1 << 30)])
        self.call = self.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                             response_deserializer=pb.ModelInferResponse.FromString)

    def infer(self, body: Body, binary: bool) -> tuple[int, dict]:
        try:
            reply = self.call(body.grpc, timeout=60)
        except grpc.RpcError as exc:
            return exc.code().name, {"error": exc.details()}
        data = np.frombuffer(reply.raw_output_contents[0], "<f8")
        return 200, {"model_version": reply.model_version, "outputs": [{"data": data}]}

    def close(self) -> None:
        self.channel.close()


def connect(server, encoding: str):
    """A client of ``server`` (``(http url, grpc address)``) for ``encoding``."""
    return GrpcClient(server[1]) if encoding == "grpc" else Client(server[0])


def load(server, bodies: list[Body], clients: int, per_client: int, warmup: int, encoding: str) -> dict:
    latencies: list[list[float]] = [[] for _ in range(clients)]
    barrier = threading.Barrier(clients + 1)
    errors = []

    binary = encoding == "binary"

    def client(i: int) -> None:
        c = connect(server, encoding)
        try:
            for k in range(warmup):
                c.infer(bodies[(i * 7919 + k) % len(bodies)], binary)
            barrier.wait()
            for k in range(per_client):
                t0 = time.perf_counter()
                status, reply = c.infer(bodies[(i * 104729 + k) % len(bodies)], binary)
                latencies[i].append(time.perf_counter() - t0)
                if status != 200:
                    errors.append(reply)
            barrier.wait()
        finally:
            c.close()

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


def inprocess_p50(model: ServedModel, bodies: list[Body], count: int) -> float:
    times = []
    for k in range(count):
        t0 = time.perf_counter()
        model.predict(bodies[k % len(bodies)].batch)
        times.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(times), 2)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def paired(server, server_pid: int, model: ServedModel, bodies: list[Body], count: int, encoding: str) -> dict:
    """One client, each request next to an in-process call on the same batch (interleaved: a busy machine slows
    both alike): the medians of both and of their differences, and the same in CPU time (this process's for the
    in-process call; this process's plus the server's per request for the request)."""
    c, binary = connect(server, encoding), encoding == "binary"
    wall = {True: [], False: []}  # in-process?: ms per call
    cpu = {True: [], False: []}  # CPU ms of this process per call
    try:
        for k in range(count + 10):
            if k == 10:
                server_cpu = cpu_seconds(server_pid)
            body = bodies[k % len(bodies)]
            # Which goes first alternates: the first call of a pair warms the cache rows the second one reads.
            for inproc in ((False, True) if k % 2 else (True, False)):
                t0, c0 = time.perf_counter(), time.process_time()
                if inproc:
                    model.predict(body.batch)
                else:
                    status, reply = c.infer(body, binary)
                    if status != 200:
                        raise RuntimeError(f"a request failed: {reply}")
                if k >= 10:  # warm-up
                    wall[inproc].append(1e3 * (time.perf_counter() - t0))
                    cpu[inproc].append(1e3 * (time.process_time() - c0))
        server_cpu_ms = 1e3 * (cpu_seconds(server_pid) - server_cpu) / count
    finally:
        c.close()
    return {"inproc_p50_ms": round(statistics.median(wall[True]), 2),
            "added_p50_ms": round(statistics.median(np.subtract(wall[False], wall[True])), 2),
            "inproc_cpu_ms": round(statistics.median(cpu[True]), 2),
            "added_cpu_ms": round(statistics.median(cpu[False]) + server_cpu_ms - statistics.median(cpu[True]), 2),
            # where the added CPU goes: this process's per request (the client), the server process's per request
            "client_cpu_ms": round(statistics.median(cpu[False]), 2), "server_cpu_ms": round(server_cpu_ms, 2)}


def paired_interleaved(server, server_pid: int, model: ServedModel, bodies: list[Body], count: int,
                       encodings) -> dict:
    """:func:`paired` for several encodings at once: per body, one pair of each encoding, the encodings' order
    rotating, so that they see the same machine (run one after the other, the first ran ~0.5-2 ms slower on a
    busy machine, whichever it was). The server's CPU is read around each request. ``{encoding: row}``."""
    conns = {e: connect(server, e) for e in encodings}
    wall = {e: {True: [], False: []} for e in encodings}
    cpu = {e: {True: [], False: []} for e in encodings}
    server_cpu = dict.fromkeys(encodings, 0.0)
    try:
        for k in range(count + 10):
            body = bodies[k % len(bodies)]
            for j in range(len(encodings)):
                e = encodings[(k + j) % len(encodings)]
                # the pair's order alternates per encoding (k // len: with two encodings, (k + j) % 2 gave each
                # encoding always the same order, and the call after a request runs beside the server's
                # post-reply work)
                for inproc in ((False, True) if (k // len(encodings) + j) % 2 else (True, False)):
                    s0, t0, c0 = cpu_seconds(server_pid), time.perf_counter(), time.process_time()
                    if inproc:
                        model.predict(body.batch)
                    else:
                        status, reply = conns[e].infer(body, e == "binary")
                        if status != 200:
                            raise RuntimeError(f"a request failed: {reply}")
                    if k >= 10:  # warm-up
                        wall[e][inproc].append(1e3 * (time.perf_counter() - t0))
                        cpu[e][inproc].append(1e3 * (time.process_time() - c0))
                        if not inproc:
                            server_cpu[e] += cpu_seconds(server_pid) - s0
    finally:
        for c in conns.values():
            c.close()
    out = {}
    for e in encodings:
        w, c, server_ms = wall[e], cpu[e], 1e3 * server_cpu[e] / count
        out[e] = {"inproc_p50_ms": round(statistics.median(w[True]), 2),
                  "added_p50_ms": round(statistics.median(np.subtract(w[False], w[True])), 2),
                  "inproc_cpu_ms": round(statistics.median(c[True]), 2),
                  "added_cpu_ms": round(statistics.median(c[False]) + server_ms - statistics.median(c[True]), 2),
                  "client_cpu_ms": round(statistics.median(c[False]), 2), "server_cpu_ms": round(server_ms, 2),
                  "interleaved": True}
    return out


def forward_passes(url: str) -> int:
    """The server's forward passes so far (the statistics route's ``execution_count``)."""
    host, port = url.removeprefix("http://").split(":")
    conn = HTTPClient(host, int(port), connection_timeout=60, network_timeout=60)
    try:
        return orjson.loads(conn.get(f"/v2/models/{NAME}/stats").read())["model_stats"][0]["execution_count"]
    finally:
        conn.close()


@contextlib.contextmanager
def serve_process(run: Path, tier_args: list) -> Iterator[tuple[tuple[str, str], int]]:
    """``dynemb serve`` on free loopback ports, in its own process as deployed; yields
    ``((http url, grpc address), pid)``."""
    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dynemb", "serve", "--model", str(run), "--port", str(port),
                             "--grpc-port", str(grpc_port), "--name", NAME, "--threads", "1", *tier_args], env=env,
                            stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dynemb serve exited with {proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("dynemb serve did not start within 300 s") from None
                time.sleep(0.2)
        yield (url, f"127.0.0.1:{grpc_port}"), proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def latency_rows(run: Path, tier: str, volatile: dict, rows: int, total: int, encodings=ENCODINGS,
                 clients_list=CLIENTS, interleave: bool = False) -> list[dict]:
    tier_args = [] if tier == "memory" else ["--volatile", "redis", "--redis-address", volatile["address"]]
    results = []
    with serve_process(run, tier_args) as (server, pid):
        url = server[0]
        model = ServedModel(run, name=NAME, volatile_db=volatile)  # the in-process reference
        try:
            bodies = make_bodies(model, rows, 64)
            gc.collect()
            gc.freeze()  # as `dynemb serve` does after loading
            for encoding in encodings:
                for clients in clients_list:
                    before = forward_passes(url)
                    r = load(server, bodies, clients, max(1, total // clients), 10, encoding)
                    passes = forward_passes(url) - before
                    r["requests_per_forward"] = round((r["requests"] + 10 * clients) / passes, 2)
                    if clients == 1 and interleave:
                        pass  # below, all encodings together
                    elif clients == 1:
                        with one_cpu(pid):
                            r.update(paired(server, pid, model, bodies, total, encoding))
                    else:
                        r["inproc_p50_ms"] = inprocess_p50(model, bodies, min(total, 200))
                    results.append({"tier": tier, "encoding": encoding, **r})
            if interleave and 1 in clients_list:
                with one_cpu(pid):
                    both = paired_interleaved(server, pid, model, bodies, total, encodings)
                for r in results:
                    if r["tier"] == tier and r["clients"] == 1:
                        r.update(both[r["encoding"]])
        finally:
            gc.unfreeze()
            model.close()
    return results


def updates_under_load(tmp: Path, rows: int) -> dict:
    """A run publishing a full export then ``UPDATES`` deltas while ``UPDATE_CLIENTS`` clients query a server
    following it with the default watch interval (see the module docstring)."""
    out = tmp / "live"
    published, expected, state = {}, {}, {}
    first, go = threading.Event(), threading.Event()

    def on_publish(step, directory, model):
        version = int(directory.name.rsplit("-", 1)[1])
        published[version] = time.perf_counter()
        if version == 1:
            first.set()
            go.wait(300)
        model.eval()
        with torch.no_grad():
            expected[version] = [torch.sigmoid(model(state["prep"].normalize(b.batch))).float().numpy()
                                 for b in state["bodies"]]
        model.train()

    result = {}
    trainer = threading.Thread(target=lambda: result.update(synthetic_run(out, 2 * (UPDATES + 1), 2, on_publish)))
    trainer.start()
    first.wait(600)
    state["prep"] = read_card(out).preprocessing
    model = ServedModel(out, name=NAME)
    watcher = ExportWatcher(model, WATCH_INTERVAL_S).start()
    state["bodies"] = bodies = make_bodies(model, rows, 8, seed=1)
    replies: list[list] = [[] for _ in range(UPDATE_CLIENTS)]
    failed, stop = [0], threading.Event()

    def client(i: int) -> None:
        c = Client(url)
        try:
            k = 0
            while not stop.is_set():
                status, reply = c.infer(bodies[k % len(bodies)], False)
                if status != 200:
                    failed[0] += 1
                else:
                    replies[i].append((time.perf_counter(), k % len(bodies), int(reply["model_version"]),
                                       np.asarray(reply["outputs"][0]["data"], np.float32)))
                k += 1
        finally:
            c.close()

    try:
        with running(build_app(model)) as url:
            clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(UPDATE_CLIENTS)]
            for t in clients:
                t.start()
            go.set()
            trainer.join()
            last = max(published)
            while model.version < last:
                time.sleep(0.05)
            time.sleep(2 * WATCH_INTERVAL_S)
            stop.set()
            for t in clients:
                t.join()
    finally:
        stop.set()
        watcher.stop()
        model.close()
    flat = sorted(r for rs in replies for r in rs)
    mixed = sum(not np.allclose(p, expected[v][b], atol=1e-5, rtol=0) for _, b, v, p in flat)
    fresh = []
    for version, t_publish in sorted(published.items())[1:]:
        served = next((t for t, _, v, _ in flat if v >= version and t >= t_publish), None)
        fresh.append(None if served is None else served - t_publish)
    seen = [x for x in fresh if x is not None]
    return {"updates": len(published) - 1, "requests": len(flat), "failed": failed[0], "mixed_version": mixed,
            "final_version": max(v for _, _, v, _ in flat), "last_published": max(published),
            "versions_answered": len({v for _, _, v, _ in flat}), "watch_interval_s": WATCH_INTERVAL_S,
            "freshness_p50_s": round(statistics.median(seen), 3), "freshness_max_s": round(max(seen), 3),
            "freshness_missing": len(fresh) - len(seen)}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model", metavar="RUN_DIR", help="a `dynemb train` run (default: train one on synthetic data)")
    p.add_argument("--rows", type=int, default=256, help="rows per request")
    p.add_argument("--requests", type=int, default=None, help="timed requests per row of the table (default 600; "
                   "--quick: 60)")
    p.add_argument("--tiers", default="memory,redis", help="volatile stores to serve from")
    p.add_argument("--no-pin", action="store_true", help="leave the server and the clients to the scheduler")
    p.add_argument("--encodings", default=",".join(ENCODINGS), help="request encodings to time")
    p.add_argument("--clients", default=",".join(map(str, CLIENTS)), help="closed-loop client counts")
    p.add_argument("--no-updates", action="store_true", help="skip the freshness / updates-under-load run")
    p.add_argument("--interleave", action="store_true", help="time the 1-client paired rows of all encodings in "
                   "one loop, their order rotating (a fair comparison of encodings on a busy machine)")
    args = p.parse_args()
    global PIN
    PIN = PIN and not args.no_pin
    torch.set_num_threads(1)
    total = args.requests or (60 if args.quick else 600)
    encodings = tuple(args.encodings.split(","))
    clients = tuple(int(c) for c in args.clients.split(","))
    if not set(encodings) <= set(ENCODINGS):
        p.error(f"--encodings must be among {ENCODINGS}, got {args.encodings!r}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.model) if args.model else Path(tmp) / "run"
        if not args.model:
            synthetic_run(run, 30 if args.quick else 300)
        for tier in args.tiers.split(","):
            if tier == "memory":
                results += latency_rows(run, tier, {"type": "memory"}, args.rows, total, encodings, clients,
                                        args.interleave)
                continue
            redis = RedisServer(tmp)
            redis.start()
            try:
                results += latency_rows(run, tier, {"type": "redis", "address": redis.address}, args.rows, total,
                                        encodings, clients, args.interleave)
            finally:
                redis.kill()
        updates = None if args.no_updates else updates_under_load(Path(tmp), args.rows)
    print(f"dynemb serve (its own process), {args.rows} rows per request, loopback"
          + ("; added_*: server and client on one CPU" if PIN else ""))
    print_table(results, ["tier", "encoding", "clients", "requests", "p50_ms", "p99_ms", "req_per_s",
                          "inproc_p50_ms", "added_p50_ms", "inproc_cpu_ms", "added_cpu_ms", "client_cpu_ms",
                          "server_cpu_ms", "requests_per_forward"])
    if updates is not None:
        print(f"\nupdates under load ({UPDATE_CLIENTS} clients, a delta every 2 training steps, --watch "
              f"{WATCH_INTERVAL_S} s)")
        print_table([updates], list(updates))
    if args.json:
        write_json(args.json, {"benchmark": "serve_endpoint", "machine": machine_info(), "rows_per_request": args.rows,
                               "pinned": PIN,
                               "results": results, "updates_under_load": updates})


if __name__ == "__main__":
    main()
