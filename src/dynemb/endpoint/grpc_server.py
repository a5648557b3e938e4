"""The gRPC transport of the Open Inference Protocol (KServe v2's ``inference.GRPCInferenceService``).

The messages and the service definition are the ones ``tritonclient[grpc]`` ships (``tritonclient.grpc.service_pb2``
and ``service_pb2_grpc``, generated from Triton's ``grpc_service.proto``), so a Triton client talks to it
unchanged. Each call goes to the same :class:`~dynemb.endpoint.service.InferenceService` as the HTTP routes, on the
same event loop (:class:`GrpcServer` starts in the HTTP app's lifespan; HTTP/2 is
:mod:`~dynemb.endpoint.grpc_http2`'s protocol on that loop, no gRPC threads), so requests from both transports are
batched together and answered alike: the same bearer token (the ``authorization`` metadata), the same limits (the
largest message is the largest HTTP body) and the same errors, with each HTTP status mapped onto a gRPC code
(:data:`~dynemb.endpoint.service.GRPC_CODES`). Input tensors come as ``raw_input_contents`` (what tritonclient
sends) or typed ``contents``; outputs always go back as ``raw_output_contents``, as Triton answers.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Optional

import numpy as np
import pyarrow as pa

try:
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError
    from tritonclient.grpc import service_pb2 as pb
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"dynemb serve's gRPC endpoint needs tritonclient[grpc]: pip install 'dynemb[serving]' "
                      f"({exc})") from exc

from .grpc_http2 import GrpcError, Http2GrpcServer
from .service import (GRPC_CODES, NOT_SUPPORTED, InferenceService, ProtocolError, check_bearer, numpy_datatype,
                      requested_outputs)
from .wire import NUMPY_DTYPES, RequestError, binary_bytes

__all__ = ["GrpcServer", "InferRequests", "request_dict"]

_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
             "FP64": "fp64_contents", "BYTES": "bytes_contents"}
_DTYPES = {datatype: np.dtype(spec) for datatype, spec in NUMPY_DTYPES.items()}


def request_dict(request) -> dict:
    """A ``ModelInferRequest`` as the dict an HTTP JSON body parses into, numeric data as numpy arrays.

    Raises:
        RequestError: raw contents for some inputs but not all, or contents that do not fit their datatype.
    """
    raw = request.raw_input_contents
    given = request.inputs
    if raw and len(raw) != len(given):
        raise RequestError(f"raw_input_contents has {len(raw)} tensors for {len(given)} inputs; give one "
                           "for each input, or none")
    inputs = []
    # Each access to a protobuf field makes a Python object (a bytes copy for a raw tensor): every field is read
    # once, and a raw tensor becomes an array over those bytes, no copy more (np.frombuffer).
    for t, blob in zip(given, raw) if raw else ((t, None) for t in given):
        datatype, name = t.datatype, t.name
        item = {"name": name, "datatype": datatype, "shape": list(t.shape)}
        # a typed field other than the datatype's was ignored: "holds 2 values, got 0", or another field's values
        # dropped; one look at the fields set (only on the typed path, or when a raw tensor comes with contents)
        others = [f.name for f, _ in t.contents.ListFields()] if blob is None or t.HasField("contents") else []
        if blob is not None and others:
            raise RequestError(f"input {name!r}: both raw_input_contents and contents.{others[0]} are given; send "
                               "one of them")
        if blob is None and others and others != [_CONTENTS.get(datatype)]:
            field = _CONTENTS.get(datatype)
            where = f"contents.{field}" if field else "raw_input_contents (it has no typed contents field)"
            wrong = ", ".join(f"contents.{f}" for f in others if f != field)
            raise RequestError(f"input {name!r}: {datatype} values go in {where}, got {wrong}")
        if blob is not None:
            dtype = _DTYPES.get(datatype)
            if dtype is not None:
                if len(blob) % dtype.itemsize:
                    raise RequestError(f"input {name!r}: {len(blob)} raw bytes are not a whole number of "
                                       f"{datatype} values")
                item["data"] = np.frombuffer(blob, dtype=dtype)
            elif datatype == "BYTES":
                item["data"] = binary_bytes(blob, name)
            else:
                raise RequestError(f"input {name!r}: datatype {datatype!r} is none this server reads "
                                   f"({', '.join(['BYTES', *NUMPY_DTYPES])})")
        elif datatype in _CONTENTS:
            values = getattr(t.contents, _CONTENTS[datatype])
            if datatype == "BYTES":  # kept as sent, UTF-8 or not (ids hash the bytes, as for binary tensors)
                item["data"] = pa.array(list(values), pa.binary())
            elif datatype in NUMPY_DTYPES:
                try:
                    item["data"] = np.asarray(values, dtype=NUMPY_DTYPES[datatype])
                except OverflowError:  # int_contents holds int32: an INT8/INT16 value may not fit
                    raise RequestError(f"input {name!r}: {datatype} contents out of the range of "
                                       f"{datatype}") from None
            else:
                item["data"] = list(values)
        else:
            item["data"] = []
        inputs.append(item)
    out = {"inputs": inputs}
    if request.id:
        out["id"] = request.id
    if request.outputs:
        out["outputs"] = [{"name": o.name, "parameters": _parameters(o.parameters)} if o.parameters else
                          {"name": o.name} for o in request.outputs]
    if request.parameters:
        out["parameters"] = _parameters(request.parameters)
    return out


def _parameters(parameters) -> dict:
    """A protobuf map of ``InferParameter`` s as the dict a JSON request's ``parameters`` reads as."""
    return {key: getattr(value, value.WhichOneof("parameter_choice") or "bool_param")
            for key, value in parameters.items()}


