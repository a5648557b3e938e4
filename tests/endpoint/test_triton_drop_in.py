"""What a Triton user meets dropping ``dynemb serve`` in Triton's place, against a real ``dynemb serve`` process with
``tritonclient`` (HTTP and gRPC) and raw HTTP/2 where a client cannot show it: features sent as ``[B, 1]`` columns,
gRPC deadlines (``client_timeout``, ``grpc-timeout``), and the habits of tritonclient's example scripts."""

import asyncio
import socket
import time

import httpx
import numpy as np
import pytest
import torch

from test_command import serving
from test_inference_protocol import inputs

http = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
grpc = pytest.importorskip("grpc")
hpack = pytest.importorskip("hpack")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

ROWS = 24


@pytest.fixture(scope="module")
def server(run):
    with serving(run) as addresses:
        yield addresses


@pytest.fixture(scope="module")
def columns(run):
    import pyarrow.parquet as pq

    table = pq.read_table(run / "test.parquet").slice(0, ROWS).to_pydict()
    return {"user": (np.array(table["user"], dtype=object), "BYTES"),
            "item": (np.array(table["item"], dtype=np.int64), "INT64"),
            "tags": (np.array([t for bag in table["tags"] for t in bag], dtype=object), "BYTES"),
            "tags__lengths": (np.array([len(bag) for bag in table["tags"]], dtype=np.int32), "INT32"),
            "price": (np.array(table["price"], dtype=np.float32), "FP32")}


def as_columns(arrays: dict) -> dict:
    """Each input of one value a row as a ``[B, 1]`` column (multi-hot ids stay ``[N]``)."""
    return {n: (v if n == "tags" else v.reshape(-1, 1), d) for n, (v, d) in arrays.items()}


def typed_request(arrays: dict) -> bytes:
    """A ModelInferRequest with typed ``contents`` (what tritonclient never sends, other clients do)."""
    request = pb.ModelInferRequest(model_name="ctr")
    field = {"BYTES": "bytes_contents", "INT64": "int64_contents", "INT32": "int_contents", "FP32": "fp32_contents"}
    for name, (values, datatype) in arrays.items():
        t = request.inputs.add(name=name, datatype=datatype, shape=list(values.shape))
        flat = values.reshape(-1).tolist()
        getattr(t.contents, field[datatype]).extend([v.encode() for v in flat] if datatype == "BYTES" else flat)
    return request.SerializeToString()


def grpc_probability(address: str, message: bytes) -> np.ndarray:
    with grpc.insecure_channel(address) as channel:
        reply = pb.ModelInferResponse.FromString(
            channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(message, timeout=30))
    return np.frombuffer(reply.raw_output_contents[0], "<f8")


def test_features_shaped_b_by_1_score_bit_equal_to_b_over_http_and_grpc(server, columns):
    shaped = as_columns(columns)
    client = http.InferenceServerClient(server[0], network_timeout=30)
    try:
        want = client.infer("ctr", inputs(http, columns)).as_numpy("probability")
        assert want.shape == (ROWS,)
        for binary in (False, True):
            got = client.infer("ctr", inputs(http, shaped, binary)).as_numpy("probability")
            assert got.tobytes() == want.tobytes(), binary
    finally:
        client.close()
    with grpcclient.InferenceServerClient(server[1]) as g:
        got = g.infer("ctr", inputs(grpcclient, shaped)).as_numpy("probability")
        assert got.tobytes() == want.tobytes()
    assert grpc_probability(server[1], typed_request(shaped)).tobytes() == want.tobytes()
    assert grpc_probability(server[1], typed_request(columns)).tobytes() == want.tobytes()
    # the metadata keeps [-1] (the [B] form); [-1, 1] is taken too (docs/serving.md)
    meta = httpx.get(f"http://{server[0]}/v2/models/ctr", timeout=30).json()
    assert {tuple(t["shape"]) for t in meta["inputs"]} == {(-1,)}


