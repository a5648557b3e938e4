"""The ``dynemb`` command: ``train``, ``eval``, ``predict``, ``export``, ``serve``, ``serve-bench`` and ``demo``.

Errors, in the options or in the data, print one line naming the problem and exit with status 2; ``--debug``
shows the traceback. ``--help`` on each command lists every option with its default.

Environment, read here and nowhere else in the library: ``DYNEMB_NUMBA=0`` runs every table index on the torch
reference path instead of the numba CPU kernels (``dynemb.kernels.set_default_backend("torch")`` at startup);
``DYNEMB_BACKEND=nccl`` makes a torchrun-launched command use NCCL instead of gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import math
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

__all__ = ["main", "build_parser"]

EVICTIONS = ("lru", "lfu", "epoch_lru", "epoch_lfu", "decayed_lfu")
DEFAULT_PATIENCE = 5  # = dynemb.train.DEFAULT_PATIENCE (not imported: `--help` stays free of torch)
MODEL_DEFAULTS = {"batch_size": 512, "dim": 16, "optimizer": "adagrad", "lr": 0.05, "max_capacity": None,
                  "eviction": None, "admission": None}
"""``dynemb train``'s model options and their defaults; on ``--resume`` the run's saved values instead."""
# The optional packages the commands import, by the extra (pyproject.toml) that installs them.
_EXTRAS = {"pyarrow": "data", "xxhash": "data", "matplotlib": "plot", "triton": "gpu",
           **dict.fromkeys(["redis", "rocksdict", "lmdb", "uvicorn", "httptools", "uvloop", "orjson", "simdjson",
                            "grpc", "hpack", "tritonclient", "prometheus_client"], "serving")}


def _optimizer_kinds() -> tuple:
    """The sparse optimizers' kinds, from the config registry (the one place that names them)."""
    from .optim import SparseOptimizer
    from .serialization import registered

    return tuple(registered(SparseOptimizer))


class CliError(Exception):
    """A problem with the user's input, reported as one line."""


class _Parser(argparse.ArgumentParser):
    """Option errors as one line (``dynemb train: error: ...``) and exit status 2, like data errors."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.option_strings and all(action.default is not v for v in (None, False, argparse.SUPPRESS))
        if shown and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _int_from(minimum: int, maximum: int | None = None):
    """An argparse type: an int ``>= minimum`` (and ``<= maximum``). Out of range is ``argument --steps: must be an
    int >= 1, got 0``, not a default put in its place (``--steps 0`` read as "no limit" trained 1,400 steps), a
    traceback (``--threads 0``) nor the library's own name for it (``max_capacity must be ...``)."""

    def parse(text: str) -> int:
        value = int(text)  # a ValueError: argparse says "invalid int value: 'many'"
        if value < minimum or (maximum is not None and value > maximum):
            form = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"must be an int {form}, got {text}")
        return value

    parse.__name__ = "int"
    return parse


def _float_in(low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = True):
    """An argparse type: a finite float within ``[low, high]`` (``low_open``/``high_open``: that end excluded)."""
    shown = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    form = f"a finite number {'>' if low_open else '>='} {low:g}" if high == math.inf else f"a number in {shown}"

    def parse(text: str) -> float:
        value = float(text)  # a ValueError: argparse says "invalid float value: 'x'"
        inside = (low < value if low_open else low <= value) and (value < high if high_open else value <= high)
        if not (math.isfinite(value) and inside):
            raise argparse.ArgumentTypeError(f"must be {form}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


_COUNT, _COUNT0 = _int_from(1), _int_from(0)
_SECONDS, _FRACTION = _float_in(0.0, low_open=True), _float_in(0.0, 1.0, low_open=True)


def _csv(value: str | None) -> tuple[str, ...]:
    return tuple(v for v in (value or "").split(",") if v)


def _json(obj) -> str:
    """One line of strict JSON, a number that is not finite as ``null``: what every command prints."""
    from .job.report import json_line

    return json_line(obj)


@contextlib.contextmanager
def _data_warnings(command: str):
    """Each warning about the user's data (``DataWarning``: the nulls, NaN and inf a rule replaced, counted once
    per pass) as one line on stderr, every time it is raised; other warnings as Python shows them."""
    from .data.preprocess import DataWarning

    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, DataWarning):
                print(f"dynemb {command}: warning: {message}", file=sys.stderr)
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.simplefilter("always", DataWarning)
        warnings.showwarning = show
        yield


