"""The ``dynemb serve`` command's options and body (registered by :mod:`dynemb.cli`)."""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

from . import WATCH_INTERVAL_S

__all__ = ["add_serve_args", "cmd_serve", "WATCH_INTERVAL_S"]


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="RUN_DIR", help="a `dynemb train` run directory")
    p.add_argument("--export", metavar="EXPORT_DIR", help="serving export of the run (default: the --use model's: "
                   "RUN_DIR/export-best, or RUN_DIR/export for last and --watch, written from the checkpoint when "
                   "missing)")
    p.add_argument("--use", choices=("best", "last"), help="serve the run's model with the lowest held-out log "
                   "loss (best) or the model of its last step (last); --watch follows the versions training "
                   "publishes, each the model of its step (default: best, last with --watch)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; anything but loopback exposes the "
                   "model to the network")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--name", default="dynemb", help="model name in the URL: /v2/models/NAME/infer")
    p.add_argument("--token", help="require `Authorization: Bearer TOKEN` on every route (default: none, no token "
                   "asked)")
    p.add_argument("--watch", type=float, nargs="?", const=WATCH_INTERVAL_S, metavar="SECONDS", help="poll the "
                   "export every SECONDS (--watch alone: %(const)s) and apply its new versions (full or delta, with "
                   "their MLPs when published by `dynemb train --publish-every`) in order while serving; waits for "
                   "the first version when the run has published none yet (default: off)")
    p.add_argument("--max-batch-size", type=int, default=4096, help="most rows per request, and per forward pass "
                   "over concurrent requests")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="larger request bodies get HTTP 400")
    p.add_argument("--volatile", default="memory", choices=["memory", "redis"], help="volatile store")
    p.add_argument("--redis-address", default="127.0.0.1:6379", help="host:port of the redis store")
    p.add_argument("--persistent", default="none", choices=["lmdb", "rocksdb", "none"], help="persistent store")
    p.add_argument("--persistent-path", help="where the persistent store lives (default: a temp dir)")
    p.add_argument("--cache-fraction", type=float, default=0.2, help="share of each table's rows cached")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")


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
    from .model import ServedModel
    from .http_server import serve
    from .watch import ExportWatcher, wait_for_export

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.watch is not None and not args.watch > 0:
        raise ValueError(f"--watch must be > 0 seconds, got {args.watch}")
    if args.watch is not None and args.use == "best":
        raise ValueError("--watch serves the versions training publishes (the model of each step, not the best); "
                         "drop --use best, or serve the best without --watch")
    torch.set_num_threads(args.threads)
    if args.watch is not None:  # following a run that may still be training: its published versions
        from ..job.card import CHECKPOINT
        from ..job.publish import EXPORT

        published = Path(args.export or Path(args.model) / EXPORT)
        if not (Path(args.model) / CHECKPOINT / "latest").is_file() or (published / "latest").is_file():
            wait_for_export(published, args.watch)  # no checkpoint is needed (nor written yet) to serve them
            args.export = published
    if args.export is None:
        from ..job.publish import serving_export

        args.export = serving_export(Path(args.model), args.use or ("best" if args.watch is None else "last"))
    volatile, persistent = stores(args)
    model = ServedModel(args.model, export=args.export, name=args.name, volatile_db=volatile,
                        persistent_db=persistent, cache_fraction=args.cache_fraction, device=args.device)
    if args.watch is not None:  # "now serving version N" lines on stderr, next to uvicorn's
        import logging

        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger = logging.getLogger(ExportWatcher.__module__)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    watcher = ExportWatcher(model, args.watch).start() if args.watch is not None else None
    try:
        app = build_app(model, token=args.token, max_body_bytes=int(args.max_body_mb * (1 << 20)),
                        max_batch_size=args.max_batch_size)
        # The ~300k objects torch and the model keep alive would make every full collection a 200 ms stall of
        # one request: keep them out of the collector, as latency-sensitive Python servers do.
        gc.collect()
        gc.freeze()
        serve(app, args.host, args.port, on_bound=lambda: print(
            f"serving {args.model} (export {model.export}, version {model.version}) as {args.name!r} on "
            f"http://{args.host}:{args.port}/v2/models/{args.name}/infer", flush=True))
    finally:
        gc.unfreeze()  # so that native extensions' objects are freed at exit, not reported as leaked
        if watcher is not None:
            watcher.stop()
        model.close()
    return 0