def test_other_shapes_are_errors_naming_the_input_on_both_transports(server, columns):
    bad = {**columns, "item": (np.repeat(columns["item"][0], 2).reshape(-1, 2), "INT64")}
    row = {**columns, "price": (columns["price"][0].reshape(1, -1), "FP32")}
    client = http.InferenceServerClient(server[0], network_timeout=30)
    try:
        with pytest.raises(InferenceServerException, match=r"input 'item': shape must be \[n\] or \[n, 1\]"):
            client.infer("ctr", inputs(http, bad, True))
        with pytest.raises(InferenceServerException, match=r"input 'price'.*a \[1, n\] row is not read as n rows"):
            client.infer("ctr", inputs(http, row))
    finally:
        client.close()
    with grpcclient.InferenceServerClient(server[1]) as g:
        with pytest.raises(InferenceServerException, match=r"input 'item': shape must be \[n\] or \[n, 1\]") as e:
            g.infer("ctr", inputs(grpcclient, bad))
        assert "INVALID_ARGUMENT" in str(e.value.status())
        tags = {**as_columns(columns), "tags": (columns["tags"][0].reshape(-1, 1), "BYTES")}
        with pytest.raises(InferenceServerException, match=r"input 'tags': shape must be \[n\], one size"):
            g.infer("ctr", inputs(grpcclient, tags))


def raw_infer(address: str, message: bytes, timeout: str) -> dict:
    """One ModelInfer over a raw HTTP/2 connection with ``grpc-timeout: timeout``; the reply's trailers."""
    host, port = address.split(":")
    encoder, decoder = hpack.Encoder(), hpack.Decoder()
    block = encoder.encode([(":method", "POST"), (":scheme", "http"),
                            (":path", "/inference.GRPCInferenceService/ModelInfer"), (":authority", "x"),
                            ("content-type", "application/grpc"), ("te", "trailers"), ("grpc-timeout", timeout)])
    body = b"\x00" + len(message).to_bytes(4, "big") + message

    def frame(kind, flags, stream, payload):
        return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload

    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"") + frame(1, 4, 1, block)
                     + frame(0, 1, 1, body))
        sock.settimeout(30)
        buffer = b""
        while True:
            while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
                length = int.from_bytes(buffer[:3], "big")
                kind, flags, stream, payload = buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big"), \
                    buffer[9:9 + length]
                buffer = buffer[9 + length:]
                if kind == 1 and stream == 1 and flags & 1:
                    return dict(decoder.decode(payload))
                if kind == 1:
                    decoder.decode(payload)
            chunk = sock.recv(1 << 16)
            assert chunk, "the connection closed"
            buffer += chunk


def test_grpc_deadlines_are_honoured_and_expired_work_is_not_started(server, columns):
    with grpcclient.InferenceServerClient(server[1]) as g:
        g.infer("ctr", inputs(grpcclient, columns))
        time.sleep(0.2)  # the counts of earlier calls are in
        before = g.get_inference_statistics("ctr", as_json=True)["model_stats"][0]
        message = typed_request(columns)
        trailers = raw_infer(server[1], message, "1n")  # passed when the request is whole: never scored
        assert trailers["grpc-status"] == "4" and "deadline" in trailers["grpc-message"]
        assert raw_infer(server[1], message, "30S")["grpc-status"] == "0"
        after = g.get_inference_statistics("ctr", as_json=True)["model_stats"][0]
        # tritonclient's client_timeout is the call's grpc-timeout
        with pytest.raises(InferenceServerException) as error:
            g.infer("ctr", inputs(grpcclient, columns), client_timeout=1e-4)
        assert "DEADLINE_EXCEEDED" in str(error.value.status())
        assert g.is_server_live(client_timeout=30)
    assert int(after["execution_count"]) == int(before["execution_count"]) + 1  # the expired one never ran
    fails = [int(s["inference_stats"]["fail"].get("count", 0)) for s in (before, after)]
    assert fails[1] == fails[0] + 1  # and counts as a failure