# ---------------------------------------------------------------------------------------------- commands
def cmd_train(args) -> int:
    import torch

    from .job import RunSpec, train_run
    from .job.fit import SYNTHETIC_STEPS
    from .train import TrainConfig

    _check_train_options(args)
    _model_options(args)
    torch.set_num_threads(args.threads)
    _init_distributed()
    stop_given = any(v is not None for v in (args.epochs, args.steps, args.seconds))
    epochs = args.epochs if stop_given else ("auto" if args.data else None)
    steps = args.steps if stop_given else (None if args.data else SYNTHETIC_STEPS)
    args.out = args.out or str(_timestamped(Path("runs")))  # main's resume hint names it
    spec = RunSpec(out=args.out, data=args.data, eval_data=args.eval_data, format=args.format, label=args.label,
                   categorical=_csv(args.categorical), multi_hot=_csv(args.multi_hot), dense=_csv(args.dense),
                   positive_label=args.positive_label, list_separator=args.list_separator,
                   eval_fraction=0.05 if args.eval_fraction is None else args.eval_fraction,
                   seed=args.seed, epochs=epochs,
                   batch_size=args.batch_size, shuffle_buffer=args.shuffle_buffer,
                   eval_batches=args.eval_batches, device=args.device, resume=args.resume,
                   publish_every=args.publish_every, publish_dir=args.publish_dir)
    cfg = TrainConfig(steps=steps, seconds=args.seconds, dim=args.dim, optimizer=args.optimizer, lr=args.lr,
                      max_capacity=args.max_capacity, eviction=args.eviction, admission=args.admission,
                      eval_every=args.eval_every, patience=args.patience, checkpoint_every=args.checkpoint_every)
    summary = train_run(spec, cfg, progress=False if args.no_progress else None, log_every=args.log_every,
                        interruptible=True, pipeline=not args.no_pipeline)
    if not (_distributed_rank() or 0):
        print(_json(summary))
    return 0


def _check_train_options(args) -> None:
    """Inconsistent options, as one-line errors (argparse checks each option alone)."""
    if args.resume and not args.out:
        raise CliError("--resume needs --out RUN_DIR, the run to continue")
    if args.eval_fraction is not None and args.eval_data:
        raise CliError("--eval-fraction splits --data; it cannot be combined with --eval-data")
    if args.synthetic and args.data:
        raise CliError("--synthetic and --data exclude each other")
    if args.publish_dir and not args.publish_every:
        raise CliError("--publish-dir needs --publish-every N (steps between published versions)")
    if args.data is None and (args.eval_data or args.epochs or args.format or args.positive_label):
        raise CliError("--eval-data, --epochs, --format and --positive-label need --data (synthetic data is an "
                       "endless stream of 0/1 labels)")


def _model_options(args) -> None:
    """Fill in the model options not given: the defaults, or on ``--resume`` the values the run was trained with
    (its model.json); a given option that differs from the run's value is an error naming both."""
    saved = dict(MODEL_DEFAULTS)
    if args.resume:
        from .job import read_card

        card = read_card(Path(args.out))
        saved = {k: card.data.get(k) if k == "batch_size" else getattr(card.config, k) for k in MODEL_DEFAULTS}
    for name, value in saved.items():
        given = getattr(args, name)
        if args.resume and given is not None and given != value:
            option = "--" + name.replace("_", "-")
            shown = "not set" if value is None else value
            raise CliError(f"{option} {given} contradicts the run being resumed: {args.out} was trained with "
                           f"{option} {shown} (its model.json); drop {option} to keep the run's value")
        setattr(args, name, value if given is None else given)
    if args.eviction and not args.max_capacity:
        raise CliError("--eviction needs --max-capacity: only a bounded table evicts")


