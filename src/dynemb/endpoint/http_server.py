"""Running the endpoint on uvicorn (and gRPC on its event loop): in the foreground (``dynemb serve``) or on a thread
(tests, benchmarks)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator, Optional

try:
    import uvicorn
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"dynemb serve needs uvicorn: pip install 'dynemb[serving]' ({exc})") from exc

__all__ = ["serve", "running", "attach_grpc", "check_free"]


def _server(app, sock: socket.socket, log_level: str) -> uvicorn.Server:
    host, port = sock.getsockname()[:2]
    # No proxy-header rewriting (nothing here reads the client's address) and no Server/Date headers: less Python
    # per request on the path the latency target is about.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
                            proxy_headers=False, server_header=False, date_header=False)
    return uvicorn.Server(config)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Connections accepted from it inherit TCP_NODELAY (Linux): without it a response written as headers then body
    # waits for the client's delayed ACK, 40 ms a request.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def check_free(host: str, ports: list) -> None:
    """Raise OSError naming ``host:port`` when one of ``ports`` cannot be listened on now (in use, or not an address
    of this machine): bound and closed at once, so that a server finds out before it loads a model."""
    for port in ports:
        _bind(host, port).close()


def attach_grpc(app, host: str, port: int, **limits):
    """Start a :class:`~dynemb.endpoint.grpc_server.GrpcServer` of ``app``'s service with the app (its lifespan),
    on the same event loop, with the app's token and body limit (and ``limits``: its ``max_connections``,
    ``idle_timeout_s``). Its port is bound now (OSError naming it when it cannot be: in the event loop a failure
    would be one log line among uvicorn's). Returns the server (``bound_port``)."""
    from .grpc_server import GrpcServer

    token = None if app.token is None else app.token.decode()
    server = GrpcServer(app.service, host, port, token=token, max_message_bytes=app.max_body_bytes, **limits)
    server.bind()
    app.on_startup.append(server.start)
    app.on_shutdown.insert(0, server.stop)
    return server


def serve(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", on_bound=None,
          grpc_port: Optional[int] = None, grpc_limits: Optional[dict] = None) -> None:
    """Serve ``app`` on ``host:port`` (and gRPC on ``host:grpc_port`` when given, with ``grpc_limits``, see
    :func:`attach_grpc`) until interrupted (Ctrl-C, SIGTERM); ``on_bound()`` is called once the ports are bound
    (a port in use raises OSError before it)."""
    sock = _bind(host, port)
    try:
        if grpc_port is not None:
            attach_grpc(app, host, grpc_port, **(grpc_limits or {}))
        if on_bound is not None:
            on_bound()
        _server(app, sock, log_level).run(sockets=[sock])
    finally:
        sock.close()


@contextlib.contextmanager
def running(app, host: str = "127.0.0.1", startup_timeout_s: float = 30.0, grpc: bool = False,
            grpc_limits: Optional[dict] = None) -> Iterator[str]:
    """Serve ``app`` on a free port of ``host`` from a background thread; yields its base URL, then stops it.
    With ``grpc``, its gRPC server too, on another free port (with ``grpc_limits``, see :func:`attach_grpc`):
    ``app.grpc_address`` is ``host:port`` then.

    Raises:
        TimeoutError: the server did not start within ``startup_timeout_s``.
    """
    sock = _bind(host, 0)
    grpc_server = attach_grpc(app, host, 0, **(grpc_limits or {})) if grpc else None
    server = _server(app, sock, "warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="dynemb-endpoint", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise TimeoutError(f"the endpoint did not start within {startup_timeout_s} s")
            time.sleep(0.01)
        if grpc_server is not None:
            app.grpc_address = f"{host}:{grpc_server.bound_port}"
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        if grpc_server is not None:
            app.on_startup.remove(grpc_server.start)
            app.on_shutdown.remove(grpc_server.stop)
