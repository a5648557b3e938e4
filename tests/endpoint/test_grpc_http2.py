"""The gRPC transport on the event loop (``dynemb.endpoint.grpc_http2``) against grpcio's client (the transport under
``tritonclient.grpc``): large messages both ways (flow control), the message size limit, compressed requests and
a compression bomb, errors with non-ASCII messages, unknown and streaming methods, concurrent calls on one
channel, metadata, and a server that stops while a call runs; and ``InferRequests``' shortcut against protobuf's
own parse (the same fields and arrays, whatever the message)."""

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("hpack")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402

from dynemb.endpoint.grpc_http2 import GrpcError, Http2GrpcServer  # noqa: E402
from dynemb.endpoint.grpc_server import InferRequests, request_dict  # noqa: E402

LIMIT = 8 << 20


class Served:
    """An Http2GrpcServer on a loop of its own thread, with an echo, a large reply, an error and a slow call."""

    def __init__(self, **limits) -> None:
        self.seen, self.cancelled = [], []

        async def echo(message, metadata):
            self.seen.append(dict(metadata))
            return bytes(message)

        async def large(message, metadata):  # a reply of the size the request asks for, over the client's window
            return bytes(int.from_bytes(bytes(message), "big") * b"\x07")

        async def fail(message, metadata):
            raise GrpcError("INVALID_ARGUMENT", "input 'é' is 100% wrong\nline two")

        async def slow(message, metadata):
            try:
                await asyncio.sleep(0.5)
            except asyncio.CancelledError:
                self.cancelled.append(time.monotonic())
                raise
            return b"done"

        self.loop = asyncio.new_event_loop()
        self.server = Http2GrpcServer({"/t.T/Echo": echo, "/t.T/Large": large, "/t.T/Fail": fail, "/t.T/Slow": slow},
                                      max_message_bytes=limits.pop("max_message_bytes", LIMIT), **limits)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{sock.getsockname()[1]}"
        started = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.server.start(sock))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace_s=2.0), self.loop).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture()
def served():
    s = Served()
    yield s
    s.close()


def call(channel, method, message: bytes, **kwargs) -> bytes:
    return channel.unary_unary(method)(message, timeout=30, **kwargs)


def test_large_messages_both_ways_and_concurrent_calls_on_one_channel(served):
    with grpc.insecure_channel(served.address, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        assert call(channel, "/t.T/Echo", b"") == b""
        big = np.random.default_rng(0).bytes(LIMIT - 64)  # over every default window: flow control both ways
        assert call(channel, "/t.T/Echo", big) == big
        assert call(channel, "/t.T/Large", (20 << 20).to_bytes(4, "big")) == (20 << 20) * b"\x07"
        messages = [bytes([k]) * (k * 4099) for k in range(64)]
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(lambda m: call(channel, "/t.T/Echo", m), messages)) == messages
        call(channel, "/t.T/Echo", b"x", metadata=[("authorization", "Bearer t0k"), ("x-bin", b"\x00")])
        assert served.seen[-1]["authorization"] == "Bearer t0k" and "x-bin" not in served.seen[-1]


def test_limits_compression_and_errors(served):
    with grpc.insecure_channel(served.address) as channel:
        with pytest.raises(grpc.RpcError) as error:
            call(channel, "/t.T/Echo", b"\x01" * (LIMIT + 1))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(LIMIT) in error.value.details()
        assert call(channel, "/t.T/Echo", b"after") == b"after"  # the connection is still good
        text = b"compressible " * 5000
        for compression in (grpc.Compression.Gzip, grpc.Compression.Deflate):
            assert call(channel, "/t.T/Echo", text, compression=compression) == text
        with pytest.raises(grpc.RpcError) as error:  # a few KB sent, over the limit once inflated
            call(channel, "/t.T/Echo", b"\x00" * (LIMIT + 1), compression=grpc.Compression.Gzip)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "inflated" in error.value.details()
        with pytest.raises(grpc.RpcError) as error:
            call(channel, "/t.T/Fail", b"")
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details() == "input 'é' is 100% wrong\nline two"
        for method in ("/t.T/Nothing", "/inference.GRPCInferenceService/ModelStreamInfer"):
            with pytest.raises(grpc.RpcError) as error:
                call(channel, method, b"")
            assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED and method in error.value.details()
        stream = channel.stream_stream("/t.T/Echo")(iter([b"a", b"b"]), timeout=30)
        with pytest.raises(grpc.RpcError) as error:
            list(stream)
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert call(channel, "/t.T/Echo", b"still") == b"still"


