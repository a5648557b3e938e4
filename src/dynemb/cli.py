"""The ``dynemb`` command: ``demo``, ``train``, ``export`` and ``serve-bench``.

Errors print one line naming the problem and exit with status 2; ``--debug`` shows the traceback.

Environment, read here and nowhere else in the library: ``DYNEMB_NUMBA=0`` runs every table index on the torch
reference path instead of the numba CPU kernels (``dynemb.kernels.set_default_backend("torch")`` at startup);
``DYNEMB_BACKEND=nccl`` makes a torchrun-launched command use NCCL instead of gloo.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["main", "build_parser"]


class CliError(Exception):
    """A problem with the user's input, reported as one line."""


# ---------------------------------------------------------------------------------------------- data sources
def _csv(value: str | None) -> list[str]:
    return [v for v in (value or "").split(",") if v]


def _data_source(args, batch_size: int):
    """``(train batches factory, eval batches, categorical names, num_dense)`` from --synthetic or --data."""
    if args.data is None:
        from .data import SyntheticClickLog

        log = SyntheticClickLog(batch_size=batch_size, seed=args.seed)
        evals = [log.batch(i, "eval") for i in range(args.eval_batches)]
        return (lambda start: log.batches("train", start=start)), evals, list(log.categorical_names), log.num_dense
    from .data import FileReader

    if not args.label or not args.categorical:
        raise CliError("--data needs --label and --categorical (and usually --dense)")
    reader = FileReader(args.data, label=args.label, categorical=_csv(args.categorical), dense=_csv(args.dense),
                        batch_size=batch_size)
    first = list(_take(iter(reader), args.eval_batches))
    if not first:
        raise CliError(f"{args.data}: the dataset is empty")

    def train_batches(start: int):
        import itertools

        forever = itertools.chain.from_iterable(iter(reader) for _ in itertools.count())
        return itertools.islice(forever, start, None)

    return train_batches, first, _csv(args.categorical), len(_csv(args.dense))


def _take(it, n):
    for _, item in zip(range(n), it):
        yield item


def _train_config(args):
    from .train import TrainConfig

    return TrainConfig(steps=args.steps, seconds=args.seconds, dim=args.dim, optimizer=args.optimizer, lr=args.lr,
                       max_capacity=args.max_capacity, eviction=args.eviction, admission=args.admission,
                       eval_every=args.eval_every, checkpoint_dir=args.checkpoint_dir,
                       checkpoint_every=args.checkpoint_every, resume=args.resume)


def _init_distributed() -> None:
    import os

    import torch.distributed as dist

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if os.environ.get("DYNEMB_BACKEND") == "nccl" else "gloo")


# ---------------------------------------------------------------------------------------------- commands
def cmd_train(args) -> int:
    import torch

    if args.resume and not args.checkpoint_dir:
        raise CliError("--resume needs --checkpoint-dir")

    from .train import Trainer, build_dlrm

    torch.set_num_threads(args.threads)
    _init_distributed()
    cfg = _train_config(args)
    batches, evals, features, num_dense = _data_source(args, args.batch_size)
    model = build_dlrm(num_dense, features, cfg)
    trainer = Trainer(model, cfg)
    if cfg.resume:
        trainer.resume()
        print(f"resumed from {cfg.checkpoint_dir} at step {trainer.step}")
    history = trainer.fit(batches(trainer.step), evals, progress=not args.no_progress)
    if trainer.rank != 0:  # under torchrun, rank 0 reports and writes the model card
        return 0
    last = history.steps[-1] if history.steps else {}
    print(json.dumps({"step": trainer.step, "auc": round(history.last_auc, 4), "rows": last.get("rows"),
                      "evicted": last.get("evicted")}))
    if cfg.checkpoint_dir:
        _write_model_card(Path(cfg.checkpoint_dir), features, num_dense, cfg)
    return 0


def _write_model_card(root: Path, features, num_dense: int, cfg) -> None:
    import dataclasses

    from .checkpoint.fsutil import write_json

    write_json(root / "model.json", {"model": "dlrm", "features": list(features), "num_dense": num_dense,
                                     "config": dataclasses.asdict(cfg)}, atomic=True)


