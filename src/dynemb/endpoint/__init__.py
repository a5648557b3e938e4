"""``dynemb serve``: a trained run as an Open Inference Protocol (KServe v2) endpoint, HTTP and gRPC.

It serves what :mod:`dynemb.job` trained, with the run's tables in a :mod:`dynemb.serving` parameter server, so it
sits above both; ``serving`` keeps what needs no run directory (the parameter server, its stores, lookup layers).

======================  ============================================================================
module                  job
======================  ============================================================================
``model``               the served model: the run's dense part, its tables in a ParameterServer
``served_export``       ``--export DIR`` without a run: a ``dynemb.serving.export_model`` export, its inputs
``wire``                an infer body as Python objects: JSON (simdjson) or binary tensors, numeric data
                        as numpy arrays
``inference_protocol``  the v2 tensors: metadata, request decoding and checks, responses
``service``             the protocol's operations, once for both transports; batching of requests
``app``                 the HTTP transport (an ASGI app): routes, bearer token, body limit, compression
``grpc_server``         the gRPC transport: the service's methods, with tritonclient's generated messages
``grpc_http2``          unary gRPC calls over HTTP/2 as an asyncio protocol on the HTTP server's event loop
``prometheus_metrics``  ``GET /metrics``: Prometheus text
``http_server``         uvicorn (and the gRPC server on its event loop), in the foreground or on a thread
``watch``               ``--watch``: new export versions applied in order while serving
``command``             the ``dynemb serve`` options
======================  ============================================================================

uvicorn, hpack, tritonclient and prometheus_client are imported on first use, so ``dynemb --help`` works without them.
"""

import importlib

__all__ = ["ServedModel", "build_app", "serve", "running", "RequestError", "WATCH_INTERVAL_S"]

# Here, not in ``command``: ``command`` imports ``watch`` (when the command runs), so ``watch`` reading the default
# from ``command`` was an import cycle.
WATCH_INTERVAL_S = 1.0
"""``--watch`` without a value: a published version is served about a second (plus its apply time) after it lands."""

_HOME = {"ServedModel": "model", "build_app": "app", "serve": "http_server", "running": "http_server",
         "RequestError": "wire"}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
