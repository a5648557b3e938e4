"""The Open Inference Protocol's operations, once for both transports (HTTP: :mod:`.app`, gRPC: :mod:`.grpc_server`).

An :class:`InferenceService` answers server and model liveness, readiness, metadata, configuration, inference and
statistics for one served model, under one name. It holds a slot for the model: while ``dynemb serve --watch``
waits for the first version the slot is empty, the server is live but not ready, and every model operation is a
:class:`ProtocolError` 503. Errors are :class:`ProtocolError` s carrying an HTTP status; :data:`GRPC_CODES` maps
them onto gRPC status codes, so both transports answer a request the same way.

The model in the slot is anything with the :class:`Servable` methods, as the CLI's
:class:`~dynemb.endpoint.model.ServedModel` has.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Protocol

import numpy as np
import torch

from ..serving.stores.store import StoreUnavailableError
from .wire import RequestError

__all__ = ["InferenceService", "ProtocolError", "Servable", "GRPC_CODES", "NOT_SUPPORTED", "SERVER_NAME",
           "numpy_datatype"]

SERVER_NAME = "dynemb"
EXTENSIONS = ["binary_tensor_data", "statistics", "model_configuration", "metrics"]
NOT_SUPPORTED = {"systemsharedmemory": "system shared memory", "cudasharedmemory": "CUDA shared memory",
                 "repository": "model repository control", "trace": "trace settings", "logging": "log settings"}
"""Protocol extensions this server does not offer: a request for one is answered with a clear error."""

GRPC_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 405: "UNIMPLEMENTED",
              413: "RESOURCE_EXHAUSTED", 415: "INVALID_ARGUMENT", 500: "INTERNAL", 501: "UNIMPLEMENTED",
              503: "UNAVAILABLE"}
"""The gRPC status code (a ``grpc.StatusCode`` name) of each HTTP status the service answers with."""


class ProtocolError(Exception):
    """A request the service cannot answer with success; ``status`` is its HTTP status (see :data:`GRPC_CODES`)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def check_bearer(token: Optional[bytes], header: Optional[bytes]) -> None:
    """Refuse a request whose ``Authorization`` value (HTTP header or gRPC metadata) does not carry ``token``
    (nothing is asked without one). The scheme is case-insensitive (RFC 9110); the message says what was wrong
    (no header, another scheme, the wrong token) but never the token.

    Raises:
        ProtocolError: 401.
    """
    if token is None:
        return
    scheme, _, given = (header or b"").strip().partition(b" ")
    if not scheme:
        raise ProtocolError(401, "this server wants a bearer token: send the header `Authorization: Bearer "
                                 "<token>` (gRPC: `authorization` metadata), got none")
    if not given.strip():  # one word: a token without its scheme, most likely (not echoed)
        raise ProtocolError(401, "this server wants `Authorization: Bearer <token>`, got a value without a scheme "
                                 "(put `Bearer ` before the token)")
    if scheme.lower() != b"bearer":
        shown = repr(scheme.decode("latin-1")) if len(scheme) <= 20 and scheme.isalpha() else "another one"
        raise ProtocolError(401, f"this server wants `Authorization: Bearer <token>`, got the scheme {shown}")
    if not hmac.compare_digest(given.strip(), token):
        raise ProtocolError(401, "wrong bearer token")


class Servable(Protocol):
    """What the service asks of a served model (the batch type is the model's own)."""

    name: str
    version: int

    def metadata(self) -> dict: ...  # {"inputs": [...], "outputs": [...], "platform": ...} of the v2 metadata

    def decode_request(self, request: dict, max_rows: int) -> Any: ...  # a batch; len() is its rows

    def join(self, batches: list) -> Any: ...

    def infer(self, batch) -> tuple[dict, int]: ...  # ({output: tensor [B, ...]}, the version that scored it)

    def updating(self) -> bool: ...

    # optional: ``joins_batches = False`` has each request scored in a forward pass of its own (inputs that cannot
    # be concatenated row-wise, as an exported model's jagged ones)


_DATATYPES = {np.dtype(np.float64): "FP64", np.dtype(np.float32): "FP32", np.dtype(np.float16): "FP16",
              np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32", np.dtype(np.int16): "INT16",
              np.dtype(np.int8): "INT8", np.dtype(np.uint8): "UINT8", np.dtype(np.bool_): "BOOL"}