def _resume_command(argv: list[str], out) -> str:
    """The ``dynemb train`` command line that continues an interrupted one: the same, with --out and --resume."""
    import shlex

    args = list(argv) + ([] if "--out" in argv else ["--out", str(out)]) + ([] if "--resume" in argv else ["--resume"])
    return shlex.join(["dynemb", *args])


def _timestamped(root: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path, n = root / stamp, 1
    while path.exists():
        n += 1
        path = root / f"{stamp}-{n}"
    return path


def _init_distributed() -> None:
    import os

    import torch.distributed as dist

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if os.environ.get("DYNEMB_BACKEND") == "nccl" else "gloo")


def _distributed_rank() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def cmd_eval(args) -> int:
    import torch

    from .job import evaluate_file

    torch.set_num_threads(args.threads)
    print(_json(evaluate_file(args.model, args.data, format=args.format, batch_size=args.batch_size,
                              device=args.device, use=args.use, progress=False if args.no_progress else None)))
    return 0


def cmd_predict(args) -> int:
    import torch

    from .job import predict_file

    _keep_freed_memory()
    torch.set_num_threads(args.threads)
    print(_json(predict_file(args.model, args.data, args.out, format=args.format, batch_size=args.batch_size,
                             device=args.device, use=args.use, progress=False if args.no_progress else None)))
    return 0


def _keep_freed_memory() -> None:
    """glibc's malloc keeps what the process frees for its next blocks (one arena for all threads, no trimming,
    blocks up to 32 MiB from the heap) instead of handing it back to the kernel, which zeroed and page-faulted it
    in again for every block (``predict``: each block's ~200 MB of tensors, about 0.5 s of system time a run on
    the demo). A process setting, so the command makes it, not the library; a no-op where there is no mallopt."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for option, value in ((-8, 1), (-3, 32 << 20), (-1, 2**31 - 1)):  # M_ARENA_MAX, M_MMAP_THRESHOLD, M_TRIM_...
        mallopt(option, value)


EXPORT_DTYPES = ("float32", "float16", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2")


def _export_dtype(value: str):
    """``--dtype``'s value as a torch dtype (argparse names the option and the choices when it raises)."""
    from .checkpoint.row_codec import QUANTIZED
    from .serialization import parse_dtype

    if value not in EXPORT_DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(EXPORT_DTYPES)}, got {value!r}")
    return QUANTIZED[value] if value in QUANTIZED else parse_dtype(value, "--dtype")  # 8-bit rows: the codec's


def cmd_export(args) -> int:
    from .checkpoint import export_for_serving
    from .job import load_model

    model, _ = load_model(Path(args.model), use=args.use, optimizer=False)
    # the MLPs go with the tables: a server of this export scores with one checkpoint's weights (--use last too)
    out = export_for_serving(args.out, model, dtype=args.dtype, dense=True)
    print(f"exported to {out}")
    return 0


def cmd_serve_bench(args) -> int:
    from .serving.bench import serve_bench, summary_table

    result = serve_bench(args.export, volatile=args.volatile, redis_address=args.redis_address,
                         persistent=args.persistent, persistent_path=args.persistent_path,
                         cache_fraction=args.cache_fraction, batch_size=args.batch_size, batches=args.batches,
                         alpha=args.alpha)
    print(_json(result) if args.json else summary_table(result))
    return 0


