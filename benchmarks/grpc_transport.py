"""What the transports cost alone: the demo model's 256-row request (26 INT64 + 13 FP32 inputs) answered by a handler
that only parses it (as ``dynemb serve`` reads it: ``parse_body``, ``InferRequests``; ``request_dict`` for the
other gRPC servers) and returns 256 FP64 values, over HTTP (uvicorn on uvloop, the KServe binary tensor extension,
a geventhttpclient connection: what ``dynemb serve`` and ``tritonclient.http`` use) and over gRPC: ``grpc-loop`` is
what ``dynemb serve`` runs (``dynemb.endpoint.grpc_http2``: HTTP/2 as an asyncio protocol on uvloop, no threads),
``grpclib`` the pure-Python asyncio server over ``h2``, ``grpc-aio`` grpcio's ``grpc.aio`` server on uvloop (what
``dynemb serve`` ran before); a grpcio channel sending the serialized ``ModelInferRequest``, or ``tritonclient.grpc``
building it from numpy arrays as a user does.

The floor under ``benchmarks/serve_endpoint.py``'s "added" figures: each server is its own process and every process
is pinned to one CPU (as the paired rows there); requests to the servers alternate (one of each per round, the order
flipping), so a busy machine slows them alike. Per request: wall p50, the client's CPU (median) and the server
process's CPU (mean, from ``/proc``), and the context switches of both
processes' threads (mean: the thread hand-offs a request costs; on a busy CPU each can wait for a time slice).

Run: ``python benchmarks/grpc_transport.py [--quick] [--json PATH] [--requests N]``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import machine_info, parser, print_table, write_json  # noqa: E402

ROWS, INT_INPUTS, FLOAT_INPUTS = 256, 26, 13
OUT = np.random.default_rng(1).random(ROWS).astype("<f8")
# grpclib (not a dependency: measured when installed) was the other option for gRPC on the event loop
GRPC_KINDS = ("grpc-loop", *(("grpclib",) if importlib.util.find_spec("grpclib") else ()), "grpc-aio")


def arrays() -> list[tuple[str, str, np.ndarray]]:
    g = np.random.default_rng(0)
    return ([(f"C{i}", "INT64", g.integers(0, 1 << 40, ROWS).astype("<i8")) for i in range(INT_INPUTS)]
            + [(f"I{i}", "FP32", g.random(ROWS).astype("<f4")) for i in range(FLOAT_INPUTS)])


def serve_http(port: int) -> None:
    import uvicorn
    from dynemb.endpoint.wire import parse_body

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        length = dict(scope["headers"]).get(b"inference-header-content-length")
        parse_body(body, int(length))
        head = b'{"outputs":[{"name":"p","datatype":"FP64","shape":[256],"parameters":{"binary_data_size":2048}}]}'
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/octet-stream"),
                                (b"inference-header-content-length", str(len(head)).encode())]})
        await send({"type": "http.response.body", "body": head + OUT.tobytes()})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="on",
                server_header=False, date_header=False)


def serve_grpc(kind: str, port: int) -> None:
    import grpc
    import uvloop
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc
    from dynemb.endpoint.grpc_server import request_dict

    def reply(request):
        request_dict(request)
        out = pb.ModelInferResponse(model_name="ctr", model_version="1", id=request.id)
        out.outputs.add(name="p", datatype="FP64", shape=[ROWS])
        out.raw_output_contents.append(OUT.tobytes())
        return out

    class Aio(pb_grpc.GRPCInferenceServiceServicer):
        async def ModelInfer(self, request, context):
            return reply(request)

    if kind == "grpc-loop":  # what dynemb serve runs: HTTP/2 on the event loop (dynemb.endpoint.grpc_http2)
        from dynemb.endpoint.grpc_http2 import Http2GrpcServer
        from dynemb.endpoint.grpc_server import InferRequests

        requests = InferRequests()  # as dynemb serve reads them: a header seen before, without protobuf

        async def infer(message, metadata):
            _, _, request_id, _ = requests.parse(message)
            out = pb.ModelInferResponse(model_name="ctr", model_version="1", id=request_id)
            out.outputs.add(name="p", datatype="FP64", shape=[ROWS])
            out.raw_output_contents.append(OUT.tobytes())
            return out.SerializeToString()

        async def loop_main():
            sock = socket.socket()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind(("127.0.0.1", port))
            server = Http2GrpcServer({"/inference.GRPCInferenceService/ModelInfer": infer})
            await server.start(sock)
            await asyncio.Event().wait()

        return uvloop.run(loop_main())
    if kind == "grpclib":  # grpclib's asyncio server over h2, with tritonclient's message classes
        from grpclib.const import Cardinality, Handler
        from grpclib.server import Server

        class Service:
            async def infer(self, stream):
                await stream.send_message(reply(await stream.recv_message()))

            def __mapping__(self):
                return {"/inference.GRPCInferenceService/ModelInfer": Handler(
                    self.infer, Cardinality.UNARY_UNARY, pb.ModelInferRequest, pb.ModelInferResponse)}

        async def grpclib_main():
            server = Server([Service()])
            await server.start("127.0.0.1", port)
            await server.wait_closed()

        return uvloop.run(grpclib_main())

    async def main():
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(Aio(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(main())


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def switches(pid) -> int:
    """Context switches so far of every thread of process ``pid`` (each one a thread woken or preempted)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.endswith("ctxt_switches") or "ctxt_switches:" in line:
                    total += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clients(ports: dict) -> dict:
    """``{row name: (server kind, call)}``: each call sends the request once and reads the FP64 output."""
    import grpc
    import tritonclient.grpc as tgrpc
    from geventhttpclient import HTTPClient
    from tritonclient.grpc import service_pb2 as pb

    data = arrays()
    head = ('{"inputs":[' + ",".join(
        f'{{"name":"{n}","datatype":"{d}","shape":[{ROWS}],"parameters":{{"binary_data_size":{a.nbytes}}}}}'
        for n, d, a in data) + "]}").encode()
    body = head + b"".join(a.tobytes() for _, _, a in data)
    http = HTTPClient("127.0.0.1", ports["http"], connection_timeout=60, network_timeout=60, concurrency=1)
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}

    def http_call():
        response = http.post("/v2/models/ctr/infer", body, headers)
        raw = response.read()
        length = int(response["inference-header-content-length"])
        return np.frombuffer(raw[length:], "<f8")

    request = pb.ModelInferRequest(model_name="ctr")
    for n, d, a in data:
        request.inputs.add(name=n, datatype=d, shape=[ROWS])
        request.raw_input_contents.append(a.tobytes())
    message = request.SerializeToString()
    calls = {"http binary": ("http", http_call)}
    for kind in GRPC_KINDS:
        channel = grpc.insecure_channel(f"127.0.0.1:{ports[kind]}")
        stub = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   response_deserializer=pb.ModelInferResponse.FromString)
        stub(message, wait_for_ready=True, timeout=120)

        def grpc_call(stub=stub):
            return np.frombuffer(stub(message, timeout=60).raw_output_contents[0], "<f8")
        calls[f"{kind} grpcio"] = (kind, grpc_call)
    triton = tgrpc.InferenceServerClient(f"127.0.0.1:{ports['grpc-loop']}")

    def triton_call():
        inputs = []
        for n, d, a in data:
            x = tgrpc.InferInput(n, [ROWS], d)
            x.set_data_from_numpy(a)
            inputs.append(x)
        return triton.infer("ctr", inputs).as_numpy("p")
    calls["grpc-loop tritonclient.grpc"] = ("grpc-loop", triton_call)
    return calls


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        kind, port = sys.argv[2], int(sys.argv[3])
        return serve_http(port) if kind == "http" else serve_grpc(kind, port)
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=None, help="timed requests per row (default 600; --quick: 100)")
    args = p.parse_args()
    count = args.requests or (100 if args.quick else 600)
    if hasattr(os, "sched_setaffinity"):  # this process and the servers (inherited) on one CPU
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ports = {kind: free_port() for kind in ("http", *GRPC_KINDS)}
    procs = {kind: subprocess.Popen([sys.executable, __file__, "--serve", kind, str(port)], env=env)
             for kind, port in ports.items()}
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with socket.create_connection(("127.0.0.1", ports["http"]), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("the HTTP server did not start within 120 s") from None
                time.sleep(0.2)
        calls = clients(ports)
        for _, call in calls.values():  # warm-up, and every path answers the same values
            for _ in range(30):
                assert np.array_equal(call(), OUT)
        wall = {name: [] for name in calls}
        cpu = {name: [] for name in calls}
        server_cpu = dict.fromkeys(calls, 0.0)
        switched = dict.fromkeys(calls, 0)
        client_switched = dict.fromkeys(calls, 0)
        names = list(calls)
        for k in range(count):
            for name in (names if k % 2 else names[::-1]):
                kind, call = calls[name]
                x0, y0 = switches(procs[kind].pid), switches("self")
                s0, t0, c0 = cpu_seconds(procs[kind].pid), time.perf_counter(), time.process_time()
                call()
                wall[name].append(1e3 * (time.perf_counter() - t0))
                cpu[name].append(1e3 * (time.process_time() - c0))
                server_cpu[name] += cpu_seconds(procs[kind].pid) - s0
                switched[name] += switches(procs[kind].pid) - x0
                client_switched[name] += switches("self") - y0
    finally:
        for proc in procs.values():
            proc.kill()
    rows = [{"path": name, "p50_ms": round(statistics.median(wall[name]), 3),
             "client_cpu_ms": round(statistics.median(cpu[name]), 3),
             "server_cpu_ms": round(1e3 * server_cpu[name] / count, 3),
             "client_switches": round(client_switched[name] / count, 1),
             "server_switches": round(switched[name] / count, 1)} for name in names]
    print(f"transport floors, {ROWS}-row request ({INT_INPUTS} INT64 + {FLOAT_INPUTS} FP32 inputs), parse-only "
          f"handler, {count} requests each, alternating, one CPU; load {os.getloadavg()[0]:.1f}")
    print_table(rows, ["path", "p50_ms", "client_cpu_ms", "server_cpu_ms", "client_switches",
                       "server_switches"])
    if args.json:
        write_json(args.json, {"benchmark": "grpc_transport", "machine": machine_info(), "requests": count,
                               "load_average": os.getloadavg()[0], "results": rows})


if __name__ == "__main__":
    main()