def test_a_stopping_server_finishes_the_call_under_way_and_takes_no_new_one(served):
    with grpc.insecure_channel(served.address) as channel:
        assert call(channel, "/t.T/Echo", b"warm") == b"warm"
        future = channel.unary_unary("/t.T/Slow").future(b"", timeout=30)
        time.sleep(0.1)
        served.stop()
        assert future.result() == b"done"
        with pytest.raises(grpc.RpcError) as error:
            call(channel, "/t.T/Echo", b"late")
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def infer_message(rows: int, seed: int, request_id: str = "", datatypes=("INT64", "FP32"), outputs=()) -> bytes:
    g = np.random.default_rng(seed)
    request = pb.ModelInferRequest(model_name="ctr", model_version="1", id=request_id)
    for k, datatype in enumerate(datatypes):
        request.inputs.add(name=f"x{k}", datatype=datatype, shape=[rows])
        if datatype == "BYTES":
            request.raw_input_contents.append(b"".join(len(v).to_bytes(4, "little") + v
                                                       for v in (b"ab", b"") * (rows // 2)))
        else:
            dtype = {"INT64": "<i8", "FP32": "<f4", "INT32": "<i4", "FP64": "<f8"}[datatype]
            request.raw_input_contents.append(g.integers(-(1 << 30), 1 << 30, rows).astype(dtype).tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    return request.SerializeToString()


def same(got, message) -> None:
    request = pb.ModelInferRequest.FromString(message)
    name, version, request_id, parsed = got
    assert (name, version, request_id) == (request.model_name, request.model_version, request.id)
    want = request_dict(request)
    assert parsed.keys() == want.keys() and parsed.get("outputs") == want.get("outputs")
    assert parsed.get("id") == want.get("id")
    for a, b in zip(parsed["inputs"], want["inputs"], strict=True):
        assert (a["name"], a["datatype"], a["shape"]) == (b["name"], b["datatype"], b["shape"])
        if isinstance(b["data"], np.ndarray):
            assert a["data"].dtype == b["data"].dtype and np.array_equal(a["data"], b["data"])
        else:
            assert a["data"] == b["data"]


def test_infer_requests_read_every_message_as_protobuf_does():
    parse = InferRequests()
    seen = 0
    cases = [infer_message(0, 0), infer_message(1, 1), infer_message(1, 2), infer_message(256, 3),
             infer_message(256, 4), infer_message(256, 5, "id7"), infer_message(256, 6, "id7"),
             infer_message(256, 7, outputs=("p",)), infer_message(256, 8, outputs=("p",)),
             infer_message(255, 9), infer_message(256, 10, datatypes=("FP32", "INT64")),
             infer_message(256, 11, datatypes=("INT64", "BYTES")), infer_message(256, 12, datatypes=("INT32",)),
             infer_message(256, 13, datatypes=("INT32",))]
    for k, message in enumerate(cases):
        view = memoryview(b"\x00" * (k % 3) + message)[k % 3:]  # as the transport hands it: a view, any alignment
        same(parse.parse(view), message)
        seen += parse.prefix is not None and bytes(view[:len(parse.prefix)]) == parse.prefix
    assert seen >= 10
    # the header of the last message, then what is not its tensors: protobuf merges a message's parts
    base = infer_message(256, 14)
    same(parse.parse(base), base)
    for message in (base + pb.ModelInferRequest(id="late").SerializeToString(),  # a field after the tensors
                    base[:-8] + b"\x00" * 8,  # same length and places, other bytes
                    infer_message(256, 14, datatypes=("FP64", "INT32"))):  # same sizes, other types
        same(parse.parse(message), message)
    half = infer_message(128, 15, datatypes=("INT64", "INT64", "FP32", "FP32"))  # same length, other layout
    same(parse.parse(half), half)


def frames(sock) -> list:
    """Read frames until the server's reply to stream 1 or 3 has ended (END_STREAM) or the connection closes."""
    out, buffer = [], b""
    sock.settimeout(10)
    while True:
        while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
            length = int.from_bytes(buffer[:3], "big")
            kind, flags, stream = buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big")
            out.append((kind, flags, stream, buffer[9:9 + length]))
            buffer = buffer[9 + length:]
            if kind == 1 and flags & 1 and stream in (1, 3) or kind == 7:  # trailers, or GOAWAY
                return out
        chunk = sock.recv(1 << 16)
        if not chunk:
            return out
        buffer += chunk


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def test_the_frames_grpcio_never_sends_padding_continuation_ping_and_a_bad_preface(served):
    import hpack

    encoder, decoder = hpack.Encoder(), hpack.Decoder()
    host, port = served.address.split(":")
    with socket.create_connection((host, int(port))) as sock:
        block = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", "/t.T/Echo"),
                                (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers"),
                                ("x-long", "v" * 3000)])
        message = b"\x00" + (5).to_bytes(4, "big") + b"hello"
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"")
                     + frame(6, 0, 0, b"12345678")  # PING
                     + frame(1, 0x8 | 0x20, 1, bytes([3]) + b"\x00\x00\x00\x00\x10" + block[:1000] + b"pad")
                     + frame(9, 0, 1, block[1000:2000]) + frame(9, 0x4, 1, block[2000:])  # CONTINUATION
                     + frame(0, 0x8 | 0x1, 1, bytes([2]) + message + b"pd"))  # padded DATA, END_STREAM
        got = frames(sock)
        kinds = [(k, f) for k, f, _, _ in got]
        assert (4, 1) in kinds and (6, 1) in kinds  # SETTINGS and PING acknowledged
        assert [p for k, f, _, p in got if k == 6 and f & 1] == [b"12345678"]
        headers = [decoder.decode(p) for k, _, s, p in got if k == 1 and s == 1]
        assert headers[0][0] == (":status", "200") and ("grpc-status", "0") in headers[-1]
        assert b"".join(p for k, _, s, p in got if k == 0 and s == 1) == message
    assert served.seen[-1]["x-long"] == "v" * 3000
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        got = frames(sock)
        assert got[-1][0] == 7 and b"preface" in got[-1][3]  # GOAWAY, with the reason


def open_raw(served, settings: bytes = b""):
    """A raw HTTP/2 connection to ``served``: the preface and a SETTINGS frame sent."""
    host, port = served.address.split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, settings))
    return sock