def numpy_datatype(dtype: np.dtype) -> str:
    """The protocol's datatype name of a numpy dtype (``float64`` -> ``"FP64"``)."""
    try:
        return _DATATYPES[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"no Open Inference Protocol datatype for numpy dtype {dtype}") from None


class Batcher:
    """Scores the batches of concurrent requests together, one forward pass at a time, on one worker thread.

    A request alone (after one turn of the event loop, no other request has come to be scored, no forward pass
    runs or waits, no update is being swapped in) is scored on the event loop's thread instead: two thread
    hand-offs less. Requests that arrive meanwhile wait in their sockets and are batched next. HTTP and gRPC
    requests share it (both transports run on one event loop), so they are batched together too. A waiting
    request whose caller was cancelled (a gRPC deadline that passed, a reset call) is dropped when its turn comes,
    never scored (``dropped`` counts them).
    """

    def __init__(self, model: Servable, max_rows: int, inline: bool = True) -> None:
        self.model, self.max_rows, self.inline = model, max_rows, inline
        self.joins = getattr(model, "joins_batches", True)  # False: each request is a forward pass of its own
        self._queue: Optional[asyncio.Queue] = None
        self._worker: Optional[asyncio.Task] = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dynemb-serve")
        self._arrived = 0  # requests in score() that have not yet chosen where to run
        self._running = False  # a forward pass on the worker thread
        self.forward_passes = self.inline_passes = self.forward_ns = 0
        self.dropped = 0  # requests whose caller gave up while they waited: never scored
        self.on_forward = None  # called with (rows, seconds) after each forward pass (the metrics)

    async def score(self, batch) -> tuple[dict, int]:
        """``({output: tensor [B, ...]}, the version that scored them)`` of one request's rows."""
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
        queue = self._queue
        while True:
            waiting = [await queue.get()]
            if waiting[0][1].done():  # its caller is gone (a gRPC deadline passed, the call was reset): not scored
                self.dropped += 1
                continue
            rows = len(waiting[0][0])
            while self.joins and not queue.empty():
                head = queue._queue[0]
                if head[1].done():
                    queue.get_nowait()
                    self.dropped += 1
                elif rows + len(head[0]) <= self.max_rows:
                    waiting.append(queue.get_nowait())
                    rows += len(head[0])
                else:
                    break
            self._running = True
            try:
                outputs, version = await loop.run_in_executor(self._pool, self._forward, [b for b, _ in waiting])
            except Exception as exc:  # noqa: BLE001 - each waiting request gets the error, the worker goes on
                for _, done in waiting:
                    if not done.done():
                        done.set_exception(exc)
                continue
            finally:
                self._running = False
            sizes = [len(b) for b, _ in waiting]
            parts = {name: torch.split(value, sizes) for name, value in outputs.items()}
            for k, (_, done) in enumerate(waiting):
                if not done.done():
                    done.set_result(({name: split[k] for name, split in parts.items()}, version))

    def _forward(self, batches: list) -> tuple[dict, int]:
        start = time.perf_counter_ns()
        batch = batches[0] if len(batches) == 1 else self.model.join(batches)
        out = self.model.infer(batch)
        self.forward_passes += 1
        elapsed = time.perf_counter_ns() - start
        self.forward_ns += elapsed
        if self.on_forward is not None:
            self.on_forward(len(batch), elapsed / 1e9)
        return out

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Stats:
    """Counts behind the statistics extension: requests answered with success and not, their time, rows scored."""

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


