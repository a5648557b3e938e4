"""The HTTP/REST endpoint (Open Inference Protocol, KServe v2) of a :class:`ServedModel`, on Starlette.

Routes: ``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /v2/models/{name}`` (metadata), ``POST
/v2/models/{name}/infer`` and ``GET /v2/models[/{name}[/versions/{version}]]/stats`` (Triton's statistics extension:
requests, rows scored, forward passes, their time). A request the model cannot score (bad JSON, a missing, unknown or
mistyped input, sizes that disagree, a body over ``max_body_bytes``, more than ``max_batch_size`` rows) is answered 400
with ``{"error": "..."}`` naming the input; an unknown model is 404; with a token, a request without ``Authorization:
Bearer <token>`` is 401, on every route. Concurrent requests are scored together: a single worker runs one forward pass
over all the requests waiting (up to ``max_batch_size`` rows), then splits the output.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

try:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"dynemb serve needs starlette and uvicorn: pip install 'dynemb[serving]' ({exc})") from exc

from ..data.batch import Batch, concat_batches
from .model import ServedModel
from .inference_protocol import decode_request, encode_response, model_metadata
from .wire import RequestError, dumps_json, parse_body

__all__ = ["build_app", "MAX_BODY_BYTES", "MAX_BATCH_SIZE"]

MAX_BODY_BYTES = 8 << 20
MAX_BATCH_SIZE = 4096
BINARY_HEADER = "inference-header-content-length"
DRAIN_FACTOR = 4
NOT_POST = ["GET", "HEAD", "PUT", "PATCH", "DELETE", "OPTIONS"]  # on the infer path: a JSON 405


class _JSON(JSONResponse):
    def render(self, content) -> bytes:
        return dumps_json(content)


def _error(status: int, message: str) -> JSONResponse:
    return _JSON({"error": message}, status_code=status)


class _Batcher:
    """Scores the batches of concurrent requests together, one forward pass at a time, on one worker thread.

    A request alone (after one turn of the event loop, no other request has come to be scored, no forward pass
    runs or waits, no update is being swapped in) is scored on the event loop's thread instead: two thread
    hand-offs less. Requests that arrive meanwhile wait in their sockets and are batched next.
    """

    def __init__(self, model: ServedModel, max_rows: int, inline: bool = True) -> None:
        self.model, self.max_rows, self.inline = model, max_rows, inline
        self._queue: Optional[asyncio.Queue] = None
        self._worker: Optional[asyncio.Task] = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dynemb-serve")
        self._arrived = 0  # requests in score() that have not yet chosen where to run
        self._running = False  # a forward pass on the worker thread
        self.forward_passes = self.inline_passes = self.forward_ns = 0

    async def score(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """``(probabilities [B], the version that scored them)`` of one request's rows."""
        if self.inline:
            self._arrived += 1
            try:
                await asyncio.sleep(0)  # the other requests ready now get here too
                alone = self._arrived == 1 and not self._running and (self._queue is None or self._queue.empty())
            finally:
                self._arrived -= 1
            if alone and not self.model.updating():
                self.inline_passes += 1
                return self._forward([batch])
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.get_running_loop().create_task(self._run())
        done = asyncio.get_running_loop().create_future()
        await self._queue.put((batch, done))
        return await done

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            waiting = [await self._queue.get()]
            rows = len(waiting[0][0])
            while not self._queue.empty() and rows + len(self._queue._queue[0][0]) <= self.max_rows:
                waiting.append(self._queue.get_nowait())
                rows += len(waiting[-1][0])
            self._running = True
            try:
                probs, version = await loop.run_in_executor(self._pool, self._forward, [b for b, _ in waiting])
            except Exception as exc:  # noqa: BLE001 - each waiting request gets the error, the worker goes on
                for _, done in waiting:
                    if not done.done():
                        done.set_exception(exc)
                continue
            finally:
                self._running = False
            for (_, done), p in zip(waiting, torch.split(probs, [len(b) for b, _ in waiting])):
                if not done.done():
                    done.set_result((p, version))

    def _forward(self, batches: list) -> tuple[torch.Tensor, int]:
        start = time.perf_counter_ns()
        batch = batches[0] if len(batches) == 1 else concat_batches(batches)
        out = self.model.predict_versioned(batch) if len(batch) else (torch.zeros(0), self.model.version)
        self.forward_passes += 1
        self.forward_ns += time.perf_counter_ns() - start
        return out

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)


class _BearerToken:
    """ASGI middleware: 401 unless ``Authorization: Bearer <token>`` (compared in constant time)."""

    def __init__(self, app, token: str) -> None:
        self.app, self.expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = _error(401, "missing or wrong bearer token")
                response.headers["WWW-Authenticate"] = "Bearer"
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


async def _read_body(receive, declared: Optional[bytes], limit: int) -> bytes:
    """The request body from ASGI ``receive`` messages; over ``limit`` bytes (declared or sent) is a RequestError.

    An oversized body is still read to its end (and dropped), up to ``DRAIN_FACTOR * limit`` bytes, so that a
    client that sends the whole body before it reads the answer gets the 400 instead of a broken pipe."""
    size = int(declared) if declared is not None and declared.isdigit() else None
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


_JSON_HEADERS = [(b"content-type", b"application/json")]


async def _send_json(send, status: int, content) -> None:
    body = dumps_json(content)
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _unknown_model(name: str, model: ServedModel) -> str:
    return f"unknown model {name!r}; this server has {model.name!r}"