def request_block(encoder, path: str) -> bytes:
    return encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x"),
                           ("content-type", "application/grpc"), ("te", "trailers")])


def goaway_code(sock) -> int | None:
    """The error code of the server's GOAWAY, None when the connection ends without one."""
    got = frames(sock)
    return int.from_bytes(got[-1][3][4:8], "big") if got and got[-1][0] == 7 else None


def test_invalid_settings_max_frame_size_is_a_protocol_error(served):
    # RFC 9113 6.5.2: SETTINGS_MAX_FRAME_SIZE outside [2^14, 2^24-1] is a PROTOCOL_ERROR; 0 used to leave every
    # reply that did not fit one frame waiting forever
    for value in (0, 100, 1 << 24):
        with open_raw(served, (5).to_bytes(2, "big") + value.to_bytes(4, "big")) as sock:
            assert goaway_code(sock) == 1


def test_bad_padding_is_a_protocol_error(served):
    import hpack

    encoder = hpack.Encoder()
    block = request_block(encoder, "/t.T/Echo")
    with open_raw(served) as sock:  # padding longer than the frame (RFC 9113 6.1, 6.2)
        sock.sendall(frame(1, 0x4 | 0x8, 1, bytes([200]) + block))
        assert goaway_code(sock) == 1
    with open_raw(served) as sock:  # a PADDED DATA frame with no Pad Length byte
        sock.sendall(frame(1, 0x4, 1, hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"),
                                                               (":path", "/t.T/Echo"), (":authority", "x"),
                                                               ("content-type", "application/grpc")]))
                     + frame(0, 0x8 | 0x1, 1, b""))
        assert goaway_code(sock) == 1