class InferenceService:
    """The protocol's operations for the model served under ``name`` (see the module docstring).

    Args:
        name: the model's name in every route.
        model: the served model, or ``None`` until :meth:`install` (the server is live but not ready meanwhile).
        max_batch_size: most rows of one request, and of one forward pass over concurrent requests.
        waiting_for: what the empty slot waits for, named in the 503 answers.

    Raises:
        ValueError: ``max_batch_size`` is not positive, or ``model`` has another name.
    """

    def __init__(self, name: str, model: Optional[Servable] = None, *, max_batch_size: int = 4096,
                 waiting_for: str = "the model to load") -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.name, self.max_batch_size, self.waiting_for = name, max_batch_size, waiting_for
        self.model: Optional[Servable] = None
        self.batcher: Optional[Batcher] = None
        self.stats = _Stats()
        self.metrics = None  # a .metrics.Metrics when /metrics is served
        self._lock = threading.Lock()
        if model is not None:
            self.install(model)

    def install(self, model: Servable) -> None:
        """Serve ``model`` from now on (once: the slot is filled when the first version has loaded)."""
        if model.name != self.name:
            raise ValueError(f"the service serves {self.name!r}, not a model named {model.name!r}")
        with self._lock:
            if self.model is not None:
                raise ValueError(f"the service already serves {self.name!r}")
            batcher = Batcher(model, self.max_batch_size)
            if self.metrics is not None:
                batcher.on_forward = self.metrics.forward
            self.batcher, self.model = batcher, model

    def attach_metrics(self, metrics) -> None:
        """Count requests and forward passes into ``metrics`` (a
        :class:`~dynemb.endpoint.prometheus_metrics.Metrics`)."""
        with self._lock:
            self.metrics = metrics
            if self.batcher is not None:
                self.batcher.on_forward = metrics.forward

    @property
    def ready(self) -> bool:
        """A model is served, and its parameter server can answer every lookup now (:meth:`unready`)."""
        return self.unready() is None

    def unready(self) -> Optional[str]:
        """Why the server is not ready, or None when it is: no model yet, or a store tier it needs failed (the
        parameter server's :meth:`~dynemb.serving.ParameterServer.ready`)."""
        model = self.model
        if model is None:
            return f"waiting for {self.waiting_for}"
        check = getattr(getattr(model, "ps", None), "ready", None)
        if check is None:
            return None
        ok, why = check(self.name)
        return None if ok else why

    # ------------------------------------------------------------------ server
    def server_metadata(self) -> dict:
        from .._version import __version__

        return {"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS}

    # ------------------------------------------------------------------ model
    def served(self, name: str, version: Optional[str] = None) -> Servable:
        """The model served as ``name`` (at ``version``, when given).

        Raises:
            ProtocolError: 404 for another name or version, 503 while no model is loaded yet.
        """
        if name != self.name:
            raise ProtocolError(404, f"unknown model {name!r}; this server has {self.name!r}")
        model = self.model
        if model is None:
            raise ProtocolError(503, f"model {name!r} is not ready: waiting for {self.waiting_for}")
        # a version is a number, as Triton reads it ("01" is version 1); anything but ASCII digits is no version
        if version not in (None, "") and not (version.isascii() and version.isdigit()
                                               and int(version) == model.version):
            raise ProtocolError(404, f"model {name!r} serves version {model.version}, not {version!r}")
        return model

    def model_ready(self, name: str, version: Optional[str] = None) -> bool:
        """Whether ``name`` (at ``version``) is served now; an unknown name is a 404 still."""
        try:
            self.served(name, version)
        except ProtocolError as exc:
            if exc.status == 503 or (exc.status == 404 and name == self.name):
                return False
            raise
        return self.unready() is None

    def model_metadata(self, name: str, version: Optional[str] = None) -> dict:
        model = self.served(name, version)
        meta = model.metadata()
        return {"name": self.name, "versions": [str(model.version)], "platform": meta["platform"],
                "inputs": meta["inputs"], "outputs": meta["outputs"]}

    def model_config(self, name: str, version: Optional[str] = None) -> dict:
        """Triton's model configuration of the model (what ``get_model_config`` reads): its inputs and outputs
        with ``TYPE_*`` data types, ``max_batch_size`` 0 (Triton's meaning: no implicit batch dimension, the sizes
        are in the dims, ``-1`` free; a KeyedJaggedTensor's lengths have none) and the server's row limit of a
        request, ``--max-batch-size``, as the parameter ``max_batch_size``."""
        meta = self.model_metadata(name, version)

        def tensors(specs):
            return [{"name": t["name"], "data_type": "TYPE_" + ("STRING" if t["datatype"] == "BYTES" else
                                                                 t["datatype"]), "dims": list(t["shape"])}
                    for t in specs]

        return {"name": self.name, "platform": meta["platform"], "backend": "dynemb", "max_batch_size": 0,
                "input": tensors(meta["inputs"]), "output": tensors(meta["outputs"]),
                "version_policy": {"latest": {"num_versions": 1}},
                "parameters": {"max_batch_size": {"string_value": str(self.max_batch_size)}}}

    def statistics(self, name: Optional[str] = None, version: Optional[str] = None) -> dict:
        """Triton's statistics extension: ``{"model_stats": [...]}`` (durations in ns, as it counts them)."""
        if name in (None, ""):
            if self.model is None:
                return {"model_stats": []}
            name = self.name
        model = self.served(name, version)
        duration = lambda count, ns: {"count": count, "ns": ns}  # noqa: E731
        batcher = self.batcher
        return {"model_stats": [{
            "name": self.name, "version": str(model.version), "last_inference": self.stats.last_ms,
            "inference_count": self.stats.rows, "execution_count": batcher.forward_passes,
            "inference_stats": {"success": duration(*self.stats.success), "fail": duration(*self.stats.fail),
                                "compute_infer": duration(batcher.forward_passes, batcher.forward_ns)}}]}

    async def infer(self, name: str, version: Optional[str], request: Any) -> tuple[dict, int, Any]:
        """Score one request (its body as :func:`~dynemb.endpoint.wire.parse_body` reads it, or the same from
        gRPC).

        Returns:
            ``({output: numpy array}, the version that scored them, the model)``.

        Raises:
            ProtocolError: 404/503 (see :meth:`served`), 400 for a request the model cannot score (the message
                names the input).
        """
        model = self.served(name, version)
        _check_output_parameters(request)
        try:
            batch = model.decode_request(request, self.max_batch_size)
        except RequestError as exc:
            raise ProtocolError(400, str(exc)) from None
        if not len(batch):
            outputs, scored = model.infer(batch)
        else:
            try:
                outputs, scored = await self.batcher.score(batch)
            except StoreUnavailableError as exc:  # a store tier the lookup needed failed (TierUnavailableError)
                raise ProtocolError(503, f"model {name!r} cannot answer now: {exc}") from None
            except (RequestError, ValueError, TypeError) as exc:
                raise ProtocolError(400, str(exc).splitlines()[0]) from None
        if version not in (None, "") and str(scored) != version:
            raise ProtocolError(404, f"model {name!r} moved to version {scored} while scoring; version {version!r} "
                                     "is no longer served")
        return {k: v.detach().cpu().numpy() for k, v in outputs.items()}, scored, model

    def record(self, route: str, ok: bool, seconds: float, rows: int, protocol: str) -> None:
        """Count one answered request (the statistics route counts inferences only; metrics count every route)."""
        if route == "infer":
            self.stats.record(ok, int(seconds * 1e9), rows)
        if self.metrics is not None:
            self.metrics.request(route, protocol, ok, seconds, rows)

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()


def _check_output_parameters(request: Any) -> None:
    """Triton's classification extension (``InferRequestedOutput(..., class_count=k)``: top-k ``"score:index"``
    strings in place of the tensor) is not served: a 400 saying so, where an answer that ignored it would hand the
    client a tensor of another datatype than it asked for."""
    asked = request.get("outputs") if isinstance(request, dict) else None
    for o in asked if isinstance(asked, list) else ():
        params = o.get("parameters") if isinstance(o, dict) else None
        if isinstance(params, dict) and params.get("classification"):
            raise ProtocolError(400, f"output {o.get('name')!r}: classification (class_count="
                                     f"{params['classification']!r}) is not supported by dynemb serve; ask for the "
                                     "output itself (class_count=0)")


def requested_outputs(request: Any, model_outputs: list) -> list[tuple[str, bool]]:
    """``[(output name, binary?)]`` a request asks for: its ``outputs`` (each may set ``parameters.binary_data``),
    or every output of the model; the request-wide ``parameters.binary_data_output`` makes all of them binary."""
    params = request.get("parameters") if isinstance(request, dict) else None
    default = bool(isinstance(params, dict) and params.get("binary_data_output"))
    asked = request.get("outputs") if isinstance(request, dict) else None
    if not asked:
        return [(t["name"], default) for t in model_outputs]
    names = [t["name"] for t in model_outputs]
    out = []
    for o in asked:
        if o["name"] not in names:
            raise ProtocolError(400, f"output {o['name']!r} is not an output of this model (it has {names})")
        p = o.get("parameters")
        out.append((o["name"], bool(p.get("binary_data", default)) if isinstance(p, dict) else default))
    return out
