"""The ``dynemb serve`` command's options and body (registered by :mod:`dynemb.cli`)."""

from __future__ import annotations

import argparse
import gc
import re
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from . import WATCH_INTERVAL_S

__all__ = ["add_serve_args", "cmd_serve", "WATCH_INTERVAL_S"]

DEFAULT_GRPC_PORT = 8001  # Triton's


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="RUN_DIR", help="a `dynemb train` run directory (default: none: then "
                   "--export names an export of your own model)")
    p.add_argument("--export", metavar="EXPORT_DIR", help="with --model: serving export of the run (default: the "
                   "--use model's: RUN_DIR/export-best, or RUN_DIR/export for last and --watch, written from the "
                   "checkpoint when missing); without --model: an export of your own model written by "
                   "dynemb.serving.export_model, served with its inputs and outputs (docs/serving.md)")
    p.add_argument("--use", choices=("best", "last"), help="serve the run's model with the lowest held-out log "
                   "loss (best) or the model of its last step (last); --watch follows the versions training "
                   "publishes, each the model of its step (default: best, last with --watch)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; anything but loopback exposes the "
                   "model to the network")
    p.add_argument("--port", type=int, default=8000, help="TCP port of HTTP/REST")
    p.add_argument("--grpc-port", type=int, default=None, help="TCP port of gRPC (KServe v2's "
                   "GRPCInferenceService), on --host too (default: 8001, as Triton's)")
    p.add_argument("--no-grpc", action="store_true", help="serve HTTP only")
    p.add_argument("--grpc-max-connections", type=int, default=1024, metavar="N", help="gRPC connections served "
                   "at once; more are sent GOAWAY and closed as they come (default: %(default)s)")
    p.add_argument("--grpc-idle-timeout", type=float, default=300.0, metavar="SECONDS", help="a gRPC connection "
                   "with no call open this long is sent GOAWAY and closed (clients reconnect at their next call); "
                   "0: never (default: %(default)s)")
    p.add_argument("--name", default="dynemb", help="model name in the URL: /v2/models/NAME/infer (letters, digits "
                   "and . _ - ~)")
    p.add_argument("--token", help="require `Authorization: Bearer TOKEN` on every route (default: none, no token "
                   "asked)")
    p.add_argument("--watch", type=float, nargs="?", const=WATCH_INTERVAL_S, metavar="SECONDS", help="poll the "
                   "export every SECONDS (--watch alone: %(const)s) and apply its new versions (full or delta, with "
                   "their MLPs when published by `dynemb train --publish-every`) in order while serving; waits for "
                   "the first version when the run has published none yet (default: off)")
    p.add_argument("--max-batch-size", type=int, default=4096, help="most rows per request, and per forward pass "
                   "over concurrent requests")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="larger request bodies, as sent or inflated, get "
                   "HTTP 400 (gRPC: RESOURCE_EXHAUSTED)")
    p.add_argument("--volatile", default="memory", choices=["memory", "redis"], help="volatile store")
    p.add_argument("--redis-address", default="127.0.0.1:6379", help="host:port of the redis store")
    p.add_argument("--persistent", default="none", choices=["lmdb", "rocksdb", "none"], help="persistent store")
    p.add_argument("--persistent-path", help="where the persistent store lives (default: a temp dir, removed when "
                   "the server stops)")
    p.add_argument("--cache-fraction", type=float, default=0.2, help="share of each table's rows cached")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")


_NAME = re.compile(r"[A-Za-z0-9._~-]+")  # what a URL path segment carries as it is (RFC 3986's unreserved)


def check_name(name: str) -> None:
    """Refuse a ``--name`` that a URL path segment cannot carry as it is: ``/v2/models/NAME/infer`` would not reach
    it."""
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"--name must be usable as it is in /v2/models/NAME/infer: letters, digits and . _ - ~ "
                         f"(not . or .. alone), got {name!r}")


def stores(args) -> tuple[dict, dict | None]:
    """The parameter server's volatile and persistent store configs from the options."""
    volatile = {"type": "memory"} if args.volatile == "memory" else {"type": "redis", "address": args.redis_address}
    if args.persistent == "none":
        return volatile, None
    path = args.persistent_path or tempfile.mkdtemp(prefix=f"dynemb-serve-{args.persistent}-")
    return volatile, {"type": args.persistent, "path": path}