def test_streams_over_the_concurrency_limit_are_refused(served):
    # each open stream may buffer a whole request: without SETTINGS_MAX_CONCURRENT_STREAMS a client could open
    # streams without end
    import hpack

    encoder = hpack.Encoder()
    with open_raw(served) as sock:
        settings = frames_until(sock, lambda k, f, s, p: k == 4 and not f & 1)[-1][3]
        limits = {int.from_bytes(settings[i:i + 2], "big"): int.from_bytes(settings[i + 2:i + 6], "big")
                  for i in range(0, len(settings), 6)}
        assert 0 < limits.get(3, 0) <= 1024
        count = limits[3] + 10
        sock.sendall(b"".join(frame(1, 0x4, 2 * i + 1, request_block(encoder, "/t.T/Slow")) for i in range(count)))
        refused = frames_until(sock, lambda k, f, s, p: k == 3 and s == 2 * count - 1)
        codes = {s: int.from_bytes(p, "big") for k, _, s, p in refused if k == 3}
        assert len(codes) == 10 and set(codes.values()) == {7}  # REFUSED_STREAM
        assert min(codes) == 2 * limits[3] + 1


def frames_until(sock, last) -> list:
    """Frames read until one for which ``last(kind, flags, stream, payload)`` holds."""
    out, buffer = [], b""
    sock.settimeout(10)
    while True:
        while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
            length = int.from_bytes(buffer[:3], "big")
            out.append((buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big"), buffer[9:9 + length]))
            buffer = buffer[9 + length:]
            if last(*out[-1]):
                return out
        chunk = sock.recv(1 << 16)
        assert chunk, "the connection closed"
        buffer += chunk


def test_a_client_that_stops_reading_does_not_grow_the_server_buffers(served):
    # a client that sends calls but never reads their replies: the server stops reading once its writes back up
    import hpack

    encoder = hpack.Encoder()
    reply = 2 << 20
    message = reply.to_bytes(4, "big")
    with open_raw(served, (4).to_bytes(2, "big") + ((1 << 31) - 1).to_bytes(4, "big")) as sock:
        sock.sendall(frame(8, 0, 0, ((1 << 31) - 1 - 65535).to_bytes(4, "big")))
        sock.setblocking(False)
        for i in range(24):
            try:
                sock.send(frame(1, 0x4, 2 * i + 1, request_block(encoder, "/t.T/Large"))
                          + frame(0, 0x1, 2 * i + 1, b"\x00" + len(message).to_bytes(4, "big") + message))
            except BlockingIOError:
                break
            time.sleep(0.05)
        time.sleep(0.5)

        async def buffered():
            return max((c.transport.get_write_buffer_size() for c in served.server.connections
                        if c.transport is not None), default=0)

        held = asyncio.run_coroutine_threadsafe(buffered(), served.loop).result(10)
        assert held < 4 * reply, held


def test_a_stopping_server_drops_a_client_that_stops_reading(served):
    # stop() closed what was left after its grace with transport.close(), which waits for the write buffer to
    # drain: a connection whose client reads nothing stayed open (and in server.connections) for good
    import hpack

    encoder = hpack.Encoder()
    message = (8 << 20).to_bytes(4, "big")
    with open_raw(served, (4).to_bytes(2, "big") + ((1 << 31) - 1).to_bytes(4, "big")) as sock:
        sock.sendall(frame(8, 0, 0, ((1 << 31) - 1 - 65535).to_bytes(4, "big"))
                     + frame(1, 0x4, 1, request_block(encoder, "/t.T/Large"))
                     + frame(0, 0x1, 1, b"\x00" + len(message).to_bytes(4, "big") + message))
        time.sleep(1.0)
        asyncio.run_coroutine_threadsafe(served.server.stop(grace_s=0.2), served.loop).result(10)
        deadline = time.monotonic() + 5
        while served.server.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not served.server.connections


def test_an_error_with_an_unknown_status_name_is_still_answered():
    """A handler's GrpcError with a name outside STATUS answers UNKNOWN (a KeyError left the stream unanswered)."""
    from dynemb.endpoint.grpc_http2 import _trailers
    assert b"grpc-status" in _trailers("NOT_A_STATUS", "boom") and b"2" in _trailers("NOT_A_STATUS", "")
    assert _trailers("NOT_A_STATUS", "x") == _trailers("UNKNOWN", "x")


@pytest.fixture()
def limited():
    s = Served(max_message_bytes=1000, max_connections=2, idle_timeout_s=0.4, max_total_buffered_bytes=6000)
    yield s
    s.close()


def call_frames(encoder, stream: int, path: str, message: bytes, extra=()) -> bytes:
    """HEADERS (with ``extra`` fields) and one DATA frame ending the stream: a whole unary call."""
    block = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x"),
                            ("content-type", "application/grpc"), ("te", "trailers"), *extra])
    return frame(1, 0x4, stream, block) + frame(0, 0x1, stream, b"\x00" + len(message).to_bytes(4, "big") + message)