def _model_from_checkpoint(checkpoint_dir: Path):
    from .checkpoint import load
    from .train import TrainConfig, build_dlrm

    card_path = checkpoint_dir / "model.json"
    if not card_path.exists():
        raise CliError(f"{checkpoint_dir}: no model.json; is this a `dynemb train --checkpoint-dir` directory?")
    card = json.loads(card_path.read_text())
    cfg = TrainConfig(**{**card["config"], "resume": False, "checkpoint_dir": None})
    model = build_dlrm(card["num_dense"], card["features"], cfg)
    load(checkpoint_dir, model, strict=False)
    return model


def cmd_export(args) -> int:
    from .checkpoint import export_for_serving

    model = _model_from_checkpoint(Path(args.checkpoint_dir))
    out = export_for_serving(args.out, model)
    print(f"exported to {out}")
    return 0


def cmd_serve_bench(args) -> int:
    from .serving.bench import serve_bench

    result = serve_bench(args.export, volatile=args.volatile, redis_address=args.redis_address,
                         persistent=args.persistent, persistent_path=args.persistent_path,
                         cache_fraction=args.cache_fraction, batch_size=args.batch_size, batches=args.batches,
                         alpha=args.alpha)
    print(json.dumps(result, indent=2))
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(seconds=args.seconds, out_dir=args.out, threads=args.threads)
    return 0


# ---------------------------------------------------------------------------------------------- parser
def _add_train_args(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("data")
    src.add_argument("--data", help="Parquet/CSV file or directory (default: --synthetic)")
    src.add_argument("--synthetic", action="store_true", help="train on synthetic click logs (the default)")
    src.add_argument("--label", help="label column (0/1)")
    src.add_argument("--categorical", help="comma-separated categorical columns (string or int ids)")
    src.add_argument("--dense", help="comma-separated dense columns")
    src.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--seconds", type=float, default=None, help="stop after this many seconds of training")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--optimizer", default="adagrad", help="sgd, adagrad, rowwise_adagrad, adam or ftrl")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--max-capacity", type=int, default=None, help="rows per table; evicts beyond it")
    p.add_argument("--eviction", default=None, help="lru (default), lfu, epoch_lru, epoch_lfu")
    p.add_argument("--admission", type=int, default=None, help="store an id from its N-th sighting")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynemb", description="Dynamic embedding tables for PyTorch: train, "
                                     "checkpoint, export and serve CTR models.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    # Also accepted after the command (`dynemb train ... --debug`); SUPPRESS keeps a flag given before it.
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", parents=[debug],
                          help="train on synthetic data, export, serve, and write demo-report/")
    demo.add_argument("--seconds", type=float, default=120.0, help="training time budget")
    demo.add_argument("--out", default="demo-report", help="report directory")
    demo.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    demo.set_defaults(func=cmd_demo)

    train = sub.add_parser("train", parents=[debug],
                           help="train a DLRM on click logs (synthetic, Parquet or CSV)")
    _add_train_args(train)
    train.set_defaults(func=cmd_train)

    export = sub.add_parser("export", parents=[debug],
                            help="turn a training checkpoint into a serving export")
    export.add_argument("--checkpoint-dir", required=True)
    export.add_argument("--out", required=True)
    export.set_defaults(func=cmd_export)

    bench = sub.add_parser("serve-bench", parents=[debug],
                           help="load a serving export into a parameter server and time lookups")
    bench.add_argument("--export", required=True, help="a directory written by `dynemb export`")
    bench.add_argument("--volatile", default="memory", choices=["memory", "redis"])
    bench.add_argument("--redis-address", default="127.0.0.1:6379")
    bench.add_argument("--persistent", default="lmdb", choices=["lmdb", "rocksdb", "none"])
    bench.add_argument("--persistent-path", default=None)
    bench.add_argument("--cache-fraction", type=float, default=0.2)
    bench.add_argument("--batch-size", type=int, default=1024)
    bench.add_argument("--batches", type=int, default=200)
    bench.add_argument("--alpha", type=float, default=1.2, help="power-law exponent of the lookup traffic")
    bench.set_defaults(func=cmd_serve_bench)
    return parser


def _kernels_from_environment() -> None:
    """``DYNEMB_NUMBA=0``: table indexes run the torch path (the library itself reads no environment variable)."""
    import os

    if os.environ.get("DYNEMB_NUMBA") == "0":
        from .kernels import set_default_backend

        set_default_backend("torch")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _kernels_from_environment()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("dynemb: interrupted", file=sys.stderr)
        return 130
    except (CliError, ValueError, TypeError, FileNotFoundError, PermissionError, OSError) as e:
        if args.debug:
            raise
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"dynemb {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