def cmd_serve(args) -> int:
    import torch

    from .app import build_app
    from .http_server import serve

    if args.no_grpc and args.grpc_port is not None:  # a port for a server that is not started: a mistake
        raise ValueError(f"--grpc-port {args.grpc_port} with --no-grpc: no gRPC server is started; drop one of them")
    if args.grpc_port is None:
        args.grpc_port = DEFAULT_GRPC_PORT
    for option, port in (("--port", args.port), ("--grpc-port", None if args.no_grpc else args.grpc_port)):
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"{option} must be in 1..65535, got {port}")
    check_name(args.name)
    if not args.no_grpc and args.grpc_port == args.port:
        raise ValueError(f"--grpc-port and --port must differ, both are {args.port}")
    if args.grpc_max_connections < 1:
        raise ValueError(f"--grpc-max-connections must be >= 1, got {args.grpc_max_connections}")
    if not args.grpc_idle_timeout >= 0:
        raise ValueError(f"--grpc-idle-timeout must be >= 0 seconds (0: never), got {args.grpc_idle_timeout}")
    if args.watch is not None and not args.watch > 0:
        raise ValueError(f"--watch must be > 0 seconds, got {args.watch}")
    if args.watch is not None and args.use == "best":
        raise ValueError("--watch serves the versions training publishes (the model of each step, not the best); "
                         "drop --use best, or serve the best without --watch")
    if args.model is None and args.export is None:
        raise ValueError("give --model RUN_DIR (a dynemb train run) or --export EXPORT_DIR (a model written by "
                         "dynemb.serving.export_model)")
    if args.model is None and args.use is not None:
        raise ValueError("--use picks a model of a run (--model); an export of your own model serves its newest "
                         "version")
    if args.model is not None and args.export is not None and args.use is not None:
        raise ValueError("--use picks which export of the run is served, and --export names one already: drop "
                         "one of them")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.max_batch_size < 1:
        raise ValueError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if not args.max_body_mb * (1 << 20) >= 1:
        raise ValueError(f"--max-body-mb must be > 0 (at least one byte), got {args.max_body_mb}")
    if not 0 < args.cache_fraction <= 1:
        raise ValueError(f"--cache-fraction must be in (0, 1], got {args.cache_fraction}")
    if args.persistent_path is not None and args.persistent == "none":
        raise ValueError("--persistent-path is where the persistent store lives: give --persistent lmdb or "
                         "--persistent rocksdb with it")
    own = None if args.model is not None else Path(args.export)
    if own is not None and (own / "model.json").is_file() and (own / "checkpoint").is_dir():
        # checked here too: with --watch, nothing would load it, and the server would wait for a version forever
        raise ValueError(f"--export {args.export}: a `dynemb train` run directory, not an export of your own model; "
                         "serve it with --model RUN_DIR")
    # A port in use is an error now, not after the model has loaded (seconds to minutes); bound again below
    from .http_server import check_free

    check_free(args.host, [args.port] + ([] if args.no_grpc else [args.grpc_port]))
    torch.set_num_threads(args.threads)
    waiting = None  # the export root whose first version is awaited while the server already listens
    if args.watch is not None:  # following a run that may still be training: its published versions
        from ..checkpoint.fsutil import read_pointer
        from ..job.card import CHECKPOINT
        from ..job.publish import EXPORT

        published = Path(args.export or Path(args.model) / EXPORT)  # --export without --model: always given
        if (args.export is not None or args.model is None or not (Path(args.model) / CHECKPOINT / "latest").is_file()
                or (published / "latest").is_file()):
            args.export = published  # no checkpoint is needed (nor written yet) to serve them
            if read_pointer(published) is None:
                waiting = published
                writer = "dynemb train --publish-every" if args.model is not None else \
                    "dynemb.serving.export_model"
                print(f"waiting for the first version in {published} ({writer} writes it); live meanwhile, ready "
                      "once it is served", flush=True)
    if args.export is None:
        from ..job.publish import serving_export

        args.export = serving_export(Path(args.model), args.use or ("best" if args.watch is None else "last"))
    app = build_app(name=args.name, token=args.token, max_body_bytes=int(args.max_body_mb * (1 << 20)),
                    max_batch_size=args.max_batch_size)
    if waiting is not None:
        app.service.waiting_for = f"the first version in {waiting}"
    loader = _Loader(args, app.service)
    if waiting is None:
        loader.load()  # a bad run or export is an error before anything listens
    grpc_port = None if args.no_grpc else args.grpc_port
    grpc_line = "" if grpc_port is None else f" and grpc://{args.host}:{grpc_port}"
    loader.grpc_line = grpc_line  # the line printed once --watch has loaded the first version names it too
    # uvicorn re-raises the SIGTERM it stopped on once it has: with the default handler the process would end there,
    # before the finally below closes the stores and removes a temporary one. Raised as an exception instead, then
    # again with the default handler once everything is closed (the exit status stays SIGTERM's).
    previous = signal.signal(signal.SIGTERM, _terminated)
    terminated = False
    try:
        # The ~300k objects torch and the model keep alive would make every full collection a 200 ms stall of
        # one request: keep them out of the collector, as latency-sensitive Python servers do.
        gc.collect()
        gc.freeze()

        def bound():
            if waiting is not None:
                print(f"listening on http://{args.host}:{args.port}{grpc_line} as {args.name!r}, not ready until "
                      "the first version is served", flush=True)
                loader.start_waiting(waiting)
            else:
                print(loader.serving_line(), flush=True)

        serve(app, args.host, args.port, on_bound=bound, grpc_port=grpc_port,
              grpc_limits={"max_connections": args.grpc_max_connections,
                           "idle_timeout_s": args.grpc_idle_timeout or None})
    except _Terminated:
        terminated = True
    finally:
        gc.unfreeze()  # so that native extensions' objects are freed at exit, not reported as leaked
        loader.close()
        signal.signal(signal.SIGTERM, previous)
    if terminated:
        signal.raise_signal(signal.SIGTERM)
    return 1 if loader.failed else 0


