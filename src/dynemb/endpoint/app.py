"""The HTTP/REST transport of the Open Inference Protocol (KServe v2, with Triton's extensions) as an ASGI app.

=====================================================================  ============================================
route (``[/versions/{v}]``: the same with a version, which must be      answer
the one served)
=====================================================================  ============================================
``GET /v2``                                                            server metadata (name, version, extensions)
``GET /v2/health/live``, ``/v2/health/ready``                          200 ``{"live": true}``; ``{"ready": true}``,
                                                                       503 while the first version is awaited
``GET /v2/models/{m}[/versions/{v}]``                                  model metadata
``GET /v2/models/{m}[/versions/{v}]/ready``                            200 when served, else 503 (loading) or 404
``GET /v2/models/{m}[/versions/{v}]/config``                           Triton's model configuration
``POST /v2/models/{m}[/versions/{v}]/infer``                           inference: JSON or binary tensors in and out
``GET /v2/models[/{m}[/versions/{v}]]/stats``                          Triton's statistics extension
``GET /metrics``                                                       Prometheus text (:mod:`.prometheus_metrics`)
shared memory, repository, trace and logging routes                    501: not supported
=====================================================================  ============================================

Every answer but ``/metrics`` is JSON; an error is ``{"error": "..."}``, 404s and 405s included. A request body
may be compressed (``Content-Encoding: gzip`` or ``deflate``; the limit applies to the body as sent and as
inflated); an answer is compressed when ``Accept-Encoding`` asks for gzip or deflate. Outputs come back as binary
tensors (``Inference-Header-Content-Length``) when the request asks (``outputs[].parameters.binary_data``, or
``parameters.binary_data_output``). With a token, every route wants ``Authorization: Bearer <token>`` (the
scheme in any case, as RFC 7235 has it), else 401. Concurrent requests are scored together (:class:`.service.Batcher`).
The router is a few comparisons of path parts: every route answers without a framework's request objects, which
cost a measurable share of a 2 ms request.
"""

from __future__ import annotations

import time
import zlib
from typing import Optional

import numpy as np

from .service import (NOT_SUPPORTED, InferenceService, ProtocolError, check_bearer, numpy_datatype,
                      requested_outputs)
from .wire import RequestError, dumps_json, parse_body

__all__ = ["build_app", "HttpApp", "MAX_BODY_BYTES", "MAX_BATCH_SIZE"]

MAX_BODY_BYTES = 8 << 20
MAX_BATCH_SIZE = 4096
BINARY_HEADER = b"inference-header-content-length"
DRAIN_FACTOR = 4
_JSON_TYPE = (b"content-type", b"application/json")
_BINARY_TYPE = (b"content-type", b"application/octet-stream")
_ROUTE_METHOD = {"infer": "POST"}  # every other route is a GET (HEAD too)


def _read_limit(declared: Optional[bytes], limit: int) -> Optional[int]:
    return int(declared) if declared is not None and declared.isdigit() else None


def _json_length(header: Optional[bytes], body_bytes: int) -> Optional[int]:
    """The JSON part's length from an ``Inference-Header-Content-Length`` value, None without one.

    Raises:
        RequestError: not a whole number of bytes within the body (it was read as no header: the binary part was
            then taken for bad JSON, "unexpected content after document").
    """
    if header is None:
        return None
    text = header.decode("latin-1").strip()
    if not text.isdigit() or int(text) > body_bytes:
        raise RequestError(f"header Inference-Header-Content-Length must be the bytes of the body's JSON part, "
                           f"an integer in 0..{body_bytes} (the body's length), got {text[:40]!r}")
    return int(text)