def status_of(decoder, got, stream: int = 1) -> dict:
    """The trailers of ``stream`` among frames ``got``, as a dict."""
    blocks = [dict(decoder.decode(p)) for k, f, s, p in got if k == 1 and s == stream]
    return blocks[-1]


def test_a_deadline_that_passes_while_a_call_runs_answers_deadline_exceeded_and_cancels_it(served):
    with grpc.insecure_channel(served.address) as channel:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as error:
            channel.unary_unary("/t.T/Slow")(b"", timeout=0.15)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 5
        while not served.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert served.cancelled and served.cancelled[0] - start < 0.45  # cancelled at the deadline, not finished
        assert call(channel, "/t.T/Echo", b"after") == b"after"


def test_grpc_timeout_is_read_from_the_request_headers(served):
    import hpack

    encoder, decoder = hpack.Encoder(), hpack.Decoder()
    with open_raw(served) as sock:  # a deadline already passed when the message is whole: the handler never runs
        seen = len(served.seen)
        sock.sendall(call_frames(encoder, 1, "/t.T/Echo", b"x", [("grpc-timeout", "1n")]))
        trailers = status_of(decoder, frames(sock))
        assert trailers["grpc-status"] == "4" and "deadline" in trailers["grpc-message"]
        assert len(served.seen) == seen
        start = time.monotonic()  # passing while the call runs: answered at the deadline, the call cancelled
        sock.sendall(call_frames(encoder, 3, "/t.T/Slow", b"", [("grpc-timeout", "100m")]))
        assert status_of(decoder, frames(sock), 3)["grpc-status"] == "4"
        assert time.monotonic() - start < 0.45
    with open_raw(served) as sock:  # a value that is no gRPC timeout
        encoder, decoder = hpack.Encoder(), hpack.Decoder()
        sock.sendall(call_frames(encoder, 1, "/t.T/Echo", b"x", [("grpc-timeout", "1.5S")]))
        trailers = status_of(decoder, frames(sock))
        assert trailers["grpc-status"] == "13" and "1.5S" in trailers["grpc-message"]
        sock.sendall(call_frames(encoder, 3, "/t.T/Echo", b"ok", [("grpc-timeout", "99999999S")]))
        assert status_of(decoder, frames(sock), 3)["grpc-status"] == "0"


def server_settings(sock) -> dict:
    """``{identifier: value}`` of the server's first SETTINGS frame (not an ACK) on a raw connection."""
    payload = frames_until(sock, lambda k, f, s, p: k == 4 and not f & 1)[-1][3]
    return {int.from_bytes(payload[i:i + 2], "big"): int.from_bytes(payload[i + 2:i + 6], "big")
            for i in range(0, len(payload), 6)}