_RAW_TAG = 0x3A  # raw_input_contents: field 7 of ModelInferRequest, length-delimited (wire type 2)


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _raw_tail(message, start: int) -> Optional[list]:
    """``[(offset, length)]`` of the ``raw_input_contents`` entries from ``start`` to the end of the serialized
    message, or None when anything else is there."""
    out, end, i = [], len(message), start
    while i < end:
        if message[i] != _RAW_TAG:
            return None
        length, shift, i = 0, 0, i + 1
        while True:
            if i >= end or shift > 28:
                return None
            byte = message[i]
            i += 1
            length |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
        if i + length > end:
            return None
        out.append((i, length))
        i += length
    return out


class InferRequests:
    """Serialized ``ModelInferRequest`` s to ``(model_name, model_version, id, request_dict(...))``.

    A client sends the same request header call after call (the inputs' names, datatypes and shapes: everything but
    the tensors' bytes, which protobuf serializes last as ``raw_input_contents``). Protobuf reads a message as the
    merge of its parts, so a message made of a header seen before and then raw tensors of the sizes seen with it
    reads as that header's fields plus those tensors: for one (same length, same header bytes, the same tensor
    tags and lengths at the same places) the header's parse is reused and each tensor is an array over the
    message's bytes, with no protobuf parse (about 100 us less for the demo model's 39 inputs: a protobuf field
    costs ~1 us to read from Python). Anything else (another header or tensor size, BYTES inputs, typed
    ``contents``) is parsed by protobuf; both give the same (``tests/endpoint/test_grpc_http2.py``). The arrays are
    read-only, as ``request_dict``'s, and may be unaligned (numpy reads them alike; every decoder copies them into
    its batch).
    """

    def __init__(self) -> None:
        self.prefix: Optional[bytes] = None  # the header's bytes
        self.size = 0  # the message's
        self.template: tuple = ()  # (model_name, model_version, id, outputs, parameters)
        self.tensors: list = []  # [(name, datatype, shape, dtype, count, offset)]
        self.heads: tuple = ()  # (the places of the tensors' tags and lengths, their bytes)

    def parse(self, message) -> tuple:
        prefix = self.prefix
        if prefix is not None and len(message) == self.size and message[:len(prefix)] == prefix and \
                np.array_equal(np.frombuffer(message, np.uint8)[self.heads[0]], self.heads[1]):
            return self._fill(message)
        request = pb.ModelInferRequest.FromString(message)
        parsed = request_dict(request)
        self._learn(message, request, parsed)
        return request.model_name, request.model_version, request.id, parsed

    def _fill(self, message) -> tuple:
        name, version, request_id, outputs, parameters = self.template
        out = {"inputs": [{"name": input_name, "datatype": datatype, "shape": list(shape),
                           "data": np.frombuffer(message, dtype, count, offset)}
                          for input_name, datatype, shape, dtype, count, offset in self.tensors]}
        if request_id:
            out["id"] = request_id
        if outputs:
            out["outputs"] = [dict(o) for o in outputs]
        if parameters is not None:
            out["parameters"] = dict(parameters)
        return name, version, request_id, out

    def _learn(self, message, request, parsed) -> None:
        inputs = parsed["inputs"]
        if not request.raw_input_contents or not all(isinstance(t["data"], np.ndarray) and t["datatype"] in _DTYPES
                                                     for t in inputs):
            return
        sizes = [t["data"].nbytes for t in inputs]
        start = len(message) - sum(1 + _varint_size(n) + n for n in sizes)
        entries = _raw_tail(message, start) if start > 0 else None
        if entries is None or [n for _, n in entries] != sizes:  # the tensors are not all at the end
            return
        self.tensors = [(t["name"], t["datatype"], tuple(t["shape"]), _DTYPES[t["datatype"]],
                         n // _DTYPES[t["datatype"]].itemsize, offset) for t, (offset, n) in zip(inputs, entries)]
        # where each tensor's tag and length are, and their bytes: checked at once in the next message
        places = np.concatenate([np.arange(offset - 1 - _varint_size(n), offset) for offset, n in entries])
        self.heads = (places, np.frombuffer(message, np.uint8)[places])
        self.template = (request.model_name, request.model_version, request.id, parsed.get("outputs", ()),
                         parsed.get("parameters"))
        self.prefix, self.size = bytes(message[:start]), len(message)


class GrpcServer:
    """``service`` over gRPC on ``host:port`` (module docstring). :meth:`start` and :meth:`stop` run on the
    event loop that serves it.

    Args:
        service: the service answered.
        host, port: where to listen (``127.0.0.1`` by default: anything else exposes the model).
        token: when given, every call wants the metadata ``authorization: Bearer <token>``.
        max_message_bytes: the largest request message.
        max_connections, idle_timeout_s: the HTTP/2 server's limits
            (:class:`~dynemb.endpoint.grpc_http2.Http2GrpcServer`): connections at once, and the time a
            connection may stay without a call open (None: no limit).
    """

    def __init__(self, service: InferenceService, host: str = "127.0.0.1", port: int = 8001, *,
                 token: Optional[str] = None, max_message_bytes: int = 8 << 20, max_connections: int = 1024,
                 idle_timeout_s: Optional[float] = 300.0) -> None:
        self.service, self.host, self.port = service, host, port
        self.limits = {"max_connections": max_connections, "idle_timeout_s": idle_timeout_s}
        self.token, self.max_message_bytes = (None if token is None else token.encode()), max_message_bytes
        self.server: Optional[Http2GrpcServer] = None
        self.bound_port: Optional[int] = None

    def bind(self) -> None:
        """Bind ``host:port`` now (``bound_port`` is then known; listening starts with :meth:`start`).

        Raises:
            OSError: ``host:port`` cannot be bound.
        """
        if self.bound_port is not None:
            return
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # inherited by accepted connections (Linux): a reply is one write, but a client's small frames must not
        # wait for a delayed ACK either
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot listen on {self.host}:{self.port} (gRPC): {exc.strerror or exc}") from None
        self.sock, self.bound_port = sock, sock.getsockname()[1]

    async def start(self) -> None:
        """Listen and serve.

        Raises:
            OSError: ``host:port`` cannot be bound.
        """
        self.bind()
        handlers = _handlers(self)
        routes = {path: getattr(h, "route", None) for path, h in handlers.items()}

        def expired(path: str) -> None:  # a call refused at its deadline counts as a failure of its route
            if routes.get(path) is not None:
                self.service.record(routes[path], False, 0.0, 0, "grpc")

        self.server = Http2GrpcServer(handlers, self.max_message_bytes, on_expired=expired, **self.limits)
        await self.server.start(self.sock)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace_s=1.0)
            self.server = None
        if self.bound_port is not None:
            self.sock.close()
            self.bound_port = None


def _method(server: GrpcServer, route: str, request_type, answer):
    """A handler of :mod:`~dynemb.endpoint.grpc_http2`: checks the token, parses the request, runs ``answer``, counts
    the call and maps ProtocolError/RequestError to a gRPC status."""
    service = server.service

    async def handler(message: bytes, metadata: dict) -> bytes:
        start, ok, rows = time.perf_counter(), False, 0
        try:
            check_bearer(server.token, metadata.get("authorization", "").encode())
            if request_type is None:
                request = message
            else:
                try:
                    request = request_type.FromString(message)
                except DecodeError as exc:
                    raise GrpcError("INTERNAL", f"a {request_type.DESCRIPTOR.name} that does not parse: {exc}") \
                        from None
            reply = await answer(request)
            ok = True
            if route == "infer" and reply.outputs:
                rows = int(reply.outputs[0].shape[0]) if reply.outputs[0].shape else 1
            return reply.SerializeToString()
        except ProtocolError as exc:
            raise GrpcError(GRPC_CODES.get(exc.status, "UNKNOWN"), str(exc)) from None
        except RequestError as exc:
            raise GrpcError("INVALID_ARGUMENT", str(exc)) from None
        finally:  # once the reply is written (as HTTP counts after sending): not on the client's wait
            asyncio.get_running_loop().call_soon(service.record, route, ok, time.perf_counter() - start, rows, "grpc")
    handler.route = route
    return handler


def _handlers(server: GrpcServer) -> dict:
    """``{":path": handler}`` for every method of ``inference.GRPCInferenceService``."""
    service = server.service

    async def live(request):
        return pb.ServerLiveResponse(live=True)

    async def server_ready(request):
        return pb.ServerReadyResponse(ready=service.ready)

    async def ready(request):
        # Triton's ModelReady answers ready=false for a model it does not know (HTTP's is a 404, which
        # tritonclient.http reads as False too): a probe script written for Triton must not get an error here
        try:
            return pb.ModelReadyResponse(ready=service.model_ready(request.name, request.version or None))
        except ProtocolError as exc:
            if exc.status != 404:
                raise
            return pb.ModelReadyResponse(ready=False)

    async def server_metadata(request):
        return json_format.ParseDict(service.server_metadata(), pb.ServerMetadataResponse())

    async def metadata(request):
        meta = service.model_metadata(request.name, request.version or None)
        return json_format.ParseDict(meta, pb.ModelMetadataResponse(), ignore_unknown_fields=True)

    async def config(request):
        config = service.model_config(request.name, request.version or None)
        return json_format.ParseDict({"config": config}, pb.ModelConfigResponse(), ignore_unknown_fields=True)

    async def stats(request):
        stats = service.statistics(request.name or None, request.version or None)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)

    requests = InferRequests()
    described = [None, None, []]  # (model, version, its outputs' metadata): built once a version, not per call

    async def infer(message):
        # a message over max_message_bytes was answered RESOURCE_EXHAUSTED before this runs (grpc_http2)
        try:
            name, version, request_id, parsed = requests.parse(message)
        except DecodeError as exc:
            raise GrpcError("INTERNAL", f"a ModelInferRequest that does not parse: {exc}") from None
        outputs, version, model = await service.infer(name, version or None, parsed)
        reply = pb.ModelInferResponse(model_name=service.name, model_version=str(version), id=request_id)
        if described[0] is not model or described[1] != model.version:
            described[:] = [model, model.version, model.metadata()["outputs"]]
        for name, _ in requested_outputs(parsed, described[2]):
            value = np.ascontiguousarray(outputs[name])
            reply.outputs.add(name=name, datatype=numpy_datatype(value.dtype), shape=list(value.shape))
            reply.raw_output_contents.append(value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes())
        return reply

    methods = {"ServerLive": ("live", pb.ServerLiveRequest, live),
               "ServerReady": ("server_ready", pb.ServerReadyRequest, server_ready),
               "ModelReady": ("ready", pb.ModelReadyRequest, ready),
               "ServerMetadata": ("server_metadata", pb.ServerMetadataRequest, server_metadata),
               "ModelMetadata": ("metadata", pb.ModelMetadataRequest, metadata),
               "ModelConfig": ("config", pb.ModelConfigRequest, config),
               "ModelStatistics": ("stats", pb.ModelStatisticsRequest, stats),
               "ModelInfer": ("infer", None, infer)}  # InferRequests parses its messages
    handlers = {f"/inference.GRPCInferenceService/{name}": _method(server, route, request_type, answer)
                for name, (route, request_type, answer) in methods.items()}
    for names, what in ((("SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister"),
                         "systemsharedmemory"),
                        (("CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister"),
                         "cudasharedmemory"),
                        (("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"), "repository"),
                        (("TraceSetting",), "trace"), (("LogSettings",), "logging")):
        for name in names:
            handlers[f"/inference.GRPCInferenceService/{name}"] = _not_supported(NOT_SUPPORTED[what])
    return handlers


def _not_supported(what: str):
    async def handler(message: bytes, metadata: dict) -> bytes:
        raise GrpcError("UNIMPLEMENTED", f"{what} is not supported by dynemb serve")
    return handler