class SlowModel:
    """A Servable whose forward pass takes ``seconds`` and records the rows it scored."""

    name, version, joins_batches = "m", 1, True

    def __init__(self, seconds: float) -> None:
        self.seconds, self.scored = seconds, []

    def join(self, batches):
        return torch.cat(batches)

    def infer(self, batch):
        time.sleep(self.seconds)
        self.scored.append(batch.tolist())
        return {"p": batch.double()}, 1

    def updating(self):
        return False


def test_a_request_whose_caller_gave_up_while_it_waited_is_never_scored():
    from dynemb.endpoint.service import Batcher

    model = SlowModel(0.3)

    async def run():
        batcher = Batcher(model, 100, inline=False)
        try:
            first = asyncio.ensure_future(batcher.score(torch.tensor([1])))
            await asyncio.sleep(0.05)  # the first forward pass runs on the worker thread
            gone = asyncio.ensure_future(batcher.score(torch.tensor([2])))
            kept = asyncio.ensure_future(batcher.score(torch.tensor([3])))
            await asyncio.sleep(0.05)
            gone.cancel()  # as the gRPC server cancels a call whose deadline passed
            (a, _), (c, _) = await first, await kept
            assert a["p"].tolist() == [1.0] and c["p"].tolist() == [3.0]
            return batcher.dropped
        finally:
            batcher.close()

    assert asyncio.run(run()) == 1
    assert model.scored == [[1], [3]]


def test_http_has_no_deadline_header_and_a_slow_client_still_gets_its_answer(server, columns):
    # Triton's HTTP endpoint has no deadline header either (its clients' timeouts are their own); the request
    # parameter "timeout" (microseconds, tritonclient's infer(timeout=)) is Triton's dynamic batcher queue policy
    client = http.InferenceServerClient(server[0], network_timeout=30)
    try:
        want = client.infer("ctr", inputs(http, columns)).as_numpy("probability")
        got = client.infer("ctr", inputs(http, columns), headers={"grpc-timeout": "1n"})
        assert got.as_numpy("probability").tobytes() == want.tobytes()
    finally:
        client.close()



def test_tritonclient_example_habits_over_http_and_grpc(server, columns):
    """What tritonclient's example scripts do: request ids and parameters, BYTES as numpy object arrays of str or of
    bytes (or a bytes_ array), ids of any integer dtype, ``class_count`` (not served: a clear error)."""
    small = columns
    users = small["user"][0]
    items = small["item"][0]
    variants = {"user as bytes": {**small, "user": (np.array([u.encode() for u in users], dtype=object), "BYTES")},
                "user as bytes_": {**small, "user": (users.astype(np.bytes_), "BYTES")}}
    for dtype in (np.int32, np.int16, np.uint8, np.uint16, np.uint32, np.uint64, np.int8):
        variants[f"item as {np.dtype(dtype).name}"] = {**small, "item": (items.astype(dtype), {
            np.int32: "INT32", np.int16: "INT16", np.uint8: "UINT8", np.uint16: "UINT16", np.uint32: "UINT32",
            np.uint64: "UINT64", np.int8: "INT8"}[dtype])}
    for module, client in ((http, http.InferenceServerClient(server[0], network_timeout=30)),
                           (grpcclient, grpcclient.InferenceServerClient(server[1]))):
        try:
            want = client.infer("ctr", inputs(module, small)).as_numpy("probability")
            for label, arrays in variants.items():
                for binary in ((None,) if module is grpcclient else (False, True)):
                    got = client.infer("ctr", inputs(module, arrays, binary)).as_numpy("probability")
                    assert got.tobytes() == want.tobytes(), (module.__name__, label, binary)
            result = client.infer("ctr", inputs(module, small), request_id="req-9",
                                  parameters={"tenant": "a", "n": 3}, timeout=1000, priority=1)
            assert result.as_numpy("probability").tobytes() == want.tobytes()
            response = result.get_response()
            assert (response["id"] if module is http else response.id) == "req-9"
            for _ in range(2):  # twice: gRPC reuses the parse of a request header seen before
                with pytest.raises(InferenceServerException, match=r"output 'probability': classification "
                                                                   r"\(class_count=2\) is not supported"):
                    client.infer("ctr", inputs(module, small),
                                 outputs=[module.InferRequestedOutput("probability", class_count=2)])
        finally:
            client.close()