def test_data_beyond_the_stream_window_is_a_flow_control_error_of_that_stream(limited):
    # padding counts against the window but not the message limit: 300 frames of padding only go past the
    # 65535 bytes announced for a stream (RFC 9113 6.9.1)
    import hpack

    encoder, decoder = hpack.Encoder(), hpack.Decoder()
    with open_raw(limited) as sock:
        window = server_settings(sock)[4]
        assert window == 65535
        sock.sendall(frame(1, 0x4, 1, request_block(encoder, "/t.T/Echo"))
                     + b"".join(frame(0, 0x8, 1, bytes([255]) + bytes(255)) for _ in range(window // 256 + 1)))
        got = frames_until(sock, lambda k, f, s, p: k == 3 and s == 1)
        assert int.from_bytes(got[-1][3], "big") == 3  # RST_STREAM FLOW_CONTROL_ERROR
        sock.sendall(call_frames(encoder, 3, "/t.T/Echo", b"still"))  # the connection goes on
        got = frames(sock)
        assert status_of(decoder, got, 3)["grpc-status"] == "0"


def test_window_updates_past_the_largest_window_and_of_zero_are_errors(limited):
    import hpack

    with open_raw(limited) as sock:  # the connection's send window past 2^31-1: GOAWAY FLOW_CONTROL_ERROR
        sock.sendall(frame(8, 0, 0, ((1 << 31) - 1).to_bytes(4, "big")))
        assert goaway_code(sock) == 3
    with open_raw(limited) as sock:  # an increment of 0 on the connection: PROTOCOL_ERROR
        sock.sendall(frame(8, 0, 0, (0).to_bytes(4, "big")))
        assert goaway_code(sock) == 1
    with open_raw(limited) as sock:  # on an open stream: that stream is reset, the connection goes on
        encoder = hpack.Encoder()
        sock.sendall(frame(1, 0x4, 1, request_block(encoder, "/t.T/Echo"))
                     + frame(8, 0, 1, ((1 << 31) - 1).to_bytes(4, "big")))
        got = frames_until(sock, lambda k, f, s, p: k == 3 and s == 1)
        assert int.from_bytes(got[-1][3], "big") == 3
        sock.sendall(call_frames(encoder, 3, "/t.T/Echo", b"x"))
        assert status_of(hpack.Decoder(), frames(sock), 3)["grpc-status"] == "0"


def test_data_after_the_end_of_a_stream_resets_it_and_the_connection_goes_on(served):
    # DATA on a stream the client had ended (half-closed remote, its call running) appended to a buffer already
    # handed over: an AttributeError in data_received, which dropped the connection
    import hpack

    encoder, decoder = hpack.Encoder(), hpack.Decoder()
    with open_raw(served) as sock:
        sock.sendall(call_frames(encoder, 1, "/t.T/Slow", b"") + frame(0, 0, 1, b"late"))
        got = frames_until(sock, lambda k, f, s, p: k == 3 and s == 1)
        assert int.from_bytes(got[-1][3], "big") == 5  # STREAM_CLOSED (RFC 9113 5.1)
        sock.sendall(call_frames(encoder, 3, "/t.T/Echo", b"on"))
        assert status_of(decoder, frames(sock), 3)["grpc-status"] == "0"


def test_connections_over_the_limit_are_refused_with_a_goaway(limited):
    import hpack

    first, second = open_raw(limited), open_raw(limited)
    try:
        for sock in (first, second):
            frames_until(sock, lambda k, f, s, p: k == 4 and not f & 1)  # both served
        with open_raw(limited) as third:
            got = frames(third)
            assert got[0][0] == 4 and got[-1][0] == 7  # the server preface (SETTINGS), then GOAWAY
            assert int.from_bytes(got[-1][3][:4], "big") == 0 and int.from_bytes(got[-1][3][4:8], "big") == 7
            assert b"too many connections" in got[-1][3]
            third.settimeout(5)
            assert third.recv(1) == b""  # and closed
        first.sendall(call_frames(hpack.Encoder(), 1, "/t.T/Echo", b"x"))
        assert status_of(hpack.Decoder(), frames(first))["grpc-status"] == "0"
    finally:
        first.close()
        second.close()
    deadline = time.monotonic() + 5
    while limited.server.connections and time.monotonic() < deadline:
        time.sleep(0.01)
    with grpc.insecure_channel(limited.address) as channel:  # a place freed: served again
        assert call(channel, "/t.T/Echo", b"back") == b"back"


def test_an_idle_connection_gets_a_goaway_and_is_closed_and_grpcio_reconnects(limited):
    import hpack

    encoder, decoder = hpack.Encoder(), hpack.Decoder()
    with open_raw(limited) as sock:
        sock.sendall(call_frames(encoder, 1, "/t.T/Slow", b""))  # open longer than the idle time: kept
        got = frames(sock)
        assert status_of(decoder, got)["grpc-status"] == "0" and not [g for g in got if g[0] == 7]
        start = time.monotonic()
        got = frames(sock)  # idle now: GOAWAY (NO_ERROR, the last stream 1), then the connection closes
        assert got and got[-1][0] == 7 and got[-1][3][:8] == (1).to_bytes(4, "big") + bytes(4)
        assert 0.3 < time.monotonic() - start < 3
        sock.settimeout(5)
        assert sock.recv(1) == b""
    with grpc.insecure_channel(limited.address) as channel:
        assert call(channel, "/t.T/Echo", b"a") == b"a"
        time.sleep(1.0)  # the server closes the idle connection meanwhile
        assert call(channel, "/t.T/Echo", b"b") == b"b"


def test_a_header_list_over_the_announced_size_fails_its_call_and_keeps_the_connection(served):
    import hpack

    encoder, decoder = hpack.Encoder(), hpack.Decoder()
    with open_raw(served) as sock:
        limit = server_settings(sock)[6]
        assert 4096 <= limit <= 64 << 10
        sock.sendall(call_frames(encoder, 1, "/t.T/Echo", b"x", [("x-big", "v" * limit)]))
        trailers = status_of(decoder, frames(sock))
        assert trailers["grpc-status"] == "8" and "MAX_HEADER_LIST_SIZE" in trailers["grpc-message"]
        sock.sendall(call_frames(encoder, 3, "/t.T/Echo", b"x", [("x-small", "v" * 100)]))
        assert status_of(decoder, frames(sock), 3)["grpc-status"] == "0"
        # a small block that decodes to a huge list (a field indexed over and over): the connection is closed
        block = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", "/t.T/Echo"), (":authority", "x"),
                                ("content-type", "application/grpc"), ("x-huge", "w" * 4000)])
        index = bytes([0x80 | 62])  # the newest dynamic table entry, x-huge
        sock.sendall(frame(1, 0x4 | 0x1, 5, block + index * 40))
        assert goaway_code(sock) == 0xB  # ENHANCE_YOUR_CALM


def test_a_client_that_resets_its_calls_before_their_answer_is_sent_away(served):
    # HTTP/2 "rapid reset": calls opened only to be reset start work the client never waits for
    import hpack

    encoder = hpack.Encoder()
    with open_raw(served) as sock:
        sock.sendall(b"".join(call_frames(encoder, 2 * i + 1, "/t.T/Slow", b"")
                              + frame(3, 0, 2 * i + 1, (8).to_bytes(4, "big")) for i in range(150)))
        assert goaway_code(sock) == 0xB  # ENHANCE_YOUR_CALM
    with grpc.insecure_channel(served.address) as channel:  # a client that cancels some of its calls is served
        futures = [channel.unary_unary("/t.T/Slow").future(b"", timeout=30) for _ in range(20)]
        for f in futures[::2]:
            f.cancel()
        assert [f.result() for f in futures[1::2]] == [b"done"] * 10
        assert call(channel, "/t.T/Echo", b"on") == b"on"


def test_a_deadline_counts_from_the_call_start_so_a_request_still_arriving_is_answered_at_it(served):
    # a client that sends its headers and then nothing (or its message too slowly) is answered at its deadline,
    # and told to stop sending; the stream does not stay open until the connection goes
    import hpack

    encoder, decoder = hpack.Encoder(), hpack.Decoder()
    with open_raw(served) as sock:
        block = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", "/t.T/Echo"), (":authority", "x"),
                                ("content-type", "application/grpc"), ("te", "trailers"), ("grpc-timeout", "200m")])
        start = time.monotonic()
        sock.sendall(frame(1, 0x4, 1, block) + frame(0, 0, 1, b"\x00\x00\x00"))  # part of the message, no end
        got = frames_until(sock, lambda k, f, s, p: k == 3 and s == 1)
        assert 0.15 < time.monotonic() - start < 2
        assert status_of(decoder, got)["grpc-status"] == "4" and int.from_bytes(got[-1][3], "big") == 0
        sock.sendall(frame(0, 0x1, 1, b"\x00\x01x")  # the rest, late: dropped
                     + call_frames(encoder, 3, "/t.T/Echo", b"next", [("grpc-timeout", "10S")]))
        assert status_of(decoder, frames(sock), 3)["grpc-status"] == "0"


