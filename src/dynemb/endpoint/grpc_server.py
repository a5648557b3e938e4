"""The gRPC transport of the Open Inference Protocol (KServe v2's ``inference.GRPCInferenceService``).

The messages and the service definition are the ones ``tritonclient[grpc]`` ships (``tritonclient.grpc.service_pb2``
and ``service_pb2_grpc``, generated from Triton's ``grpc_service.proto``), so a Triton client talks to it
unchanged. Each call goes to the same :class:`~dynemb.endpoint.service.InferenceService` as the HTTP routes, on the
same event loop (:class:`GrpcServer` starts in the HTTP app's lifespan), so requests from both transports are
batched together and answered alike: the same bearer token (the ``authorization`` metadata), the same limits (the
largest message is the largest HTTP body) and the same errors, with each HTTP status mapped onto a gRPC code
(:data:`~dynemb.endpoint.service.GRPC_CODES`). Input tensors come as ``raw_input_contents`` (what tritonclient
sends) or typed ``contents``; outputs always go back as ``raw_output_contents``, as Triton answers.
"""

from __future__ import annotations

import hmac
import time
from typing import Optional

import numpy as np

try:
    import grpc
    from google.protobuf import json_format
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"dynemb serve's gRPC endpoint needs grpcio and tritonclient[grpc]: "
                      f"pip install 'dynemb[serving]' ({exc})") from exc

from .service import GRPC_CODES, NOT_SUPPORTED, InferenceService, ProtocolError, numpy_datatype, requested_outputs
from .wire import NUMPY_DTYPES, RequestError, binary_strings

__all__ = ["GrpcServer", "request_dict"]

_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
             "FP64": "fp64_contents", "BYTES": "bytes_contents"}
_DTYPES = {datatype: np.dtype(spec) for datatype, spec in NUMPY_DTYPES.items()}


def _utf8(values, name) -> list:
    try:
        return [v.decode("utf-8") for v in values]
    except UnicodeDecodeError:
        raise RequestError(f"input {name!r}: BYTES elements must be UTF-8 text") from None


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
        if blob is not None:
            dtype = _DTYPES.get(datatype)
            if dtype is not None:
                if len(blob) % dtype.itemsize:
                    raise RequestError(f"input {name!r}: {len(blob)} raw bytes are not a whole number of "
                                       f"{datatype} values")
                item["data"] = np.frombuffer(blob, dtype=dtype)
            elif datatype == "BYTES":
                item["data"] = binary_strings(blob, name)
            else:
                raise RequestError(f"input {name!r}: datatype {datatype!r} is none this server reads "
                                   f"({', '.join(['BYTES', *NUMPY_DTYPES])})")
        elif datatype in _CONTENTS:
            values = getattr(t.contents, _CONTENTS[datatype])
            if datatype == "BYTES":
                item["data"] = _utf8(values, name)
            elif datatype in NUMPY_DTYPES:
                item["data"] = np.asarray(values, dtype=NUMPY_DTYPES[datatype])
            else:
                item["data"] = list(values)
        else:
            item["data"] = []
        inputs.append(item)
    out = {"inputs": inputs}
    if request.id:
        out["id"] = request.id
    if request.outputs:
        out["outputs"] = [{"name": o.name} for o in request.outputs]
    return out


class GrpcServer:
    """``service`` over gRPC on ``host:port`` (module docstring). :meth:`start` and :meth:`stop` run on the
    event loop that serves it.

    Args:
        service: the service answered.
        host, port: where to listen (``127.0.0.1`` by default: anything else exposes the model).
        token: when given, every call wants the metadata ``authorization: Bearer <token>``.
        max_message_bytes: the largest request message.
    """

    def __init__(self, service: InferenceService, host: str = "127.0.0.1", port: int = 8001, *,
                 token: Optional[str] = None, max_message_bytes: int = 8 << 20) -> None:
        self.service, self.host, self.port = service, host, port
        self.token, self.max_message_bytes = (None if token is None else token.encode()), max_message_bytes
        self.server: Optional[grpc.aio.Server] = None
        self.bound_port: Optional[int] = None

    async def start(self) -> None:
        """Listen and serve.

        Raises:
            OSError: ``host:port`` cannot be bound.
        """
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", self.max_message_bytes),
                                               ("grpc.so_reuseport", 0)])
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(_Servicer(self), self.server)
        address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        try:
            self.bound_port = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {self.host}:{self.port} (gRPC): {exc}") from None
        if not self.bound_port:
            raise OSError(f"cannot listen on {self.host}:{self.port} (gRPC)")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=1.0)

    def authorized(self, context) -> bool:
        if self.token is None:
            return True
        given = dict(context.invocation_metadata()).get("authorization", "")
        scheme, _, value = given.strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token)