def cmd_plan(args) -> int:
    import json

    from .checkpoint.errors import CheckpointError
    from .checkpoint.planning import plan_from_checkpoint
    from .distributed.planner import PlanError

    if args.world < 1:
        raise CliError(f"--world must be a number of ranks >= 1, got {args.world}")
    if args.ranks_per_node is not None and (args.ranks_per_node < 1 or args.world % args.ranks_per_node):
        raise CliError(f"--ranks-per-node must be >= 1 and divide --world {args.world}, got {args.ranks_per_node}")
    memory = _parse_bytes("--memory-per-rank", args.memory_per_rank) if args.memory_per_rank is not None else None
    pins = {}
    for pin in args.pin:
        table, sep, kind = pin.partition("=")
        if not sep or not table or not kind:
            raise CliError(f"--pin must be TABLE=KIND (KIND: {_PIN_KINDS}), got {pin!r}")
        if table in pins:
            raise CliError(f"--pin gives table {table!r} twice ({pins[table]!r} and {kind!r}); give it once")
        name, colon, owner = kind.partition(":")
        if name not in ("row", "data", "column", "table_row", "table") or (colon and name != "table"):
            raise CliError(f"--pin {pin}: KIND must be one of {_PIN_KINDS}, got {kind!r}")
        if colon and not (owner.isdigit() and int(owner) < args.world):
            raise CliError(f"--pin {pin}: RANK of table:RANK must be a rank of --world {args.world} "
                           f"(0 to {args.world - 1}), got {owner!r}")
        pins[table] = ("table", int(owner)) if colon else kind
    checkpoint = Path(args.checkpoint)
    if (checkpoint / "model.json").is_file() and (checkpoint / "checkpoint").is_dir():
        from .train import newest_checkpoint  # a run directory: the checkpoint --resume continues from

        checkpoint = newest_checkpoint(checkpoint / "checkpoint", checkpoint / "checkpoint-best") or \
            checkpoint / "checkpoint"
    try:
        plan = plan_from_checkpoint(checkpoint, args.world, memory_per_rank=memory,
                                    ranks_per_node=args.ranks_per_node, pins=pins)
    except CheckpointError as e:
        raise CliError(f"--checkpoint: {e}") from e
    except PlanError as e:  # the planner names its Python argument; here the user typed the option
        raise CliError(str(e).replace("memory_per_rank=", "--memory-per-rank ")) from e
    if args.json:  # stdout one JSON line (for jq or a script), the table still shown on stderr
        print(plan, file=sys.stderr)
        print(json.dumps(plan.to_dict(), sort_keys=True))
    else:
        print(plan)
    return 0