class _Terminated(BaseException):
    """SIGTERM, once uvicorn has stopped serving (see cmd_serve)."""


def _terminated(signum, frame) -> None:
    raise _Terminated()


class _Loader:
    """Loads the served model into the service, now or (``--watch`` before the first version) on a thread once
    the version is there, then starts the watcher. A failure on the thread is reported and stops the server."""

    def __init__(self, args, service) -> None:
        self.args, self.service = args, service
        self.model = self.watcher = None
        self.failed = False
        self.grpc_line = ""
        self._stop = threading.Event()
        self._thread = None
        self.temporary = None  # the persistent store's temp dir this server made (no --persistent-path): removed

    def load(self) -> None:
        from .watch import ExportWatcher

        args = self.args
        volatile, persistent = stores(args)
        if persistent is not None and args.persistent_path is None:
            self.temporary = persistent["path"]
        options = dict(name=args.name, volatile_db=volatile, persistent_db=persistent,
                       cache_fraction=args.cache_fraction, device=args.device)
        try:
            if args.model is None:  # a model of the user's own (dynemb.serving.export_model)
                from .served_export import ServedExport

                self.model = ServedExport(args.export, **options)
            else:
                from .model import ServedModel

                self.model = ServedModel(args.model, export=args.export, **options)
        except BaseException:
            self._remove_temporary()
            raise
        if args.watch is not None:  # "now serving version N" lines on stderr, next to uvicorn's
            import logging

            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
            logger = logging.getLogger(ExportWatcher.__module__)
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
        self.service.install(self.model)
        if args.watch is not None:
            self.watcher = ExportWatcher(self.model, args.watch).start()

    def serving_line(self) -> str:
        args, model = self.args, self.model
        return (f"serving {args.model or 'your model'} (export {model.export}, version {model.version}) as "
                f"{args.name!r} on "
                f"http://{args.host}:{args.port}/v2/models/{args.name}/infer{self.grpc_line}")

    def start_waiting(self, root: Path) -> None:
        self._thread = threading.Thread(target=self._wait_and_load, args=(root,), name="dynemb-serve-load",
                                        daemon=True)
        self._thread.start()

    def _wait_and_load(self, root: Path) -> None:
        from ..checkpoint.fsutil import read_pointer

        try:
            while read_pointer(root) is None:
                if self._stop.wait(self.args.watch):
                    return
            self.load()
            print(self.serving_line(), flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, and the server stops: it would never be ready
            self.failed = True
            print(f"dynemb serve: cannot serve {root}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            signal.raise_signal(signal.SIGTERM)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.watcher is not None:
            self.watcher.stop()
        if self.model is not None:
            self.model.close()
        self._remove_temporary()

    def _remove_temporary(self) -> None:
        """Remove the persistent store this server made in a temp dir (a copy of every row); never a
        --persistent-path the user named."""
        if self.temporary is not None:
            shutil.rmtree(self.temporary, ignore_errors=True)
            self.temporary = None