class _Stats:
    """Counts behind the statistics route: requests answered 200 and not, their time, rows scored."""

    def __init__(self) -> None:
        self.success = [0, 0]  # count, ns
        self.fail = [0, 0]
        self.rows = 0
        self.last_ms = 0

    def record(self, ok: bool, ns: int, rows: int) -> None:
        counter = self.success if ok else self.fail
        counter[0] += 1
        counter[1] += ns
        self.rows += rows
        if ok:
            self.last_ms = time.time_ns() // 1_000_000

    def model_stats(self, model: ServedModel, batcher: "_Batcher") -> dict:
        """One entry of the Triton statistics extension's ``model_stats`` (durations in ns, as it counts)."""
        duration = lambda count, ns: {"count": count, "ns": ns}  # noqa: E731
        return {"name": model.name, "version": str(model.version), "last_inference": self.last_ms,
                "inference_count": self.rows, "execution_count": batcher.forward_passes,
                "inference_stats": {"success": duration(*self.success), "fail": duration(*self.fail),
                                    "compute_infer": duration(batcher.forward_passes, batcher.forward_ns)}}


class _Infer:
    """``POST /v2/models/{name}/infer`` as a plain ASGI app in front of the Starlette one: the route every
    prediction takes skips the router, the request and response objects and the exception middleware (about
    0.3 ms of a request's 2 ms budget, most of it code the forward pass pushed out of the caches). The other
    routes, and other methods on this path, go to ``routes``."""

    PREFIX, SUFFIX = "/v2/models/", "/infer"

    def __init__(self, routes, model: ServedModel, batcher: "_Batcher", max_body_bytes: int, max_batch_size: int):
        self.routes, self.model, self.batcher = routes, model, batcher
        self.max_body_bytes, self.max_batch_size = max_body_bytes, max_batch_size
        self.stats = _Stats()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if not (scope["type"] == "http" and scope["method"] == "POST" and path.startswith(self.PREFIX)
                and path.endswith(self.SUFFIX) and "/" not in path[len(self.PREFIX):-len(self.SUFFIX)]
                and len(path) > len(self.PREFIX) + len(self.SUFFIX)):
            return await self.routes(scope, receive, send)
        start = time.perf_counter_ns()
        try:
            status, content = await self.infer(path[len(self.PREFIX):-len(self.SUFFIX)], scope, receive)
        except ConnectionResetError:
            return
        except Exception as exc:  # noqa: BLE001 - a bug answers 500 and the server goes on, as Starlette's would
            status, content = 500, {"error": f"internal error: {type(exc).__name__}: {exc}"[:500]}
        await _send_json(send, status, content)
        self.stats.record(status == 200, time.perf_counter_ns() - start,
                          content["outputs"][0]["shape"][0] if status == 200 else 0)

    async def infer(self, name: str, scope, receive) -> tuple[int, dict]:
        model = self.model
        if name != model.name:
            return 404, {"error": _unknown_model(name, model)}
        headers = dict(scope["headers"])
        try:
            body = await _read_body(receive, headers.get(b"content-length"), self.max_body_bytes)
            header = headers.get(BINARY_HEADER.encode())
            parsed = parse_body(body, int(header) if header and header.isdigit() else None)
            batch = decode_request(parsed, model.preprocessing, self.max_batch_size)
        except RequestError as exc:
            return 400, {"error": str(exc)}
        try:
            probs, version = await self.batcher.score(batch)
        except (RequestError, ValueError, TypeError) as exc:
            return 400, {"error": str(exc).splitlines()[0]}
        return 200, encode_response(model.name, version, parsed, probs)


def build_app(model: ServedModel, *, token: Optional[str] = None, max_body_bytes: int = MAX_BODY_BYTES,
              max_batch_size: int = MAX_BATCH_SIZE):
    """The ASGI app serving ``model`` under its name (``model.name``).

    Args:
        model: the served model.
        token: when given, every route wants ``Authorization: Bearer <token>``.
        max_body_bytes: larger request bodies are refused (400).
        max_batch_size: most rows of one request, and of one forward pass over concurrent requests.

    Raises:
        ValueError: ``max_body_bytes`` or ``max_batch_size`` is not positive, or ``token`` is empty.
    """
    if max_body_bytes < 1 or max_batch_size < 1:
        raise ValueError(f"max_body_bytes and max_batch_size must be >= 1, got {max_body_bytes}, {max_batch_size}")
    if token is not None and not token:
        raise ValueError("token must not be empty")
    batcher = _Batcher(model, max_batch_size)

    def known(request: Request) -> Optional[Response]:
        name = request.path_params["name"]
        return None if name == model.name else _error(404, _unknown_model(name, model))

    async def live(request: Request) -> Response:
        return _JSON({"live": True})

    async def ready(request: Request) -> Response:
        return _JSON({"ready": True})

    async def metadata(request: Request) -> Response:
        return known(request) or _JSON(model_metadata(model.name, model.version, model.preprocessing))

    async def stats(request: Request) -> Response:
        name = request.path_params.get("name")
        if name is not None and (missing := known(request)) is not None:
            return missing
        version = request.path_params.get("version")
        if version is not None and version != str(model.version):
            return _error(404, f"model {model.name!r} serves version {model.version}, not {version!r}")
        return _JSON({"model_stats": [infer.stats.model_stats(model, batcher)]})

    async def wrong_method(request: Request) -> Response:
        return known(request) or _error(405, "infer takes POST")

    routes = [Route("/v2/health/live", live), Route("/v2/health/ready", ready),
              Route("/v2/models/stats", stats), Route("/v2/models/{name}/stats", stats),
              Route("/v2/models/{name}/versions/{version}/stats", stats),
              Route("/v2/models/{name}", metadata), Route("/v2/models/{name}/infer", wrong_method, methods=NOT_POST)]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        batcher.close()

    app = infer = _Infer(Starlette(routes=routes, lifespan=lifespan), model, batcher, max_body_bytes, max_batch_size)
    return _BearerToken(app, token) if token is not None else app