_PIN_KINDS = "row, data, column, table_row, table or table:RANK"
_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def _parse_bytes(option: str, text: str) -> int:
    """``8e10``, ``80GB``, ``80G`` (10**9) or ``64GiB`` (2**30) as a positive whole number of bytes."""
    import math
    import re

    match = re.fullmatch(r"\s*([0-9.eE+-]+?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    try:
        value = float(match.group(1)) * _BYTE_UNITS[unit] if match else math.nan
    except (ValueError, KeyError):
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise CliError(f"{option} must be a positive number of bytes (8e10, 80GB, 64GiB), got {text!r}")
    return int(value)


def cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(seconds=args.seconds, out_dir=args.out, threads=args.threads, command=main)
    return 0


# ---------------------------------------------------------------------------------------------- parser
def _add_train_args(p: argparse.ArgumentParser) -> None:
    data = p.add_argument_group("data")
    data.add_argument("--data", metavar="PATH", help="training data: a Parquet, CSV or Criteo TSV file, or a "
                      "directory of them (default: synthetic click logs)")
    data.add_argument("--synthetic", action="store_true", help="train on synthetic click logs (what no --data "
                      "means; for torchrun smoke runs)")
    data.add_argument("--eval-data", metavar="PATH", help="held-out data (default: hold out --eval-fraction of "
                      "--data)")
    data.add_argument("--eval-fraction", type=_FRACTION, metavar="F", help="share of --data's rows held out from "
                      "training, chosen by a seeded hash of the row number (default: 0.05)")
    data.add_argument("--format", choices=("parquet", "csv", "criteo"), help="format of the files (default: from "
                      "the suffix: .parquet, .csv/.tsv, .criteo/.txt, each optionally compressed)")
    data.add_argument("--label", help="label column, values 0/1 or booleans (default for a Criteo file: 'label')")
    data.add_argument("--positive-label", metavar="VALUE", help="labels equal to VALUE (compared as text: '>50K', "
                      "'yes', 'true') are 1, every other label 0; kept in model.json for eval and --resume "
                      "(default: none, labels must be 0/1 or booleans)")
    data.add_argument("--categorical", metavar="C1,C2", help="categorical columns: string or integer ids, one "
                      "table each (a Criteo file: default C1..C26)")
    data.add_argument("--multi-hot", metavar="M1,M2", help="list columns (list<string>, list<int>; in CSV, ids "
                      "separated by --list-separator), mean-pooled per row (default: none)")
    data.add_argument("--dense", metavar="D1,D2", help="dense numeric columns, normalized by sign(x)*log1p(|x|) "
                      "then standardized over the training rows (a Criteo file: default I1..I13; else none)")
    data.add_argument("--list-separator", default="|", metavar="C", help="separator of the ids of a multi-hot "
                      "CSV field")
    data.add_argument("--seed", type=int, default=0, help="seed of the held-out split, the shuffles, the "
                      "synthetic data and the initial weights: identical commands give identical runs")
    data.add_argument("--shuffle-buffer", type=_COUNT, default=500_000, metavar="ROWS", help="each epoch is "
                      "shuffled within a window of twice this many rows (the whole data when it fits)")
    run = p.add_argument_group("run")
    run.add_argument("--out", metavar="RUN_DIR", help="run directory: model.json, the last and the best checkpoint, "
                     "metrics.jsonl, loss_auc.png (default: runs/<UTC timestamp>)")
    stop = run.add_mutually_exclusive_group()
    stop.add_argument("--epochs", type=_COUNT, metavar="N", help="passes over the training rows, fewer when early "
                      "stopping ends the run (default: up to 20, within 20000 steps; one pass of a data set over 1M "
                      "rows; 500 steps of synthetic data)")
    stop.add_argument("--steps", type=_COUNT, metavar="N", help="stop after N steps, over as many epochs as needed "
                      "(default: see --epochs)")
    stop.add_argument("--seconds", type=_SECONDS, metavar="S", help="stop after S seconds of training (default: no "
                      "time limit)")
    run.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint "
                     "(from step 0 when it has none: a run stopped before its first save)")
    run.add_argument("--checkpoint-every", type=_COUNT0, default=0, metavar="N", help="also checkpoint every N steps "
                     "(0: only the final checkpoint; the 3 newest are kept), written in the background while training "
                     "goes on (a host copy of the rows at that step)")
    run.add_argument("--eval-every", type=_COUNT, default=100, metavar="N", help="evaluate --eval-batches held-out "
                     "batches every N steps and at the end, keeping the model with the lowest log loss as the best "
                     "(and every held-out row at the end, with the best model)")
    run.add_argument("--patience", type=_COUNT0, default=DEFAULT_PATIENCE, metavar="N", help="stop after N evaluations "
                     "in a row without a lower held-out log loss than the best (0: never stop early; the best model "
                     "is kept either way)")
    run.add_argument("--eval-batches", type=_COUNT, default=16, metavar="N", help="held-out batches of each periodic "
                     "evaluation: more rows choose the best model and the stop more surely, at the cost of a "
                     "forward pass each")
    run.add_argument("--publish-every", type=_COUNT0, default=0, metavar="N", help="publish a serving version every N "
                     "steps and after the last: a full export, then deltas, each with the MLPs, for `dynemb serve "
                     "--model RUN_DIR --watch`; each is the model being trained at that step, not the best so far "
                     "(0: none)")
    run.add_argument("--publish-dir", metavar="EXPORT_DIR", help="where --publish-every writes (default: "
                     "RUN_DIR/export, what `dynemb serve --model RUN_DIR --watch` follows; elsewhere, serve it with "
                     "--export)")
    run.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    run.add_argument("--threads", type=_COUNT, default=1, help="torch CPU threads")
    run.add_argument("--log-every", type=_float_in(0.0), default=10.0, metavar="S", help="without a terminal: seconds "
                     "between progress lines on stderr (a terminal gets a progress bar)")
    run.add_argument("--no-progress", action="store_true", help="neither a progress bar nor progress lines")
    run.add_argument("--no-pipeline", action="store_true", help="run each batch's loading, copy and key exchange "
                     "on the step's thread instead of ahead of it, while the previous batch computes (for "
                     "debugging: results are the same)")
    model = p.add_argument_group("model")
    model.description = "with --resume, an option not given keeps the run's value (one given must equal it)"
    model.add_argument("--batch-size", type=_COUNT, help="samples per step (default: 512)")
    model.add_argument("--dim", type=_COUNT, help="embedding width (default: 16)")
    model.add_argument("--optimizer", choices=_optimizer_kinds(),
                       help="sparse optimizer of the tables (default: adagrad)")
    model.add_argument("--lr", type=_float_in(0.0), help="learning rate of the tables (the MLPs use Adam, "
                       "1e-3) (default: 0.05)")
    model.add_argument("--max-capacity", type=_int_from(1, 2**31 - 1), metavar="ROWS", help="rows per table; "
                       "evicts beyond it (default: unbounded)")
    model.add_argument("--eviction", choices=EVICTIONS, help="eviction policy; needs --max-capacity (default: "
                       "decayed_lfu)")
    model.add_argument("--admission", type=_COUNT, metavar="N", help="store an id from its N-th sighting (default: "
                       "at once)")