async def _read_body(receive, declared: Optional[bytes], limit: int) -> bytes:
    """The request body from ASGI ``receive`` messages; over ``limit`` bytes (declared or sent) is a RequestError.

    An oversized body is still read to its end (and dropped), up to ``DRAIN_FACTOR * limit`` bytes, so that a
    client that sends the whole body before it reads the answer gets the 400 instead of a broken pipe."""
    size = _read_limit(declared, limit)
    chunks, received, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("the client went away")
        chunk = message.get("body", b"")
        received += len(chunk)
        more = message.get("more_body", False)
        if received <= limit and (size is None or size <= limit):
            chunks.append(chunk)
        elif received > DRAIN_FACTOR * limit or (size is not None and size > DRAIN_FACTOR * limit):
            break  # not worth reading: answer now, the connection closes
    if size is not None and size > limit:
        raise RequestError(f"the request body has {size} bytes, more than the limit ({limit})")
    if received > limit:
        raise RequestError(f"the request body is over the limit ({limit} bytes)")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """``body`` decoded by its ``Content-Encoding`` (``gzip``, ``deflate`` as zlib or raw, ``identity``), at most
    ``limit`` bytes once inflated (a small body must not inflate into gigabytes).

    Raises:
        RequestError: another encoding, a body that does not decode, or one over the limit once inflated.
    """
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise RequestError(f"Content-Encoding must be gzip, deflate or identity, got {encoding!r}")
    # gzip: a gzip header (wbits 16+); deflate: the zlib stream RFC 9110 means, or the raw one some clients send
    for wbits in ((31,) if encoding != "deflate" else (15, -15)):
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(body, limit + 1)
        except zlib.error as exc:
            error = exc
            continue
        if len(out) > limit or inflater.unconsumed_tail:
            raise RequestError(f"the request body is over the limit ({limit} bytes) once inflated ({encoding})")
        if not inflater.eof:
            error = "the stream is truncated"
            continue
        return out
    raise RequestError(f"the request body is not valid {encoding} data ({error})")


def _accepted_encoding(accept: Optional[bytes]) -> Optional[str]:
    """``gzip`` or ``deflate`` when ``Accept-Encoding`` asks for it (q > 0), gzip first; else None."""
    if not accept:
        return None
    wanted = {}
    for part in accept.decode("latin-1").lower().split(","):
        coding, _, params = part.strip().partition(";")
        q = 1.0
        if params.strip().startswith("q="):
            try:
                q = float(params.strip()[2:])
            except ValueError:
                q = 0.0
        wanted[coding.strip()] = q
    for coding in ("gzip", "deflate"):
        if wanted.get(coding, 0) > 0:
            return coding
    return None


def _compress(body: bytes, coding: str) -> bytes:
    # level 1: most of the size gone for a small share of the time of the default level
    if coding == "gzip":
        z = zlib.compressobj(1, zlib.DEFLATED, 31)
    else:
        z = zlib.compressobj(1)
    return z.compress(body) + z.flush()


def encode_infer_response(name: str, version: int, request, outputs: dict, model_outputs: list) -> tuple[bytes, int]:
    """The infer response body and its JSON header's length (``-1``: all JSON, no binary tensors)."""
    binary, tensors = [], []
    for out_name, as_binary in requested_outputs(request, model_outputs):
        value = np.ascontiguousarray(outputs[out_name])
        tensor = {"name": out_name, "datatype": numpy_datatype(value.dtype), "shape": list(value.shape)}
        if as_binary:
            raw = value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes()
            tensor["parameters"] = {"binary_data_size": len(raw)}
            binary.append(raw)
        else:
            tensor["data"] = value.ravel().tolist()
        tensors.append(tensor)
    out = {"model_name": name, "model_version": str(version), "outputs": tensors}
    if isinstance(request, dict) and "id" in request:
        out["id"] = request["id"]
    head = dumps_json(out)
    return (head + b"".join(binary), len(head)) if binary else (head, -1)


