"""``dynemb serve``: a trained run as an Open Inference Protocol (KServe v2) HTTP endpoint.

======================  ============================================================================
module                  job
======================  ============================================================================
``model``               the served model: the run's dense part, its tables in a ParameterServer
``protocol``            the v2 tensors: metadata, request decoding and checks, responses
``app``                 the Starlette app: routes, bearer token, body limit, batching of requests
``server``              uvicorn, in the foreground or on a background thread
======================  ============================================================================
"""

from .app import build_app
from .model import ServedModel
from .protocol import RequestError
from .server import running, serve

__all__ = ["ServedModel", "build_app", "serve", "running", "RequestError"]