def _add_use_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--use", choices=("best", "last"), default="best", help="the run's model with the lowest "
                   "held-out log loss (best), or the model of its last step (last); a run without a best checkpoint "
                   "gives its last")


def _add_scoring_args(p: argparse.ArgumentParser, out_help: str | None) -> None:
    p.add_argument("--model", required=True, metavar="RUN_DIR", help="a `dynemb train` run directory")
    _add_use_arg(p)
    p.add_argument("--data", required=True, metavar="PATH", help="a file or directory with the model's columns")
    if out_help:
        p.add_argument("--out", required=True, metavar="PREDS.parquet|PREDS.csv", help=out_help)
    p.add_argument("--format", choices=("parquet", "csv", "criteo"), help="format of the files (default: from "
                   "the suffix)")
    p.add_argument("--batch-size", type=_COUNT, default=65536, help="rows per forward pass")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    p.add_argument("--threads", type=_COUNT, default=1, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (one is drawn on stderr when it is a "
                   "terminal)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dynemb", description="Dynamic embedding tables for PyTorch: train, evaluate, score, "
                     "export and serve CTR models.", formatter_class=_Help)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    # Also accepted after the command (`dynemb train ... --debug`); SUPPRESS keeps a flag given before it.
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name: str, help: str, func, description: str | None = None) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[debug], help=help, description=description or help, formatter_class=_Help)
        p.set_defaults(func=func)
        return p

    train = command("train", "train a DLRM on a file (or synthetic click logs) into a run directory", cmd_train,
                    "Train a DLRM into a run directory and print the held-out metrics as the last line (JSON).\n"
                    "Held-out rows never reach training.")
    _add_train_args(train)
    _add_scoring_args(command("eval", "held-out metrics of a trained run on a file: JSON {auc, logloss, rows}",
                              cmd_eval), None)
    _add_scoring_args(command("predict", "score every row of a file into a Parquet or CSV file of probabilities",
                              cmd_predict), "output file, Parquet (.parquet, .pq) or CSV (.csv) by its suffix: "
                      "a float64 'probability' column per input row, in input order, and the label column (0/1) "
                      "when the input has one; never an input file or in the run directory, and an existing file "
                      "only when predict wrote it")

    export = command("export", "turn a run's best (or last) model into a serving export", cmd_export)
    export.add_argument("--model", required=True, metavar="RUN_DIR", help="a `dynemb train` run directory")
    export.add_argument("--out", required=True, metavar="EXPORT_DIR", help="export root (version-N/ is added)")
    export.add_argument("--dtype", default="float32", type=_export_dtype, metavar="DTYPE",
                        help=f"the rows' type in the export: {', '.join(EXPORT_DTYPES)} (8-bit rows are row-wise "
                        "scaled, int8 also biased, and served dequantized; docs/serving.md '8-bit rows')")
    _add_use_arg(export)

    bench = command("serve-bench", "load a serving export into a parameter server and time lookups",
                    cmd_serve_bench)
    bench.add_argument("--export", required=True, help="a directory written by `dynemb export`")
    bench.add_argument("--volatile", default="memory", choices=["memory", "redis"], help="volatile store")
    bench.add_argument("--redis-address", default="127.0.0.1:6379", help="host:port of the redis store")
    bench.add_argument("--persistent", default="lmdb", choices=["lmdb", "rocksdb", "none"], help="persistent store")
    bench.add_argument("--persistent-path", help="where the persistent store lives (default: a temp dir)")
    bench.add_argument("--cache-fraction", type=_float_in(0.0, 1.0, low_open=True, high_open=False), default=0.2,
                       help="share of each table's rows cached, in (0, 1]")
    bench.add_argument("--batch-size", type=_COUNT, default=1024, help="ids per table per request")
    bench.add_argument("--batches", type=_COUNT, default=200, help="timed requests")
    bench.add_argument("--alpha", type=_float_in(0.0), default=1.2, help="power-law exponent of the lookup traffic "
                       "(0: uniform)")
    bench.add_argument("--json", action="store_true", help="print the full result as one JSON line instead of a "
                       "table")

    from .endpoint.command import add_serve_args, cmd_serve

    add_serve_args(command("serve", "serve a run over HTTP and gRPC (Open Inference Protocol / KServe v2)", cmd_serve))

    plan = command("plan", "print a sharding plan for the next run from a checkpoint's observed tables", cmd_plan,
                   "Print a sharding plan (a kind per table, per rank: tables, rows, bytes, lookups and bytes on the "
                   "wire a step) for --world ranks from the rows and accesses training recorded in a checkpoint. "
                   "Loading that checkpoint into a collection built with the plan reshards it.")
    plan.add_argument("--checkpoint", required=True, metavar="CKPT",
                      help="a run directory (the checkpoint --resume continues from: the newer of its last and best), "
                      "or a checkpoint root or directory (RUN_DIR/checkpoint-best for the best model's)")
    plan.add_argument("--world", required=True, type=int, help="ranks of the next run")
    plan.add_argument("--memory-per-rank", metavar="BYTES",
                      help="bytes each rank may hold: 8e10, 80GB (10**9 bytes a GB) or 64GiB (default: no limit)")
    plan.add_argument("--ranks-per-node", type=int,
                      help="ranks of one node; row-sharded tables stay in one (default: all ranks are one node)")
    plan.add_argument("--pin", action="append", default=[], metavar="TABLE=KIND",
                      help="give TABLE the kind KIND (row, data, column, table_row, table: whole on the least loaded "
                      "rank, table:RANK: whole on RANK); repeatable")
    plan.add_argument("--json", action="store_true", help="print the shardings as one JSON line (to_dict: the "
                      "collection's plan=) on stdout, the table on stderr")

    demo = command("demo", "synthetic data -> train -> eval -> predict -> export -> serve-bench, with a report",
                   cmd_demo)
    demo.add_argument("--seconds", type=_SECONDS, default=75.0, help="training time budget")
    demo.add_argument("--out", default="demo-report", help="report directory")
    demo.add_argument("--threads", type=_COUNT, default=1, help="torch CPU threads")
    return parser