class HttpApp:
    """The ASGI app of an :class:`~dynemb.endpoint.service.InferenceService` (module docstring).

    Args:
        service: the service answered.
        token: when given, every route wants ``Authorization: Bearer <token>``.
        max_body_bytes: larger request bodies (as sent or inflated) are refused (400).
        on_startup, on_shutdown: callables run in the server's event loop (coroutines awaited) at its ASGI
            lifespan's start and end: the gRPC server starts there, on the same loop and batcher.
    """

    def __init__(self, service: InferenceService, *, token: Optional[str] = None,
                 max_body_bytes: int = MAX_BODY_BYTES, on_startup=(), on_shutdown=()) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        if token is not None and not token:
            raise ValueError("token must not be empty")
        self.service, self.max_body_bytes = service, max_body_bytes
        self.token = None if token is None else token.encode()
        self.on_startup, self.on_shutdown = list(on_startup), list(on_shutdown)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        start = time.perf_counter()
        headers = dict(scope["headers"])
        coding = _accepted_encoding(headers.get(b"accept-encoding"))
        route, rows = "other", 0
        try:
            check_bearer(self.token, headers.get(b"authorization"))
            route, params = _route(scope["path"])
            wanted = _ROUTE_METHOD.get(route, "GET")
            method = scope["method"]
            if method != wanted and not (wanted == "GET" and method == "HEAD"):
                if route == "infer":
                    self.service.served(*params)  # an unknown model is a 404 before a wrong method
                raise ProtocolError(405, f"{route} takes {wanted}, got {method}")
            if route == "infer":
                status, body, extra, rows = await self._infer(params, headers, receive)
            elif route == "metrics":
                status, body, extra = 200, self._metrics(), [(b"content-type", b"text/plain; version=0.0.4")]
            else:
                status, body, extra = 200, dumps_json(self._get(route, params)), [_JSON_TYPE]
        except ConnectionResetError:
            return
        except ProtocolError as exc:
            status, body, extra = exc.status, dumps_json({"error": str(exc)}), [_JSON_TYPE]
        except Exception as exc:  # noqa: BLE001 - a bug answers 500 and the server goes on
            status = 500
            body, extra = dumps_json({"error": f"internal error: {type(exc).__name__}: {exc}"[:500]}), [_JSON_TYPE]
        if status == 401:
            extra = [*extra, (b"www-authenticate", b"Bearer")]
        # Errors go out plain: clients read them before (tritonclient: without) looking at Content-Encoding.
        if coding is not None and route != "metrics" and status == 200:
            body = _compress(body, coding)
            extra = [*extra, (b"content-encoding", coding.encode())]
        await send({"type": "http.response.start", "status": status,
                    "headers": [*extra, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body if scope["method"] != "HEAD" else b""})
        if route != "other" or status != 404:
            self.service.record(route, status == 200, time.perf_counter() - start, rows, "http")

    async def _infer(self, params: tuple, headers: dict, receive) -> tuple:
        service = self.service
        model = service.served(*params)  # an unknown model or version: 404 before the body is read
        try:
            body = await _read_body(receive, headers.get(b"content-length"), self.max_body_bytes)
            encoding = headers.get(b"content-encoding")
            if encoding:
                body = inflate(body, encoding.decode("latin-1"), self.max_body_bytes)
            request = parse_body(body, _json_length(headers.get(BINARY_HEADER), len(body)))
        except RequestError as exc:
            raise ProtocolError(400, str(exc)) from None
        outputs, version, model = await service.infer(*params, request)
        body, head = encode_infer_response(service.name, version, request, outputs, model.metadata()["outputs"])
        extra = [_JSON_TYPE] if head < 0 else [_BINARY_TYPE, (BINARY_HEADER, str(head).encode())]
        rows = len(next(iter(outputs.values()))) if outputs else 0
        return 200, body, extra, rows

    def _get(self, route: str, params: tuple) -> dict:
        service = self.service
        if route == "server_metadata":
            return service.server_metadata()
        if route == "live":
            return {"live": True}
        if route == "server_ready":
            why = service.unready()
            if why is not None:
                raise ProtocolError(503, f"not ready: {why}")
            return {"ready": True}
        if route == "metadata":
            return service.model_metadata(*params)
        if route == "ready":
            service.served(*params)
            why = service.unready()
            if why is not None:
                raise ProtocolError(503, f"model {service.name!r} is not ready: {why}")
            return {"name": service.name, "ready": True}
        if route == "config":
            return service.model_config(*params)
        if route == "stats":
            return service.statistics(*params)
        raise ProtocolError(404, f"no route {route!r}")  # pragma: no cover - _route names only these

    def _metrics(self) -> bytes:
        if self.service.metrics is None:
            raise ProtocolError(404, "metrics are off on this server")
        return self.service.metrics.render()

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    for hook in self.on_startup:
                        result = hook()
                        if hasattr(result, "__await__"):
                            await result
                except Exception as exc:  # noqa: BLE001 - reported to the server, which stops
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for hook in self.on_shutdown:
                    result = hook()
                    if hasattr(result, "__await__"):
                        await result
                self.service.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _route(path: str) -> tuple[str, tuple]:
    """``(route, (model, version))`` of a request path.

    Raises:
        ProtocolError: 404 for a path no route has, 501 for a route of an extension this server lacks.
    """
    parts = path.split("/")[1:]
    if parts and parts[-1] == "" and len(parts) > 1:
        parts = parts[:-1]  # a trailing slash
    if parts == ["metrics"]:
        return "metrics", ()
    if not parts or parts[0] != "v2" or "" in parts:
        raise ProtocolError(404, f"no route for {path!r}; the routes are under /v2 (and /metrics)")
    rest = parts[1:]
    if not rest:
        return "server_metadata", ()
    if rest[0] == "health" and len(rest) == 2 and rest[1] in ("live", "ready"):
        return ("live" if rest[1] == "live" else "server_ready"), ()
    if rest[0] in NOT_SUPPORTED:
        raise ProtocolError(501, f"{NOT_SUPPORTED[rest[0]]} is not supported by dynemb serve ({path})")
    if rest[0] == "models" and len(rest) >= 2:
        if rest[1:] == ["stats"]:
            return "stats", ()
        name, tail, version = rest[1], rest[2:], None
        if tail[:1] == ["versions"] and len(tail) >= 2:
            version, tail = tail[1], tail[2:]
        if tail[:1] == ["trace"]:
            raise ProtocolError(501, f"{NOT_SUPPORTED['trace']} is not supported by dynemb serve ({path})")
        if not tail:
            return "metadata", (name, version)
        if len(tail) == 1 and tail[0] in ("ready", "config", "infer", "stats"):
            return tail[0], (name, version)
    raise ProtocolError(404, f"no route for {path!r}")


def build_app(model=None, *, name: Optional[str] = None, token: Optional[str] = None,
              max_body_bytes: int = MAX_BODY_BYTES, max_batch_size: int = MAX_BATCH_SIZE,
              metrics: bool = True, service: Optional[InferenceService] = None) -> HttpApp:
    """The ASGI app serving ``model`` under its name (``model.name``).

    Args:
        model: the served model (a :class:`~dynemb.endpoint.ServedModel` or any
            :class:`~dynemb.endpoint.service.Servable`); ``None`` with ``name``: live, not ready, until
            ``app.service.install(model)``.
        name: the model's name when ``model`` is None.
        token: when given, every route wants ``Authorization: Bearer <token>``.
        max_body_bytes: larger request bodies are refused (400).
        max_batch_size: most rows of one request, and of one forward pass over concurrent requests.
        metrics: serve ``GET /metrics`` (Prometheus text).
        service: an existing service to answer (its own model and limits); the others are then ignored.

    Raises:
        ValueError: ``max_body_bytes`` or ``max_batch_size`` is not positive, ``token`` is empty, or neither
            ``model`` nor ``name`` is given.

    Example:
        >>> app = build_app(name="ctr")  # nothing to serve yet: live, not ready
        >>> app.service.ready
        False
    """
    if service is None:
        if model is None and name is None:
            raise ValueError("build_app needs a model, or the name of the model it will serve")
        service = InferenceService(name or model.name, model, max_batch_size=max_batch_size)
        if metrics:
            from .prometheus_metrics import Metrics

            service.attach_metrics(Metrics(service))
    return HttpApp(service, token=token, max_body_bytes=max_body_bytes)