def _answer(route: str):
    """A servicer method that checks the token, runs ``fn``, counts the call and maps ProtocolError to a status."""

    def wrap(fn):
        async def method(self, request, context):
            start, ok, rows = time.perf_counter(), False, 0
            try:
                if not self.server.authorized(context):
                    raise ProtocolError(401, "missing or wrong bearer token")
                reply = await fn(self, request)
                ok = True
                if route == "infer" and reply.outputs:
                    rows = int(reply.outputs[0].shape[0]) if reply.outputs[0].shape else 1
                return reply
            except ProtocolError as exc:
                await context.abort(getattr(grpc.StatusCode, GRPC_CODES.get(exc.status, "UNKNOWN")), str(exc))
            except RequestError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            finally:
                self.service.record(route, ok, time.perf_counter() - start, rows, "grpc")
        method.__name__ = fn.__name__
        return method
    return wrap


def _not_supported(what: str):
    async def method(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{what} is not supported by dynemb serve")
    return method


class _Servicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, server: GrpcServer) -> None:
        self.server, self.service = server, server.service

    @_answer("live")
    async def ServerLive(self, request):
        return pb.ServerLiveResponse(live=True)

    @_answer("server_ready")
    async def ServerReady(self, request):
        return pb.ServerReadyResponse(ready=self.service.ready)

    @_answer("ready")
    async def ModelReady(self, request):
        return pb.ModelReadyResponse(ready=self.service.model_ready(request.name, request.version or None))

    @_answer("server_metadata")
    async def ServerMetadata(self, request):
        return json_format.ParseDict(self.service.server_metadata(), pb.ServerMetadataResponse())

    @_answer("metadata")
    async def ModelMetadata(self, request):
        meta = self.service.model_metadata(request.name, request.version or None)
        return json_format.ParseDict(meta, pb.ModelMetadataResponse(), ignore_unknown_fields=True)

    @_answer("config")
    async def ModelConfig(self, request):
        config = self.service.model_config(request.name, request.version or None)
        return json_format.ParseDict({"config": config}, pb.ModelConfigResponse(), ignore_unknown_fields=True)

    @_answer("stats")
    async def ModelStatistics(self, request):
        stats = self.service.statistics(request.name or None, request.version or None)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)

    @_answer("infer")
    async def ModelInfer(self, request):
        # grpc refuses a message over max_message_bytes before this runs (grpc.max_receive_message_length)
        parsed = request_dict(request)
        outputs, version, model = await self.service.infer(request.model_name, request.model_version or None,
                                                           parsed)
        reply = pb.ModelInferResponse(model_name=self.service.name, model_version=str(version), id=request.id)
        for name, _ in requested_outputs(parsed, model.metadata()["outputs"]):
            value = np.ascontiguousarray(outputs[name])
            reply.outputs.add(name=name, datatype=numpy_datatype(value.dtype), shape=list(value.shape))
            reply.raw_output_contents.append(value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes())
        return reply

    SystemSharedMemoryStatus = _not_supported(NOT_SUPPORTED["systemsharedmemory"])
    SystemSharedMemoryRegister = _not_supported(NOT_SUPPORTED["systemsharedmemory"])
    SystemSharedMemoryUnregister = _not_supported(NOT_SUPPORTED["systemsharedmemory"])
    CudaSharedMemoryStatus = _not_supported(NOT_SUPPORTED["cudasharedmemory"])
    CudaSharedMemoryRegister = _not_supported(NOT_SUPPORTED["cudasharedmemory"])
    CudaSharedMemoryUnregister = _not_supported(NOT_SUPPORTED["cudasharedmemory"])
    RepositoryIndex = _not_supported(NOT_SUPPORTED["repository"])
    RepositoryModelLoad = _not_supported(NOT_SUPPORTED["repository"])
    RepositoryModelUnload = _not_supported(NOT_SUPPORTED["repository"])
    TraceSetting = _not_supported(NOT_SUPPORTED["trace"])
    LogSettings = _not_supported(NOT_SUPPORTED["logging"])