def _kernels_from_environment() -> None:
    """``DYNEMB_NUMBA=0``: table indexes run the torch path (the library itself reads no environment variable)."""
    import os

    if os.environ.get("DYNEMB_NUMBA") == "0":
        from .kernels import set_default_backend

        set_default_backend("torch")


def _unrecognized(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> None:
    """Unknown options are the command's error (``dynemb train: error: ...``, not the top parser's), with the
    command's closest option for each: ``--categoricals`` -> ``--categorical``."""
    import difflib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    options = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    hints = [f"{o} -> {m[0]}" for o in extra if o.startswith("--")
             and (m := difflib.get_close_matches(o.split("=")[0], options, n=1, cutoff=0.75))]
    sub.error(f"unrecognized arguments: {' '.join(extra)}" + (f" (did you mean: {', '.join(hints)}?)" if hints else ""))


def main(argv: list[str] | None = None) -> int:
    """Run ``dynemb ARGV`` (default: ``sys.argv[1:]``, the process's own command line); the exit status.

    As the process's command (``argv`` None: ``python -m dynemb``, the ``dynemb`` script), ``predict`` and
    ``eval`` end the process at once (``os._exit`` after flushing stdout and stderr): their files are written,
    synced and renamed, and the interpreter's exit (collecting the ~300k objects torch, numba and pyarrow made, then
    its teardown) took 0.8-2 s after the file was written. Other commands exit normally: freezing the collector
    before their exit made triton's nanobind bindings report every object as leaked on stderr. An in-process call
    changes nothing."""
    global _AS_COMMAND
    if argv is not None:
        return _main([str(a) for a in argv])
    _AS_COMMAND = True
    try:
        code = _main(sys.argv[1:])
    except BaseException:
        gc.unfreeze()  # a failed predict/eval exits normally: let its exit see every object (see above)
        gc.enable()
        raise
    if _ONE_FILE_RAN:
        with contextlib.suppress(OSError):  # a reader that closed the pipe: the file is written, exit as we would
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    return code


_AS_COMMAND = False  # main() runs as the process's command
_ONE_FILE_RAN = False  # ... and the command is one of _ONE_FILE
_ONE_FILE = ("predict", "eval")
"""Commands that score one file and end: as the process's command they run with no cycle collection. The imports
of torch, numba and pyarrow (which ``import dynemb`` leaves to the command) allocate ~300k objects, and the
collections they trigger cost 0.1-0.4 s before the first row while finding little; the collector is back on,
with those objects frozen, once the model is loaded (``job.score._collect_from_here``). In-process calls keep the
collector as it is."""


_PRELOAD = {"train": (".job", ".train"), "eval": (".job",), "predict": (".job",), "export": (".job", ".checkpoint"),
            "demo": (".demo",)}
"""Modules each command imports, imported under :func:`_sigint_deferred` before it runs."""


@contextlib.contextmanager
def _sigint_deferred():
    """Take a Ctrl-C that comes while the block runs (the imports of torch, numba and pyarrow: 1-2 s) after it, as a
    KeyboardInterrupt. Raised inside an import it printed 30-50 lines of traceback, or left numba half-imported
    ("module 'numba' has no attribute 'core'", exit 1). Only where SIGINT has Python's own handler (not when the
    process ignores it, nor off the main thread)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def _main(argv: list[str]) -> int:
    global _ONE_FILE_RAN
    try:
        with _sigint_deferred():
            parser = build_parser()  # imports torch and dynemb's kernels
            args, extra = parser.parse_known_args(argv)
            for module in _PRELOAD.get(args.command, ()):  # the command's own imports (numba, pyarrow), here too
                with contextlib.suppress(ImportError):  # a missing extra: the command says which, in one line
                    importlib.import_module(module, __package__)
    except KeyboardInterrupt:
        command = next((a for a in argv if not a.startswith("-")), None)
        print(f"dynemb{' ' + command if command else ''}: interrupted before it started; nothing was written",
              file=sys.stderr)
        return 130
    if extra:
        _unrecognized(parser, args.command, extra)
    if _AS_COMMAND and args.command in _ONE_FILE:
        _ONE_FILE_RAN = True
        gc.disable()
    _kernels_from_environment()
    try:
        with _data_warnings(args.command):
            return args.func(args)
    except KeyboardInterrupt as e:
        from .job import Interrupted

        if args.command != "train":
            print(f"dynemb {args.command}: interrupted", file=sys.stderr)
        elif _distributed_rank():
            pass  # under torchrun, rank 0 says it
        elif isinstance(e, Interrupted):
            print(f"dynemb train: {e}; continue with: {_resume_command(argv, args.out)}", file=sys.stderr)
        elif args.out and Path(args.out).is_dir():
            print(f"dynemb train: aborted; {args.out} keeps its newest checkpoint (if any): "
                  f"{_resume_command(argv, args.out)} continues from it", file=sys.stderr)
        else:
            print("dynemb train: aborted", file=sys.stderr)
        return 130
    except (CliError, ValueError, TypeError, FileNotFoundError, PermissionError, OSError, ImportError) as e:
        if args.debug:
            raise
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        missing = e.name if isinstance(e, ModuleNotFoundError) else None  # a missing submodule is another problem
        if missing in _EXTRAS:
            message = (f"needs the Python package {missing!r}, which is not installed: "
                       f"pip install 'dynemb[{_EXTRAS[missing]}]'")
        print(f"dynemb {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