def test_uint64_ids_past_int64_read_as_a_uint64_column_does():
    # the readers reinterpret a uint64 column's ids >= 2**63 as int64 (a bijection); JSON and binary alike
    import json

    from dynemb.data.preprocess import Preprocessing
    from dynemb.endpoint.inference_protocol import decode_request
    from dynemb.endpoint.wire import RequestError, parse_body

    prep = Preprocessing(label=None, categorical=("a",), dense=(), dense_mean=(), dense_std=(), dense_min=(),
                         dense_max=(), dense_rows=1, id_types={"a": "INT64"})
    ids = np.array([0, 2**63, 2**64 - 1, 7], dtype=np.uint64)
    want = ids.view(np.int64)
    text = json.dumps({"inputs": [{"name": "a", "datatype": "UINT64", "shape": [4], "data": ids.tolist()}]})
    assert decode_request(parse_body(text.encode()), prep, 8).sparse["a"].numpy().tolist() == want.tolist()
    head = json.dumps({"inputs": [{"name": "a", "datatype": "UINT64", "shape": [4],
                                   "parameters": {"binary_data_size": 32}}]}).encode()
    got = decode_request(parse_body(head + ids.tobytes(), len(head)), prep, 8).sparse["a"].numpy()
    assert got.tolist() == want.tolist()
    for datatype, values, message in (("UINT64", [-1], r"UINT64 values must be in \[0, 18446744073709551615\], "
                                                        r"got -1"),
                                      ("INT8", [128], r"INT8 values must be in \[-128, 127\], got 128"),
                                      ("UINT8", [1, True], "UINT8 values must be integers")):
        body = {"inputs": [{"name": "a", "datatype": datatype, "shape": [len(values)], "data": values}]}
        with pytest.raises(RequestError, match=message):
            decode_request(body, prep, 8)


def test_typed_contents_in_another_field_than_the_datatypes_are_an_error_naming_both(server, columns):
    """``int64_contents`` is where INT64 values go: ones sent in ``int_contents`` or ``fp32_contents`` were ignored
    ("shape [24] holds 24 values, got 0", or dropped beside the right field's), and ``contents`` beside a raw tensor
    too."""
    good = pb.ModelInferRequest.FromString(typed_request(columns))
    assert np.array_equal(grpc_probability(server[1], good.SerializeToString()),
                          grpc_probability(server[1], typed_request(columns)))
    item = columns["item"][0].tolist()
    cases = []
    for extra in ("int_contents", "fp32_contents"):
        request = pb.ModelInferRequest.FromString(typed_request(columns))
        t = next(t for t in request.inputs if t.name == "item")
        if extra == "fp32_contents":  # instead of the INT64 field
            t.contents.ClearField("int64_contents")
        getattr(t.contents, extra).extend(item)
        wrong = "contents.int_contents" if extra == "int_contents" else "contents.fp32_contents"
        cases.append((request, f"input 'item': INT64 values go in contents.int64_contents, got {wrong}"))
    raw = pb.ModelInferRequest.FromString(typed_request(columns))
    for t in raw.inputs:
        values, datatype = columns[t.name]
        raw.raw_input_contents.append(b"".join(len(v.encode()).to_bytes(4, "little") + v.encode() for v in values)
                                      if datatype == "BYTES" else values.astype(values.dtype.newbyteorder("<"))
                                      .tobytes())
    cases.append((raw, "input 'user': both raw_input_contents and contents.bytes_contents are given; send one of "
                       "them"))
    for request, message in cases:
        with pytest.raises(grpc.RpcError) as error:
            grpc_probability(server[1], request.SerializeToString())
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.value.details() == message, \
            error.value.details()
    assert len(grpc_probability(server[1], good.SerializeToString())) == ROWS  # and it keeps serving