def test_the_unfinished_requests_a_connection_holds_are_bounded(limited):
    # each stream may hold a whole message: without a bound a client could park 256 unfinished ones a connection
    import hpack

    encoder, decoder = hpack.Encoder(), hpack.Decoder()
    head = b"\x00" + (995).to_bytes(4, "big")
    with open_raw(limited) as sock:
        for i in range(5):  # 4 x 900 bytes fit the bound (4 whole messages of 1000), the fifth stream's do not
            sock.sendall(frame(1, 0x4, 2 * i + 1, request_block(encoder, "/t.T/Echo")) + frame(0, 0, 2 * i + 1,
                                                                                               head + bytes(895)))
        got = frames_until(sock, lambda k, f, s, p: k == 3)
        assert (got[-1][2], int.from_bytes(got[-1][3], "big")) == (9, 7)  # RST_STREAM REFUSED_STREAM
        sock.sendall(frame(0, 0x1, 1, bytes(100)))  # the first one finished: answered
        got = frames_until(sock, lambda k, f, s, p: k == 1 and s == 1 and f & 1)
        assert status_of(decoder, got)["grpc-status"] == "0"
        sock.sendall(b"".join(frame(3, 0, s, (8).to_bytes(4, "big")) for s in (3, 5, 7)))  # the others reset
        sock.sendall(call_frames(encoder, 11, "/t.T/Echo", b"x" * 990))
        got = frames_until(sock, lambda k, f, s, p: k == 1 and s == 11 and f & 1)
        assert status_of(decoder, got, 11)["grpc-status"] == "0"

        async def held():
            return [c.buffered for c in limited.server.connections]

        assert asyncio.run_coroutine_threadsafe(held(), limited.loop).result(10) == [0]  # all given back


def test_the_unfinished_requests_of_all_connections_are_bounded_and_given_back_when_one_closes(limited):
    import hpack

    head = b"\x00" + (995).to_bytes(4, "big")
    part = head + bytes(895)  # 900 bytes of a 1000-byte message

    def park(sock, encoder, streams):
        sock.sendall(b"".join(frame(1, 0x4, s, request_block(encoder, "/t.T/Echo")) + frame(0, 0, s, part)
                              for s in streams))

    async def held():
        return limited.server.buffered

    first, second = open_raw(limited), open_raw(limited)
    try:
        park(first, hpack.Encoder(), (1, 3, 5, 7))  # 3600 bytes: under the connection's bound (4020)
        encoder = hpack.Encoder()
        park(second, encoder, (1, 3, 5))  # 5400, then 6300: over all connections' (6000)
        got = frames_until(second, lambda k, f, s, p: k == 3)
        assert (got[-1][2], int.from_bytes(got[-1][3], "big")) == (5, 7)  # REFUSED_STREAM
        first.close()  # its unfinished requests are given back
        deadline = time.monotonic() + 5
        while asyncio.run_coroutine_threadsafe(held(), limited.loop).result(10) != 1800:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        park(second, encoder, (7,))
        second.sendall(frame(0, 0x1, 7, bytes(100)))
        got = frames_until(second, lambda k, f, s, p: k == 1 and s == 7 and f & 1)
        assert status_of(hpack.Decoder(), got, 7)["grpc-status"] == "0"
    finally:
        first.close()
        second.close()
    deadline = time.monotonic() + 5
    while asyncio.run_coroutine_threadsafe(held(), limited.loop).result(10) != 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_call_with_no_deadline_whose_message_stops_arriving_is_answered_at_the_idle_time(limited):
    # without a grpc-timeout the message must be whole within idle_timeout_s (0.4 s here) of its headers: a client
    # that sends headers and part of a message, then nothing, does not hold its stream (and connection) for good
    import hpack

    encoder, decoder = hpack.Encoder(), hpack.Decoder()
    block = lambda: encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", "/t.T/Echo"),  # noqa: E731
                                    (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")])
    with open_raw(limited) as sock:
        start = time.monotonic()
        sock.sendall(frame(1, 0x4, 1, block()) + frame(0, 0, 1, b"\x00\x00\x00"))  # part of the message, no end
        got = frames_until(sock, lambda k, f, s, p: k == 3 and s == 1)
        assert 0.3 < time.monotonic() - start < 3
        trailers = status_of(decoder, got)
        assert trailers["grpc-status"] == "4" and "not whole within 0.4 s" in trailers["grpc-message"]
        assert int.from_bytes(got[-1][3], "big") == 0  # RST_STREAM NO_ERROR: stop sending
        # a message that arrives in parts, each well within the idle time, is served; the connection goes on
        sock.sendall(frame(1, 0x4, 3, block()) + frame(0, 0, 3, b"\x00\x00\x00"))
        time.sleep(0.2)
        sock.sendall(frame(0, 0x1, 3, b"\x00\x02ok"))
        got = frames(sock)
        assert status_of(decoder, got, 3)["grpc-status"] == "0"
        assert [p for k, f, s, p in got if k == 0 and s == 3][0][5:] == b"ok"
        assert not [g for g in got if g[0] == 3]  # no reset of the served call
